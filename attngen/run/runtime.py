"""Generated kernels, callable from PyTorch on a Hopper GPU.

    kernel = attngen.run.runtime.compile_kernel(spec)   # JIT: plan -> render -> TileLang -> nvcc (sm_90a), or the cache
    attngen.run.runtime.precompile(spec)                # the same build ahead of time, into the cache (no GPU needed)
    out = kernel(q, k, v)                           # q [B, Sq, H, D], k/v [B, Skv, HKV, D]
    out = attngen.run.runtime.attention(q, k, v, causal=True)   # spec picked from the tensors

Compiling needs nvcc but no GPU; running needs a CUDA device of compute
capability 9.0. Every input is checked before anything is launched, and a bad
input raises `InputError` (a ValueError) that names the argument, the value and
what was expected.

Caching: `compile_kernel` memoizes per (spec, shape) in this process; across processes the
attngen cache ($ATTNGEN_CACHE, default ~/.cache/attngen; attngen.build.cache) keeps a runtime entry
per kernel, runtime/<kernel>-<key>/ (key: the emitted source, the nvcc flags, attngen's and
TileLang's versions), holding TileLang's compiled library, its parameters and the prim_func as
JSON. A hit loads it the way TileLang loads its own disk cache: no lowering, no nvcc, no process
started, no emitted code run. A miss lowers and compiles with `tilelang.compile` (which also
fills TileLang's cache under $TILELANG_CACHE_DIR) and stores the entry. `precompile(spec)` (and
`attngen precompile`) makes entries ahead of the first call; an entry holds no absolute path, so
a cache folder built on one machine serves another (docs/build.md, "Kernels before the first call").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from attngen.run import serving
from attngen.build.cache import RUNTIME, cache_key, cache_root, locked, package_versions, tool_versions
from attngen.hw import CAPABILITY, DTYPES
# The input checks live in attngen/inputs.py, shared with the CPU model (attngen.emulate);
# re-exported here, where the GPU path's callers have always found them.
from attngen.run.inputs import (backward_block_mask, check_append_tensors, check_extra, check_layout, check_serving_tensors,  # noqa: F401
                            check_tensors, extra_dims, packed_strides)
from attngen.build.lower import TARGET, load_module
from attngen.kernels.append.plan import AppendPlan, append_plan
from attngen.kernels.bwd.plan import autograd_spec, plan_backward
from attngen.kernels.common.plan import BLOCK_MASK_TENSORS, Shape
from attngen.kernels.fwd.plan import Plan, as_plan
from attngen.reference.forward import InputError, resolve_scale  # noqa: F401  (re-exported: attngen.run.runtime.InputError)
from attngen.kernels.append.render import render_append_source
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec, check_keys
from attngen.run.tuning_table import SCHEDULE_FIELDS, tuned_fields

NAMES = ("q", "k", "v", "out")
SERVING_KEYWORDS = serving.KEYWORDS  # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits
INT_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")


# -- input checks (no GPU needed) -------------------------------------------------


def _torch():
    import torch

    return torch


def torch_dtype(name: str):
    """The torch dtype of a spec dtype name (hw.DTYPES names are torch's)."""
    return getattr(_torch(), DTYPES[name].name)


def spec_dtype(dtype) -> str | None:
    """The spec dtype name of a torch dtype, or None if the kernels do not take it."""
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPES else None


def check_device(tensors: dict, *, device_type: str = "cuda", capability_of: Callable | None = None) -> None:
    """All tensors on one CUDA device of compute capability 9.0.

    `device_type` and `capability_of` exist so the messages can be tested without a GPU.
    """
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device.type != device_type:
            beside = f" ({first_name} is on {first.device})" if first.device.type == device_type else ""
            raise InputError(
                f"{name}.device", str(t.device),
                f"a {device_type.upper()} tensor on a compute capability {CAPABILITY[0]}.{CAPABILITY[1]} (Hopper) GPU{beside}",
            )
        if t.device != first.device:
            raise InputError(f"{name}.device", str(t.device), f"{first.device}, the device of {first_name}")
    if capability_of is None:
        capability_of = _torch().cuda.get_device_capability
    cap = tuple(capability_of(first.device))
    if cap != CAPABILITY:
        raise InputError(
            f"{first_name}.device capability", f"{cap[0]}.{cap[1]}",
            f"{CAPABILITY[0]}.{CAPABILITY[1]}: the kernels are built for sm_90a (H100/H200), whose wgmma and setmaxnreg run nowhere else",
        )


def check_written(out) -> None:
    """Raise if `out` still holds NaN: with a NaN-poisoned buffer, an element the kernel never wrote."""
    torch = _torch()
    bad = torch.isnan(out)
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()]
        raise AssertionError(f"{int(bad.sum())} output element(s) are NaN (unwritten or non-finite), first at index {idx}")


