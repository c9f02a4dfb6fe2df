"""emulate_backward(): the emitted backward kernels on the CPU model (docs/backward.md).

The forward kernel with lse = true runs first (or the caller's out and lse are used), then the
backward module's preprocess, main and postprocess kernels, each on the same CPU model as the
forward (warpgroups as agents, mbarriers, wgmma, TMA, race detection), each fed what the one
before it wrote. Nothing here computes a gradient itself.
"""

from __future__ import annotations

import numpy as np

from attngen.emulator import blas
from attngen.emulator.agents import POLICIES
from attngen.emulator.driver import BLOCK_ORDERS, PROXY_FENCES, Runtime, Stats, _host_array, check_seed, emulate
from attngen.reference import InputError, check_scale, resolve_scale, to_numpy


def emulate_backward(spec, q, k, v, dout, *, seed: int = 0, policy: str = "random", source: str | None = None,
                     out=None, lse=None, alibi_slopes=None, sinks=None, softmax_scale=None, scale=None,
                     proxy_fences: bool = PROXY_FENCES, stats: Stats | None = None, block_order: str = "grid", **tensors):
    """Gradients of sum(attention(q, k, v) * dout) from the emitted backward kernels on the CPU model.

    q [B, Sq, H, D], k [B, Skv, HKV, D], v [B, Skv, HKV, DV], dout [B, Sq, H, DV] (torch or numpy,
    rounded to the spec's dtype as the kernels read them). The forward kernel (the spec with
    lse = true) runs first on the CPU model unless `out` and `lse` ([B, H, Sq] float32, natural log)
    are given. Returns (dq, dk, dv), plus dsinks [H] (float32) when the spec has sinks: torch
    tensors for torch input, else float32 numpy arrays holding values of the dtype. `seed` and
    `policy` pick the schedule of every kernel; `source` replaces the rendered backward module;
    `block_order` ("grid" or "shuffled", Runtime.run) orders the backward kernels' blocks: blocks are
    unordered on a GPU, so a sum of float atomics from several blocks may vary with it;
    the other keywords are emulate()'s (call-time tensors by name, softmax_scale or scale)."""
    from attngen.plan import Plan, plan_backward
    from attngen.render_bwd import render_backward_source
    from attngen.spec import Spec

    if isinstance(spec, Plan):
        spec = spec.spec
    if not isinstance(spec, Spec):
        raise InputError("spec", type(spec).__name__, "an attngen.Spec")
    bp = plan_backward(spec)
    seed = check_seed(seed)
    if policy not in POLICIES:
        raise InputError("policy", repr(policy), f"one of {', '.join(POLICIES)}")
    if block_order not in BLOCK_ORDERS:
        raise InputError("block_order", repr(block_order), f"one of {', '.join(BLOCK_ORDERS)}")
    sm_scale = check_scale(resolve_scale(softmax_scale, scale, head_dim=spec.head_dim), spec.head_dim)
    named = {n: t for n, t in dict(tensors, alibi_slopes=alibi_slopes, sinks=sinks).items() if t is not None}
    if (out is None) != (lse is None):
        raise InputError("out" if out is None else "lse", "None", "both out and lse, or neither (the forward then runs)")
    if out is None:
        out, lse = emulate(bp.forward, q, k, v, seed=seed, policy=policy, proxy_fences=proxy_fences,
                           softmax_scale=sm_scale, **named)
    qa, ka, va, do, oa, la = (_host_array(x) for x in (q, k, v, dout, out, lse))
    b, sq, h, d = qa.shape
    skv, hkv = ka.shape[1], ka.shape[2]
    if do.shape != oa.shape or oa.shape != (b, sq, h, va.shape[3]):
        raise InputError("dout", f"shape {tuple(do.shape)}", f"the output's shape {(b, sq, h, va.shape[3])}")
    if la.shape != (b, h, sq):
        raise InputError("lse", f"shape {tuple(la.shape)}", f"[B, H, Sq] = {(b, h, sq)}")
    if not np.isfinite(do).all():
        raise InputError("dout", "a non-finite value", "finite values")

    text = render_backward_source(bp) if source is None else source
    dims = {"batch": b, "q_len": sq, "kv_len": skv, "kv_heads": hkv, "heads": h}
    extra = [t for t in bp.forward.extra if not t.output and t.name != "sinks"]
    for t in extra:  # free axes of the call-time tensors are T.dynamic extents
        x = np.asarray(to_numpy(named[t.name]))
        dims.update({t.dim(i): x.shape[i] for i, a in enumerate(t.shape) if a is None})
    stats = stats if stats is not None else Stats()
    run = dict(seed=seed, policy=policy, stats=stats, proxy_fences=proxy_fences, block_order=block_order)
    with blas.single_threaded():
        rt = Runtime(text, f"<emitted {bp.name}>", dims)
        pre = [oa, do, la, None, None] + ([] if bp.deterministic else [None])
        if spec.sinks:
            pre += [_host_array(named["sinks"]), np.zeros(h, np.float32)]
        rt.run(pre, entry="build_preprocess_kernel", **run)
        t = rt.tensors
        dsinks = t.get("dSinks")
        lse2, dpsum = t["LSE2"], t["dPsum"]
        calls = [_host_array(named[x.name]) for x in extra] + [np.float32(sm_scale)]
        kv_in = ([np.zeros(ka.shape, np.float32), np.zeros(va.shape, np.float32)] if bp.kv_accum else [None, None])
        main = [qa, ka, va, do, lse2, dpsum] + ([] if bp.deterministic else [t["dQ_accum"]]) + kv_in
        rt.run(main + calls, **run)
        t = rt.tensors
        dk, dv = (t["dK_accum"], t["dV_accum"]) if bp.kv_accum else (t["dK"], t["dV"])
        if bp.deterministic:  # the dq kernel: KV tiles in order, no atomics
            dq = rt.run([qa, ka, va, do, lse2, dpsum, None] + calls, entry="build_dq_kernel", **run)
        else:
            dq = rt.run([t["dQ_accum"], None, np.float32(sm_scale)], entry="build_postprocess_kernel", **run)
        if bp.kv_accum:
            dk, dv = rt.run([dk, dv, None, None], entry="build_postprocess_kv_kernel", **run)
    grads = [dq, dk, dv] + ([dsinks] if spec.sinks else [])
    if hasattr(q, "detach"):
        import torch

        dt = getattr(torch, spec.dtype)
        grads = [torch.from_numpy(np.array(g)).to(dt) for g in grads[:3]] + [torch.from_numpy(np.array(g)) for g in grads[3:]]
    return tuple(grads)
