"""attngen's kernels as PyTorch custom ops (`torch.ops.attngen.*`), and `attngen.attention` on them.

    out = attngen.attention(q, k, v, causal=True)          # CUDA: the compiled kernel; CPU: the CPU model
    torch.compile(f, fullgraph=True)(q, k, v)              # no graph break: the ops have fake kernels
    torch.export.export(module, (q, k, v))                 # the graph holds torch.ops.attngen.fwd

The ops (docs/torch.md):
- `attngen::fwd` runs the forward kernel the call's spec names. On CUDA tensors it is
  runtime's compiled kernel; on CPU tensors the SAME emitted kernel on the CPU model
  (attngen.emulate), never the fp64 reference, so compile, export and opcheck are tested for
  real without a GPU. A CPU run estimated past CPU_MAX_SECONDS is refused before it starts.
- `attngen::bwd` runs the backward kernels of that spec (preprocess, main, postprocess) from the
  forward's out and LSE: on CUDA runtime's compiled backward, on CPU the CPU model
  (attngen.emulate_backward). register_autograd wires fwd to it, so attngen.attention is
  differentiable in q, k, v and sinks. `attngen::bwd_tensors` is bwd that also returns the
  gradients of the learnable tensors (alibi_slopes, the score_mod's float tensors) its fields name.
- `attngen::append_kv` writes new keys and values into a paged KV cache in place (the append
  companion kernel of flash_attn_with_kvcache's k=, v=; its schema marks the caches mutated).

What selects the kernel travels as arguments torch can hash and put in a graph: `fields`, a
JSON object of the spec fields the caller chose (causal, lse, score_mod, schedule overrides,
...); the window and softcap as an int, int and float of their own (numbers that may reach the
call as graph inputs, which a traced function cannot turn into text); and the tensors
themselves (head_dim, dtype, gqa_group, head_dim_v, which variant and serving tensors are
present, the page size). The op resolves the Spec from both at run time, so the tuned schedule
per sequence length (attngen/run/tuned) is picked per call and one graph serves every length.
The fakes read only metadata: no value, no guard on a sequence length. That encoding, the plan
it resolves to and the op's checks are interfaces/op_arguments.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from attngen import expr
from attngen.interfaces.op_arguments import (MAX_PLANS, _check, _names, _one_device, _scale_value, check_cpu_time,
                                              compiling, cpu_max_seconds, encode_fields, encode_splits, resolve,
                                              scale_argument, serving_keywords, softcap_argument, window_arguments)
from attngen.run import append, backward, checks, forward, inputs
from attngen.emulator.driver import SECONDS_PER_CTA, SECONDS_PER_RUN, emulate, emulate_append
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.common.plan import BLOCK_MASK_TENSORS
from attngen.kernels.fwd.plan import Plan
from attngen.reference.forward import InputError
from attngen.spec import FIELDS, Spec, SpecError, check_keys, out_dtype_of, plain_value

NAMESPACE = "attngen"

_ARGS = ("Tensor q, Tensor k, Tensor v, str fields, int window_left, int window_right, float softcap, "
         "Tensor? softmax_scale, str tensor_names, Tensor[] tensors, "
         "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, Tensor? block_table, Tensor? seqused_k, "
         "int num_splits")
FWD_SCHEMA = f"({_ARGS}) -> (Tensor, Tensor)"  # (out, lse); lse is empty [0] when the spec has no lse
# (dq, dk, dv, dsinks); dsinks is empty [0] without sinks. dlse: the LSE output's gradient (float32,
# lse's shape), None when the loss did not read the LSE
BWD_SCHEMA = f"(Tensor dout, Tensor out, Tensor lse, {_ARGS}, Tensor? dlse=None) -> (Tensor, Tensor, Tensor, Tensor)"
# bwd's, and the gradients of the learnable tensors `fields` names (spec field learnable), float32, each its tensor's shape
BWD_TENSORS_SCHEMA = (f"(Tensor dout, Tensor out, Tensor lse, {_ARGS}, Tensor? dlse=None) -> "
                      f"(Tensor, Tensor, Tensor, Tensor, Tensor[])")
# the backward's work against the forward's (FlashAttention's FLOP count: 5 GEMMs to 2, each as large)
BACKWARD_WORK = 2.5


# -- the forward op --------------------------------------------------------------------------------


def _checked(q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors, cu_seqlens_q,
             cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, *, work: float = 1.0,
             what: str = "") -> tuple:
    """The op's checks, before anything runs: (plan, scale, named tensors, serving keywords, the
    serving call or None, the extra tensors, the tensors that must share a device). `work` and
    `what`: the CPU-time check's (check_cpu_time), for a backward or a training call."""
    plan = resolve(q, k, v, fields, (window_left, window_right), softcap, tensor_names, cu_seqlens_q, block_table,
                   num_splits)
    scale = _scale_value(softmax_scale, plan.spec.head_dim)  # the kernel's run-time argument; None: 1/sqrt(head_dim)
    named = dict(zip(_names(tensor_names), tensors))
    keywords = serving_keywords(plan, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits)
    call, extra = _check(plan, q, k, v, named, keywords)
    devices = call_tensors(q, k, v, tensor_names, tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
    if q.device.type == "cpu":
        _one_device(devices)
        check_cpu_time(plan, call, q, k, work=work, what=what)
    return plan, scale, named, keywords, call, extra, devices


def check_attention(q, k, v, **kwargs) -> None:
    """Every check attngen.attention(q, k, v, **kwargs) makes before its kernel runs, running nothing
    (the kvcache door checks its attention so before the append writes the cache)."""
    args, _ = fwd_arguments(q, k, v, **kwargs)
    *_, devices = _checked(*args)
    if q.device.type == "cuda":
        checks.check_device(devices)  # one sm_90 device
    elif q.device.type != "cpu":
        raise InputError("q.device", str(q.device), "a CUDA tensor (the kernel) or a CPU tensor (the CPU model)")


def _fwd(q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors, cu_seqlens_q,
         cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits):
    plan, scale, named, keywords, call, extra, devices = _checked(
        q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits)
    if q.device.type == "cpu":
        result = emulate(plan, q, k, v, softmax_scale=scale, **named, **keywords)
    elif q.device.type == "cuda":
        checks.check_device(devices)  # one sm_90 device
        kernel = forward.compile_kernel(plan)
        if call is not None:
            result = kernel._launch_serving(call, q, k, v, None, extra, scale)
        else:  # the checked tensors, with any left-out fp8 descale as its ones
            checked = dict(zip([t.name for t in plan.extra if not t.output], extra))
            result = kernel(q, k, v, check=False, softmax_scale=scale, **checked)
    else:
        raise InputError("q.device", str(q.device), "a CUDA tensor (the kernel) or a CPU tensor (the CPU model)")
    out, lse = result if plan.spec.lse else (result, None)
    if lse is None:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    return _packed(out), _packed(lse)


def _packed(t):
    """t with the packed strides the fake promises (an empty array from numpy has strides 0)."""
    if tuple(t.stride()) == inputs.packed_strides(t.shape):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


fwd = torch.library.custom_op(f"{NAMESPACE}::fwd", _fwd, mutates_args=(), schema=FWD_SCHEMA)


def out_metadata(q, v, fields: str, cu_seqlens_q) -> tuple[list, list]:
    """The shapes of (out, lse) from metadata alone: out packed like q with v's head dim; lse
    (heads, total_q) for packed q (cu_seqlens_q given), (batch, heads, q_len) otherwise, and
    [0] when the spec has no lse. Sizes may be symbolic: nothing here guards on them."""
    chosen = json.loads(fields) if fields else {}
    out = [*q.shape[:-1], v.shape[-2 if chosen.get("v_layout") == "transposed" else -1]]  # fp8's [B, HKV, Dv, Skv] v
    lse_on = bool(chosen.get("lse", False))
    if not lse_on:
        return out, [0]
    if cu_seqlens_q is not None:
        return out, [q.shape[1], q.shape[0]]
    return out, [q.shape[0], q.shape[2], q.shape[1]]


@fwd.register_fake
def _fwd_fake(q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors, cu_seqlens_q,
              cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits):
    if checks.spec_dtype(q.dtype) is None:
        raise InputError("q.dtype", q.dtype, checks.DTYPE_CHOICES)
    rank = 3 if cu_seqlens_q is not None else 4
    if q.dim() != rank or v.dim() != k.dim():
        raise InputError("q, k, v shapes", f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}",
                         "q [B, Sq, H, D] (or [total_q, H, D] with cu_seqlens_q), k and v of one rank")
    _one_device(call_tensors(q, k, v, tensor_names, tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k))
    out_shape, lse_shape = out_metadata(q, v, fields, cu_seqlens_q)
    return q.new_empty(out_shape, dtype=out_dtype(q, fields)), q.new_empty(lse_shape, dtype=torch.float32)


