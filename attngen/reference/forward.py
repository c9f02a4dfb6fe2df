"""The fp64 oracle for attention, its low-precision twin, and the tolerance rule every test uses.

Layout is BSHD: q [B, Sq, H, D], k and v [B, Skv, HKV, D]. Query head h reads KV head
h // (H // HKV) (GQA; MQA when HKV = 1). Causal masks are aligned bottom-right: query i
sees key j when j <= i + Skv - Sq, so with Sq > Skv the first Sq - Skv rows see no key;
such rows give output 0 (never NaN) and log-sum-exp -inf.

Tolerance (FlashAttention's rule, with the twin made honest): a kernel output passes when

    max|out - ref| <= 2 * max|lowprec - ref| + eps,   eps = ulp(dtype) * max|ref|

where `ref` is this module's fp64 attention and `lowprec` (`attention_lowprec`) the kernel's own
arithmetic: float32 scores, max, exp2 and sums; P rounded to the dtype before PV; the output
rounded to the dtype. Rounding the scores too (what an earlier twin did) makes the bound grow
with the logits until an all-zeros output passes. eps is one unit in the last place of the
largest reference output (2**-10 for float16, 2**-7 for bfloat16, times max|ref|), so a tiny
output (an average of many values) is held to its own scale. Non-finite values: a position
where the reference is NaN (or +-inf) must be NaN (or the same inf) in `out`; every other
position must be finite. A reference that is NaN or inf although every input is finite is a
FAIL whatever `out` holds (`Check.note` says why): the spec's own arithmetic is undefined there.
docs/emulator.md, "The tolerance rule", has the reasoning and the measured numbers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes  # tilelang depends on it: numpy has no fp8 type
import numpy as np

from attngen import expr as expr_mod, tiles
from attngen.hw import DTYPES, E4M3, E4M3_MAX, FP8_MAX_OFFSET, LOG2E

# One ulp at 1.0 of each dtype (hw.DTYPES): the tolerance's floor is this times max|ref|.
EPS = {name: d.eps for name, d in DTYPES.items()}
# The smallest positive value of each dtype: below it no output difference is representable.
TINY = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


class InputError(ValueError):
    """An input the kernel cannot take: names the argument, the value and what was expected.

    It lives here, beneath the emulator and the runtime, so both raise the same error
    (attngen.InputError is this class).
    """

    def __init__(self, argument: str, value, expected: str):
        self.argument, self.value, self.expected = argument, value, expected
        super().__init__(f"{argument} = {value}: expected {expected}")


# -- the softmax scale (one home: the reference, the CPU model, the runtime and the CLI call these) --
def default_scale(head_dim: int) -> float:
    """The softmax scale when the caller gives none: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def check_scale(value, head_dim: int, argument: str = "softmax_scale") -> float:
    """The scale a kernel is called with: `value` checked, or default_scale(head_dim) for None.

    A finite positive real. Unlike FlashAttention-3 (any float), zero and negative scales are
    refused: the kernel takes the row max of the unscaled scores q . k and scales in the exponent,
    exp2(s * c - max(s) * c) with c = scale * log2(e), which is the softmax only for c > 0
    (docs/online-softmax.md). The kernel receives it as a float32."""
    if value is None:
        return default_scale(head_dim)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(argument, type(value).__name__,
                         f"a finite positive float (omitted: 1/sqrt(head_dim) = {default_scale(head_dim):.6g})")
    x = float(value)
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= x <= float(f32.max):  # NaN fails too; a subnormal would flush to 0 under the kernel's fast math
        raise InputError(argument, repr(value),
                         f"a positive float from {f32.tiny:.3g} to {f32.max:.3g} (a normal float32, the kernel's type); "
                         f"omitted: 1/sqrt(head_dim) = {default_scale(head_dim):.6g}")
    return x


