"""The varlen persistent tile list's cost: schedulers.varlen_pairs (torch ops on cu_seqlens' device,
no host read) beside the old host sort (Python tuples per (sequence, head, row tile), sorted; kept
here only as the reference), for the 248-sequence batch of bench/multi_sm.py and a small one.

    python bench/varlen_order.py [--repeat 20] [--threads 1]

--threads: torch's CPU threads (1 by default: on a machine whose cores are busy, torch's intra-op
thread pool stalls small ops for milliseconds, repeat_interleave among them).

CPU always; CUDA too where torch sees a GPU (there the builder's time is the launch of its kernels
plus a synchronize, and the old sort's includes copying cu_seqlens to the host).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from attngen import tiles
from attngen.kernels.common.schedulers import varlen_pairs

HEADS, BLOCK_M, BLOCK_N = 16, 128, 128  # causal hd128, as bench/multi_sm.py


def old_host_sort(cu_q, cu_k, edges) -> list:
    """The old launcher's order: the lengths read on the host, (sequence, head, row tile) tuples sorted."""
    q_lens, kv_lens = (torch.diff(cu.cpu()).tolist() for cu in (cu_q, cu_k))
    pairs = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        frame = tiles.Frame.of(q_len, kv_len, edges, BLOCK_M, BLOCK_N)
        pairs += [(-frame.row_tile_visits(t), b, t) for t in range(frame.q_tiles())]
    pairs.sort()
    return [(b, h, t) for _, b, t in pairs for h in range(HEADS)]


def best_ms(fn, repeat: int, sync) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)  # bench/multi_sm.py's draw: lengths log-uniform in [128, 8192]
    batches = {"248 sequences": [round(128 * 64 ** rng.random()) for _ in range(248)], "4 sequences": [300, 1, 0, 129]}
    edges = tiles.edges(True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for what, lengths in batches.items():
            cu = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
            listed = varlen_pairs(cu, cu, sum(lengths), edges, BLOCK_M, BLOCK_N)
            want = old_host_sort(cu, cu, edges)
            real = int(listed[-1, 0])
            assert [(b, h, t) for b, t in listed[:real].tolist() for h in range(HEADS)] == want  # the same order
            new = best_ms(lambda: varlen_pairs(cu, cu, sum(lengths), edges, BLOCK_M, BLOCK_N), args.repeat, sync)
            old = best_ms(lambda: old_host_sort(cu, cu, edges), max(3, args.repeat // 4), sync)
            print(f"{device}: {what} ({real} pairs, {real * HEADS} tiles, {len(listed) - 1 - real} padding pairs): "
                  f"builder {new:.3f} ms, old host sort {old:.3f} ms (best of runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
