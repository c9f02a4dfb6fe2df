"""The backward pass on the command line (docs/backward.md, "On the command line").

`attngen show|generate|build|emulate --backward SPEC` act on the spec's backward module
(kernels/bwd/render.py) instead of its forward kernel, and `attngen check SPEC` runs both passes: the
verdicts here are the backward's half. cli/ parses the options and calls these; a spec the
backward refuses (paged KV, split-KV: inference layouts) is plan_backward's SpecError, one
line naming the field.
"""

from __future__ import annotations

import json
import time

import numpy as np

from attngen.build.nvcc import smem_as_planned
from attngen.kernels.bwd.plan import BackwardPlan, plan_backward
from attngen.reference.forward import InputError
from attngen.spec import SpecError

GRADS = ("dq", "dk", "dv", "dsinks")
# The warp-specialised kernels (a TMA producer warpgroup beside MMA warpgroups) set their register
# split with setmaxnreg; the preprocess, postprocess(_kv) and dsinks kernels are plain and have none.
WARP_SPECIALISED = ("main", "dq")


def backward_plan_or_reason(plan) -> tuple:
    """(BackwardPlan, None), or (None, why) when the backward refuses the spec."""
    try:
        return plan_backward(plan.spec, plan.shape), None
    except SpecError as e:
        return None, str(e)


def kernel_verdicts(part: str, report: dict, planned: int | None = None, slack: int = 0) -> tuple:
    """(ok, what) of one backward kernel's build: 0 spills, no local memory, setmaxnreg applied
    where the kernel is warp-specialised (and ignored nowhere), shared memory as planned (the
    report's plan, or `planned`: the dq kernel's is the plan's dq_smem; `slack`: build.smem_as_planned)."""
    sass = report["sass"]
    problems = []
    if report["spill_store_bytes"] or report["spill_load_bytes"]:
        problems.append(f"SPILLS {report['spill_store_bytes']} B stored, {report['spill_load_bytes']} B loaded")
    if report["stack_frame_bytes"] or sass["LDL"] or sass["STL"]:
        problems.append(f"LOCAL MEMORY ({report['stack_frame_bytes']} B stack, LDL {sass['LDL']}, STL {sass['STL']})")
    if part in WARP_SPECIALISED and not report["setmaxnreg_applied"]:
        problems.append("setmaxnreg NOT APPLIED")
    if report.get("setmaxnreg_ignored"):
        problems.append("setmaxnreg IGNORED (ptxas C7508)")
    planned = report.get("plan_smem_bytes") if planned is None else planned
    if planned is not None and not smem_as_planned(report, slack, planned):
        problems.append(f"shared memory {report['dynamic_smem_bytes']} B, planned {planned} B")
    facts = [f"{report['registers']} registers", "0 B spilled", "no local memory"]
    if part in WARP_SPECIALISED:
        facts.append("setmaxnreg applied")
    if planned is not None:
        facts.append(f"{planned} B shared memory as planned")
    what = f"backward {part} kernel {report['kernel']} builds for sm_90a: " + ", ".join(problems or facts)
    return not problems, what


def format_build_row(part: str, r: dict) -> str:
    setmaxnreg = "applied" if r["setmaxnreg_applied"] else "IGNORED" if r["setmaxnreg_ignored"] else "absent"
    how = f"cached ({round(sum(r['seconds'].values()), 1)} s)" if r.get("cached") else f"built in {round(sum(r['seconds'].values()), 1)} s"
    return (f"{part:15} {r['kernel']:58} {r['registers']:>4} {r['spill_store_bytes']:>4}/{r['spill_load_bytes']:<4} "
            f"{r['stack_frame_bytes']:>5} {r['dynamic_smem_bytes'] or 0:>7} {r['sass']['HGMMA']:>5}  {setmaxnreg:8} {how}")


def format_builds(results: dict) -> str:
    head = f"{'kernel':15} {'name':58} {'regs':>4} {'spill st/ld':>9} {'stack':>5} {'smem B':>7} {'HGMMA':>5}  setmaxnreg"
    return "\n".join([head] + [format_build_row(part, res.report) for part, res in results.items()])


def build_command(plan, args) -> int:
    """`attngen build --backward SPEC`: every kernel of the forward plan's backward module (its
    static shape, if any), one row each (or --json)."""
    from attngen.build.nvcc import build_backward

    results = build_backward(plan, cache_dir=args.cache_dir)
    if args.json:
        # the kernels in launch order, each report's keys sorted (as `attngen build --json`)
        print(json.dumps({part: json.loads(json.dumps(res.report, sort_keys=True)) for part, res in results.items()}, indent=2))
    else:
        print(format_builds(results))
    return 0