# -- serving calls (docs/serving.md): varlen, paged KV, split-KV ----------------------------


def check_serving_call(plan: Plan, q, k, v, out=None, *, shape: Shape | None = None, tensors: dict | None = None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, block_table=None, seqused_k=None,
                       num_splits=None) -> tuple[serving.ServingCall, list]:
    """Every check of a serving call (docs/serving.md, "What is validated"), no launch: shapes and
    values (serving.check_serving, one host copy of each int32 tensor), dtypes and layouts, the
    extra tensors, devices. Returns (the ServingCall, the extra tensors in kernel order)."""
    ints = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table, seqused_k=seqused_k)
    call = serving.check_serving(plan, q, k, v, max_seqlen_q=max_seqlen_q, num_splits=num_splits, **ints)
    if shape is not None:
        raise InputError("shape", str(shape), "no static shape: a serving call's extents are dynamic")
    check_serving_tensors(plan, call, q, k, v, out, ints)
    extra = check_extra(plan, extra_dims(call), {n: t for n, t in (tensors or {}).items() if t is not None})
    named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
    named.update({n: t for n, t in ints.items() if t is not None})
    named.update({t.name: x for t, x in zip([t for t in plan.extra if not t.output], extra)})
    check_device(named)
    return call, extra


def serving_outputs(plan: Plan, call: serving.ServingCall, q, out=None) -> dict:
    """The buffers a serving launch writes, on q's device: out (packed like q; the caller's when
    given), lse (float32, with spec.lse), and for a split kernel the float32 partials
    O_partial [num_splits, *out] and LSE_partial [num_splits, *lse] (none for an empty call)."""
    torch = _torch()
    f = call.fields
    if out is None:
        out = torch.empty(call.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device) if f.lse else None
    o_partial = lse_partial = None
    if f.split and not call.empty:
        o_partial = torch.empty(call.o_partial_shape, dtype=torch.float32, device=q.device)
        lse_partial = torch.empty(call.lse_partial_shape, dtype=torch.float32, device=q.device)
    return {"out": out, "lse": lse, "o_partial": o_partial, "lse_partial": lse_partial}


def launch_arguments(plan: Plan, call: serving.ServingCall, q, k, v, *, out, lse=None, o_partial=None, lse_partial=None,
                     extra=(), softmax_scale: float) -> tuple[list, list | None]:
    """The arguments of the main kernel and of the combine kernel (None without splits), in the
    ABI's order (docs/serving.md): Q, K, V, then O (or O_partial), LSE (or LSE_partial), the
    variant tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q, and last
    softmax_scale (a checked float: reference.resolve_scale). The
    combine kernel takes O_partial, LSE_partial, O, with spec.lse LSE, and varlen cu_seqlens_q (it
    writes only the rows before cu_seqlens_q[-1]: the rest is padding)."""
    f = call.fields
    if f.lse and lse is None:
        raise ValueError("launch_arguments: the spec has lse, so an lse buffer is needed")
    if f.split:
        if o_partial is None or lse_partial is None:
            raise ValueError("launch_arguments: a split kernel writes O_partial and LSE_partial; pass both")
        main = [q, k, v, o_partial, lse_partial]
        combine = [o_partial, lse_partial, out] + ([lse] if f.lse else [])
        if f.varlen:
            combine.append(dict(zip(call.arg_names, call.args))["cu_seqlens_q"])
    else:
        main = [q, k, v, out] + ([lse] if f.lse else [])
        combine = None
    return main + list(extra) + list(call.args) + [float(softmax_scale)], combine


def serving_overrides(q, k, *, cu_seqlens_q=None, block_table=None, num_splits=None) -> dict:
    """The spec fields a call's keywords imply: layout "varlen" with cu_seqlens_q, paged_kv (page
    size k.shape[1]) with block_table, and splits "auto" for num_splits other than None and 1
    ("auto": one kernel serves every count, the call's num_splits fixes it)."""
    fields = {}
    if cu_seqlens_q is not None:
        fields["layout"] = "varlen"
    if block_table is not None:
        fields["paged_kv"] = True
        shape = getattr(k, "shape", ())
        if len(shape) >= 2:
            fields["page_size"] = int(shape[1])
    if num_splits is not None and not (isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits == 1):
        fields["splits"] = "auto"
    return fields


