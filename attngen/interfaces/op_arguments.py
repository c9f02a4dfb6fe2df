"""From the torch ops' arguments to a plan (docs/torch.md): how attngen.attention's keywords travel as
arguments torch can hash and put in a graph (`fields` as JSON, the window, softcap, softmax scale
and num_splits as numbers or tensors of their own), the plan they resolve to (memoized per call
shape and tuned-table stamp), the op's checks before anything runs, and the CPU model's time limit.
The ops themselves (schemas, registrations, fakes, autograd) are interfaces/ops.py's.
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from attngen.emulator.driver import estimate_seconds
from attngen.kernels.fwd.plan import Plan, as_plan
from attngen.reference.forward import InputError, check_scale, resolve_scale
from attngen.run import checks, inputs, runtime, serving, tuning_table
from attngen.spec import SpecError, check_keys, check_softcap, check_window, plain_value

# num_splits travels as an int: the spec's own choice (None), "auto", or a count >= 1
SPLITS_SPEC, SPLITS_AUTO = -1, 0
# A CPU-model run estimated past this many seconds is refused (an InputError with the estimate);
# ATTNGEN_CPU_MAX_SECONDS moves the limit for one who will wait.
CPU_MAX_SECONDS = 60.0


def encode_splits(num_splits) -> int:
    num_splits = plain_value("splits", num_splits)
    serving._check_num_splits(num_splits)  # None, "auto" or an int >= 1; anything else is an InputError
    if num_splits is None:
        return SPLITS_SPEC
    return SPLITS_AUTO if num_splits == "auto" else int(num_splits)


def _json(field: str, x) -> str:
    """One field's value as JSON text, by hand: torch.compile traces this (json.dumps it cannot)."""
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        # a compiled function's argument is symbolic once its value changed (dynamo's automatic dynamic),
        # and str() of it cannot be traced; a spec field picks the kernel: each value is its graph's constant
        x = guard_scalar(x)
    if isinstance(x, bool):
        return "true" if x else "false"
    if x is None:
        return "null"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x != x:
            return "NaN"
        return repr(x) if abs(x) != float("inf") else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, str):
        chars = [c if c not in '"\\' and ord(c) >= 0x20 else f"\\u{ord(c):04x}" for c in x]
        return '"' + "".join(chars) + '"'
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_json(field, e) for e in x) + "]"
    raise SpecError(field, x, "a Python bool, int, float or string (or a list of them); under torch.compile a "
                              "constant, not a value computed from a tensor")


def scale_argument(softmax_scale, scale, head_dim: int):
    """The op's softmax_scale from attngen.attention's two names for it (FlashAttention-3's and
    SDPA's): None when neither is given (the op then uses 1/sqrt(head_dim)), else a 0-d float64
    CPU tensor. A tensor, not a float: dynamo specializes a custom op's float argument (a guard
    `s == 0.3` per value, so one graph per scale), where a tensor made by arithmetic on the
    number (`ones * s`, which dynamo's tensorify pass keeps symbolic) is a graph input like q.
    A number is checked here (reference.resolve_scale); a SymFloat (a graph input under
    torch.compile) and a 0-d tensor when the op runs."""
    if softmax_scale is None and scale is None:
        return None
    symbolic = (torch.SymFloat, torch.Tensor)
    if isinstance(softmax_scale, symbolic) or isinstance(scale, symbolic):
        if softmax_scale is not None and scale is not None:
            raise InputError("softmax_scale, scale", f"{softmax_scale!r}, {scale!r}",
                             "one of them (they name the same argument)")
        value, name = (softmax_scale, "softmax_scale") if scale is None else (scale, "scale")
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or not value.is_floating_point():
                raise InputError(name, f"a {value.dtype} tensor of shape {list(value.shape)}",
                                 "a number, or a 0-d floating tensor")
            if value.requires_grad:
                raise InputError(name, "a tensor that requires grad",
                                 "a constant: the kernels have no gradient for the softmax scale")
            return value.detach().to(device="cpu", dtype=torch.float64)
    elif compiling() and (softmax_scale is None or scale is None) and _number(softmax_scale if scale is None else scale):
        # checked where the op runs (_scale_value): a refusal raised while dynamo traces is dynamo's error
        # (fullgraph: "Observed exception", or one about the message's repr), not attngen's line
        value = softmax_scale if scale is None else scale
    else:
        value = resolve_scale(softmax_scale, scale, head_dim=head_dim)
    if not compiling():
        return torch.full((), value, dtype=torch.float64)  # eager: the cheapest 0-d tensor (a third of ones * s)
    return torch.ones((), dtype=torch.float64) * value  # dynamo specializes torch.full's and torch.tensor's number


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scale_value(softmax_scale, head_dim: int) -> float:
    """The op's softmax_scale slot as the kernel's float (None: 1/sqrt(head_dim)), checked."""
    return check_scale(None if softmax_scale is None else float(softmax_scale), head_dim)


