"""Generated kernels, callable from PyTorch on a Hopper GPU.

    kernel = attngen.runtime.compile_kernel(spec)   # JIT: plan -> render -> TileLang -> nvcc (sm_90a)
    out = kernel(q, k, v)                           # q [B, Sq, H, D], k/v [B, Skv, HKV, D]
    out = attngen.runtime.attention(q, k, v, causal=True)   # spec picked from the tensors

Compiling needs nvcc but no GPU; running needs a CUDA device of compute
capability 9.0. Every input is checked before anything is launched, and a bad
input raises `InputError` (a ValueError) that names the argument, the value and
what was expected.

Caching: `compile_kernel` memoizes per (spec, shape) in this process, and TileLang's own
disk cache (content-keyed: the TIR script, target, flags, pass configs and the
TileLang build) lets a second process load the built library instead of running
nvcc again. The disk cache lives under $TILELANG_CACHE_DIR (default
~/.tilelang/cache), in <version>/<platform>/kernels/<sha256>/.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable

from attngen.hw import CAPABILITY, DTYPES, GRID_YZ_MAX, INT32_MAX, TMA_ALIGN
from attngen.lower import TARGET, load_module
from attngen.plan import Plan, Shape, as_plan
from attngen.reference import InputError  # noqa: F401  (re-exported: attngen.runtime.InputError)
from attngen.render import render_source
from attngen.spec import Spec, check_keys
from attngen.tuning_table import SCHEDULE_FIELDS, tuned_fields

NAMES = ("q", "k", "v", "out")


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


def packed_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def check_layout(name: str, t) -> None:
    """Layout the generated kernel can take: TMA's rules, then the packed ABI of the host stub."""
    shape, strides, elem = tuple(t.shape), tuple(t.stride()), t.element_size()
    if shape[-1] > 1 and strides[-1] != 1:
        raise InputError(f"{name}.stride()", strides, "the last dimension (head_dim) contiguous, stride 1")
    # TMA: every non-last stride a multiple of 16 bytes, the base address 16-byte aligned.
    for dim, (size, stride) in enumerate(zip(shape[:-1], strides[:-1])):
        if size > 1 and (stride * elem) % TMA_ALIGN:
            raise InputError(
                f"{name}.stride({dim})", stride,
                f"a multiple of {TMA_ALIGN // elem} elements ({TMA_ALIGN} bytes), which TMA requires",
            )
    if t.data_ptr() % TMA_ALIGN:
        raise InputError(f"{name}.data_ptr()", hex(t.data_ptr()), f"a {TMA_ALIGN}-byte aligned address, which TMA requires")
    # The emitted buffers declare no strides, so TileLang's host stub takes packed tensors
    # only (size-1 dimensions excepted, as torch's is_contiguous does).
    if not t.is_contiguous():
        raise InputError(
            f"{name}.stride()", strides,
            f"a contiguous tensor, strides {packed_strides(shape)} for shape {list(shape)} (call .contiguous())",
        )


