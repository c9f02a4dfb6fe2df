"""Generated kernels, callable from PyTorch on a Hopper GPU.

    kernel = attngen.run.forward.compile_kernel(spec)   # JIT: plan -> render -> TileLang -> nvcc (sm_90a), or the cache
    attngen.run.forward.precompile(spec)                # the same build ahead of time, into the cache (no GPU needed)
    out = kernel(q, k, v)                           # q [B, Sq, H, D], k/v [B, Skv, HKV, D]
    out = attngen.run.runtime.attention(q, k, v, causal=True)   # spec picked from the tensors

Compiling needs nvcc but no GPU; running needs a CUDA device of compute
capability 9.0. Every input is checked before anything is launched, and a bad
input raises `InputError` (a ValueError) that names the argument, the value and
what was expected.

This module maps a call's tensors and keywords to a spec (`spec_for`, `attention`). The kernels
live beside it: run/forward.py (Kernel, compile_kernel, precompile), run/backward.py,
run/append.py; their runtime cache entries in run/entries.py; the GPU call checks in run/checks.py.
"""

from __future__ import annotations

from attngen.run import serving
from attngen.kernels.fwd.plan import as_plan
from attngen.reference.forward import InputError, resolve_scale
from attngen.run.checks import DTYPE_CHOICES, NAMES, _torch, check_device, check_serving_call, spec_dtype
from attngen.run.forward import compile_kernel
from attngen.run.inputs import check_extra, check_tensors
from attngen.spec import KV_DTYPES, Spec, check_keys
from attngen.kernels.fwd.kv_cache import DESCALES
from attngen.run.tuning_table import SCHEDULE_FIELDS, tuned_fields



# -- serving calls (docs/serving.md): varlen, paged KV, split-KV ----------------------------


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
    v_dim = -2 if fields.get("v_layout") == "transposed" else -1  # a transposed v: [batch, kv_heads, head_dim_v, seqlen_k]
    if len(v_shape) in (3, 4) and len(q_shape) in (3, 4) and v_shape[v_dim] != q_shape[-1]:
        variant["head_dim_v"] = int(v_shape[v_dim])
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
        raise InputError("q.dtype", q.dtype, DTYPE_CHOICES)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    h_axis, k_axis = q.dim() - 2, k.dim() - 2
    if kv_heads < 1:
        raise InputError(f"k.shape[{k_axis}] (kv_heads)", kv_heads, "at least 1")
    if heads < 1 or heads % kv_heads:
        raise InputError(f"q.shape[{h_axis}] (heads)", heads,
                         f"a positive multiple of k.shape[{k_axis}] (kv_heads) = {kv_heads}")
    fields = {"head_dim": int(q.shape[-1]), "dtype": dtype, "causal": causal, "gqa_group": heads // kv_heads}
    cache = str(k.dtype).removeprefix("torch.")
    if cache != dtype and cache in KV_DTYPES:
        fields["kv_dtype"] = cache  # an fp8 KV cache for 16-bit queries (k_descale, v_descale by name)
    fields.update(chosen)  # an override of a derived field (head_dim, ...) wins, not a TypeError
    spec = Spec(**fields)
    # the tuned table holds 16-bit caches' schedules (an fp8 cache's plan adds staging tiles)
    if not any(f in overrides for f in SCHEDULE_FIELDS) and not serving.serving_fields(spec).uses_serving \
            and spec.kv_dtype is None:
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
    named = set(DESCALES)  # the tensors the call's score_mod/mask_mod read, and descales; any other keyword is a typo
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
    extra = check_extra(plan, dims, tensors, like=q)
    named = {n: t for n, t in zip(NAMES, (q, k, v, out)) if t is not None}
    named.update({t.name: x for t, x in zip([t for t in plan.extra if not t.output], extra)})
    check_device(named)
    return compile_kernel(plan)(q, k, v, out=out, check=False, softmax_scale=softmax_scale, **tensors)


__all__ = ["attention", "call_spec", "serving_overrides", "spec_for"]
