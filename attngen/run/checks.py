"""The GPU path's call checks (no GPU needed): dtypes, one sm_90 device, unwritten outputs, and a
serving call checked whole, its output buffers and its launch arguments (docs/serving.md).

The shape, layout and extra-tensor checks are attngen.run.inputs' (shared with the CPU model);
serving's shapes and values are attngen.run.serving's.
"""

from __future__ import annotations

from typing import Callable

from attngen.hw import CAPABILITY, DTYPES
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan
from attngen.reference.forward import InputError
from attngen.spec import out_dtype_of
from attngen.run import serving
from attngen.run.inputs import check_extra, check_serving_tensors, extra_dims

NAMES = ("q", "k", "v", "out")
INT_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")


def _torch():
    import torch

    return torch


def torch_dtype(name: str):
    """The torch dtype of a spec dtype name (hw.DTYPES names are torch's)."""
    return getattr(_torch(), DTYPES[name].name)


def out_torch_dtype(plan: Plan):
    """The torch dtype the kernel writes O in: the spec's dtype, or an fp8 spec's out_dtype."""
    return torch_dtype(out_dtype_of(plan.spec))


DTYPE_CHOICES = "torch.float16, torch.bfloat16 or torch.float8_e4m3fn"  # what q may be (hw.DTYPES)


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
    extra = check_extra(plan, extra_dims(call), {n: t for n, t in (tensors or {}).items() if t is not None}, like=q)
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
        out = torch.empty(call.out_shape, dtype=out_torch_dtype(plan), device=q.device)
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


def _detach(x):
    return x.detach() if hasattr(x, "detach") else x


__all__ = ["check_device", "check_serving_call", "check_written", "launch_arguments", "serving_outputs", "spec_dtype",
           "torch_dtype"]