def draw_inputs(bp: BackwardPlan, batch, heads, kv_heads, q_len, kv_len, seed):
    """q, k, v, the call-time tensors (the forward's variant_inputs), a standard normal dout, and for
    varlen the packing: {} or {cu_seqlens_q, cu_seqlens_k} of the forward check's ragged batch
    (driver.serving_lengths: the given lengths, a 1-row query, more queries than keys, an empty one)."""
    from attngen.emulator.driver import serving_lengths, variant_inputs
    from attngen.reference.forward import round_to

    if bp.spec.layout != "varlen":
        q, k, v, tensors = variant_inputs(bp.forward, batch, heads, kv_heads, q_len, kv_len, seed)
        dout = np.random.default_rng(seed + 7).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
        return q, k, v, dout, tensors, {}
    lq, lk = serving_lengths("varlen", q_len, kv_len, paged=False)
    *_, tensors = variant_inputs(bp.forward, len(lq), heads, kv_heads, max(lq), max(lk), seed)  # per sequence
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    rng = np.random.default_rng(seed)
    dv = bp.forward.head_dim_v
    q, k, v, dout = (round_to(rng.standard_normal(shape), bp.spec.dtype).astype(np.float32) for shape in
                     [(cq[-1], heads, bp.spec.head_dim), (ck[-1], kv_heads, bp.spec.head_dim), (ck[-1], kv_heads, dv),
                      (cq[-1], heads, dv)])
    return q, k, v, dout, tensors, {"cu_seqlens_q": cq, "cu_seqlens_k": ck}


def varlen_checks(grads: dict, q, k, v, dout, packing: dict, spec, scale, variant) -> dict:
    """check_grads for packed sequences: each sequence against its own fp64 gradients
    (reference.backward.attention_grad_varlen and its twin), the same rule and non-finite agreement."""
    from attngen.reference.forward import Check, nonfinite_agree, tolerance
    from attngen.reference.backward import attention_grad_varlen

    cq, ck = packing["cu_seqlens_q"], packing["cu_seqlens_k"]
    ref = attention_grad_varlen(q, k, v, dout, cq, ck, spec.causal, scale, **variant)
    low = attention_grad_varlen(q, k, v, dout, cq, ck, spec.causal, scale, lowprec=spec.dtype, **variant)
    out = {}
    for name in GRADS:
        r = getattr(ref, name)
        if r is None:
            continue
        bound = tolerance(r, getattr(low, name), spec.dtype, None)
        g = np.asarray(grads.get(name), np.float64)
        ok_shape = g.shape == r.shape
        err = float(np.abs(g - r).max(initial=0.0)) if ok_shape and nonfinite_agree(g, r) else float("inf")
        out[name] = Check(err <= bound, err, bound)
    return out


