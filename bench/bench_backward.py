"""How fast the CPU model runs the emitted backward kernels, and the backward's workspace (figures
only; nothing here asserts a time).

    PYTHONPATH=. python bench/bench_backward.py [--repeat N]

For each case: the best wall time of N runs of `attngen.emulate_backward` given the forward's out
and LSE (the backward kernels only; the forward is timed apart), the work (CTAs, wgmma), whether
every gradient is within the tolerance rule, and the workspace bytes per query token and head
(float32 dQ_accum, dPsum, LSE2; GQA adds dK_accum and dV_accum per key and KV head).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attngen
from attngen.emulator import Stats, emulate_backward
from attngen.plan import plan_backward
from attngen.reference import random_inputs
from attngen.reference_bwd import check_grads

CASES = [  # (label, spec fields, (batch, heads, kv_heads, q_len, kv_len))
    ("target: hd128 causal", {"causal": True}, (1, 2, 2, 512, 512)),
    ("hd128 non-causal", {}, (1, 2, 2, 512, 512)),
    ("hd64 causal GQA 4", {"causal": True, "head_dim": 64, "gqa_group": 4}, (1, 4, 1, 512, 512)),
    ("hd128 causal deterministic", {"causal": True, "deterministic": True}, (1, 2, 2, 512, 512)),
    ("hd256 causal (column split)", {"causal": True, "head_dim": 256}, (1, 2, 2, 512, 512)),
]


def workspace_bytes_per_token(bp) -> int:
    """float32 bytes per query token and head the backward allocates besides the gradients."""
    return 4 * (0 if bp.deterministic else bp.spec.head_dim) + 4 + 4


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    for label, fields, (b, h, hkv, sq, skv) in CASES:
        spec = attngen.Spec(**fields)
        bp = plan_backward(spec)
        q, k, v = random_inputs(spec.dtype, spec.head_dim, b, h, hkv, sq, skv, 0)
        dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
        t0 = time.perf_counter()
        out, lse = attngen.emulate(bp.forward, q, k, v)
        fwd = time.perf_counter() - t0
        best, stats = float("inf"), None
        for _ in range(args.repeat):
            st = Stats()
            t0 = time.perf_counter()
            grads = emulate_backward(spec, q, k, v, dout, out=out, lse=lse, stats=st)
            best, stats = min(best, time.perf_counter() - t0), st
        checks = check_grads(dict(zip(("dq", "dk", "dv"), grads)), q, k, v, dout, spec.causal, dtype=spec.dtype)
        verdict = "PASS" if all(c.ok for c in checks.values()) else "FAIL"
        print(f"{label:32s} B={b} H={h} HKV={hkv} Sq={sq} Skv={skv}  backward {best:6.2f} s (forward {fwd:5.2f} s), "
              f"{stats.ctas} CTAs, {stats.wgmma} wgmma, gradients {verdict}, "
              f"workspace {workspace_bytes_per_token(bp)} B per query token and head  [{bp.name}]")


if __name__ == "__main__":
    main()