def out_dtype(q, fields: str):
    """O's torch dtype from metadata alone: q's, or for fp8 q the out_dtype field (default bfloat16)."""
    chosen = (json.loads(fields) if fields else {}).get("out_dtype")
    spec = Spec(dtype=checks.spec_dtype(q.dtype), out_dtype=chosen)  # validates the pair as the op would
    return checks.torch_dtype(out_dtype_of(spec))


def call_tensors(q, k, v, tensor_names, tensors, *serving_tensors) -> dict:
    """Every tensor of a call by name, q first (softmax_scale, a 0-d CPU number, is none of them).
    The fakes check that they share a device: a meta tensor among CPU or CUDA ones sends the call
    to the fake (Meta outranks both in the dispatcher), whose empty output would be returned."""
    return {"q": q, "k": k, "v": v} | dict(zip(_names(tensor_names), tensors)) | {
        n: t for n, t in zip(checks.INT_TENSORS, serving_tensors) if t is not None}


# -- the backward op ---------------------------------------------------------------------------------


def _bwd(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors,
         cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse=None):
    """(dq, dk, dv, dsinks) of the forward kernel the same arguments name, from the forward's out
    and LSE: the backward kernels (preprocess, main, postprocess) on the CPU model for CPU
    tensors, runtime's compiled backward for CUDA ones. dsinks is [0] without sinks. dlse, the LSE
    output's gradient, folds into the preprocess's row term (docs/backward.md); None: zeros."""
    return _bwd_tensors(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names,
                        tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse)[:4]