def emulated_grads(bp: BackwardPlan, batch, heads, kv_heads, q_len, kv_len, *, seed=0, policy="random", source=None,
                   softmax_scale=None) -> tuple:
    """The emitted backward on the CPU model against the fp64 gradients: ({name: Check}, Stats, seconds, what
    was run). Raises EmulationError for a hazard or a deadlock."""
    from attngen.emulator import Stats, emulate_backward
    from attngen.reference.forward import variant_of
    from attngen.reference.backward import check_grads

    q, k, v, dout, tensors, packing = draw_inputs(bp, batch, heads, kv_heads, q_len, kv_len, seed)
    stats = Stats()
    t0 = time.perf_counter()
    grads = emulate_backward(bp.spec, q, k, v, dout, seed=seed, policy=policy, source=source, softmax_scale=softmax_scale,
                             stats=stats, **packing, **tensors)
    seconds = time.perf_counter() - t0
    learnable = bp.spec.learnable  # their gradients come last, in learnable's order
    named = {f"d{n}": g for n, g in zip(learnable, grads[len(grads) - len(learnable):])}
    grads = dict(zip(GRADS, grads[:len(grads) - len(learnable)]), **named)
    mods = {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")}
    variant = variant_of(bp.spec, tensors.get("alibi_slopes"), tensors.get("sinks"), mods)
    if packing:  # (the learnable tensors' gradients are checked on bshd only: the reference's varlen takes none)
        checks = varlen_checks(grads, q, k, v, dout, packing, bp.spec, softmax_scale, variant)
        lengths = [np.diff(packing[c]).tolist() for c in ("cu_seqlens_q", "cu_seqlens_k")]
        ran = f"H={heads} HKV={kv_heads}, {len(lengths[0])} sequences (q {lengths[0]}, kv {lengths[1]})"
    else:
        checks = check_grads(grads, q, k, v, dout, bp.spec.causal, dtype=bp.spec.dtype, scale=softmax_scale,
                             learnable=learnable, **variant)
        ran = f"B={batch} H={heads} HKV={kv_heads} Sq={q_len} Skv={kv_len}"
    return checks, stats, seconds, ran


def grads_text(checks: dict) -> str:
    return ", ".join(f"{name} {c.err:.2e} <= {c.bound:.2e}" if c.ok else f"{name} {c.err:.2e} > {c.bound:.2e} FAIL"
                     for name, c in checks.items())


def check_verdict(bp: BackwardPlan, heads, kv_heads, q_len, kv_len, args) -> tuple:
    """(ok, what) of `attngen check`'s CPU run of the backward: every gradient within its bound."""
    from attngen.emulator import EmulationError

    what = "backward CPU model vs fp64 gradients"
    scale = "" if args.softmax_scale is None else f", softmax scale {args.softmax_scale!r}"
    try:
        checks, _, seconds, ran = emulated_grads(bp, 1, heads, kv_heads, q_len, kv_len, seed=args.seed,
                                                 softmax_scale=args.softmax_scale)
    except EmulationError as e:
        print(e.report)
        return False, f"{what} (seed {args.seed}{scale}): {type(e).__name__}"
    return all(c.ok for c in checks.values()), f"{what} ({ran}, seed {args.seed}{scale}): {grads_text(checks)}, {seconds:.1f} s"


def check_verdicts(bp: BackwardPlan, run_shape: tuple, args) -> list:
    """`attngen check`'s backward half: build each kernel of the rendered module, run it on the CPU model.

    The module is not written: generated/ holds the backward presets' modules only, and two specs
    that differ in a forward-only field (seed_parity's aligned split loop and the default) share a
    backward module name, so writing every checked spec's module would leave stale or clashing files."""
    from attngen.build.nvcc import build_backward

    print(f"backward   {bp.name} (rendered; `attngen generate --backward SPEC` writes it)")
    results = build_backward(bp, cache_dir=args.cache_dir)
    print(format_builds(results))
    dq_smem = sum(bp.dq_smem.values()) if bp.dq_smem else None
    verdicts = [kernel_verdicts(part, res.report, dq_smem if part == "dq" else None, bp.smem_slack if part == "main" else 0)
                for part, res in results.items()]
    verdicts.append(check_verdict(bp, *run_shape, args))
    return verdicts


def emulate_command(args, plan) -> int:
    """`attngen emulate --backward`: random inputs and dout, the emitted backward kernels on the CPU
    model, each gradient's error against its bound. Exit 0 all within, 1 a mismatch, hazard or
    deadlock, 2 bad input (checked before any input is drawn)."""
    from attngen.cli.common import emulate_options, emulated

    bp = plan_backward(plan.spec)  # a spec the backward refuses: its SpecError, exit 2
    source, filename, heads = emulate_options(args, plan.spec)  # InputError: exit 2
    scale = args.softmax_scale
    print(f"attngen emulate --backward: {bp.name} ({'--source ' + filename if filename else 'rendered'}), "
          f"seed {args.seed}, policy {args.policy}" + ("" if scale is None else f", softmax scale {scale!r}"))
    result, status = emulated(lambda: emulated_grads(bp, args.batch, heads, args.kv_heads, args.q_len, args.kv_len,
                                                     seed=args.seed, policy=args.policy, source=source,
                                                     softmax_scale=scale))
    if result is None:
        return status
    checks, stats, seconds, ran = result
    print(f"  {ran}")
    print(f"  the forward (lse) and {stats.ctas} backward CTAs, {stats.handovers} scheduler hand-overs, {stats.wgmma} wgmma, "
          f"{stats.tma} TMA loads, {stats.atomics} atomics, {stats.reduce_adds} TMA reduce-adds, {seconds:.2f} s")
    for name, c in checks.items():
        print(f"  {name:6} max |{name} - ref| = {c.err:.3e}, bound = {c.bound:.3e}: {c.verdict}")
    print("  (bound = 2 x max|lowprec - ref| + ulp x max|ref|, per gradient)")
    return 0 if all(c.ok for c in checks.values()) else 1


def only_one_spec(specs: list, option: str = "--backward") -> str:
    if len(specs) != 1:
        raise InputError(option, f"{len(specs)} spec files", "one spec file (the backward module's kernels build one after another)")
    return specs[0]