def _detach(x):
    return x.detach() if hasattr(x, "detach") else x


# -- compile and run ------------------------------------------------------------


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
        extra = check_extra(self.plan, dims, {n: t for n, t in tensors.items() if t is not None})
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
            out = torch.empty((*q.shape[:3], dv), dtype=q.dtype, device=q.device)
        lse = None
        if self.spec.lse:
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        args, inputs = [], iter(extra)
        for t in self.plan.extra:
            args.append(lse if t.output else next(inputs))
        with torch.cuda.device(q.device):
            # forward only: DLPack refuses tensors that require grad, and no graph is recorded
            self.jit(q.detach(), k.detach(), v.detach(), out.detach(), *(a.detach() for a in args), softmax_scale)
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
            if combine is not None and self.combine_jit is None:
                raise RuntimeError(f"{self.name}: a split-KV kernel without its combine kernel (build_combine_kernel)")
            with torch.cuda.device(q.device):
                self.jit(*(_detach(a) for a in main))
                if combine is not None:
                    self.combine_jit(*(_detach(a) for a in combine))
        return (bufs["out"], bufs["lse"]) if call.fields.lse else bufs["out"]


class KernelBuildError(RuntimeError):
    """TileLang or nvcc could not build a kernel: the tail of the error, and where the whole log is."""


_BuildKey = tuple[Spec, Shape | None, str | None]  # spec, static shape, edited source
_memo: dict[_BuildKey, Kernel] = {}
_failed: dict[_BuildKey, str] = {}  # a build that failed fails again at once, not after another nvcc run
_memo_lock = threading.Lock()
_key_locks: dict[_BuildKey, threading.Lock] = {}
ERROR_TAIL = 1500  # characters of a build error shown; TileLang's message embeds the whole CUDA source


def _once(memo: dict, key, build):
    """memo[key], made by build() at most once per key in this process, even when threads race
    (a lock per key: a build of one kernel does not hold up a lookup of another)."""
    with _memo_lock:
        if key in memo:
            return memo[key]
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in memo:
            value = build()
            with _memo_lock:
                memo[key] = value
        return memo[key]


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


def _failure_message(plan: Plan, err: Exception) -> str:
    """The error's tail, with the whole text written to a log file ($ATTNGEN_LOG_DIR or the temp dir)."""
    import tempfile

    text = f"{type(err).__name__}: {err}"
    log_dir = os.environ.get("ATTNGEN_LOG_DIR") or os.path.join(tempfile.gettempdir(), "attngen-build-failures")
    where = ""
    try:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"{plan.name}{'_static' if plan.shape else ''}.log")
        with open(path, "w") as f:
            f.write(text)
        where = f" (whole log: {path})"
    except OSError:
        pass
    tail = text if len(text) <= ERROR_TAIL else "..." + text[-ERROR_TAIL:]
    return f"building {plan.name} failed{where}:\n{tail}"


RUNTIME_FORMAT = "tilelang-jit-1"  # what a runtime entry holds; a change of layout changes every key


def runtime_key(plan: Plan, source: str) -> str:
    """The runtime entry's key: the emitted source, the nvcc flags, attngen's and TileLang's versions.
    Not the local nvcc's version (unlike `attngen build`'s reports): a deployment that ships a
    precompiled cache needs no CUDA toolkit, and a hit must start no process at all."""
    import platform
    import sys

    # the library is a host shared object: an entry serves the OS and CPU architecture it was built on
    versions = {**package_versions(), "format": RUNTIME_FORMAT, "platform": f"{sys.platform}-{platform.machine()}"}
    return cache_key(source, versions, list(plan.compile_flags))


def runtime_entry(plan: Plan, source: str | None = None, cache_dir=None) -> Path:
    """Where the runtime entry of the plan's kernel (or of an edited `source`) lives, built or not:
    `<cache>/runtime/<kernel>-<key>`, under $ATTNGEN_CACHE unless `cache_dir` is given."""
    text = source or render_source(plan)
    name = plan.name if plan.shape is None else f"{plan.name}_static"
    return cache_root(cache_dir) / RUNTIME / f"{name}-{runtime_key(plan, text)}"