def _bwd_tensors(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names,
                 tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse=None):
    """_bwd's gradients and a list of the learnable tensors' (the spec field `learnable` in `fields`: the
    main kernel scatters them, docs/backward.md "Learnable tensors"), float32, in learnable's order."""
    plan, scale, named, keywords, call, extra, devices = _checked(
        q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names, tensors, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, work=BACKWARD_WORK, what="backward")
    _check_saved(plan, dout, out, lse, dlse)
    devices |= {"dout": dout, "out": out, "lse": lse} | ({} if dlse is None else {"dlse": dlse})
    dlse = None if dlse is None else dlse.contiguous()  # autograd's may be a stride-0 expand (lse.sum())
    if q.device.type == "cpu":
        _one_device(devices)
    elif q.device.type == "cuda":
        checks.check_device(devices)  # one sm_90 device
    else:
        raise InputError("q.device", str(q.device), "a CUDA tensor (the kernel) or a CPU tensor (the CPU model)")
    learnable = plan.spec.learnable
    if call is not None and call.empty:  # no query row (as the forward): nothing to launch, every gradient 0
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)) + (
            (torch.zeros(q.shape[-2], dtype=torch.float32, device=q.device),) if "sinks" in named else ()) + tuple(
            torch.zeros(named[n].shape, dtype=torch.float32, device=q.device) for n in learnable)
    elif q.device.type == "cpu":
        serving_given = {n: x for n, x in keywords.items() if x is not None}  # varlen's; the backward refuses the others
        values = {n: t.detach() for n, t in named.items()}  # (emulate_backward asks a tensor that requires grad to be learnable)
        grads = emulate_backward(plan, q, k, v, dout, out=out, lse=lse, dlse=dlse, softmax_scale=scale, **values,
                                 **serving_given)
    else:
        grads = backward.compile_backward(plan).run(q, k, v, out, lse, dout, call=call, extra=extra,
                                                   softmax_scale=scale, dlse=dlse)
    dq, dk, dv, *rest = grads
    dtensors, rest = rest[len(rest) - len(learnable):], rest[:len(rest) - len(learnable)]  # (spec.learnable's, last)
    dsinks = rest[0] if rest and rest[0] is not None else torch.empty((0,), dtype=torch.float32, device=q.device)
    return _packed(dq), _packed(dk), _packed(dv), _packed(dsinks), [_packed(d) for d in dtensors]