def resolve_scale(softmax_scale=None, scale=None, *, head_dim: int) -> float:
    """The one scale of a call that takes both names, softmax_scale (FlashAttention-3's) and scale
    (SDPA's and FlexAttention's): either one, or both when equal; neither gives the default.
    Checked by check_scale() under the name the caller used."""
    if softmax_scale is not None and scale is not None:
        if _same(softmax_scale, scale):
            return check_scale(softmax_scale, head_dim)
        raise InputError("softmax_scale, scale", f"{softmax_scale!r}, {scale!r}",
                         "one of them, or the same value for both (they name the same argument)")
    if scale is not None:
        return check_scale(scale, head_dim, "scale")
    return check_scale(softmax_scale, head_dim)


def _same(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a is b


def round_to(x, dtype: str) -> np.ndarray:
    """Round to float16/bfloat16/float8_e4m3fn (round to nearest even) and return float32 holding those values.

    The emulator stores 16-bit buffers as float32 so numpy matmuls stay fast; every write
    into such a buffer goes through here. float64 input is rounded to float32 first (a
    double rounding that matters only at exact float32 ties, far below any tolerance).
    """
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as on the GPU
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x).view(np.uint32)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
        rounded = np.where(np.isnan(x), np.uint32(0x7FC00000), rounded).astype(np.uint32)
        return rounded.view(np.float32).reshape(x.shape)
    if dtype == E4M3:
        # Hopper's cvt.rn.satfinite: round to nearest even, saturating at +-448 (e4m3fn has no inf)
        return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dtype in ("float32", "float"):
        return x
    raise ValueError(f"dtype {dtype!r}: expected one of float16, bfloat16, {E4M3}, float32")