@dataclasses.dataclass
class Precompiled:
    """A runtime entry `precompile` made or found: its folder, whether it was there already, the seconds spent."""

    path: Path
    cached: bool
    seconds: float


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


def _built_entry(plan: Plan, source: str, entry: Path, *, module_name: str | None = None, require: bool = False,
                 kernels: dict | None = None):
    """Build (under the entry's lock: one build per entry across processes) and store the entry;
    returns (jit, combine jit, origin). `require`: a kernel whose entry cannot be stored is an error
    (precompile's whole point), where a first call would still run it. `kernels`: part -> the
    module's builder (default: build_kernel, and build_combine_kernel for a split spec)."""
    parts = kernels
    if parts is None:
        parts = {"main": "build_kernel"}
        if serving.serving_fields(plan).split:  # the split-KV kernel's partials are merged by a second prim_func
            parts["combine"] = "build_combine_kernel"
    jits, origin = _built_parts(plan, source, entry, parts, module_name=module_name, require=require)
    return jits["main"], jits.get("combine"), origin


def _built_parts(plan, source: str, entry: Path, parts: dict, *, module_name: str | None = None,
                 require: bool = False) -> tuple[dict, str]:
    """Build each prim_func of the emitted module (`parts`: part -> its builder, e.g. main ->
    build_kernel) and store them as one entry; returns ({part: jit}, origin). `plan` is a forward
    Plan, a BackwardPlan or an AppendPlan (name, shape, compile_flags)."""
    with locked(entry.parent / f".{entry.name}.lock"):
        if (entry / "meta.json").exists():  # another process built it while we waited
            return _load_parts(entry, plan), "disk"
        import tilelang
        from tvm.target import Target

        name = plan.name if plan.shape is None else f"{plan.name}_static"
        module = load_module(source, module_name or name)
        target = Target(TARGET)
        built, start = {}, time.time()
        for part, builder in parts.items():
            with target:  # T.tma_copy and the sm_90a intrinsics need the arch while the TIR is built
                prim_func = getattr(module, builder)()
            # out_idx=None (not [3]): the caller's `out` buffer is passed in, so tests can poison it;
            # with out_idx=[3] TileLang would allocate O itself and ignore any buffer given.
            jit = tilelang.compile(prim_func, out_idx=None, target=target, pass_configs=module.PASS_CONFIGS,
                                   compile_flags=list(plan.compile_flags))
            built[part] = (prim_func, jit)
        stored = _store_entry(entry, built, module.PASS_CONFIGS)
        if require and not stored:
            raise RuntimeError(f"{name}: TileLang wrote no kernel-cache entry to copy into {entry.parent} "
                               "(is TileLang's cache disabled? unset TILELANG_DISABLE_CACHE)")
        # TileLang's entry appears by an atomic rename during its build: one older than this call was loaded
        first = next(iter(parts))
        tl_entry = getattr(built[first][1], "_tilelang_cache_path", None)
        origin = "disk" if tl_entry and os.path.isdir(tl_entry) and os.stat(tl_entry).st_mtime < start else "compiled"
        return {part: jit for part, (_, jit) in built.items()}, origin


def _store_entry(entry: Path, built: dict, pass_configs: dict) -> bool:
    """Copy TileLang's cache entry of each built kernel (its library, parameters and sources) into
    `entry`/<part>/, with the prim_func as JSON (what TileLang's loader needs beside them, so a hit
    runs no emitted code) and meta.json (last: its presence marks a whole entry). No absolute path
    is stored. Returns False when TileLang kept no entry to copy."""
    import shutil
    import tempfile

    import tilelang  # noqa: F401  (first: it puts its bundled tvm on the path)
    import tvm

    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}-"))
    try:
        parts = {}
        for part, (prim_func, jit) in built.items():
            src = getattr(jit, "_tilelang_cache_path", None)
            library = next((n for n in LIBRARIES if src and os.path.isfile(os.path.join(src, n))), None)
            if library is None or not os.path.isfile(os.path.join(src, "params.json")):
                return False
            (work / part).mkdir()
            for n in (library, "params.json", "device_kernel.cu", "host_kernel.cu"):
                if os.path.isfile(os.path.join(src, n)):
                    shutil.copyfile(os.path.join(src, n), work / part / n)
            (work / part / "prim_func.json").write_text(tvm.ir.save_json(prim_func))
            parts[part] = {"library": library, "execution_backend": jit.execution_backend}
        meta = {"format": RUNTIME_FORMAT, "parts": parts, "versions": tool_versions(),
                "pass_configs": {str(getattr(k, "value", k)): v for k, v in pass_configs.items()},
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        os.replace(work, entry)  # atomic: readers see a whole entry or none
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)


