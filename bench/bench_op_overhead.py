"""The torch op's per-call Python overhead on CPU tensors (figures only; nothing here asserts a time).

    python bench/bench_op_overhead.py [--repeat N] [--profile] [--training B H S D]

At a tiny shape (1x16x2x64, causal), best-of-N medians of:
- `attngen.attention` (the op, the CPU model included) beside a direct `attngen.emulate` of the
  same plan: the CPU model's milliseconds dwarf the op's microseconds, so a second pair
- with the CPU model replaced by a stub that returns the precomputed result (in attngen.interfaces.ops and
  for the direct call alike): what is left is the op's own Python work (argument encoding, the
  custom-op dispatch, the memoized spec resolution, the input checks, the CPU-time estimate);
- a forward and backward through autograd on the CPU model at the tiny shape, and with
  `--training B H S D` (causal, fp16) at that shape too: the forward alone under no_grad, the
  forward with the LSE plus the backward through autograd, and emulate_backward called directly.
`--profile` prints cProfile's top entries of the stubbed op call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attngen
from attngen.interfaces import op_arguments, ops


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
    ap.add_argument("--training", type=int, nargs=4, metavar=("B", "H", "S", "D"))
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=g).half() for _ in range(3))
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": False}))
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

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def step():
        attngen.attention(qg, kg, vg, causal=True).float().sum().backward()

    print(f"forward + backward through autograd (CPU model): {timed(step, max(1, args.repeat // 2), 1) * 1e3:.1f} ms")
    if args.training:
        training(*args.training)


def training(b: int, h: int, s: int, d: int, rounds: int = 3) -> None:
    """Best of `rounds` (the first also renders and plans each kernel: the render cache warms)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, generator=g).half() for _ in range(3))
    dout = torch.randn(q.shape, generator=g).half()
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": True}))
    best = {}

    def clock(name, fn):
        t0 = time.perf_counter()
        result = fn()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        return result

    for _ in range(rounds):
        with torch.no_grad():
            clock("forward", lambda: attngen.attention(q, k, v, causal=True))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = clock("with_lse", lambda: attngen.attention(qg, kg, vg, causal=True))
        clock("backward", lambda: out.backward(dout))
        o, lse = attngen.emulate(plan, q, k, v)
        clock("direct", lambda: attngen.emulate_backward(plan, q, k, v, dout, out=o, lse=lse))
    print(f"{b}x{h}x{s}x{s} hd{d} causal fp16 on the CPU model, best of {rounds}: forward (no grad) "
          f"{best['forward']:.2f} s, forward with LSE {best['with_lse']:.2f} s, backward through autograd "
          f"{best['backward']:.2f} s, emulate_backward direct {best['direct']:.2f} s")


if __name__ == "__main__":
    main()