def _check_saved(plan: Plan, dout, out, lse, dlse=None) -> None:
    """dout is shaped and typed like out (what the forward returned) and laid out as the kernels
    take it; lse is the forward's LSE, and dlse (when given) shaped and typed like it."""
    want = tuple(out.shape)
    if tuple(dout.shape) != want or dout.dtype != out.dtype:
        raise InputError("dout", f"{dout.dtype} {list(dout.shape)}", f"a {out.dtype} tensor of shape {list(want)}, "
                                                                     f"the output's")
    if not plan.spec.lse or (lse.dim() == 1 and lse.numel() == 0):
        raise InputError("lse", f"shape {list(lse.shape)}", "the forward's LSE: the backward reads it (call the "
                                                            "forward with lse true, as autograd does)")
    for name, t in (("dout", dout), ("out", out)):  # the kernels' layout rules (TMA, packed), on CPU too
        inputs.check_layout(name, t)
    if dlse is not None and (tuple(dlse.shape) != tuple(lse.shape) or dlse.dtype != torch.float32):
        raise InputError("dlse", f"{dlse.dtype} {list(dlse.shape)}", f"a torch.float32 tensor of shape "
                                                                     f"{list(lse.shape)}, the LSE's")


def emulate_backward(*args, **kwargs):
    """attngen.emulate_backward (the backward kernels on the CPU model), looked up at call time."""
    from attngen import emulator

    return emulator.emulate_backward(*args, **kwargs)


bwd = torch.library.custom_op(f"{NAMESPACE}::bwd", _bwd, mutates_args=(), schema=BWD_SCHEMA)
bwd_tensors = torch.library.custom_op(f"{NAMESPACE}::bwd_tensors", _bwd_tensors, mutates_args=(),
                                      schema=BWD_TENSORS_SCHEMA)


