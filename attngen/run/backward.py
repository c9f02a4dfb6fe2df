"""The compiled backward module (docs/backward.md): preprocess, main, postprocess (or the
deterministic dq kernel), dsinks and the dK/dV postprocess, one runtime entry (run/entries.py);
`compile_backward`, `precompile_backward` and `precompile_training` (the forward with its LSE and
the backward, what a gradient through attngen.attention loads).
"""

from __future__ import annotations

import dataclasses
import time

from attngen.kernels.bwd.plan import autograd_spec, plan_backward
from attngen.kernels.bwd.persistent import grouped, main_section
from attngen.kernels.bwd.render import term_names
from attngen.kernels.common.schedulers import section_of
from attngen.kernels.common.plan import BLOCK_MASK_TENSORS, Shape
from attngen.kernels.fwd.plan import Plan
from attngen.reference.forward import InputError
from attngen.run.checks import _detach, _torch
from attngen.run.entries import KernelBuildError, Precompiled, _built_parts, _failure_message, _load_parts, _once, runtime_entry
from attngen.run import forward, persistent
from attngen.run.inputs import backward_block_mask
from attngen.spec import Spec


def backward_part(builder: str) -> str:
    """A backward module's part name from its builder: build_kernel -> main, build_dq_kernel -> dq, ..."""
    return "main" if builder == "build_kernel" else builder.removeprefix("build_").removesuffix("_kernel")


@dataclasses.dataclass(eq=False)
class BackwardKernel:
    """The compiled backward module of a spec: its kernels by part (kernels.bwd.render.entries: preprocess,
    main, then postprocess, or with deterministic = true the dq kernel and with sinks the dsinks
    kernel, and for GQA/MQA the dK/dV postprocess). `run` launches them in order on CUDA tensors."""

    plan: object  # plan.BackwardPlan
    jits: dict  # part -> tilelang JITKernel
    cache_path: str | None
    origin: str
    compile_seconds: float

    @property
    def name(self) -> str:
        return self.plan.name

    def run(self, q, k, v, out, lse, dout, *, extra=(), softmax_scale: float, call=None, dlse=None) -> tuple:
        """(dq, dk, dv), with sinks dsinks [H] float32, then each of spec.learnable's gradients (float32,
        its tensor's shape): gradients of sum(out * dout) + sum(lse * dlse)
        for the forward (out, lse [B, H, Sq]) that the plan's forward kernel returned (dlse: float32,
        packed, lse's shape; None: zeros, one memset of 4 bytes a row). `extra` are the
        forward's call-time tensors in its kernel order (check_extra). The inputs are checked by
        the caller (attngen.interfaces.ops: the forward's checks, dout and lse against out). The launches
        and their arguments follow emulate_backward's (docs/backward.md, "The kernels' parameters");
        a varlen call passes its checked ServingCall (packed q [total_q, H, D], lse [H, total_q])."""
        torch = _torch()
        bp = self.plan
        varlen = bp.forward.varlen
        if (call is not None) != varlen:
            raise InputError("call", "a serving call" if call is not None else None,
                             "a varlen call's checked ServingCall for a varlen spec, else none")
        names = [t.name for t in bp.forward.extra if not t.output]
        tensors = dict(zip(names, extra))
        h = int(q.shape[-2])
        f32 = dict(dtype=torch.float32, device=q.device)
        rows = (h, int(q.shape[0])) if varlen else (int(q.shape[0]), h, int(q.shape[1]))  # kernels.bwd.render.rows_shape
        seq = []
        if varlen:  # every kernel takes the prefix sums and the longest sequence's rows and keys (last but the scale)
            given = dict(zip(call.arg_names, call.args))
            max_k = int(call.kv_lens.max()) if call.kv_lens is not None and len(call.kv_lens) else 0
            seq = [given["cu_seqlens_q"], given["cu_seqlens_k"], int(call.max_seqlen_q), max_k]
        dpsum, lse2 = torch.empty(rows, **f32), torch.empty(rows, **f32)
        # deterministic: the dq kernel computes dQ in order, no accumulator; else the preprocess zeroes it
        dq_accum = None if bp.deterministic else torch.empty(q.shape, **f32)
        accum = [] if dq_accum is None else [dq_accum]
        dlse = torch.zeros(rows, **f32) if dlse is None else dlse
        pre = [out, dout, lse, dlse, dpsum, lse2] + accum
        dsinks = torch.zeros((h,), **f32) if bp.spec.sinks else None
        if bp.spec.sinks and not bp.deterministic:  # the preprocess subtracts each row's share (atomics)
            pre += [tensors["sinks"], dsinks]
        if bp.kv_accum:  # summed over each KV head's query heads by atomics: start at zero
            dk_main, dv_main = torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32)
        elif varlen:  # rows past the last sequence are padding no block writes
            dk_main, dv_main = torch.zeros_like(k), torch.zeros_like(v)
        else:
            dk_main, dv_main = torch.empty_like(k), torch.empty_like(v)
        lists = {n for n, _, _ in BLOCK_MASK_TENSORS}  # the forward's: the backward takes its own, derived from them
        calls = [tensors[n] for n in names if n != "sinks" and n not in lists]
        bm, _ = backward_block_mask(bp, tensors, int(q.shape[1]), int(k.shape[1])) if bp.forward.block_mask else ([], {})
        bm = [torch.from_numpy(x).to(q.device) for x in bm]
        # the learnable tensors' float32 gradients: the main kernel's atomics add into them (kernels.bwd.render)
        dtensors = [torch.zeros(tuple(tensors[n].shape), **f32) for n in names if n in bp.spec.learnable]
        # deterministic: the main kernel stores each read's terms, the dtensors kernel walks them in one order
        terms = [torch.zeros((int(q.shape[0]), h, int(q.shape[1]), int(k.shape[1])), **f32) for _ in term_names(bp)]
        constants = list(calls)  # the call-time tensors alone (the dtensors kernel's)
        main_calls = calls + (terms if bp.deterministic else dtensors) + bm[:4] + seq  # the main kernel's transposed q_* lists ...
        calls = calls + bm[4:] + seq  # ... and the dq kernel's kv_*
        scale = [float(softmax_scale)]
        main = [q, k, v, dout, lse2, dpsum] + accum + [dk_main, dv_main] + main_calls + scale
        dq_tail = list(scale)
        if varlen:  # a persistent main kernel takes its counters, grid and list; the dq kernel its grid and list
            main_tail, dq_list = persistent.varlen_backward_args(bp, call, q, k)
            main += main_tail
            dq_tail += dq_list
        else:  # ... its counters, grid and section; the dq kernel a fixed order's grid and section
            main += persistent.launch_args(bp.forward, q, k, main_section(bp.spec, int(q.shape[1]), grouped(bp)))
            dq_tail += persistent.block_args(bp.forward, q, section_of(bp.spec, int(k.shape[1])))
        dq = torch.zeros_like(q) if varlen else torch.empty_like(q)
        with torch.cuda.device(q.device):
            self.jits["preprocess"](*(_detach(a) for a in pre + seq))
            self.jits["main"](*(_detach(a) for a in main))
            if bp.deterministic:
                self.jits["dq"](*(_detach(a) for a in [q, k, v, dout, lse2, dpsum, dq] + calls + dq_tail))
            else:
                self.jits["postprocess"](*(_detach(a) for a in [dq_accum, dq] + seq + scale))
            if bp.deterministic and bp.spec.sinks:  # one block per head sums the rows in order
                self.jits["dsinks"](*(_detach(a) for a in [lse, dpsum, tensors["sinks"], dsinks] + seq))
            if terms:
                self.jits["dtensors"](*(_detach(a) for a in terms + constants + dtensors))
            if bp.kv_accum:
                dk, dv = torch.zeros_like(k) if varlen else torch.empty_like(k), \
                    torch.zeros_like(v) if varlen else torch.empty_like(v)
                self.jits["postprocess_kv"](*(_detach(a) for a in [dk_main, dv_main, dk, dv] + seq))
            else:
                dk, dv = dk_main, dv_main
        found = dict(zip([n for n in names if n in bp.spec.learnable], dtensors))
        return (dq, dk, dv) + ((dsinks,) if dsinks is not None else ()) + tuple(found[n] for n in bp.spec.learnable)