def plain_argument(field: str, x):
    """spec.plain_value, but a SymInt or SymFloat (a graph input under torch.compile) stays symbolic."""
    return x if isinstance(x, (torch.SymInt, torch.SymFloat)) else plain_value(field, x)


def window_arguments(window) -> tuple:
    """(left, right) of a window= keyword (NumPy scalars and 0-d CPU tensors as ints, as the Spec
    takes them; a SymInt stays symbolic); the Spec checks the values."""
    if isinstance(window, (tuple, list)):
        window = tuple(plain_argument("window", x) for x in window)
    if not isinstance(window, tuple) or len(window) != 2 or any(
            isinstance(x, bool) or not isinstance(x, (int, torch.SymInt)) for x in window):
        check_window(window)  # raises: the Spec's message, naming what was given
    return window[0], window[1]


def softcap_argument(softcap):
    softcap = plain_argument("softcap", softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, torch.SymInt, torch.SymFloat)):
        check_softcap(softcap)  # raises: the Spec's message, naming what was given
    return softcap if isinstance(softcap, (float, torch.SymFloat)) else float(softcap)


def encode_fields(chosen: dict) -> str:
    """The op's `fields` argument: a JSON object of spec fields, keys sorted (one text per choice)."""
    return "{" + ", ".join(f'"{n}": {_json(n, x)}' for n, x in ((n, chosen[n]) for n in sorted(chosen))) + "}"


def decode_splits(code: int):
    return None if code == SPLITS_SPEC else ("auto" if code == SPLITS_AUTO else code)


def _names(tensor_names: str) -> list[str]:
    return tensor_names.split(",") if tensor_names else []


NUMERIC = ("window", "softcap")  # spec fields that travel as op arguments of their own, not in `fields`


def resolve(q, k, v, fields: str, window: tuple = (-1, -1), softcap: float = 0.0, tensor_names: str = "",
            cu_seqlens_q=None, block_table=None, num_splits: int = SPLITS_SPEC) -> Plan:
    """The plan of one call: the caller's fields, then what the tensors say (runtime.call_spec:
    head_dim, dtype, gqa_group, serving layout, page size, the tuned schedule); alibi, sinks and
    head_dim_v follow from the tensors given, as attngen.attention derives them.

    Memoized on what spec_for reads (ranks, heads, head dims, the page size, the tuned table's
    sequence bucket and its file's stamp), so a call pays a dict lookup, not a Spec and a plan."""
    key = (fields, tuple(window), softcap, tensor_names, str(q.dtype), str(k.dtype), q.dim(), int(q.shape[-2]), int(q.shape[-1]),
           k.dim(), int(k.shape[-2]), int(v.shape[-1]), int(v.shape[-2]), cu_seqlens_q is not None,  # [-2]: a transposed v's dim
           None if block_table is None else int(k.shape[1]), num_splits,
           tuning_table.seq_bucket(max(int(q.shape[1]), int(k.shape[1]))), _table_stamp())
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _resolve(q, k, v, fields, window, softcap, tensor_names, cu_seqlens_q, block_table,
                                      num_splits)
    return plan


_plans: dict[tuple, Plan] = {}


MAX_PLANS = 1024


def _table_stamp():
    """The tuned table file's mtime, looked at no more than every STAMP_SECONDS (a stat per call
    was a tenth of the op's own Python time): an edit of the table is seen within that."""
    now, table = time.monotonic(), tuning_table.TABLE
    if now - _stamp[0] >= STAMP_SECONDS or table is not _stamp[2]:  # another table file is looked at at once
        try:
            _stamp[1] = table.stat().st_mtime_ns
        except OSError:
            _stamp[1] = None
        _stamp[0], _stamp[2] = now, table
    return _stamp[1]


STAMP_SECONDS = 1.0


_stamp = [float("-inf"), None, None]  # (when looked at, the mtime seen, the table's path)


def serving_of(plan: Plan) -> serving.Serving:
    """serving.serving_fields(plan), memoized per plan object (the op asks twice per call)."""
    hit = _serving.get(id(plan))
    if hit is None or hit[0] is not plan:
        if len(_serving) >= MAX_PLANS:
            _serving.clear()
        hit = _serving[id(plan)] = (plan, serving.serving_fields(plan))
    return hit[1]


