"""How fast the CPU emulator runs emitted kernels (figures only; nothing here asserts a time).

    python bench/bench_emulator.py [--repeat N] [--quick]
    python bench/bench_emulator.py --calibrate     # fit emulator.driver's SECONDS_PER_* constants

For each case: the best wall time of N runs of `attngen.emulator.emulate_stats` (render
cache warm), the work it did (CTAs, wgmma, TMA loads, scheduler hand-overs), time per
wgmma, and whether the output is within the reference tolerance. The emulator runs on one
core: its agents hand a single baton around and numpy's BLAS is kept single-threaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import attngen
from attngen.emulator import emulate_stats
from attngen.reference.forward import check_close, random_inputs

# (label, spec fields, (batch, heads, q_len, kv_len), policy)
CASES = [
    ("target: hd128 causal 2 consumers", {"causal": True}, (1, 2, 512, 512), "random"),
    ("same, producer-first", {"causal": True}, (1, 2, 512, 512), "producer-first"),
    ("hd128 non-causal 2 consumers", {}, (1, 2, 512, 512), "random"),
    ("hd64 causal 3 consumers", {"causal": True, "head_dim": 64, "consumers": 3}, (1, 2, 512, 512), "random"),
    ("hd128 1 consumer", {"consumers": 1}, (1, 2, 512, 512), "random"),
    ("hd128 bf16 GQA 4 causal", {"causal": True, "dtype": "bfloat16", "gqa_group": 4}, (1, 4, 300, 517), "random"),
    ("hd256 causal", {"causal": True, "head_dim": 256}, (1, 1, 512, 512), "random"),
    ("hd128 causal 2048", {"causal": True}, (1, 1, 2048, 2048), "random"),
]


def run(fields, shape, policy, repeat):
    spec = attngen.Spec(**fields)
    b, h, sq, skv = shape
    hkv = h // spec.gqa_group
    q, k, v = random_inputs(spec.dtype, spec.head_dim, b, h, hkv, sq, skv, seed=0)
    best, stats, out = float("inf"), None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out, stats = emulate_stats(spec, q, k, v, seed=0, policy=policy)
        best = min(best, time.perf_counter() - t0)
    return spec, best, stats, check_close(out, q, k, v, spec.causal, dtype=spec.dtype)


# (spec fields, (batch, heads, q_len, kv_len)): the calibration grid, up to a few seconds each
CALIBRATION = [
    ({}, (1, 1, 128, 128)), ({}, (1, 2, 512, 512)), ({"causal": True}, (1, 2, 1024, 1024)),
    ({}, (2, 4, 256, 1024)), ({"consumers": 1}, (1, 2, 512, 512)), ({"head_dim": 64, "consumers": 3}, (1, 2, 700, 900)),
    ({"head_dim": 256, "causal": True}, (1, 2, 1024, 1024)), ({"head_dim": 64}, (4, 8, 130, 130)),
    ({"dtype": "bfloat16", "gqa_group": 4, "causal": True}, (1, 8, 300, 2048)), ({}, (1, 1, 2048, 4096)),
]


def calibrate(repeat):
    """Fit seconds = RUN + CTA x blocks + WGMMA x wgmma (least squares) and show each case's
    estimate (attngen.emulator.driver.estimate_seconds, whose counts are checked against Stats)."""
    from attngen.emulator import driver
    from attngen.kernels.fwd.plan import make_plan

    rows = []
    for fields, shape in CALIBRATION:
        spec, secs, st, _ = run(fields, shape, "random", repeat)
        b, h, sq, skv = shape
        est = driver.estimate_seconds(make_plan(spec), b, h, h // spec.gqa_group, [sq] * b, [skv] * b)
        rows.append((fields, shape, secs, st, est))
    a = np.array([[1.0, st.ctas, st.wgmma] for *_, st, _ in rows])
    y = np.array([secs for _, _, secs, _, _ in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    print(f"fit: SECONDS_PER_RUN = {coef[0]:.4f}, SECONDS_PER_CTA = {coef[1]:.5f}, SECONDS_PER_WGMMA = {coef[2]:.5f}")
    print(f"{'fields':48} {'B,H,Sq,Skv':>16} {'CTAs':>5} {'est':>5} {'wgmma':>6} {'est':>6} {'seconds':>8} {'fit':>7} "
          f"{'driver':>7}")
    for (fields, shape, secs, st, est), fit in zip(rows, a @ coef):
        print(f"{str(fields):48} {','.join(map(str, shape)):>16} {st.ctas:5d} {est.ctas:5d} {st.wgmma:6d} {est.wgmma:6d} "
              f"{secs:8.3f} {fit:7.3f} {est.seconds:7.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="only the target case")
    ap.add_argument("--calibrate", action="store_true", help="fit the CPU-time estimate's constants")
    args = ap.parse_args()
    print(f"# attngen {attngen.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, best of {args.repeat}")
    print(f"{'case':34} {'B,H,Sq,Skv':>18} {'policy':>15} {'seconds':>8} {'CTAs':>5} {'wgmma':>6} "
          f"{'TMA':>5} {'hand-overs':>10} {'ms/wgmma':>8}  check")
    if args.calibrate:
        return calibrate(args.repeat)
    for label, fields, shape, policy in CASES[:1] if args.quick else CASES:
        spec, secs, st, res = run(fields, shape, policy, args.repeat)
        per = 1e3 * secs / max(st.wgmma, 1)
        print(f"{label:34} {','.join(map(str, shape)):>18} {policy:>15} {secs:8.3f} {st.ctas:5d} {st.wgmma:6d} "
              f"{st.tma:5d} {st.handovers:10d} {per:8.2f}  {'PASS' if res.ok else 'FAIL'} (err {res.err:.1e} <= {res.bound:.1e})")


if __name__ == "__main__":
    main()