@bwd.register_fake
def _bwd_fake(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names,
              tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse=None):
    _one_device(call_tensors(q, k, v, tensor_names, tensors, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
                | {"dout": dout, "out": out, "lse": lse} | ({} if dlse is None else {"dlse": dlse}))
    dsinks = [q.shape[-2]] if "sinks" in _names(tensor_names) else [0]  # one per query head
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(dsinks, dtype=torch.float32)


@bwd_tensors.register_fake
def _bwd_tensors_fake(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names,
                      tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse=None):
    grads = _bwd_fake(dout, out, lse, q, k, v, fields, window_left, window_right, softcap, softmax_scale, tensor_names,
                      tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, num_splits, dlse)
    named = dict(zip(_names(tensor_names), tensors))
    learnable = sorted(json.loads(fields).get("learnable", ())) if fields else []
    return (*grads, [named[n].new_empty(named[n].shape, dtype=torch.float32) for n in learnable])


def _setup_context(ctx, inputs, output):
    q, k, v, fields, left, right, softcap, softmax_scale, tensor_names, tensors, cu_q, cu_k, max_q, table, used, splits = inputs
    out, lse = output
    # what the backward kernels read: q, k, v, out and the forward's LSE (FA3's preprocess
    # takes dPsum = rowsum(dO * O) and LSE), plus every tensor the forward took
    ctx.save_for_backward(q, k, v, out, lse, softmax_scale, cu_q, cu_k, table, used, *tensors)
    ctx.args = (fields, left, right, softcap, tensor_names, max_q, splits)
    # the tensors that ask for a gradient (besides sinks): the score's learnable ones get the kernels'
    # scatter, the others (read by a mask_mod only) the zero gradient a boolean mask has (learnable_names)
    ctx.wanted = tuple(n for n, t in zip(_names(tensor_names), tensors) if n != "sinks" and t.requires_grad)
    # an output the loss does not read gets None, not a zero tensor: an unused LSE costs no check
    ctx.set_materialize_grads(False)


def learnable_names(fields: str, wanted) -> tuple:
    """The tensors of `wanted` whose entries the score reads (the score_mod's float tensors, alibi_slopes):
    the spec field learnable, sorted as the Spec sorts it."""
    score_mod = (json.loads(fields).get("score_mod") or "") if fields else ""
    reads = expr.parse(score_mod, "score_mod") if score_mod.strip() else None
    floats = {n for n, _ in reads.tensors if n not in reads.int_tensors} if reads else set()
    return tuple(sorted(n for n in wanted if n in floats or n == "alibi_slopes"))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, softmax_scale, cu_q, cu_k, table, used, *tensors = ctx.saved_tensors
    fields, left, right, softcap, tensor_names, max_q, splits = ctx.args
    if dout is None:  # the loss reads the LSE alone
        dout = torch.zeros_like(out)
    learnable = learnable_names(fields, ctx.wanted)
    # autograd may hand a strided view (flex_attention returns out.transpose(1, 2)); the kernels take packed
    if learnable:
        fields = encode_fields({**json.loads(fields), "learnable": list(learnable)})
        dq, dk, dv, dsinks, dtensors = bwd_tensors(dout.contiguous(), out, lse, q, k, v, fields, left, right, softcap,
                                                   softmax_scale, tensor_names, tensors, cu_q, cu_k, max_q, table,
                                                   used, splits, dlse)
    else:
        dq, dk, dv, dsinks = bwd(dout.contiguous(), out, lse, q, k, v, fields, left, right, softcap, softmax_scale,
                                 tensor_names, tensors, cu_q, cu_k, max_q, table, used, splits, dlse)
        dtensors = []
    # the sinks' gradient goes to its slot, each learnable tensor's (float32) to its own in its dtype, a
    # mask_mod's tensor that asked gets 0; dlse (None when the loss reads no LSE) folds into the row term
    found = dict(zip(learnable, dtensors))
    grads = [dsinks if n == "sinks" else found[n].to(t.dtype) if n in found else
             torch.zeros_like(t) if n in ctx.wanted else None for n, t in zip(_names(tensor_names), tensors)]
    return dq, dk, dv, None, None, None, None, None, None, grads, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def _double_backward(ctx, *grads):
    """A gradient of the gradients (create_graph=True, then a backward through dq, dk or dv): the
    backward kernels have no backward of their own. Raised only when one is asked for; a
    create_graph first backward that nobody differentiates again runs as before."""
    raise InputError("a second-order gradient", "asked of attngen's backward (attngen::bwd)",
                     "first-order gradients only: attngen's backward is not differentiable twice (compute "
                     "the term that needs a double backward with torch's scaled_dot_product_attention, or "
                     "drop create_graph=True)")


bwd.register_autograd(_double_backward, setup_context=lambda ctx, inputs, output: None)
bwd_tensors.register_autograd(_double_backward, setup_context=lambda ctx, inputs, output: None)


# -- the KV-cache append op (flash_attn_with_kvcache's k=, v=) -------------------------------------

APPEND_SCHEMA = ("(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor block_table, "
                 "Tensor cache_seqlens, Tensor? k_descale=None, Tensor? v_descale=None) -> ()")


def _append_kv(k_cache, v_cache, k, v, block_table, cache_seqlens, k_descale=None, v_descale=None) -> None:
    """Write k, v into the paged caches in place at cache_seqlens (docs/interfaces.md): on CUDA the
    compiled append kernel (append.append_kv); on CPU the same emitted kernel on the CPU model,
    whose rows are then copied into the caller's caches (only the appended rows: the CPU model's
    ownership rule has held every store of the kernel to them, and the rest keeps its bytes).
    An e4m3 cache takes k_descale, v_descale float32 [num_pages, kv_heads] (docs/fp8-kv-cache.md)."""
    given = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
             "cache_seqlens": cache_seqlens}
    descales = {n: t for n, t in (("k_descale", k_descale), ("v_descale", v_descale)) if t is not None}
    given.update(descales)
    if k_cache.device.type == "cpu":
        _one_device(given)
        call = append.check_append(k_cache, v_cache, k, v, block_table, cache_seqlens)
        est = SECONDS_PER_RUN + SECONDS_PER_CTA * math.prod(call.grid)
        if est > cpu_max_seconds():
            raise InputError("k.shape", list(k.shape), f"an append the CPU model runs within {cpu_max_seconds():g} s: "
                                                       f"this one would take about {est:.0f} s; run it on CUDA tensors")
        new_k, new_v = emulate_append(k_cache, v_cache, k, v, block_table, cache_seqlens, **descales)
        if call.empty:
            return
        slots = call.slots()
        pages, rows = (torch.from_numpy(a) for a in slots)
        with torch.no_grad():  # an in-place write of the caller's cache, as FA3's
            k_cache[pages, rows] = torch.from_numpy(new_k[slots]).to(k_cache.dtype)
            v_cache[pages, rows] = torch.from_numpy(new_v[slots]).to(v_cache.dtype)
    elif k_cache.device.type == "cuda":
        append.append_kv(k_cache, v_cache, k, v, block_table, cache_seqlens, **descales)
    else:
        raise InputError("k_cache.device", str(k_cache.device), "a CUDA tensor (the kernel) or a CPU tensor (the CPU model)")


