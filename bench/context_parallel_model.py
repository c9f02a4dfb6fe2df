"""A cost model of context-parallel attention (attngen.interfaces.distributed, docs/distributed.md): a MODEL, not a
measurement. For W ranks and a sequence of S tokens it prints, per ring step and per rank, the
attention's compute time at an assumed throughput, the bytes each method moves, whether a ring step's
compute hides its transfer at NVLink and InfiniBand rates, and the causal balance of zigzag and
contiguous sharding (the most work on one rank over the least, counted exactly from the step calls
attngen.interfaces.distributed makes, at chunks of --balance-chunk rows).

    python bench/context_parallel_model.py                         # Llama-3-70B-like: 64 heads, 8 KV heads, hd128, bf16
    python bench/context_parallel_model.py --tflops 400 --nvlink 300 --ib 25

The assumptions (all overridable) and their sources:
- --tflops 600: attained dense bf16 attention TFLOP/s per GPU. H100 SXM's peak is 989 (NVIDIA's
  datasheet); FlashAttention-3 reports up to 740 forward (arXiv 2407.08608), and 690 on an H200
  for causal hd128 at 4k (flash-attention PR #2754). The backward is taken at the same rate with
  2.5x the forward's FLOPs (FlashAttention's count).
- --nvlink 450 GB/s per direction: NVLink 4 is 900 GB/s per GPU, both directions together (NVIDIA
  H100/H200 datasheets).
- --ib 50 GB/s: one 400 Gb/s NDR InfiniBand adapter (ConnectX-7) per GPU.
Causal attention: 2 GEMMs of 2 FLOPs per multiply-add over the visible (row, key) pairs: 4 D H per pair.
"""

from __future__ import annotations

import argparse

import numpy as np

from attngen import tiles
from attngen.interfaces.distributed import LOAD_BALANCES, chunk_ids, segments, step_calls

BYTES = {"bf16": 2, "fp32": 4}


def visible_pairs(world: int, rank: int, src: int, load_balance: str, chunk: int, causal: bool = True) -> int:
    """(row, key) pairs rank `rank` computes against rank src's block, from the calls distributed makes."""
    calls = step_calls(segments(chunk_ids(rank, world, load_balance), chunk),
                       segments(chunk_ids(src, world, load_balance), chunk), causal, (-1, -1))
    total = 0
    for c in calls:
        m, n = c.q1 - c.q0, c.k1 - c.k0
        total += int(tiles.visible(np.arange(m)[:, None], np.arange(n)[None, :], m, n,
                                   tiles.edges(c.causal, c.window)).sum())
    return total


def balance(world: int, load_balance: str, chunk: int) -> float:
    """Causal: the most (row, key) pairs one rank computes over all its steps, over the least."""
    work = [sum(visible_pairs(world, r, s, load_balance, chunk) for s in range(world)) for r in range(world)]
    return max(work) / min(work)


def rows(args) -> list[dict]:
    out = []
    for world in args.worlds:
        zigzag, contiguous = (balance(world, lb, args.balance_chunk) for lb in LOAD_BALANCES)
        for seq in args.seqs:
            local = seq // world
            # zigzag causal: every step computes half of a local x local block (docs/distributed.md)
            flops_fwd = 4 * args.head_dim * args.heads * local * local / 2
            t_fwd = flops_fwd / (args.tflops * 1e12)
            t_bwd = 2.5 * t_fwd
            kv = 2 * local * args.kv_heads * args.head_dim * BYTES["bf16"]  # K and V of one rank
            dkv = 2 * local * args.kv_heads * args.head_dim * BYTES["fp32"]  # dK and dV travel in fp32
            ring_fwd, ring_bwd = kv, kv + dkv  # per step, sent to one neighbour
            gather_fwd = (world - 1) * kv  # all-gather: received once per rank
            scatter_bwd = (world - 1) * dkv  # reduce-scatter of dK, dV (fp32)
            row = dict(W=world, S=seq, fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3, ring_fwd_MB=ring_fwd / 1e6,
                       ring_bwd_MB=ring_bwd / 1e6, allgather_MB=gather_fwd / 1e6, reducescatter_MB=scatter_bwd / 1e6,
                       zigzag=zigzag, contiguous=contiguous)
            for link, rate in (("nvl", args.nvlink), ("ib", args.ib)):
                row[f"{link}_fwd_ms"] = ring_fwd / (rate * 1e9) * 1e3
                row[f"{link}_bwd_ms"] = ring_bwd / (rate * 1e9) * 1e3
                row[f"{link}_hides"] = t_fwd >= ring_fwd / (rate * 1e9) and t_bwd >= ring_bwd / (rate * 1e9)
            out.append(row)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=list(range(2, 9)))
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072, 262144, 524288, 1048576])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tflops", type=float, default=600.0, help="assumed attained attention TFLOP/s per GPU")
    p.add_argument("--nvlink", type=float, default=450.0, help="assumed NVLink GB/s per direction")
    p.add_argument("--ib", type=float, default=50.0, help="assumed InfiniBand GB/s per GPU")
    p.add_argument("--balance-chunk", type=int, default=64, help="rows per chunk when counting the balance")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    print(f"MODEL (not measured): causal, H={args.heads}, HKV={args.kv_heads}, D={args.head_dim}, bf16, "
          f"{args.tflops:g} TFLOP/s, NVLink {args.nvlink:g} GB/s, IB {args.ib:g} GB/s; per ring step and rank")
    print(f"{'W':>2} {'S':>8} {'fwd ms':>8} {'bwd ms':>8} {'ring MB f/b':>13} {'NVL ms f/b':>13} {'IB ms f/b':>13} "
          f"{'hides NVL/IB':>12} {'gather MB':>10} {'rs MB':>8} {'zigzag':>7} {'contig':>7}")
    for r in rows(args):
        print(f"{r['W']:>2} {r['S']:>8} {r['fwd_ms']:>8.3f} {r['bwd_ms']:>8.3f} "
              f"{r['ring_fwd_MB']:>6.1f}/{r['ring_bwd_MB']:<6.1f} {r['nvl_fwd_ms']:>6.3f}/{r['nvl_bwd_ms']:<6.3f} "
              f"{r['ib_fwd_ms']:>6.3f}/{r['ib_bwd_ms']:<6.3f} "
              f"{('yes' if r['nvl_hides'] else 'NO'):>5}/{('yes' if r['ib_hides'] else 'NO'):<6} "
              f"{r['allgather_MB']:>10.1f} {r['reducescatter_MB']:>8.1f} {r['zigzag']:>7.2f} {r['contiguous']:>7.2f}")


if __name__ == "__main__":
    main()