_serving: dict[int, tuple] = {}


def _resolve(q, k, v, fields, window, softcap, tensor_names, cu_seqlens_q, block_table, num_splits) -> Plan:
    try:
        chosen = json.loads(fields) if fields else {}
    except ValueError as e:
        raise InputError("fields", repr(fields), f"a JSON object of spec fields ({e})") from None
    if not isinstance(chosen, dict):
        raise InputError("fields", repr(fields), "a JSON object of spec fields")
    check_keys(chosen, "attngen::fwd(fields=...)")
    for name in NUMERIC:
        if name in chosen:
            raise InputError(f"fields[{name!r}]", chosen[name], f"no {name} here: it is an argument of its own")
    names = _names(tensor_names)
    return as_plan(runtime.call_spec(q, k, v, chosen, window=tuple(window), softcap=softcap,
                                     alibi="alibi_slopes" in names, sinks="sinks" in names, cu_seqlens_q=cu_seqlens_q,
                                     block_table=block_table, num_splits=decode_splits(num_splits),
                                     call="attngen::fwd(fields=...)"))


def serving_keywords(plan: Plan, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits) -> dict:
    """The op's serving arguments as the runtime's and the CPU model's keywords."""
    splits = decode_splits(num_splits)
    if not serving_of(plan).split and splits == 1:
        splits = None  # one split is the kernel without splits
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                block_table=block_table, seqused_k=seqused_k, num_splits=splits)


def _check(plan: Plan, q, k, v, tensors: dict, keywords: dict):
    """Every check of runtime's launch path but the device's (the serving call, or None, and the
    extra tensors in kernel order)."""
    if serving_of(plan).uses_serving or any(x is not None for x in keywords.values()):
        ints = {n: keywords[n] for n in checks.INT_TENSORS}
        call = serving.check_serving(plan, q, k, v, **keywords)
        inputs.check_serving_tensors(plan, call, q, k, v, None, ints)
        return call, inputs.check_extra(plan, inputs.extra_dims(call), tensors, like=q)
    dims = inputs.check_tensors(plan, q, k, v)
    return None, inputs.check_extra(plan, dims, tensors, like=q)


def _one_device(given: dict) -> None:
    first_name, first = next(iter(given.items()))
    for name, t in given.items():
        if t.device != first.device:
            raise InputError(f"{name}.device", str(t.device), f"{first.device}, the device of {first_name}")


def cpu_max_seconds() -> float:
    text = os.environ.get("ATTNGEN_CPU_MAX_SECONDS")
    if not text:
        return CPU_MAX_SECONDS
    try:
        return float(text)
    except ValueError:
        raise InputError("ATTNGEN_CPU_MAX_SECONDS", repr(text), "a number of seconds") from None


def check_cpu_time(plan: Plan, call, q, k, *, work: float = 1.0, what: str = "") -> None:
    """Refuse a CPU-model run estimated past cpu_max_seconds(), naming the estimate. `work`: the
    run's cost in forwards (the forward alone 1; its backward BACKWARD_WORK; a forward whose
    backward will follow 1 + BACKWARD_WORK, refused before either starts)."""
    if call is None:
        batch, q_len, heads, _ = q.shape
        _, kv_len, kv_heads, _ = k.shape
        est = estimate_seconds(plan, batch, heads, kv_heads, [q_len] * batch, [kv_len] * batch)
    else:
        est = estimate_seconds(plan, call.batch, call.heads, call.kv_heads, call.q_lens, call.kv_lens,
                               call.num_splits, max_seqlen_q=call.max_seqlen_q, total_q=call.total_q)
    seconds = est.seconds * work
    limit = cpu_max_seconds()
    if seconds > limit:
        scaled = "" if work == 1.0 else f" {work:g}x a forward's"
        raise InputError(
            "q.shape", list(q.shape),
            f"a problem the CPU model runs within {limit:g} s: this {what or 'one'} would take about {seconds:.0f} s "
            f"({scaled.strip() + ' ' if scaled else ''}{est.wgmma} wgmma in {est.ctas} blocks); run it on a CUDA tensor, "
            f"shrink it, or raise ATTNGEN_CPU_MAX_SECONDS")


def compiling() -> bool:
    """Whether torch.compile is tracing: a check that reads tensor values on the host runs eagerly only."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


__all__ = ["CPU_MAX_SECONDS", "check_cpu_time", "compiling", "decode_splits", "encode_fields", "encode_splits", "plain_argument",
           "resolve", "scale_argument", "serving_keywords", "softcap_argument", "window_arguments"]