def check_tensors(spec_or_plan: Spec | Plan, q, k, v, out=None, *, shape: Shape | None = None) -> tuple[int, int, int, int, int]:
    """Check dtypes, shapes and layouts against the planned spec (and a static `shape`); device not checked.

    Returns (batch, heads, kv_heads, q_len, kv_len).
    """
    spec = as_plan(spec_or_plan).spec  # resolved: block_m and block_n are known
    torch = _torch()
    given = {"q": q, "k": k, "v": v} | ({"out": out} if out is not None else {})
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
        if t.dim() != 4:
            raise InputError(f"{name}.shape", list(t.shape), "4 dimensions: [batch, seq_len, heads, head_dim]")
    want = torch_dtype(spec.dtype)
    dv = spec.head_dim if spec.head_dim_v is None else spec.head_dim_v
    for name, t in given.items():
        if t.dtype != want:
            raise InputError(f"{name}.dtype", t.dtype, f"{want} (spec dtype {spec.dtype!r})")
        if name in ("v", "out") and dv != spec.head_dim:
            if t.shape[3] != dv:
                raise InputError(f"{name}.shape[3] (head_dim_v)", t.shape[3], f"{dv}, the spec's head_dim_v")
        elif t.shape[3] != spec.head_dim:
            raise InputError(f"{name}.shape[3] (head_dim)", t.shape[3], f"{spec.head_dim}, the spec's head_dim")

    batch, q_len, heads, _ = q.shape
    _, kv_len, kv_heads, _ = k.shape
    if k.shape[0] != batch:
        raise InputError("k.shape[0] (batch)", k.shape[0], f"{batch}, the batch of q")
    if tuple(v.shape) != (*k.shape[:3], dv):
        what = "the shape of k" if dv == spec.head_dim else "the shape of k with head_dim_v"
        raise InputError("v.shape", list(v.shape), f"{[*k.shape[:3], dv]}, {what}")
    if out is not None and tuple(out.shape) != (*q.shape[:3], dv):
        what = "the shape of q" if dv == spec.head_dim else "the shape of q with head_dim_v"
        raise InputError("out.shape", list(out.shape), f"{[*q.shape[:3], dv]}, {what}")
    for label, size in (("q.shape[0] (batch)", batch), ("q.shape[1] (q_len)", q_len), ("q.shape[2] (heads)", heads),
                        ("k.shape[1] (kv_len)", kv_len), ("k.shape[2] (kv_heads)", kv_heads)):
        if size < 1:  # an empty grid is a launch error; kv_len 0 would leave consumers waiting forever
            raise InputError(label, size, "at least 1")
    if heads % kv_heads:
        raise InputError("q.shape[2] (heads)", heads, f"a multiple of k.shape[2] (kv_heads) = {kv_heads}")
    if heads // kv_heads != spec.gqa_group:
        raise InputError(
            "q.shape[2] / k.shape[2] (gqa group)", f"{heads}/{kv_heads} = {heads // kv_heads}",
            f"{spec.gqa_group}, the spec's gqa_group (query heads per KV head)",
        )
    if heads > GRID_YZ_MAX or batch > GRID_YZ_MAX:
        bad = ("q.shape[2] (heads)", heads) if heads > GRID_YZ_MAX else ("q.shape[0] (batch)", batch)
        raise InputError(bad[0], bad[1], f"at most {GRID_YZ_MAX} (a CUDA grid dimension)")
    for name, t in given.items():
        if t.numel() > INT32_MAX:
            raise InputError(f"{name}.numel()", t.numel(), f"at most {INT32_MAX}: the kernel indexes with int32")
    if spec.aligned:  # aligned kernels skip the bounds masks: lengths must be whole tiles
        if q_len % spec.block_m:
            raise InputError("q.shape[1] (q_len)", q_len, f"a multiple of block_m = {spec.block_m} (the spec is aligned)")
        if kv_len % spec.block_n:
            raise InputError("k.shape[1] (kv_len)", kv_len, f"a multiple of block_n = {spec.block_n} (the spec is aligned)")
    if shape is not None:
        got = Shape(batch, heads, kv_heads, q_len, kv_len)
        if got != shape:
            raise InputError("shape (B,H,HKV,SQ,SKV)", str(got), f"{shape}, the static shape this kernel was built for")
    for name, t in given.items():
        check_layout(name, t)
    if out is not None:
        for name in ("q", "k", "v"):
            if _overlap(out, given[name]):  # other blocks still read what out would overwrite
                raise InputError("out", f"memory overlapping {name}", "a buffer that shares no memory with q, k or v")
    return batch, heads, kv_heads, q_len, kv_len


def check_extra(plan: Plan, dims: tuple, tensors: dict) -> list:
    """The call-time tensors the plan's kernel takes (alibi_slopes, sinks, score_mod/mask_mod
    tensors), checked for presence, type, dtype float32, shape and layout; returned in the
    kernel's parameter order (outputs left out). `dims` is check_tensors's result."""
    torch = _torch()
    batch, heads, kv_heads, q_len, kv_len = dims
    extent = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    wanted = [t for t in plan.extra if not t.output]
    unknown = sorted(set(tensors) - {t.name for t in wanted})
    if unknown:
        takes = ", ".join(t.name for t in wanted) or "no extra tensors"
        raise InputError(unknown[0], _describe(tensors[unknown[0]]), f"no such tensor: the spec takes {takes}")
    ordered = []
    for t in wanted:
        shape_text = "[" + ", ".join("any" if a is None else f"{a} = {extent[a]}" for a in t.shape) + "]"
        x = tensors.get(t.name)
        if x is None:
            raise InputError(t.name, None, f"a float32 tensor of shape {shape_text}: the spec uses it")
        if not isinstance(x, torch.Tensor):
            raise InputError(t.name, type(x).__name__, "a torch.Tensor")
        if x.dtype != torch.float32:
            raise InputError(f"{t.name}.dtype", x.dtype, "torch.float32")
        if x.dim() != len(t.shape) or any(a is not None and x.shape[i] != extent[a] for i, a in enumerate(t.shape)) \
                or x.numel() == 0:
            raise InputError(f"{t.name}.shape", list(x.shape), shape_text)
        if not x.is_contiguous():
            raise InputError(f"{t.name}.stride()", tuple(x.stride()), f"a contiguous tensor, strides {packed_strides(x.shape)} (call .contiguous())")
        ordered.append(x)
    return ordered