append_kv = torch.library.custom_op(f"{NAMESPACE}::append_kv", _append_kv, mutates_args=("k_cache", "v_cache"),
                                    schema=APPEND_SCHEMA)


@append_kv.register_fake
def _append_kv_fake(k_cache, v_cache, k, v, block_table, cache_seqlens, k_descale=None, v_descale=None) -> None:
    return None


# -- attngen.attention ---------------------------------------------------------------------------------


def attention(q, k, v, *, causal: bool = False, window=None, softcap=None, alibi_slopes=None, sinks=None,
              return_lse: bool = False, out=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              block_table=None, seqused_k=None, num_splits=None, softmax_scale=None, scale=None, block_mask=None,
              **kwargs):
    """FlashAttention-3 forward: q [B, Sq, H, D], k [B, Skv, HKV, D], v [B, Skv, HKV, DV] -> [B, Sq, H, DV].

    score = q . k * softmax_scale (FlashAttention-3's name; `scale`, SDPA's and FlexAttention's, is
    the same argument; both given and different is an InputError); None gives 1 / sqrt(D). It is a
    run-time argument of the kernel (one build, and one compiled graph, serve every scale); it must
    be a positive normal float32.

    On CUDA tensors (an sm_90 GPU) the compiled kernel runs; on CPU tensors the same emitted
    kernel runs on the CPU model (slow: docs/torch.md). It calls torch.ops.attngen.fwd, so
    torch.compile (fullgraph), torch.export and autograd's bookkeeping see one op.
    Every other keyword (causal, window, softcap, alibi_slopes, sinks, return_lse, score_mod/mask_mod
    and their tensors, spec fields, the serving keywords) is runtime.attention's (docs/variants.md,
    docs/serving.md); the op validates them the same way.
    The output is packed like q; lse is (heads, total_q) for varlen. `out`, if given, receives
    the result (a copy: the op itself is functional, as torch.compile needs).
    `block_mask`: an attngen BlockMask (attngen.create_block_mask): the kernel (spec block_mask =
    true) visits only its listed KV tiles and runs its mask_mod on the partial ones only; its
    BLOCK_SIZE sets the kernel's tiles (consumers = BLOCK_SIZE[0] / 64, block_n = BLOCK_SIZE[1]).
    A bool is the spec field itself, with kv_num_blocks, kv_indices, full_kv_num_blocks and
    full_kv_indices passed by name.
    An e4m3 k/v (torch.float8_e4m3fn) with 16-bit q is an fp8 KV cache (spec kv_dtype): pass
    k_descale and v_descale by name, float32 [batch or num_pages, kv_heads] (docs/fp8-kv-cache.md).
    Differentiable (docs/torch.md, "Autograd"): out.backward() gives q, k, v and sinks their
    gradients by the backward kernels, and alibi_slopes and the score_mod's float tensors theirs when
    they require grad (learnable: the main kernel scatters them); a mask_mod's tensor gets 0; a loss
    that reads the returned LSE differentiates it too."""
    args, asked_lse = fwd_arguments(
        q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        return_lse=return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        block_table=block_table, seqused_k=seqused_k, num_splits=num_splits, softmax_scale=softmax_scale,
        scale=scale, block_mask=block_mask, **kwargs)
    if not compiling() and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *args[9])):
        check_training(args)
    result, lse = fwd(*args)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != result.shape or out.dtype != result.dtype:
            got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise InputError("out", got, f"a {result.dtype} tensor of shape {list(result.shape)}")
        result = out.copy_(result)
    return (result, lse) if asked_lse else result


