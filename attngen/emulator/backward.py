"""emulate_backward(): the emitted backward kernels on the CPU model (docs/backward.md).

The forward kernel with lse = true runs first (or the caller's out and lse are used), then the
backward module's preprocess, main and postprocess kernels, each on the same CPU model as the
forward (warpgroups as agents, mbarriers, wgmma, TMA, race detection), each fed what the one
before it wrote. Nothing here computes a gradient itself.
"""

from __future__ import annotations

import numpy as np

from attngen.emulator import blas
from attngen.emulator.driver import PROXY_FENCES, Runtime, Stats, _host_array, call_time_array, check_schedule, emulate
from attngen.reference.forward import InputError, check_scale, resolve_scale, to_numpy


def emulate_backward(spec, q, k, v, dout, *, seed: int = 0, policy: str = "random", source: str | None = None,
                     out=None, lse=None, dlse=None, alibi_slopes=None, sinks=None, softmax_scale=None, scale=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     proxy_fences: bool = PROXY_FENCES, stats: Stats | None = None, block_order: str = "grid", num_sms=None,
                     counters=None, **tensors):
    """Gradients of sum(attention(q, k, v) * dout + lse * dlse) from the emitted backward kernels on the CPU model.

    q [B, Sq, H, D], k [B, Skv, HKV, D], v [B, Skv, HKV, DV], dout [B, Sq, H, DV] (torch or numpy,
    rounded to the spec's dtype as the kernels read them). The forward kernel (the spec with
    lse = true) runs first on the CPU model unless `out` and `lse` ([B, H, Sq] float32, natural log)
    are given. `dlse` (shaped like lse): the LSE output's gradient, none (zeros) by default.
    Returns (dq, dk, dv), plus dsinks [H] (float32) when the spec has sinks, then the gradient of
    each of the spec's learnable tensors (float32, the tensor's shape, in spec.learnable's order): torch
    tensors for torch input, else float32 numpy arrays holding values of the dtype. `seed` and
    `policy` pick the schedule of every kernel; `source` replaces the rendered backward module;
    `block_order` ("grid" or "shuffled", Runtime.run) orders the backward kernels' blocks (unordered
    on a GPU: a sum of float atomics from several blocks may vary with it);
    the other keywords are emulate()'s (call-time tensors by name, softmax_scale or scale).
    A persistent spec (scheduler = "persistent") runs its forward (when it runs), its main kernel and
    its dq kernel with `num_sms` blocks at once (None: one per SM, at most one per tile): the main
    kernel's blocks race for KV tiles at its counter (`counters`, emulator/persistent.py; None: the
    model's launcher's), the dq kernel's take theirs in a fixed order; a tile run twice or skipped
    is a KernelError."""
    from attngen.emulator import persistent
    from attngen.kernels.bwd.plan import plan_backward
    from attngen.kernels.fwd.plan import Plan
    from attngen.run.inputs import backward_block_mask
    from attngen.kernels.bwd.render import call_tensors, learnable_tensors, render_backward_source, term_names
    from attngen.kernels.bwd.persistent import grouped, main_section
    from attngen.kernels.common.schedulers import section_of
    from attngen.spec import Spec

    if isinstance(spec, Plan):
        spec = spec.spec
    if not isinstance(spec, Spec):
        raise InputError("spec", type(spec).__name__, "an attngen.Spec")
    bp = plan_backward(spec)
    seed = check_schedule(seed, policy, block_order)
    sm_scale = check_scale(resolve_scale(softmax_scale, scale, head_dim=spec.head_dim), spec.head_dim)
    named = {n: t for n, t in dict(tensors, alibi_slopes=alibi_slopes, sinks=sinks).items() if t is not None}
    for n, t in named.items():  # sinks and the spec's learnable tensors get gradients; the others are constants
        if n != "sinks" and n not in spec.learnable and getattr(t, "requires_grad", False):
            raise InputError(n, "a tensor that requires grad", f"a constant, or a name in the spec's learnable "
                             f"{list(spec.learnable)} (whose gradients the backward returns)")
    if (out is None) != (lse is None):
        raise InputError("out" if out is None else "lse", "None", "both out and lse, or neither (the forward then runs)")
    varlen = bp.forward.varlen
    seq = {}
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise InputError("cu_seqlens_q/cu_seqlens_k", "None", "both prefix sums for a varlen spec")
        cq, ck = (np.asarray(to_numpy(c)).astype(np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
        max_q = int(np.diff(cq).max(initial=0)) if max_seqlen_q is None else int(max_seqlen_q)
        max_k = int(np.diff(ck).max(initial=0)) if max_seqlen_k is None else int(max_seqlen_k)
        seq = dict(cu_seqlens_q=cq.astype(np.int32), cu_seqlens_k=ck.astype(np.int32), max_seqlen_q=max_q)
    if out is None:
        out, lse = emulate(bp.forward, q, k, v, seed=seed, policy=policy, proxy_fences=proxy_fences,
                           softmax_scale=sm_scale, num_sms=num_sms, **seq, **named)
    qa, ka, va, do, oa, la = (_host_array(x) for x in (q, k, v, dout, out, lse))
    lead = qa.shape[:-2]  # (B, Sq) or (total_q,)
    h, hkv = qa.shape[-2], ka.shape[-2]
    want = lead + (h, va.shape[-1])
    if do.shape != oa.shape or oa.shape != want:
        raise InputError("dout", f"shape {tuple(do.shape)}", f"the output's shape {want}")
    lse_want = (h, lead[0]) if varlen else (lead[0], h, lead[1])
    if la.shape != lse_want:
        raise InputError("lse", f"shape {tuple(la.shape)}", f"{lse_want} ({'[H, total_q]' if varlen else '[B, H, Sq]'})")
    dl = np.zeros(la.shape, np.float32) if dlse is None else _host_array(dlse)
    if dl.shape != la.shape:
        raise InputError("dlse", f"shape {tuple(dl.shape)}", f"the LSE's shape {lse_want}")

    text = render_backward_source(bp) if source is None else source
    if varlen:
        b = len(seq["cu_seqlens_q"]) - 1
        dims = {"batch": b, "total_q": lead[0], "total_k": ka.shape[0], "kv_heads": hkv, "heads": h}
        ints = [seq["cu_seqlens_q"], seq["cu_seqlens_k"], max_q, max_k]
    else:
        b = lead[0]
        dims = {"batch": b, "q_len": lead[1], "kv_len": ka.shape[1], "kv_heads": hkv, "heads": h}
        ints = []
    extra = call_tensors(bp)
    grads_in = [np.zeros(np.shape(to_numpy(named[t.name])), np.float32) for t in learnable_tensors(bp)]  # atomics add here
    # deterministic: the main kernel stores each read's terms (zeros where it visits nothing), walked in one order after
    terms = [np.zeros((b, h, lead[1], ka.shape[1]), np.float32) for _ in term_names(bp)]
    bm_lists, bm_dims = backward_block_mask(bp, named, dims.get("q_len", 0), dims.get("kv_len", 0))
    dims.update(bm_dims)
    for t in extra:  # free axes of the call-time tensors are T.dynamic extents
        x = np.asarray(to_numpy(named[t.name]))
        dims.update({t.dim(i): x.shape[i] for i, a in enumerate(t.shape) if a is None})
    stats = stats if stats is not None else Stats()
    main_heads = hkv if grouped(bp) else h
    if varlen and spec.scheduler == "persistent":  # the lists the launcher builds, and their tiles
        persistent.backward_varlen_lists(bp, dims, seq["cu_seqlens_q"], seq["cu_seqlens_k"])
        main_tiles = int(dims["tile_list"][-1, 0]) * main_heads
    else:
        main_tiles = -(-ka.shape[1] // bp.block_n) * main_heads * b if not varlen else 0
    blocks = persistent.check_num_sms(num_sms, bp.forward, dims, tiles=main_tiles)
    counters = counters if counters is not None else persistent.DEFAULT_COUNTERS
    run = dict(seed=seed, policy=policy, stats=stats, proxy_fences=proxy_fences, block_order=block_order)
    with blas.single_threaded():
        rt = Runtime(text, f"<emitted {bp.name}>", dims)
        pre = [oa, do, la, dl, None, None] + ([] if bp.deterministic else [None])
        if spec.sinks and not bp.deterministic:
            pre += [_host_array(named["sinks"]), np.zeros(h, np.float32)]
        rt.run(pre + ints, entry="build_preprocess_kernel", **run)
        t = rt.tensors
        dsinks = t.get("dSinks")
        lse2, dpsum = t["LSE2"], t["dPsum"]
        sm = [np.float32(sm_scale)]
        calls = [call_time_array(x, named[x.name]) for x in extra]
        main_calls = calls + (terms if bp.deterministic else grads_in) + bm_lists[:4] + ints  # (transposed lists; dq's kv_*)
        calls = calls + bm_lists[4:] + ints
        kv_in = ([np.zeros(ka.shape, np.float32), np.zeros(va.shape, np.float32)] if bp.kv_accum else [None, None])
        main = [qa, ka, va, do, lse2, dpsum] + ([] if bp.deterministic else [t["dQ_accum"]]) + kv_in
        if varlen and not bp.kv_accum:  # rows of dK/dV past the last sequence are padding: written by no block
            main[-2:] = [np.zeros(ka.shape, np.float32), np.zeros(va.shape, np.float32)]
        if blocks:  # the blocks race for KV tiles at the counter
            boxes = len(stats.k_boxes)
            try:
                section = None if varlen else main_section(spec, lead[1], grouped(bp))  # varlen: the list instead
                rt.run(main + main_calls + sm + persistent.launch_inputs(bp.forward, dims, blocks, counters, section),
                       concurrent=True, **run)
            finally:
                persistent.keep(counters, rt.tensors)
            persistent.check_each_kv_tile_once(bp, dims, stats.k_boxes[boxes:])
        else:
            rt.run(main + main_calls + sm, **run)
        t = rt.tensors
        dk, dv = (t["dK_accum"], t["dV_accum"]) if bp.kv_accum else (t["dK"], t["dV"])
        if terms:  # one thread adds every term in order
            rt.run([t[n] for n in term_names(bp)] + calls[:len(extra)] + grads_in, entry="build_dtensors_kernel", **run)
            t = rt.tensors
        dtensors = {x.name: np.array(t["d" + x.param]) for x in learnable_tensors(bp)}
        if bp.deterministic:  # the dq kernel: KV tiles in order, no atomics
            dq_in = [qa, ka, va, do, lse2, dpsum, np.zeros(qa.shape, np.float32) if varlen else None]
            if blocks:  # each block takes every blocks-th tile of the fixed order
                boxes = len(stats.q_boxes)
                order = dims["dq_tile_list"] if varlen else section_of(spec, ka.shape[1])  # a varlen call's list
                dq = rt.run(dq_in + calls + sm + [blocks, order], entry="build_dq_kernel", concurrent=True, **run)
                persistent.check_each_dq_tile_once(bp, dims, stats.q_boxes[boxes:])
            else:
                dq = rt.run(dq_in + calls + sm, entry="build_dq_kernel", **run)
            dq = rt.tensors["dQ"] if varlen else dq
        else:
            dq_out = np.zeros(qa.shape, np.float32) if varlen else None
            dq = rt.run([t["dQ_accum"], dq_out] + ints + sm, entry="build_postprocess_kernel", **run)
            dq = rt.tensors["dQ"] if varlen else dq
        if bp.deterministic and spec.sinks:  # one block per head sums the rows in order
            dsinks = rt.run([la, dpsum, _host_array(named["sinks"]), None] + ints, entry="build_dsinks_kernel", **run)
        if bp.kv_accum:
            dk, dv = rt.run([dk, dv, None, None] + ints, entry="build_postprocess_kv_kernel", **run)
    grads = [dq, dk, dv] + ([dsinks] if spec.sinks else []) + [dtensors[n] for n in spec.learnable]
    if hasattr(q, "detach"):
        import torch

        dt = getattr(torch, spec.dtype)
        grads = [torch.from_numpy(np.array(g)).to(dt) for g in grads[:3]] + [torch.from_numpy(np.array(g)) for g in grads[3:]]
    return tuple(grads)
