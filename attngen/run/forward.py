"""The compiled forward kernel: `Kernel` (call it with CUDA tensors), `compile_kernel` (JIT, memoized
per process, through the attngen cache's runtime entry: run/entries.py) and `precompile` (the same
build ahead of time, no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan, as_plan
from attngen.kernels.fwd.render import render_source
from attngen.reference.forward import InputError, resolve_scale
from attngen.run import persistent, serving
from attngen.run.checks import (NAMES, _detach, _torch, check_device, check_serving_call, launch_arguments, out_torch_dtype,
                                serving_outputs)
from attngen.run.entries import (KernelBuildError, Precompiled, _built_entry, _failure_message, _load_entry, _once,
                                 runtime_entry)
from attngen.run.inputs import check_extra, check_tensors
from attngen.spec import Spec


@dataclasses.dataclass(eq=False)
class Kernel:
    """A compiled FA3 forward kernel: call it with CUDA tensors q, k, v (and optionally out)."""

    plan: Plan
    jit: object  # tilelang JITKernel
    cache_path: str | None  # the attngen cache's runtime entry of this kernel (runtime_entry)
    origin: str  # "compiled" (nvcc ran in this process) or "disk" (loaded from the attngen or TileLang cache)
    compile_seconds: float
    combine_jit: object = None  # the split-KV combine kernel (build_combine_kernel), for a spec with splits != 1

    @property
    def spec(self) -> Spec:
        return self.plan.spec

    @property
    def shape(self) -> Shape | None:
        return self.plan.shape

    @property
    def name(self) -> str:
        return self.plan.name if self.shape is None else f"{self.plan.name}_static"

    @functools.cached_property
    def serving(self) -> serving.Serving:
        """The spec's serving fields (docs/serving.md): whether a call takes the serving path."""
        return serving.serving_fields(self.plan)

    def check(self, q, k, v, out=None, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, block_table=None,
              seqused_k=None, num_splits=None, softmax_scale=None, scale=None, **tensors) -> list:
        """Every check of a call, without launching; returns the extra tensors in kernel order."""
        resolve_scale(softmax_scale, scale, head_dim=self.spec.head_dim)
        keywords = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        block_table=block_table, seqused_k=seqused_k, num_splits=num_splits)
        if self.serving.uses_serving or any(x is not None for x in keywords.values()):
            return self.check_call(q, k, v, out, **keywords, **tensors)[1]
        dims = check_tensors(self.plan, q, k, v, out, shape=self.shape)
        extra = check_extra(self.plan, dims, {n: t for n, t in tensors.items() if t is not None}, like=q)
        named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
        named.update({t.name: x for t, x in zip([t for t in self.plan.extra if not t.output], extra)})
        check_device(named)
        return extra

    def check_call(self, q, k, v, out=None, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   block_table=None, seqused_k=None, num_splits=None, **tensors) -> tuple[serving.ServingCall, list]:
        """A serving call's checks (check_serving_call); returns (the ServingCall, the extra tensors)."""
        keywords = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        block_table=block_table, seqused_k=seqused_k, num_splits=num_splits)
        return check_serving_call(self.plan, q, k, v, out, shape=self.shape, tensors=tensors, **keywords)

    def __call__(self, q, k, v, *, out=None, check: bool = True, alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, block_table=None, seqused_k=None, num_splits=None,
                 softmax_scale=None, scale=None, **tensors):
        """out[b, i, h] = softmax(q[b, i, h] . k[b, :, h // g] * softmax_scale) v[b, :, h // g].

        `softmax_scale` (or `scale`, SDPA's and FlexAttention's name) is a run-time argument of the
        kernel: one build serves every scale; None gives 1 / sqrt(D); it must be finite and positive.

        `out`, if given, is written in place (a NaN-poisoned buffer shows unwritten
        elements). `check=False` skips the input checks (for timing loops only).
        Variants: `alibi_slopes`, `sinks` and the score_mod/mask_mod tensors by name (float32);
        returns (out, lse) when the spec has lse (lse float32 [B, H, Sq]).
        Serving specs (docs/serving.md): `cu_seqlens_q`, `cu_seqlens_k`, `max_seqlen_q` (varlen),
        `block_table`, `seqused_k` (paged), `num_splits` (split-KV: None, "auto" or an int);
        out is packed like q, lse (heads, total_q) for varlen.
        """
        softmax_scale = resolve_scale(softmax_scale, scale, head_dim=self.spec.head_dim)  # checked even with check=False
        tensors = dict(tensors, alibi_slopes=alibi_slopes, sinks=sinks)
        tensors = {n: t for n, t in tensors.items() if t is not None}
        keywords = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        block_table=block_table, seqused_k=seqused_k, num_splits=num_splits)
        if self.serving.uses_serving or any(x is not None for x in keywords.values()):
            return self._call_serving(q, k, v, out, check, keywords, tensors, softmax_scale)
        if check:
            extra = self.check(q, k, v, out, **tensors)
        else:
            extra = [tensors[t.name] for t in self.plan.extra if not t.output]
        torch = _torch()
        if out is None:
            dv = self.spec.head_dim_v or self.spec.head_dim
            out = torch.empty((*q.shape[:3], dv), dtype=out_torch_dtype(self.plan), device=q.device)
        lse = None
        if self.spec.lse:
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        args, inputs = [], iter(extra)
        for t in self.plan.extra:
            args.append(lse if t.output else next(inputs))
        with torch.cuda.device(q.device):
            # forward only: DLPack refuses tensors that require grad, and no graph is recorded
            self.jit(q.detach(), k.detach(), v.detach(), out.detach(), *(a.detach() for a in args), softmax_scale,
                     *persistent.launch_args(self.plan, q, k))
        return (out, lse) if self.spec.lse else out

    def _call_serving(self, q, k, v, out, check: bool, keywords: dict, tensors: dict, softmax_scale: float):
        """Check (or, with check=False, only read the shapes), then launch."""
        if check:
            call, extra = self.check_call(q, k, v, out, **keywords, **tensors)
        else:
            call = serving.check_serving(self.plan, q, k, v, read_values=False, **keywords)
            extra = [tensors[t.name] for t in self.plan.extra if not t.output]
        return self._launch_serving(call, q, k, v, out, extra, softmax_scale)

    def _launch_serving(self, call: serving.ServingCall, q, k, v, out, extra: list, softmax_scale: float):
        """Allocate the outputs, launch the main kernel and, for a split spec, the combine kernel."""
        torch = _torch()
        bufs = serving_outputs(self.plan, call, q, out)
        if not call.empty:  # no query row: an empty grid would be a launch error
            main, combine = launch_arguments(self.plan, call, q, k, v, extra=extra, softmax_scale=softmax_scale, **bufs)
            main += persistent.varlen_launch_args(self.plan, call, q, k)
            if combine is not None and self.combine_jit is None:
                raise RuntimeError(f"{self.name}: a split-KV kernel without its combine kernel (build_combine_kernel)")
            with torch.cuda.device(q.device):
                self.jit(*(_detach(a) for a in main))
                if combine is not None:
                    self.combine_jit(*(_detach(a) for a in combine))
        return (bufs["out"], bufs["lse"]) if call.fields.lse else bufs["out"]