def check_training(args: tuple) -> None:
    """A call whose backward will follow is refused before the forward runs when its backward would
    be (the op itself runs under autograd's no-grad and cannot tell): the backward plan's SpecError
    (a paged cache, split-KV, a variant the deterministic backward cannot fit: plan.plan_backward),
    and on CPU a forward and backward estimated past the CPU model's limit. Eager only: under
    torch.compile each op refuses its own pass (planning here would guard on the lengths)."""
    q, k, v, fields, left, right, softcap, _, tensor_names, _, cu_q, _, _, table, _, splits = args
    if q.device.type == "cpu":
        _checked(*args, work=1.0 + BACKWARD_WORK, what="forward and its backward")
    plan = resolve(q, k, v, fields, (left, right), softcap, tensor_names, cu_q, table, splits)
    wanted = [n for n, t in zip(_names(tensor_names), args[9]) if n != "sinks" and t.requires_grad]
    learnable = learnable_names(fields, wanted)
    if learnable:  # the backward the autograd node will run (deterministic varlen refuses learnable tensors)
        plan_backward(dataclasses.replace(plan.spec, learnable=learnable))
    elif _trainable.get(id(plan)) is not plan:
        plan_backward(plan.spec)  # the SpecError backward() would raise, before the forward runs
        if len(_trainable) >= MAX_PLANS:
            _trainable.clear()
        _trainable[id(plan)] = plan


_trainable: dict[int, Plan] = {}  # plans whose backward plan_backward takes (0.75 ms a plan, once)


def fwd_arguments(q, k, v, *, causal: bool = False, window=None, softcap=None, alibi_slopes=None, sinks=None,
                  return_lse: bool = False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, block_table=None,
                  seqused_k=None, num_splits=None, softmax_scale=None, scale=None, block_mask=None,
                  **kwargs) -> tuple[tuple, bool]:
    """attngen.attention's keywords as torch.ops.attngen.fwd's arguments, and whether the caller
    asked for the LSE. Checks what the op's schema would otherwise reject with a TypeError."""
    # NumPy scalars and 0-d CPU tensors as the Python values the Spec (and the op's JSON) take
    overrides = {n: plain_value(n, x) for n, x in kwargs.items() if n in FIELDS}
    causal, return_lse, block_mask = (plain_value(n, x) for n, x in (("causal", causal), ("lse", return_lse),
                                                                      ("block_mask", block_mask)))
    tensors = {n: x for n, x in kwargs.items() if n not in FIELDS}
    if isinstance(block_mask, bool):  # the spec field itself: the four lists come by name
        overrides["block_mask"] = block_mask
    elif block_mask is not None:
        block_mask_arguments(block_mask, q, k, overrides, tensors)
    # a keyword that is neither a spec field nor a tensor is a typo: named before any tensor is looked at
    check_keys({n: x for n, x in tensors.items() if not isinstance(x, torch.Tensor)}, "attngen.attention(...)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, torch.SymInt))):
        raise InputError("max_seqlen_q", type(max_seqlen_q).__name__, "an int, the longest query sequence")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("block_table", block_table),
                    ("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
    splits = encode_splits(num_splits)
    softmax_scale = scale_argument(softmax_scale, scale, int(q.shape[-1]))
    # window and softcap default to None, not numbers: a default is a graph input under
    # torch.compile(dynamic=True), a constant written here is not
    left, right = window_arguments((-1, -1) if window is None else window)
    softcap = softcap_argument(0.0 if softcap is None else softcap)
    chosen = {"causal": causal, "lse": return_lse}
    chosen.update(overrides)  # a spec field given by name (lse=, splits=) wins over the one derived from the call
    asked_lse = bool(chosen["lse"])  # return_lse, or lse=True as a field: the caller gets (out, lse)
    extra = {n: t for n, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)) if t is not None}
    extra.update((n, tensors[n]) for n in sorted(tensors))  # sorted by name: one text per set of tensors
    # the backward reads the forward's LSE (issue 17): a call that needs a gradient asks for it
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *extra.values())):
        chosen["lse"] = True
    names = [n for n in extra]  # torch 2.4's dynamo joins a list of names, not a dict
    args = (q, k, v, encode_fields(chosen), left, right, softcap, softmax_scale, ",".join(names), [extra[n] for n in names],
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, seqused_k, splits)
    return args, asked_lse


