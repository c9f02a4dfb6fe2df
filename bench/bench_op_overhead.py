"""The torch op's per-call Python overhead on CPU tensors (figures only; nothing here asserts a time).

    python bench/bench_op_overhead.py [--repeat N] [--profile]

At a tiny shape (1x16x2x64, causal), best-of-N medians of:
- `attngen.attention` (the op, the CPU model included) beside a direct `attngen.emulate` of the
  same plan: the CPU model's milliseconds dwarf the op's microseconds, so a second pair
- with the CPU model replaced by a stub that returns the precomputed result (in attngen.ops and
  for the direct call alike): what is left is the op's own Python work (argument encoding, the
  custom-op dispatch, the memoized spec resolution, the input checks, the CPU-time estimate);
- the same for a forward and backward through autograd when the backward exists.
`--profile` prints cProfile's top entries of the stubbed op call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attngen
from attngen import ops


def timed(fn, repeat: int, inner: int) -> float:
    """Median over `repeat` rounds of the mean seconds per call over `inner` calls."""
    fn()
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        rounds.append((time.perf_counter() - t0) / inner)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=g).half() for _ in range(3))
    plan = ops.resolve(q, k, v, ops.encode_fields({"causal": True, "lse": False}))
    print(f"torch {torch.__version__}, q {list(q.shape)} causal, kernel {plan.name}")

    op = timed(lambda: attngen.attention(q, k, v, causal=True), args.repeat, 3)
    direct = timed(lambda: attngen.emulate(plan, q, k, v), args.repeat, 3)
    print(f"with the CPU model:  op {op * 1e3:8.2f} ms   direct emulate {direct * 1e3:8.2f} ms")

    result = attngen.emulate(plan, q, k, v)
    real = ops.emulate
    ops.emulate = lambda *a, **kw: result  # the op's CPU path, minus the model
    try:
        stub_op = timed(lambda: attngen.attention(q, k, v, causal=True), args.repeat, 2000)
        stub_direct = timed(lambda: ops.emulate(plan, q, k, v), args.repeat, 2000)
        fwd_args = ops.fwd_arguments(q, k, v, causal=True)[0]
        encode = timed(lambda: ops.fwd_arguments(q, k, v, causal=True), args.repeat, 2000)
        dispatch = timed(lambda: ops.fwd(*fwd_args), args.repeat, 2000)
        print(f"model stubbed:       op {stub_op * 1e6:8.1f} us   direct call {stub_direct * 1e6:8.1f} us   "
              f"overhead {(stub_op - stub_direct) * 1e6:.1f} us")
        print(f"  of which: fwd_arguments {encode * 1e6:.1f} us, torch.ops.attngen.fwd (dispatch, resolve, "
              f"checks, estimate) {dispatch * 1e6:.1f} us")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                attngen.attention(q, k, v, causal=True)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        ops.emulate = real

    if hasattr(ops, "emulate_backward"):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def step():
            attngen.attention(qg, kg, vg, causal=True).float().sum().backward()

        print(f"forward + backward through autograd (CPU model): {timed(step, max(1, args.repeat // 2), 1) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