def random_inputs(dtype: str, head_dim: int, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                  seed: int = 0):
    """Standard-normal q [B, Sq, H, D], k and v [B, Skv, HKV, D], rounded to `dtype` (float32 arrays)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim), (batch, kv_len, kv_heads, head_dim)]
    return [round_to(rng.standard_normal(s), dtype) for s in shapes]


def to_numpy(x) -> np.ndarray:
    """A torch tensor or array-like as a numpy array (bfloat16 and fp8 tensors become float32, exactly)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", f"torch.{E4M3}"):
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def dtype_of(x) -> str | None:
    """float16/bfloat16 when the tensor itself says so, else None."""
    name = str(getattr(x, "dtype", "")).split(".")[-1]  # "torch.bfloat16" or numpy's "float16"
    return name if name in DTYPES else None


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected 4-d BSHD tensors, got q {q.shape}, k {k.shape}, v {v.shape}")
    b, _, h, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:  # v's head dim may differ (head_dim_v)
        raise ValueError(f"k and v must be [B, Skv, HKV, D] and [B, Skv, HKV, DV] matching q [B, Sq, H, D]: "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {hkv}")
    return h // hkv


def causal_visible(sq: int, skv: int) -> np.ndarray:
    """[Sq, Skv] bool: query i sees key j when j <= i + Skv - Sq (bottom-right alignment)."""
    return tiles.visible(np.arange(sq)[:, None], np.arange(skv)[None, :], sq, skv, tiles.edges(True))


def _pv(w, v, visible):
    """out [Sq, group, D] = w [group, Sq, Skv] @ v [Skv, D], over visible keys only.

    A masked key has weight 0, but 0 * NaN is NaN: columns of v that hold a non-finite value
    are summed over the visible keys alone, so a NaN or inf reaches exactly the rows that see it.
    """
    finite = np.isfinite(v)
    out = np.einsum("gqk,kd->qgd", w, np.where(finite, v, 0.0))
    for d in np.flatnonzero(~finite.all(axis=0)):
        with np.errstate(invalid="ignore"):
            out[:, :, d] = np.where(visible, w * v[:, d], 0.0).sum(axis=-1).T
    return out


# -- variants (docs/variants.md) ---------------------------------------------------------
VARIANT_KEYS = ("window", "softcap", "alibi_slopes", "sinks", "score_mod", "mask_mod", "tensors")


def variant_of(spec, alibi_slopes=None, sinks=None, tensors=None) -> dict:
    """The variant keywords of attention()/attention_lowprec()/check_close() for a spec
    (read by attribute: this module sits beside spec.py, not above it)."""
    return {"window": tuple(spec.window), "softcap": spec.softcap, "alibi_slopes": alibi_slopes if spec.alibi else None,
            "sinks": sinks if spec.sinks else None, "score_mod": spec.score_mod, "mask_mod": spec.mask_mod,
            "tensors": dict(tensors or {})}


def _prescaled(variant: dict) -> bool:
    """softcap, ALiBi or a score_mod: the kernel transforms the natural-units score first."""
    return bool(variant.get("softcap") or variant.get("alibi_slopes") is not None or (variant.get("score_mod") or "").strip())


def _variant_scores(s, bi, heads, sq, skv, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                    score_mod="", mask_mod="", tensors=None, dtype=np.float64, grad=False, learnable=()):
    """Scores s [g, Sq, Skv] (q . k * scale, natural units) of batch bi and query heads `heads`
    through softcap, ALiBi, score_mod, then the masks (causal, window, mask_mod): masked -> -inf.
    Returns (scores, visible [g, Sq, Skv], the heads' sink logits [g, 1, 1] or None), and with
    `grad` a fourth value: d(score)/d(s) [g, Sq, Skv] through the same chain (softcap's
    1 - tanh^2, ALiBi's 1, score_mod's symbolic derivative, expr.derivative), meaningful where visible.
    With `learnable` (names of tensors: alibi_slopes, the score_mod's float tensors) a fifth: per read
    site (name, the entry each element reads [index arrays], d(score)/d(that entry) [g, Sq, Skv]),
    the terms a learnable tensor's gradient is scattered from (expr.derivative with `wrt`)."""
    off = skv - sq
    qi = np.arange(sq)[None, :, None]
    kj = np.arange(skv)[None, None, :]
    hh = np.asarray(heads)[:, None, None]
    tensors = {n: to_numpy(t).astype(np.float64) for n, t in (tensors or {}).items()}
    env = {"b": bi, "h": hh, "q_idx": qi, "kv_idx": kj}
    dsds = 1.0
    terms = []
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if softcap:
            t = np.tanh(s / softcap)
            s, dsds = softcap * t, 1.0 - t * t
        if alibi_slopes is not None:
            slopes = to_numpy(alibi_slopes).astype(np.float64)[hh]
            s = s - slopes * np.abs(qi + off - kj)
        dmod = 1.0  # d(score_mod)/d(its input)
        if score_mod and score_mod.strip():
            e = expr_mod.parse(score_mod, "score_mod")
            if grad:
                dmod = expr_mod.evaluate(expr_mod.derivative(e), {**env, "score": s}, tensors)
                dsds = dsds * dmod
            for name in learnable:
                for site in expr_mod.tensor_reads(e, name):
                    at = expr_mod.read_index(site, tensors[name].shape,
                                             lambda n: expr_mod.evaluate(e, env, tensors, node=n))
                    terms.append((name, at, expr_mod.evaluate(expr_mod.derivative(e, site), {**env, "score": s}, tensors)))
            s = expr_mod.evaluate(e, {**env, "score": s}, tensors)
        if "alibi_slopes" in learnable:  # score -= slope[h] |q + off - k|
            terms.append(("alibi_slopes", (hh,), -np.abs(qi + off - kj) * dmod))
        s = np.broadcast_to(np.asarray(s, dtype), (len(heads), sq, skv))
    visible = np.broadcast_to(tiles.visible(qi, kj, sq, skv, tiles.edges(causal, window)), (len(heads), sq, skv)).copy()
    if mask_mod and mask_mod.strip():
        visible &= np.asarray(expr_mod.evaluate(expr_mod.parse(mask_mod, "mask_mod"), env, tensors), bool)
    s = np.where(visible, s, dtype(-np.inf))
    sink = None if sinks is None else to_numpy(sinks).astype(dtype)[hh]
    if grad and learnable:
        shape = s.shape
        terms = [(n, tuple(np.broadcast_to(i, shape) for i in at), np.broadcast_to(np.asarray(v, dtype), shape))
                 for n, at, v in terms]
        return s, visible, sink, np.broadcast_to(np.asarray(dsds, dtype), shape), terms
    if grad:
        return s, visible, sink, np.broadcast_to(np.asarray(dsds, dtype), s.shape)
    return s, visible, sink


def attention(q, k, v, causal: bool = False, scale: float | None = None, *, batch_offset: int = 0, **variant):
    """fp64 attention. Returns (out [B, Sq, H, DV] float64, lse [B, H, Sq] float64, natural log).

    Non-finite inputs propagate to the outputs that read them: a NaN in q row i gives NaN in
    output row i; a score that is NaN or +inf makes its row NaN (a -inf score is a key of
    weight 0); a non-finite v[j, d] reaches column d of the rows that see key j.
    `variant`: window, softcap, alibi_slopes, sinks, score_mod, mask_mod, tensors (docs/variants.md;
    `variant_of(spec, ...)` builds them from a spec). With sinks the LSE includes the sink's term.
    `batch_offset`: the batch index of q[0] in the caller's batch (the `b` a score_mod or mask_mod
    reads), for a caller that passes one sequence of a larger batch (attngen/run/serving.py).
    """
    q, k, v = (to_numpy(t).astype(np.float64) for t in (q, k, v))
    group = _check_shapes(q, k, v)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    scale = check_scale(scale, d, "scale")
    out = np.zeros((b, sq, h, v.shape[3]))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hk in range(k.shape[2]):
            heads = slice(hk * group, (hk + 1) * group)
            with np.errstate(invalid="ignore", over="ignore"):
                s = np.einsum("qgd,kd->gqk", q[bi, :, heads], k[bi, :, hk]) * scale  # [group, Sq, Skv]
                s, visible, sink = _variant_scores(s, bi + batch_offset, range(hk * group, (hk + 1) * group), sq, skv,
                                                   causal, **variant)
                m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # (a sequence may have no key)
                if sink is not None:
                    m = np.maximum(m, sink)
                m_safe = np.where(np.isfinite(m), m, 0.0)  # a row with no key: exp(-inf) = 0, not NaN
                p = np.exp(s - m_safe)
                den = p.sum(axis=-1, keepdims=True)
                if sink is not None:  # the sink joins the denominator only
                    den = den + np.exp(sink - m_safe)
                w = p / np.where(den > 0, den, 1.0)
            out[bi, :, heads] = _pv(w, v[bi, :, hk], visible)
            with np.errstate(divide="ignore", invalid="ignore"):
                lse[bi, heads] = (m_safe + np.log(den))[..., 0]
    return out, lse


def fa3_descale(rng, rows: int, kv_heads: int):
    """One random fp8 descale, float32 [rows, kv_heads], drawn as FA3's fp8 test draws it: rand * 2 (an fp8
    cache's per-page descales keep clear of 0 instead: reference/kv_cache.random_descales)."""
    return (rng.random((rows, kv_heads)) * 2).astype(np.float32)


def dequantize(q, k, v, descales):
    """fp8's inputs as the values they stand for (fp64): q, k, v times their float32 [batch, kv_heads]
    descales (FA3's q_descale, k_descale, v_descale; None: 1), query head h taking its KV head's."""
    q, k, v = (to_numpy(t).astype(np.float64) for t in (q, k, v))
    group = _check_shapes(q, k, v)
    out = []
    for x, d, per_query in zip((q, k, v), descales or (None,) * 3, (True, False, False)):
        if d is not None:
            d = to_numpy(d).astype(np.float32).astype(np.float64)
            x = x * (np.repeat(d, group, axis=1) if per_query else d)[:, None, :, None]
        out.append(x)
    return out


def _descale_factors(descales, b: int, hkv: int):
    """The kernel's per-(batch, KV head) float32 products: q_descale * k_descale (into the scale), v_descale."""
    qd, kd, vd = (np.ones((b, hkv), np.float32) if d is None else to_numpy(d).astype(np.float32) for d in (descales or (None,) * 3))
    return qd * kd, vd


def _online(s, v, cc, sink, offset, dtype: str, block_n: int, sum_rounded: bool):
    """(P V, row sum) as the kernel's online softmax forms them, tile by tile of block_n keys: the running
    max m (from the sink's logit, if any), alpha = exp2(m_old - m_new) rescaling both, P of each tile
    exp2(s - m + offset) relative to the max so far, rounded to `dtype` for PV, the sum from the unrounded P."""
    ninf, f32 = np.float32(-np.inf), np.float32
    shape = s.shape[:-1] + (1,)
    m = np.full(shape, ninf, f32) if sink is None else np.broadcast_to(sink, shape).astype(f32)
    den = np.zeros(shape, f32) if sink is None else np.full(shape, np.exp2(f32(offset)), f32)
    acc = np.zeros(s.shape[:-1] + (v.shape[-1],), f32)
    for j in range(0, s.shape[-1], block_n):
        tile = s[..., j:j + block_n]
        m_new = np.maximum(m, tile.max(axis=-1, keepdims=True, initial=-np.inf))
        mc = np.where(m_new == ninf, f32(0), m_new * cc)
        alpha = np.where(m == ninf, f32(0), np.exp2(m * cc - mc))
        p = np.exp2(tile * cc - mc + offset)
        pr = round_to(p, dtype)
        acc = acc * alpha + pr @ v[j:j + block_n]
        den = den * alpha + (pr if sum_rounded else p).sum(axis=-1, keepdims=True, dtype=f32)
        m = m_new
    return acc, den


def attention_lowprec(q, k, v, causal: bool = False, dtype: str = "float16", scale: float | None = None, *,
                      batch_offset: int = 0, descales=None, out_dtype: str | None = None, twin: dict | None = None,
                      block_n: int | None = None, **variant) -> np.ndarray:
    """The kernel's arithmetic on the CPU: the twin whose error against `attention` sets the bound.

    Inputs rounded to `dtype`; s = q @ k^T in float32 (tensor cores accumulate in float32);
    m = the row max of s; P = exp2(s * c - m * c) in float32 with c = float32(scale) * float32(log2 e),
    the kernel's scale_log2 (it takes the scale as a float32 argument); the row sum over the float32 P; P rounded to
    `dtype` and multiplied by v in float32; out = round(acc / row sum) (0 for a row that sees
    no key). The kernel takes the max online, tile by tile, and rescales by
    alpha = exp2(m_old * c - m_new * c); those factors telescope to the one-shot max used here,
    and P is rounded with the same relative error wherever the max sits, so this one-shot form
    has the kernel's roundings (docs/emulator.md, "The tolerance rule"; against the emulated
    kernel it is within one ulp of each row's largest output, and equal in >= 99% of elements
    with one K tile: tests/test_reference.py::test_the_twin_has_the_emulated_kernels_roundings).
    Returns float64.

    Variants as the kernel computes them: with softcap, ALiBi or a score_mod the float32 score
    is transformed first, z = mods(s * scale) * log2(e), and P = exp2(z - max z); masks set
    -inf; a sink enters the max and the row sum in the same units. `batch_offset` as in `attention`.

    fp8 (dtype float8_e4m3fn, docs/fp8.md): s from the raw e4m3 q and k, the scale times q_descale *
    k_descale (float32, per batch and KV head, as the kernel folds them); P = exp2(... + 8) (FA3's
    Max_offset), its row sum from the unrounded P, P rounded to e4m3 before PV with the raw v; the
    output times v_descale / row sum, rounded to `out_dtype` (default bfloat16). `twin` deliberately
    breaks one step (the tolerance test's wrong kernels): {"offset": 0} no max offset, {"sum_rounded":
    True} the row sum of the rounded P, {"v_transposed_tiles": n} each n-key V tile used transposed.
    `block_n`: the online softmax tile by tile (_online), the kernel's exact roundings of P.
    """
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    group = _check_shapes(q, k, v)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    fp8 = dtype == E4M3
    twin = twin or {}
    offset = np.float32(twin.get("offset", FP8_MAX_OFFSET) if fp8 else 0)
    out_dtype = out_dtype or ("bfloat16" if fp8 else dtype)
    qk_descale, v_descale = _descale_factors(descales, b, k.shape[2])
    tile = twin.get("v_transposed_tiles")
    if tile:  # a kernel that multiplies by each V tile as if it were already transposed (square tiles only)
        v = v.reshape(b, skv // tile, tile, k.shape[2], tile).transpose(0, 1, 4, 3, 2).reshape(v.shape)
    scale_arg = np.float32(check_scale(scale, d, "scale"))  # the kernel takes it as a float32
    prescaled = _prescaled(variant)
    out = np.zeros((b, sq, h, v.shape[3]))
    ninf = np.float32(-np.inf)
    for bi in range(b):
        for hk in range(k.shape[2]):
            heads = slice(hk * group, (hk + 1) * group)
            scale = scale_arg * qk_descale[bi, hk]  # fp8: the descales fold into the scale (float32); 16 bits: x 1
            c = scale * np.float32(LOG2E)  # the kernel's scale_log2, a float32 product
            with np.errstate(invalid="ignore", over="ignore"):
                s = q[bi, :, heads].transpose(1, 0, 2) @ k[bi, :, hk].T  # [group, Sq, Skv] float32
                head_ids = range(hk * group, (hk + 1) * group)
                if prescaled:  # the kernel's transform, then base-2 units (no further scale)
                    s, _, sink = _variant_scores(s * scale, bi + batch_offset, head_ids, sq, skv, causal, dtype=np.float32, **variant)
                    s, cc = s * np.float32(LOG2E), np.float32(1)
                    sink = None if sink is None else sink * np.float32(LOG2E)
                else:  # masks only: the raw score, scaled in the exponent
                    s, _, sink = _variant_scores(s, bi + batch_offset, head_ids, sq, skv, causal, dtype=np.float32, **variant)
                    cc = c
                    sink = None if sink is None else sink / scale  # the kernel's Sinks[h] / softmax_scale
                m = s.max(axis=-1, keepdims=True, initial=-np.inf)
                if sink is not None:
                    m = np.maximum(m, sink)
                mc = np.where(m == ninf, np.float32(0), m * cc)  # a row that sees no key: P = 0, not NaN
                if block_n:  # the kernel's own roundings: P relative to the running max of its tiles
                    acc, den = _online(s, v[bi, :, hk], cc, sink, offset, dtype, block_n, twin.get("sum_rounded", False))
                else:
                    p = np.exp2(s * cc - mc + offset)
                    den = (round_to(p, dtype) if twin.get("sum_rounded") else p).sum(axis=-1, keepdims=True, dtype=np.float32)
                    if sink is not None:
                        den = den + np.exp2(sink * cc - mc + offset)
                    acc = round_to(p, dtype) @ v[bi, :, hk]
                if fp8:
                    acc = acc * v_descale[bi, hk]
                o = np.where(den == 0, np.float32(0), acc / np.where(den == 0, np.float32(1), den))
            out[bi, :, heads] = round_to(o, out_dtype).transpose(1, 0, 2)
    return out


class _Verdict(NamedTuple):
    ok: bool
    err: float  # max |out - ref| over finite positions; inf when out and ref disagree on a non-finite one
    bound: float  # 2 * max |lowprec - ref| + ulp(dtype) * max |ref|


class Check(_Verdict):
    """A comparison's verdict; unpacks as (ok, err, bound). `note` says why it failed when the
    error does not: the reference itself is NaN or inf although every input is finite."""

    def __new__(cls, ok: bool, err: float, bound: float, note: str = ""):
        self = super().__new__(cls, ok, err, bound)
        self.note = note
        return self

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else (f"FAIL ({self.note})" if self.note else "FAIL")

    def __str__(self):
        return f"max |out - ref| = {self.err:.3e}, bound = {self.bound:.3e}: {self.verdict}"


def undefined_reference(ref: np.ndarray, inputs, *, allow_neg_inf: bool = False) -> str:
    """Why a check must fail although `out` may match: `ref` is NaN or inf (-inf allowed for an LSE,
    a row that sees no key) while every input is finite, so the spec's own arithmetic (a
    score_mod's log of a negative score, a division by zero) is undefined there and no kernel
    output can be right. '' when ref is defined, or when a non-finite input explains it (then
    NaN and inf propagate by the rules above and must match)."""
    bad = np.isnan(ref) | (np.isposinf(ref) if allow_neg_inf else np.isinf(ref))
    if not bad.any():
        return ""
    if not all(np.all(np.isfinite(to_numpy(x))) for x in inputs if x is not None):
        return ""
    first = [int(i) for i in np.argwhere(bad)[0]]
    return (f"the reference is NaN or inf at {int(bad.sum())} of {bad.size} positions, first at {first}, from finite "
            f"inputs: the spec's arithmetic is undefined there (a score_mod's log of a negative score or division by zero?)")


def _inputs_of(q, k, v, variant: dict) -> list:
    """Every tensor a reference reads: q, k, v and the variant's call-time tensors."""
    return [q, k, v, variant.get("alibi_slopes"), variant.get("sinks"), *(variant.get("tensors") or {}).values()]


def nonfinite_agree(out: np.ndarray, ref: np.ndarray) -> bool:
    """True when out is NaN exactly where ref is NaN, the same inf where ref is inf, finite elsewhere."""
    ref_nan, out_nan = np.isnan(ref), np.isnan(out)
    ref_inf, out_inf = np.isinf(ref), np.isinf(out)
    return bool(np.array_equal(ref_nan, out_nan) and np.array_equal(ref_inf, out_inf)
                and np.array_equal(out[out_inf], ref[ref_inf]))


def tolerance(ref: np.ndarray, low: np.ndarray, dtype: str, eps: float | None = None) -> float:
    """2 * max|low - ref| + eps over the positions where both are finite; always finite.

    eps defaults to one ulp of the largest output, ulp(dtype) * max|ref| (at least the smallest
    value the dtype holds): a fixed eps would pass a x1.05 output whose values are all small.
    """
    both = np.isfinite(ref) & np.isfinite(low)
    twin = float(np.abs(low[both] - ref[both]).max(initial=0.0))
    if eps is None:
        scale = float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0))
        eps = max(EPS[dtype] * scale, TINY[dtype])
    return 2.0 * twin + eps