def block_mask_arguments(bm, q, k, overrides: dict, tensors: dict) -> None:
    """An attngen BlockMask as spec fields (block_mask, its mask_mod, the tiles of its BLOCK_SIZE)
    and call-time tensors (its four lists, and its mask_mod's tensors unless the call gives them)."""
    names = [n for n, _, _ in BLOCK_MASK_TENSORS]
    if not all(hasattr(bm, a) for a in names + ["BLOCK_SIZE", "seq_lengths", "mask_text"]):
        raise InputError("block_mask", type(bm).__name__, "a BlockMask from attngen.create_block_mask "
                                                          "(attngen.flex_attention also takes torch's)")
    for name in names:
        if name in tensors:
            raise InputError(name, "a tensor", "no such keyword with block_mask= (the block mask brings its own)")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        raise InputError("block_mask", "with q, k not [B, S, H, D] tensors", "dense q [B, Sq, H, D] and k [B, Skv, HKV, D]")
    lengths = (int(q.shape[1]), int(k.shape[1]))
    if tuple(bm.seq_lengths) != lengths:
        raise InputError("block_mask.seq_lengths", tuple(bm.seq_lengths), f"{lengths}, q's and k's lengths")
    given = overrides.get("mask_mod")
    if given is not None:
        try:
            same = isinstance(given, str) and expr.parse(given, "mask_mod").canonical == bm.mask_text
        except expr.ExprError as e:
            raise SpecError("mask_mod", given, str(e)) from None
        if not same:
            raise InputError("mask_mod", given, f"the block mask's own mask_mod `{bm.mask_text}` (the block mask "
                                                f"lists that mask's tiles), or none")
    bq, bk = (int(x) for x in bm.BLOCK_SIZE)
    if bq % 64 or not 1 <= bq // 64 <= 3:
        raise InputError("block_mask.BLOCK_SIZE", (bq, bk), "a Q block of 64, 128 or 192 rows, the kernel's Q tile "
                                                             "(64 per consumer warpgroup): create the block mask with one")
    for field, want, why in (("consumers", bq // 64, f"the block mask's Q block {bq} = 64 x consumers"),
                             ("block_m", bq, "the block mask's Q block (BLOCK_SIZE[0])"),
                             ("block_n", bk, "the block mask's KV block (BLOCK_SIZE[1])")):
        if overrides.get(field) is not None and overrides[field] != want:
            raise InputError(field, overrides[field], f"{want}, {why}; or create the block mask with the kernel's "
                                                      f"tiles, BLOCK_SIZE=(block_m, block_n)")
    overrides.update(block_mask=True, mask_mod=bm.mask_text, consumers=bq // 64, block_n=bk)
    for name, t in (bm.mask_tensors or {}).items():
        tensors.setdefault(name, t)
    for name in names:
        tensors[name] = getattr(bm, name).to(q.device)


__all__ = ["BACKWARD_WORK", "append_kv", "attention", "check_attention", "bwd", "bwd_tensors", "fwd", "fwd_arguments",
           "out_metadata"]