LIBRARIES = ("executable.so", "kernel_lib.so")  # TileLang's library file, by execution backend (tvm_ffi, cython)


def _load_entry(entry: Path, plan: Plan) -> tuple:
    """(jit, combine jit or None) from a runtime entry, the way TileLang loads its own disk cache:
    no lowering, no nvcc, no emitted code run."""
    jits = _load_parts(entry, plan)
    return jits["main"], jits.get("combine")


def _load_parts(entry: Path, plan) -> dict:
    """{part: jit} of a runtime entry (a forward Plan's or a BackwardPlan's compile flags)."""
    import tilelang  # noqa: F401  (first: it puts its bundled tvm on the path)
    import tvm
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource
    from tvm.target import Target

    meta = json.loads((entry / "meta.json").read_text())
    jits = {}
    for part, info in meta["parts"].items():
        folder = entry / part
        jits[part] = JITKernel.from_database(
            func=tvm.ir.load_json((folder / "prim_func.json").read_text()),
            host_kernel_source=CachedTextSource(path=str(folder / "host_kernel.cu")),
            device_kernel_source=CachedTextSource(path=str(folder / "device_kernel.cu")),
            kernel_lib_path=str(folder / info["library"]),
            params=load_kernel_params((folder / "params.json").read_text()),
            target=Target(TARGET), target_host=None, out_idx=None, execution_backend=info["execution_backend"],
            pass_configs=meta["pass_configs"], compile_flags=list(plan.compile_flags),
        )
    return jits


# -- the backward kernels (docs/backward.md): preprocess, main, postprocess --------------------------

def backward_part(builder: str) -> str:
    """A backward module's part name from its builder: build_kernel -> main, build_dq_kernel -> dq, ..."""
    return "main" if builder == "build_kernel" else builder.removeprefix("build_").removesuffix("_kernel")


@dataclasses.dataclass(eq=False)
class BackwardKernel:
    """The compiled backward module of a spec: its kernels by part (render_bwd.entries: preprocess,
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
        """(dq, dk, dv) and, with sinks, dsinks [H] float32: gradients of sum(out * dout) + sum(lse * dlse)
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
        h, d = int(q.shape[-2]), int(q.shape[-1])
        f32 = dict(dtype=torch.float32, device=q.device)
        rows = (h, int(q.shape[0])) if varlen else (int(q.shape[0]), h, int(q.shape[1]))  # render_bwd.rows_shape
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
        main_calls = calls + bm[:4] + seq  # the main kernel's transposed q_* lists ...
        calls = calls + bm[4:] + seq  # ... and the dq kernel's kv_*
        scale = [float(softmax_scale)]
        main = [q, k, v, dout, lse2, dpsum] + accum + [dk_main, dv_main] + main_calls + scale
        dq = torch.zeros_like(q) if varlen else torch.empty_like(q)
        with torch.cuda.device(q.device):
            self.jits["preprocess"](*(_detach(a) for a in pre + seq))
            self.jits["main"](*(_detach(a) for a in main))
            if bp.deterministic:
                self.jits["dq"](*(_detach(a) for a in [q, k, v, dout, lse2, dpsum, dq] + calls + scale))
            else:
                self.jits["postprocess"](*(_detach(a) for a in [dq_accum, dq] + seq + scale))
            if bp.deterministic and bp.spec.sinks:  # one block per head sums the rows in order
                self.jits["dsinks"](*(_detach(a) for a in [lse, dpsum, tensors["sinks"], dsinks] + seq))
            if bp.kv_accum:
                dk, dv = torch.zeros_like(k) if varlen else torch.empty_like(k), \
                    torch.zeros_like(v) if varlen else torch.empty_like(v)
                self.jits["postprocess_kv"](*(_detach(a) for a in [dk_main, dv_main, dk, dv] + seq))
            else:
                dk, dv = dk_main, dv_main
        return (dq, dk, dv) + ((dsinks,) if dsinks is not None else ())


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
    return [precompile(autograd_spec(spec), shape, cache_dir=cache_dir), precompile_backward(spec, cache_dir=cache_dir)]