def _describe(x) -> str:
    return f"a tensor of shape {list(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def _overlap(a, b) -> bool:
    if a.device != b.device or a.device.type == "meta":  # meta tensors have no memory (data_ptr 0)
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def check_device(tensors: dict, *, device_type: str = "cuda", capability_of: Callable | None = None) -> None:
    """All tensors on one CUDA device of compute capability 9.0.

    `device_type` and `capability_of` exist so the messages can be tested without a GPU.
    """
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device.type != device_type:
            raise InputError(
                f"{name}.device", str(t.device),
                f"a {device_type.upper()} tensor on a compute capability {CAPABILITY[0]}.{CAPABILITY[1]} (Hopper) GPU",
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


# -- compile and run ------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Kernel:
    """A compiled FA3 forward kernel: call it with CUDA tensors q, k, v (and optionally out)."""

    plan: Plan
    jit: object  # tilelang JITKernel
    cache_path: str | None  # TileLang disk-cache entry of this kernel
    origin: str  # "compiled" (nvcc ran in this process) or "disk" (TileLang's cache)
    compile_seconds: float

    @property
    def spec(self) -> Spec:
        return self.plan.spec

    @property
    def shape(self) -> Shape | None:
        return self.plan.shape

    @property
    def name(self) -> str:
        return self.plan.name if self.shape is None else f"{self.plan.name}_static"

    def check(self, q, k, v, out=None, **tensors) -> list:
        """Every check of a call, without launching; returns the extra tensors in kernel order."""
        dims = check_tensors(self.plan, q, k, v, out, shape=self.shape)
        extra = check_extra(self.plan, dims, {n: t for n, t in tensors.items() if t is not None})
        named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
        named.update({t.name: x for t, x in zip([t for t in self.plan.extra if not t.output], extra)})
        check_device(named)
        return extra

    def __call__(self, q, k, v, *, out=None, check: bool = True, alibi_slopes=None, sinks=None, **tensors):
        """out[b, i, h] = softmax(q[b, i, h] . k[b, :, h // g] / sqrt(D)) v[b, :, h // g].

        `out`, if given, is written in place (a NaN-poisoned buffer shows unwritten
        elements). `check=False` skips the input checks (for timing loops only).
        Variants: `alibi_slopes`, `sinks` and the score_mod/mask_mod tensors by name (float32);
        returns (out, lse) when the spec has lse (lse float32 [B, H, Sq]).
        """
        tensors = dict(tensors, alibi_slopes=alibi_slopes, sinks=sinks)
        tensors = {n: t for n, t in tensors.items() if t is not None}
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
            self.jit(q.detach(), k.detach(), v.detach(), out.detach(), *(a.detach() for a in args))
        return (out, lse) if self.spec.lse else out


class KernelBuildError(RuntimeError):
    """TileLang or nvcc could not build a kernel: the tail of the error, and where the whole log is."""


_memo: dict[tuple[Spec, Shape | None], Kernel] = {}
_failed: dict[tuple[Spec, Shape | None], str] = {}  # a build that failed fails again at once, not after another nvcc run
_memo_lock = threading.Lock()
_key_locks: dict[tuple[Spec, Shape | None], threading.Lock] = {}
ERROR_TAIL = 1500  # characters of a build error shown; TileLang's message embeds the whole CUDA source


def compile_kernel(spec_or_plan: Spec | Plan, shape: Shape | None = None) -> Kernel:
    """JIT-compile the planned kernel (static `shape` optional) for sm_90a; memoized per process."""
    if not isinstance(spec_or_plan, (Spec, Plan)):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    plan = as_plan(spec_or_plan, shape)  # a bad static shape fails here, as a SpecError, before TileLang
    key = (plan.spec, plan.shape)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:  # one build per key even when threads race
        if key in _memo:
            return _memo[key]
        if key in _failed:
            raise KernelBuildError(_failed[key])
        try:
            kernel = _build(plan)
        except Exception as e:
            _failed[key] = _failure_message(plan, e)
            raise KernelBuildError(_failed[key]) from None
        with _memo_lock:
            _memo[key] = kernel
        return kernel


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


def _build(plan: Plan) -> Kernel:
    import tilelang
    from tvm.target import Target

    name = plan.name if plan.shape is None else f"{plan.name}_static"
    module = load_module(render_source(plan), name)
    target = Target(TARGET)
    start = time.time()
    with target:  # T.tma_copy and the sm_90a intrinsics need the arch while the TIR is built
        prim_func = module.build_kernel()
    # out_idx=None (not [3]): the caller's `out` buffer is passed in, so tests can poison it;
    # with out_idx=[3] TileLang would allocate O itself and ignore any buffer given.
    jit = tilelang.compile(
        prim_func,
        out_idx=None,
        target=target,
        pass_configs=module.PASS_CONFIGS,
        compile_flags=list(plan.compile_flags),
    )
    seconds = time.time() - start
    path = getattr(jit, "_tilelang_cache_path", None)
    # The cache entry appears by an atomic rename of a directory made during the build,
    # so an entry older than this call was loaded, not built.
    origin = "disk" if path and os.path.isdir(path) and os.stat(path).st_mtime < start else "compiled"
    return Kernel(plan=plan, jit=jit, cache_path=path, origin=origin, compile_seconds=seconds)


def spec_for(q, k, *, causal: bool = False, **overrides) -> Spec:
    """The spec a call needs: head_dim, dtype and gqa_group from the tensors, plus overrides.

    Without a schedule override (consumers, k_stages, v_stages, block_n, pingpong) the tuned
    table (attngen/tuned/h200.json) picks the schedule; without an entry, the plan's defaults.
    """
    return _spec_for(q, k, causal, overrides, "attngen.runtime.spec_for(...)")


def _spec_for(q, k, causal, overrides: dict, call: str) -> Spec:
    check_keys(overrides, call)  # a misspelt keyword names the call that got it, before any tensor check
    torch = _torch()
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
        if t.dim() != 4:
            raise InputError(f"{name}.shape", list(t.shape), "4 dimensions: [batch, seq_len, heads, head_dim]")
    dtype = spec_dtype(q.dtype)
    if dtype is None:
        raise InputError("q.dtype", q.dtype, "torch.float16 or torch.bfloat16")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads < 1:
        raise InputError("k.shape[2] (kv_heads)", kv_heads, "at least 1")
    if heads < 1 or heads % kv_heads:
        raise InputError("q.shape[2] (heads)", heads, f"a positive multiple of k.shape[2] (kv_heads) = {kv_heads}")
    fields = {"head_dim": int(q.shape[3]), "dtype": dtype, "causal": causal, "gqa_group": heads // kv_heads}
    fields.update(overrides)  # an override of a derived field (head_dim, ...) wins, not a TypeError
    spec = Spec(**fields)
    if not any(f in overrides for f in SCHEDULE_FIELDS):  # the caller named no schedule: the tuned one, if any
        tuned = tuned_fields(spec, max(int(q.shape[1]), int(k.shape[1])))
        if tuned:
            spec = Spec(**{**spec.to_dict(), **tuned})
    return spec


def attention(q, k, v, *, causal: bool = False, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
              return_lse: bool = False, out=None, **kwargs):
    """FlashAttention-3 forward on Hopper: q [B, Sq, H, D], k [B, Skv, HKV, D], v [B, Skv, HKV, DV] -> [B, Sq, H, DV].

    Causal masks and windows align bottom-right (query i sees keys j <= i + Skv - Sq).
    Variants (docs/variants.md): `window=(left, right)`, `softcap`, `alibi_slopes` (float32
    (heads,)), `sinks` (float32 (heads,)), `return_lse` (then returns (out, lse)), and
    `score_mod=`/`mask_mod=` expressions whose tensors are passed as keywords by name. Other
    spec fields (consumers, k_stages, block_n, aligned, ...) may be given as keywords too.
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
    variant = {"window": tuple(window) if isinstance(window, list) else window, "softcap": softcap,
               "alibi": alibi_slopes is not None, "sinks": sinks is not None, "lse": return_lse}
    if hasattr(v, "shape") and len(v.shape) == 4 and hasattr(q, "shape") and len(q.shape) == 4 and v.shape[3] != q.shape[3]:
        variant["head_dim_v"] = int(v.shape[3])
    # a spec field given by name (lse=, alibi=) wins over the one derived from the call
    plan = as_plan(_spec_for(q, k, causal, {**variant, **overrides}, "attngen.attention(...)"))
    # Check before compiling: a bad input should not cost an nvcc run first.
    dims = check_tensors(plan, q, k, v, out)
    tensors.update({n: t for n, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)) if t is not None})
    extra = check_extra(plan, dims, tensors)
    named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
    named.update({t.name: x for t, x in zip([t for t in plan.extra if not t.output], extra)})
    check_device(named)
    return compile_kernel(plan)(q, k, v, out=out, check=False, **tensors)


__all__ = [
    "CAPABILITY", "InputError", "Kernel", "KernelBuildError", "attention", "check_device", "check_extra", "check_layout",
    "check_tensors",
    "check_written", "compile_kernel", "spec_for", "torch_dtype", "spec_dtype",
]