def check_close(out, q, k, v, causal: bool, *, dtype: str | None = None, eps: float | None = None, scale: float | None = None,
                descales=None, out_dtype: str | None = None, block_n: int | None = None, **variant) -> Check:
    """Compare a kernel output with the fp64 reference under the tolerance rule above.

    The reference is computed from the inputs rounded to `dtype` (what the kernel reads);
    `dtype` defaults to the dtype of q when q is a float16/bfloat16 tensor. A NaN or inf in
    `out` passes only where the reference has the same (err = inf otherwise); `eps` replaces
    the ulp(dtype) * max|ref| floor.
    """
    dtype = dtype or dtype_of(q)
    if dtype not in EPS:
        raise ValueError(f"check_close: pass dtype='float16' or 'bfloat16' (q has dtype {getattr(q, 'dtype', None)})")
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    out = to_numpy(out).astype(np.float64)
    if dtype == E4M3:
        return check_close_fp8(out, q, k, v, causal, descales=descales, out_dtype=out_dtype, scale=scale, block_n=block_n,
                               **variant)
    ref, _ = attention(q, k, v, causal, scale, **variant)
    if out.shape != ref.shape:
        raise ValueError(f"check_close: out has shape {out.shape}, expected {ref.shape}")
    low = attention_lowprec(q, k, v, causal, dtype, scale, **variant)
    finite = np.isfinite(ref) & np.isfinite(out)
    if nonfinite_agree(out, ref):
        err = float(np.abs(out[finite] - ref[finite]).max(initial=0.0))
    else:
        err = float("inf")
    bound = tolerance(ref, low, dtype, eps)
    note = undefined_reference(ref, _inputs_of(q, k, v, variant))
    return Check(err <= bound and not note, err, bound, note)