def compile_backward(spec_or_plan) -> BackwardKernel:
    """The backward module of a spec (or forward Plan, or BackwardPlan), JIT-built for sm_90a
    through the attngen cache (a runtime entry of its own) and memoized per process. A spec the
    backward refuses (paged KV, split-KV, ...) is the backward plan's SpecError."""
    if not (isinstance(spec_or_plan, (Spec, Plan)) or hasattr(spec_or_plan, "forward")):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    # looked up before planning and rendering: a call of the op pays a dict lookup here
    key = ("bwd", spec_or_plan.spec, getattr(spec_or_plan, "shape", None)) if not isinstance(spec_or_plan, Spec) \
        else ("bwd", spec_or_plan, None)

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


# -- the KV-cache append (flash_attn_with_kvcache's k=, v=; docs/interfaces.md) -------------------


@dataclasses.dataclass(eq=False)
class AppendKernel:
    """The compiled append kernel of one cache kind (dtype, head dims, page size): it writes
    k, v into a paged cache in place (render.render_append_source, its own module)."""

    plan: AppendPlan
    jit: object  # tilelang JITKernel of build_append_kernel
    cache_path: str | None
    origin: str  # "compiled" or "disk", as Kernel.origin
    compile_seconds: float

    def launch(self, call: serving.AppendCall, k_cache, v_cache, k, v, block_table, cache_seqlens) -> None:
        """Launch on a checked call (append_kv's checks); nothing for an append of no key."""
        torch = _torch()
        if call.empty:  # seqlen_new = 0: an empty grid would be a launch error
            return
        with torch.cuda.device(k_cache.device):
            self.jit(*(_detach(a) for a in (k_cache, v_cache, k, v, block_table, cache_seqlens)))


_append_memo: dict[AppendPlan, AppendKernel] = {}


def compile_append(plan: AppendPlan) -> AppendKernel:
    """The append kernel for sm_90a, from the attngen cache's runtime entry or built (and stored)
    as the forward's are; memoized per process."""

    def build() -> AppendKernel:
        text = render_append_source(plan)
        entry = runtime_entry(plan, text)
        start = time.time()
        try:
            if (entry / "meta.json").exists():
                jit, _ = _load_entry(entry, plan)
                origin = "disk"
            else:
                jit, _, origin = _built_entry(plan, text, entry, kernels={"main": "build_append_kernel"})
        except Exception as e:
            raise KernelBuildError(_failure_message(plan, e)) from None
        return AppendKernel(plan=plan, jit=jit, cache_path=str(entry), origin=origin, compile_seconds=time.time() - start)

    return _once(_append_memo, plan, build)


def check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens) -> tuple[serving.AppendCall, AppendPlan]:
    """Every check of a GPU append, no launch: shapes and values (serving.check_append, one host copy
    of each int32 tensor), dtypes and layouts (inputs.check_append_tensors), one sm_90 device."""
    call = serving.check_append(k_cache, v_cache, k, v, block_table, cache_seqlens)
    dtype = check_append_tensors(k_cache, v_cache, k, v, block_table, cache_seqlens)
    check_device({"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
                  "cache_seqlens": cache_seqlens})
    return call, append_plan(dtype, call.head_dim, call.head_dim_v, call.page_size)


def append_kv(k_cache, v_cache, k, v, block_table, cache_seqlens) -> serving.AppendCall:
    """Write k, v [batch, seqlen_new, kv_heads, D(v)] into the paged CUDA caches k_cache/v_cache
    [num_pages, page_size, kv_heads, D(v)] in place, at positions cache_seqlens[b] .. + seqlen_new - 1
    through block_table (int32 [batch, max_pages]); returns the checked call (its seqused_k is
    cache_seqlens + seqlen_new, what the attention then reads)."""
    call, plan = check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens)
    compile_append(plan).launch(call, k_cache, v_cache, k, v, block_table, cache_seqlens)
    return call