_bwd_memo: dict = {}


def _backward_build(spec_or_plan):
    """(backward plan, its emitted module, its runtime entry, its parts)."""
    from attngen.kernels.bwd.render import as_backward_plan, entries, render_backward_source

    if not (isinstance(spec_or_plan, (Spec, Plan)) or hasattr(spec_or_plan, "forward")):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    bp = as_backward_plan(spec_or_plan)
    text = render_backward_source(bp)
    return bp, text, {backward_part(builder): builder for builder in entries(bp)}


def precompile_backward(spec_or_plan, *, cache_dir=None) -> Precompiled:
    """precompile() for the spec's backward module: every part into one runtime entry, so that
    compile_backward (and autograd through attngen.attention) in a later process only loads it."""
    bp, text, parts = _backward_build(spec_or_plan)
    start = time.time()
    entry = runtime_entry(bp, text, cache_dir=cache_dir)
    if (entry / "meta.json").exists():
        return Precompiled(entry, True, time.time() - start)
    _built_parts(bp, text, entry, parts, require=True)
    return Precompiled(entry, False, time.time() - start)


def precompile_training(spec: Spec, shape: Shape | None = None, *, cache_dir=None) -> list:
    """What attngen.attention loads when a gradient is wanted, precompiled: the forward with its LSE
    (plan.autograd_spec) and the backward module. A spec the backward refuses: its SpecError."""
    plan_backward(spec)  # refuse before building anything
    return [forward.precompile(autograd_spec(spec), shape, cache_dir=cache_dir), precompile_backward(spec, cache_dir=cache_dir)]


def compile_backward(spec_or_plan) -> BackwardKernel:
    """The backward module of a spec (or forward Plan, or BackwardPlan), JIT-built for sm_90a
    through the attngen cache (a runtime entry of its own) and memoized per process. A spec the
    backward refuses (paged KV, split-KV, ...) is the backward plan's SpecError."""
    if not (isinstance(spec_or_plan, (Spec, Plan)) or hasattr(spec_or_plan, "forward")):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    # looked up before planning and rendering: a call of the op pays a dict lookup here
    # (a BackwardPlan's tiles may differ from its spec's default plan's: its name, which spells them, is in the key)
    key = ("bwd", spec_or_plan.spec, getattr(spec_or_plan, "shape", None), getattr(spec_or_plan, "name", None)) \
        if not isinstance(spec_or_plan, Spec) else ("bwd", spec_or_plan, None)

    def build() -> BackwardKernel:
        bp, text, parts = _backward_build(spec_or_plan)
        entry = runtime_entry(bp, text)
        start = time.time()
        try:
            if (entry / "meta.json").exists():
                jits, origin = _load_parts(entry, bp), "disk"
            else:
                jits, origin = _built_parts(bp, text, entry, parts)
        except Exception as e:
            raise KernelBuildError(_failure_message(bp, e)) from None
        return BackwardKernel(bp, jits, str(entry), origin, time.time() - start)

    return _once(_bwd_memo, key, build)


__all__ = ["BackwardKernel", "compile_backward", "precompile_backward", "precompile_training"]