TWIN_SHARE = 0.1  # fp8: how far the kernel may be from its tile-exact twin, as a share of the twin's own error (docs/fp8.md)


def check_close_fp8(out, q, k, v, causal: bool, *, descales=None, out_dtype: str | None = None, scale: float | None = None,
                    block_n: int | None = None, twin: dict | None = None, **variant) -> Check:
    """The fp8 rule (docs/fp8.md). ref: the fp64 attention of the dequantized inputs; twin: the kernel's
    arithmetic (attention_lowprec with e4m3: P offset by 2**8, its row sum from the unrounded P, P rounded
    to e4m3 for PV; with `block_n`, tile by tile as the kernel's online softmax). Two clauses, with
    eps = 2 ulp(max|ref|) of out_dtype:
      FA3's shape    max|out - ref|  <= 2 max|twin - ref| + eps
      the twin's     max(|out - twin| - ulp(twin)) <= TWIN_SHARE max|twin - ref|   (with block_n only)
    e4m3's P carries about 4% relative noise, so FA3's clause alone passes an output 5% off; the tile-exact
    twin has the kernel's very roundings, so the second does not. `twin` breaks the twin (see there)."""
    out_dtype = out_dtype or "bfloat16"
    out = to_numpy(out).astype(np.float64)
    ref, _ = attention(*dequantize(q, k, v, descales), causal, scale, **variant)
    if out.shape != ref.shape:
        raise ValueError(f"check_close: out has shape {out.shape}, expected {ref.shape}")
    low = attention_lowprec(q, k, v, causal, E4M3, scale, descales=descales, out_dtype=out_dtype, twin=twin,
                            block_n=block_n, **variant)
    finite = np.isfinite(ref) & np.isfinite(out)
    agree = nonfinite_agree(out, ref)
    err = float(np.abs(out[finite] - ref[finite]).max(initial=0.0)) if agree else float("inf")
    peak = float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0))
    eps = max(2 * EPS[out_dtype] * peak, TINY[out_dtype])
    bound = tolerance(ref, low, out_dtype, eps=eps)
    ok = err <= bound
    if block_n and agree:  # beyond one ulp of each element (both are rounded to out_dtype), a share of the twin's error
        both = finite & np.isfinite(low)
        off_twin = float((np.abs(out[both] - low[both]) - EPS[out_dtype] * np.abs(low[both])).max(initial=0.0))
        twin_bound = TWIN_SHARE * (bound - eps) / 2 + TINY[out_dtype]
        if off_twin > twin_bound:
            ok, err, bound = False, off_twin, twin_bound
    note = undefined_reference(ref, _inputs_of(q, k, v, variant))
    return Check(ok and not note, err, bound, note)