def spec_for(q, k, *, causal: bool = False, cu_seqlens_q=None, block_table=None, num_splits=None, **overrides) -> Spec:
    """The spec a call needs: head_dim, dtype and gqa_group from the tensors, plus overrides.

    Serving calls (docs/serving.md): `cu_seqlens_q` makes layout "varlen" (q [total_q, H, D]),
    `block_table` makes paged_kv true with page_size k.shape[1], and `num_splits` other than
    None and 1 makes splits "auto" (serving_overrides); fields given by name win.
    Without a schedule override (consumers, k_stages, v_stages, block_n, pingpong) the tuned
    table (attngen/tuned/h200.json) picks the schedule; without an entry, the plan's defaults
    (a serving spec always takes the plan's defaults: the table holds dense kernels only).
    """
    inferred = serving_overrides(q, k, cu_seqlens_q=cu_seqlens_q, block_table=block_table, num_splits=num_splits)
    return _spec_for(q, k, causal, overrides, "attngen.run.runtime.spec_for(...)", inferred)


def call_spec(q, k, v, fields: dict, *, causal: bool = False, window=(-1, -1), softcap=0.0, alibi: bool = False,
              sinks: bool = False, lse: bool = False, cu_seqlens_q=None, block_table=None, num_splits=None,
              call: str = "attngen.attention(...)") -> Spec:
    """The one mapping from an attention call's keywords to its Spec, for both of attngen.attention's
    paths (runtime.attention, and the torch op's ops.resolve): the variant the keywords imply
    (window, softcap, alibi and sinks for the tensors given, lse, head_dim_v when v's differs from
    q's), spec fields given by name winning over it, then the serving fields cu_seqlens_q,
    block_table and num_splits imply, and what the tensors say (spec_for). `call` names the
    caller in a misspelt field's error."""
    variant = {"window": tuple(window) if isinstance(window, list) else window, "softcap": softcap,
               "alibi": alibi, "sinks": sinks, "lse": lse}
    q_shape, v_shape = getattr(q, "shape", ()), getattr(v, "shape", ())
    if len(v_shape) in (3, 4) and len(q_shape) in (3, 4) and v_shape[-1] != q_shape[-1]:
        variant["head_dim_v"] = int(v_shape[-1])
    inferred = serving_overrides(q, k, cu_seqlens_q=cu_seqlens_q, block_table=block_table, num_splits=num_splits)
    # a spec field given by name (lse=, alibi=, splits=) wins over the one derived from the call
    return _spec_for(q, k, causal, {**variant, **fields}, call, inferred)


