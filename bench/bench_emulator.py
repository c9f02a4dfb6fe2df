"""How fast the CPU emulator runs emitted kernels (figures only; nothing here asserts a time).

    python bench/bench_emulator.py [--repeat N] [--quick]

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
from attngen.reference import check_close, random_inputs

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="only the target case")
    args = ap.parse_args()
    print(f"# attngen {attngen.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, best of {args.repeat}")
    print(f"{'case':34} {'B,H,Sq,Skv':>18} {'policy':>15} {'seconds':>8} {'CTAs':>5} {'wgmma':>6} "
          f"{'TMA':>5} {'hand-overs':>10} {'ms/wgmma':>8}  check")
    for label, fields, shape, policy in CASES[:1] if args.quick else CASES:
        spec, secs, st, res = run(fields, shape, policy, args.repeat)
        per = 1e3 * secs / max(st.wgmma, 1)
        print(f"{label:34} {','.join(map(str, shape)):>18} {policy:>15} {secs:8.3f} {st.ctas:5d} {st.wgmma:6d} "
              f"{st.tma:5d} {st.handovers:10d} {per:8.2f}  {'PASS' if res.ok else 'FAIL'} (err {res.err:.1e} <= {res.bound:.1e})")


if __name__ == "__main__":
    main()
