"""The CPU model's backward: time and workspace (figures only; nothing here asserts a time).

    python bench/bench_backward.py [--repeat N] [--profile]

For each case: the best wall time of N runs of the forward kernel (with its LSE) and of the
backward kernels alone (`emulate_backward` given that out and lse), their ratio, the work done
(CTAs, wgmma, TMA loads, reduce-adds, atomics) and whether every gradient passes
reference.backward.check_grads. Then the workspace of the backward per token: the bytes of the
float32 tensors the backward module declares between its kernels (dQ_accum, dPsum, LSE2, and
with GQA/MQA dK_accum and dV_accum), read from the emitted prim_funcs' parameters at the case's
shape, not from a formula: docs/backward.md ("Memory") states the same figures.
`--profile` prints cProfile's top functions for the first case's backward.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attngen  # noqa: E402
from attngen.emulator import Stats, emulate_backward, emulate_stats  # noqa: E402
from attngen.emulator.driver import Runtime  # noqa: E402
from attngen.kernels.bwd.plan import plan_backward  # noqa: E402
from attngen.reference.forward import random_inputs  # noqa: E402
from attngen.reference.backward import check_grads  # noqa: E402
from attngen.kernels.bwd.render import entries, render_backward_source  # noqa: E402

# (label, spec fields, (batch, heads, kv heads, q_len, kv_len)); the first is issue 17's target
CASES = [
    ("target: hd128 causal", {"causal": True}, (1, 2, 2, 512, 512)),
    ("hd128 causal deterministic", {"causal": True, "deterministic": True}, (1, 2, 2, 512, 512)),
    ("hd128 non-causal", {}, (1, 2, 2, 512, 512)),
    ("hd64 causal GQA 4", {"causal": True, "head_dim": 64, "gqa_group": 4}, (1, 4, 1, 512, 512)),
    ("hd256 causal (column split)", {"causal": True, "head_dim": 256}, (1, 2, 2, 512, 512)),
]
# The backward's workspace: float32 tensors written by one kernel of the module and read by the next.
WORKSPACE = ("dQ_accum", "dPsum", "LSE2", "dK_accum", "dV_accum")
PER_QUERY = ("dQ_accum", "dPsum", "LSE2")  # per query token and query head
PER_KEY = ("dK_accum", "dV_accum")  # per key token and KV head


def inputs(spec, shape):
    b, h, hkv, sq, skv = shape
    q, k, v = random_inputs(spec.dtype, spec.head_dim, b, h, hkv, sq, skv, seed=0)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    return q, k, v, dout


def timed(fields, shape, repeat):
    spec = attngen.Spec(**fields)
    fwd_plan = plan_backward(spec).forward  # the forward with lse = true, as emulate_backward runs it
    q, k, v, dout = inputs(spec, shape)
    t_fwd = t_bwd = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        (out, lse), fstats = emulate_stats(fwd_plan, q, k, v)
        t_fwd = min(t_fwd, time.perf_counter() - t0)
        bstats = Stats()
        t0 = time.perf_counter()
        grads = emulate_backward(spec, q, k, v, dout, out=out, lse=lse, stats=bstats)
        t_bwd = min(t_bwd, time.perf_counter() - t0)
    checks = check_grads(dict(zip(("dq", "dk", "dv"), grads)), q, k, v, dout, spec.causal, dtype=spec.dtype)
    return spec, t_fwd, t_bwd, fstats, bstats, checks


def workspace_bytes(spec, shape=(1, 2, 2, 512, 512)) -> dict:
    """{tensor name: bytes} of the backward's workspace tensors at this shape, from the emitted
    module's prim_func parameters (every entry), plus 'per_query' (bytes per query token and head)
    and 'per_key' (per key token and KV head)."""
    b, h, hkv, sq, skv = shape
    text = render_backward_source(spec)
    rt = Runtime(text, "<bench>", {"batch": b, "q_len": sq, "kv_len": skv, "kv_heads": hkv, "heads": h})
    found = {}
    for entry in entries(plan_backward(spec)):
        _, prim = rt.load(entry)
        for name, ann in prim.params:
            if name in WORKSPACE:
                assert ann.dtype == "float32", (name, ann.dtype)
                found[name] = 4 * int(np.prod(ann.shape))
    found["per_query"] = sum(found.get(n, 0) for n in PER_QUERY) / (b * sq * h)
    found["per_key"] = sum(found.get(n, 0) for n in PER_KEY) / (b * skv * hkv)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the first case's backward")
    args = ap.parse_args()
    print(f"# attngen {attngen.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; best of {args.repeat}")
    print(f"{'case':28} {'B,H,HKV,Sq,Skv':18} {'fwd s':>7} {'bwd s':>7} {'bwd/fwd':>7} {'CTAs':>5} {'wgmma':>6} "
          f"{'TMA':>5} {'red-add':>7} {'atomic':>6}  gradients")
    for label, fields, shape in CASES:
        spec, t_fwd, t_bwd, _, st, checks = timed(fields, shape, args.repeat)
        verdict = "PASS" if all(c.ok for c in checks.values()) else "FAIL " + str(checks)
        print(f"{label:28} {','.join(map(str, shape)):18} {t_fwd:7.3f} {t_bwd:7.3f} {t_bwd / t_fwd:7.2f} {st.ctas:5d} "
              f"{st.wgmma:6d} {st.tma:5d} {st.reduce_adds:7d} {st.atomics:6d}  {verdict}", flush=True)
    print()
    print("workspace of the backward (float32, from the emitted prim_funcs' parameters):")
    for label, fields, shape in CASES:
        spec = attngen.Spec(**fields)
        w = workspace_bytes(spec, shape)
        tensors = ", ".join(f"{n} {w[n]}" for n in WORKSPACE if n in w)
        line = f"  {label:28} {w['per_query']:6.0f} bytes per query token and head"
        if w["per_key"]:
            line += f", {w['per_key']:6.0f} per key token and KV head"
        print(f"{line}  ({tensors} bytes at {shape})")
    if args.profile:
        import cProfile
        import pstats

        label, fields, shape = CASES[0]
        spec = attngen.Spec(**fields)
        q, k, v, dout = inputs(spec, shape)
        (out, lse), _ = emulate_stats(plan_backward(spec).forward, q, k, v)
        prof = cProfile.Profile()
        prof.runcall(emulate_backward, spec, q, k, v, dout, out=out, lse=lse)
        print(f"\ncProfile of the backward, {label}:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