def _spec_for(q, k, causal, overrides: dict, call: str, inferred: dict | None = None) -> Spec:
    check_keys(overrides, call)  # a misspelt keyword names the call that got it, before any tensor check
    torch = _torch()
    chosen = {**(inferred or {}), **overrides}
    varlen = chosen.get("layout", "bshd") == "varlen"
    paged = bool(chosen.get("paged_kv", False))
    ranks = {"q": (3, "[total_q, heads, head_dim]") if varlen else (4, "[batch, seq_len, heads, head_dim]"),
             "k": (4, "[num_pages, page_size, kv_heads, head_dim]") if paged
             else ((3, "[total_k, kv_heads, head_dim]") if varlen else (4, "[batch, seq_len, heads, head_dim]"))}
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
        rank, text = ranks[name]
        if t.dim() != rank:
            raise InputError(f"{name}.shape", list(t.shape), f"{rank} dimensions: {text}")
    dtype = spec_dtype(q.dtype)
    if dtype is None:
        raise InputError("q.dtype", q.dtype, "torch.float16 or torch.bfloat16")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    h_axis, k_axis = q.dim() - 2, k.dim() - 2
    if kv_heads < 1:
        raise InputError(f"k.shape[{k_axis}] (kv_heads)", kv_heads, "at least 1")
    if heads < 1 or heads % kv_heads:
        raise InputError(f"q.shape[{h_axis}] (heads)", heads,
                         f"a positive multiple of k.shape[{k_axis}] (kv_heads) = {kv_heads}")
    fields = {"head_dim": int(q.shape[-1]), "dtype": dtype, "causal": causal, "gqa_group": heads // kv_heads}
    fields.update(chosen)  # an override of a derived field (head_dim, ...) wins, not a TypeError
    spec = Spec(**fields)
    if not any(f in overrides for f in SCHEDULE_FIELDS) and not serving.serving_fields(spec).uses_serving:
        tuned = tuned_fields(spec, max(int(q.shape[1]), int(k.shape[1])))  # the caller named no schedule: the tuned one
        if tuned:
            spec = Spec(**{**spec.to_dict(), **tuned})
    return spec


def attention(q, k, v, *, causal: bool = False, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
              return_lse: bool = False, out=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              block_table=None, seqused_k=None, num_splits=None, softmax_scale=None, scale=None, **kwargs):
    """FlashAttention-3 forward on Hopper: q [B, Sq, H, D], k [B, Skv, HKV, D], v [B, Skv, HKV, DV] -> [B, Sq, H, DV].

    score = q . k * softmax_scale (FlashAttention-3's name; `scale`, SDPA's and FlexAttention's, is
    the same argument; both given and different is an InputError); None gives 1 / sqrt(D). It is a
    run-time argument of the kernel (one build serves every scale); it must be a positive normal float32.

    Causal masks and windows align bottom-right (query i sees keys j <= i + Skv - Sq).
    Variants (docs/variants.md): `window=(left, right)`, `softcap`, `alibi_slopes` (float32
    (heads,)), `sinks` (float32 (heads,)), `return_lse` (then returns (out, lse)), and
    `score_mod=`/`mask_mod=` expressions whose tensors are passed as keywords by name. Other
    spec fields (consumers, k_stages, block_n, aligned, ...) may be given as keywords too.
    Serving (docs/serving.md, FlashAttention-3's names): `cu_seqlens_q`, `cu_seqlens_k` (int32
    (batch + 1,)) and `max_seqlen_q` for packed q [total_q, H, D] and k/v [total_k, HKV, D];
    `block_table` (int32 (batch, max_pages)) and `seqused_k` (int32 (batch,)) for a paged cache
    k/v [num_pages, page_size, HKV, D]; `num_splits` (None, "auto" or an int) for split-KV.
    The output is packed like q; lse is (heads, total_q) for varlen.
    The kernel is compiled once per spec and memoized.
    """
    from attngen import expr
    from attngen.spec import FIELDS

    overrides = {n: x for n, x in kwargs.items() if n in FIELDS}
    tensors = {n: x for n, x in kwargs.items() if n not in FIELDS}
    named = set()  # the tensors the call's score_mod/mask_mod read; any other keyword is a typo
    for field in ("score_mod", "mask_mod"):
        text = overrides.get(field)
        if isinstance(text, str) and text.strip():
            try:
                named |= {name for name, _ in expr.parse(text, field).tensors}
            except expr.ExprError:
                pass  # the Spec reports it, naming the field
    check_keys({n: x for n, x in tensors.items() if n not in named}, "attngen.attention(...)")
    plan = as_plan(call_spec(q, k, v, overrides, causal=causal, window=window, softcap=softcap,
                             alibi=alibi_slopes is not None, sinks=sinks is not None, lse=return_lse,
                             cu_seqlens_q=cu_seqlens_q, block_table=block_table, num_splits=num_splits))
    tensors.update({n: t for n, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)) if t is not None})
    softmax_scale = resolve_scale(softmax_scale, scale, head_dim=plan.spec.head_dim)
    fields = serving.serving_fields(plan)
    if not fields.split and num_splits == 1 and not isinstance(num_splits, bool):
        num_splits = None  # one split is the kernel without splits
    keywords = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    block_table=block_table, seqused_k=seqused_k, num_splits=num_splits)
    # Check before compiling: a bad input should not cost an nvcc run first.
    if fields.uses_serving or any(x is not None for x in keywords.values()):
        call, extra = check_serving_call(plan, q, k, v, out, tensors=tensors, **keywords)
        return compile_kernel(plan)._launch_serving(call, q, k, v, out, extra, softmax_scale)
    dims = check_tensors(plan, q, k, v, out)
    extra = check_extra(plan, dims, tensors)
    named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
    named.update({t.name: x for t, x in zip([t for t in plan.extra if not t.output], extra)})
    check_device(named)
    return compile_kernel(plan)(q, k, v, out=out, check=False, softmax_scale=softmax_scale, **tensors)


__all__ = [
    "AppendKernel", "BackwardKernel", "CAPABILITY", "InputError", "Kernel", "append_kv", "check_append_call",
    "compile_append", "compile_backward", "precompile_backward", "KernelBuildError", "Precompiled", "attention",
    "precompile", "runtime_entry", "check_device", "check_extra", "check_layout",
    "check_serving_call", "check_serving_tensors", "check_tensors", "check_written", "compile_kernel", "extra_dims",
    "launch_arguments", "serving_outputs", "serving_overrides", "call_spec", "spec_for", "torch_dtype", "spec_dtype",
]