_BuildKey = tuple[Spec, Shape | None, str | None]  # spec, static shape, edited source
_memo: dict[_BuildKey, Kernel] = {}
_failed: dict[_BuildKey, str] = {}  # a build that failed fails again at once, not after another nvcc run


def compile_kernel(spec_or_plan: Spec | Plan, shape: Shape | None = None, *, source: str | None = None) -> Kernel:
    """JIT-compile the planned kernel (static `shape` optional) for sm_90a; memoized per process.

    `source`: emitted text to compile instead of the plan's own, for a diagnostic edit of it
    (bench/bench_gpu.py times bench/build_time.py's variants beside the kernel as emitted)."""
    if not isinstance(spec_or_plan, (Spec, Plan)):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    plan = as_plan(spec_or_plan, shape)  # a bad static shape fails here, as a SpecError, before TileLang
    key = (plan.spec, plan.shape, source)

    def build() -> Kernel:
        if key in _failed:
            raise KernelBuildError(_failed[key])
        try:
            return _build(plan, source)
        except Exception as e:
            _failed[key] = _failure_message(plan, e)
            raise KernelBuildError(_failed[key]) from None

    return _once(_memo, key, build)


def precompile(spec_or_plan: Spec | Plan, shape: Shape | None = None, *, cache_dir=None) -> Precompiled:
    """Fill the runtime cache with the planned kernel (and a split-KV kernel's combine kernel) ahead
    of the first call: TileLang's lowering and nvcc run now, so that compile_kernel (and
    attngen.attention) in any later process, pointed at the same or a copied cache, only loads it.
    Needs a CUDA toolkit, no GPU. `attngen precompile` runs this for each spec (docs/build.md)."""
    if not isinstance(spec_or_plan, (Spec, Plan)):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    plan = as_plan(spec_or_plan, shape)
    start = time.time()
    entry = runtime_entry(plan, cache_dir=cache_dir)
    if (entry / "meta.json").exists():
        return Precompiled(entry, True, time.time() - start)
    _built_entry(plan, render_source(plan), entry, require=True)
    return Precompiled(entry, False, time.time() - start)


def _build(plan: Plan, source: str | None = None) -> Kernel:
    """Load the kernel's runtime entry from the attngen cache (no lowering, no nvcc), or build it
    with TileLang and store it there for the next process."""
    name = plan.name if plan.shape is None else f"{plan.name}_static"
    text = source or render_source(plan)
    entry = runtime_entry(plan, text)
    start = time.time()
    if (entry / "meta.json").exists():
        try:
            jit, combine_jit = _load_entry(entry, plan)
        except Exception as e:  # a damaged or incomplete copy: say which entry, do not rebuild behind the user's back
            raise RuntimeError(f"the runtime cache entry {entry} could not be loaded ({type(e).__name__}: {e}); "
                               "remove that folder to rebuild the kernel") from e
        origin = "disk"
    else:
        jit, combine_jit, origin = _built_entry(plan, text, entry, module_name=name if source is None else f"{name}_edited")
    return Kernel(plan=plan, jit=jit, cache_path=str(entry), origin=origin, compile_seconds=time.time() - start,
                  combine_jit=combine_jit)


__all__ = ["Kernel", "compile_kernel", "precompile"]