LSE_ATOL, LSE_RTOL = 2e-3, 1e-3  # the kernel's LSE is fp32 math on the exact scores: ~1e-5 off; log(2) is 0.69


def check_lse(lse, q, k, v, causal: bool, *, dtype: str | None = None, scale: float | None = None, descales=None,
              **variant) -> Check:
    """The kernel's log-sum-exp [B, H, Sq] against the fp64 one: -inf exactly where the reference
    has -inf (rows that see no key), else within LSE_ATOL + LSE_RTOL * |ref|."""
    dtype = dtype or dtype_of(q)
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    if dtype == E4M3:
        q, k, v = dequantize(q, k, v, descales)
    _, ref = attention(q, k, v, causal, scale, **variant)
    lse = to_numpy(lse).astype(np.float64)
    if lse.shape != ref.shape:
        raise ValueError(f"check_lse: lse has shape {lse.shape}, expected {ref.shape}")
    note = undefined_reference(ref, _inputs_of(q, k, v, variant), allow_neg_inf=True)
    empty = np.isneginf(ref)
    if np.any(np.isneginf(lse) != empty) or np.any(np.isnan(lse)):
        return Check(False, float("inf"), 0.0, note)
    with np.errstate(invalid="ignore"):  # inf - inf where the reference is undefined (note says so)
        diff = np.abs(lse[~empty] - ref[~empty])
    excess = diff - LSE_RTOL * np.abs(ref[~empty])
    err = float(excess.max(initial=0.0))
    return Check(err <= LSE_ATOL and not note, err, LSE_ATOL, note)
