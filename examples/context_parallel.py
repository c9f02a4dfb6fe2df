"""Context-parallel attention with attngen (docs/distributed.md), forward and backward.

    torchrun --nproc-per-node 2 examples/context_parallel.py                 # CPU tensors, gloo, the CPU model
    torchrun --nproc-per-node 8 examples/context_parallel.py --device cuda   # one GPU per rank, NCCL

Every rank makes the same full q, k, v (one seed), keeps its zigzag part, runs ring attention over
the group, and rank 0 compares the reassembled output and gradients with attngen.attention run on
the whole sequence in one process. The code is the same for both backends: the process group's.
"""

import argparse
import os

import torch
import torch.distributed as dist

from attngen import distributed as cp
from attngen.ops import attention


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--method", default="ring", choices=cp.METHODS)
    parser.add_argument("--load-balance", default="zigzag", choices=cp.LOAD_BALANCES)
    parser.add_argument("--chunk", type=int, default=16, help="rows per chunk (the sequence is 2W chunks for zigzag)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)

    seq = cp.num_chunks(world, args.load_balance) * args.chunk
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, n, args.head_dim, generator=g).half().to(device)
                     for n in (args.heads, args.kv_heads, args.kv_heads, args.heads))

    parts = [cp.shard_sequence(t, load_balance=args.load_balance).requires_grad_() for t in (q, k, v)]
    out = cp.context_parallel_attention(*parts, method=args.method, load_balance=args.load_balance, causal=True)
    out.backward(cp.shard_sequence(dout, load_balance=args.load_balance))
    full = [cp.unshard_sequence(t.detach(), load_balance=args.load_balance)
            for t in (out, parts[0].grad, parts[1].grad, parts[2].grad)]

    if rank == 0:  # the same attention in one process, on the whole sequence
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        out1 = attention(q1, k1, v1, causal=True)
        out1.backward(dout)
        for name, got, want in zip(("out", "dq", "dk", "dv"), full, (out1, q1.grad, k1.grad, v1.grad)):
            err = (got.float() - want.float()).abs().max().item()
            print(f"{name}: max |context parallel - one process| = {err:.2e} (max |value| {want.float().abs().max().item():.2f})")
        print(f"W = {world}, S = {seq}, method {args.method}, {args.load_balance}, causal, backend {backend}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
