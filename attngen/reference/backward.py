"""The fp64 oracle for attention's gradients, their low-precision twin, and the backward tolerance rule.

Written from the maths, independently of any kernel (docs/backward.md derives each line). Per batch
b and query head h, in natural units, with s = q . k * scale and z the final score (softcap, ALiBi,
score_mod, masks -> -inf):

    P = exp(z - lse),  lse = log(sum_j exp(z_j) + exp(sink_h)),  O = P V
    dV = P^T dO                       (summed over the query heads of a KV head: GQA/MQA)
    dP = dO V^T,  D = rowsum(dO * O) - dLSE   (dPsum; rowsum(P * dP) - dLSE, the sink has no value)
    dZ = P * (dP - D),  dS = dZ * dz/ds   (dz/ds: softcap 1 - tanh^2, ALiBi 1, score_mod's derivative)
    dQ = scale * dS K,  dK = scale * dS^T Q
    dsink_h = -sum over rows of exp(sink_h - lse) * D

dLSE is the LSE output's gradient (d lse_i / d z_ij = P_ij and d lse_i / d sink_h = exp(sink_h -
lse_i), so it folds into D; zeros when the loss does not read the LSE). A masked entry has dS = 0
(never 0 * NaN), so a row that sees no key gets dQ = 0 and adds nothing to dK and dV, whatever its
dLSE (its lse is -inf whatever the scores). Call-time tensors of score_mod/mask_mod are constants.

Tolerance (FlashAttention-3's backward tests): per gradient g,

    max|g - ref| <= 2 * max|g_lowprec - ref| + eps,   eps = ulp(dtype) * max|ref|

where `attention_grad_lowprec` mirrors the kernel's precisions (fp32 GEMM accumulators; P and dS
rounded to the dtype before the GEMMs that read them; the gradients rounded to the dtype at the
end). For dq and dk, eps is at least CANCELLATION x the size of what cancels in dP - D (below).
It reuses reference.py's tolerance and non-finite rules.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from attngen.hw import LOG2E
from attngen.reference.forward import (Check, InputError, _check_shapes, _prescaled, _variant_scores, attention_lowprec,
                               nonfinite_agree, round_to, to_numpy, tolerance)


# dq and dk's floor: CANCELLATION x the sum of absolute terms of dS = P (dP - D) carried through
# to dq and dk (_attention_grad's magnitudes). Where a row sees one key, P = 1 and O = V, so dP = D
# and the exact dS is 0; the kernel's dP (a wgmma) and D (the preprocess's row sum) are float32
# sums in different orders, so its dq and dk hold rounding noise that the twin's own sample of it
# need not cover (a gradient that is 0 everywhere then has a bound of one subnormal). Measured on
# the CPU model: 0.0 to 1.42 x 2^-24 x magnitude over 240 such gradients (lengths 1-200, kv_len 1
# or window [0, 0]). It can hide a 5% error only in a sum that cancels 10^5-fold: in ordinary
# cases it is about 1/100 of the ulp(dtype) eps (docs/backward.md, "The tolerance rule").
CANCELLATION = 8 * 2.0 ** -24


class Grads(NamedTuple):
    dq: np.ndarray  # [B, Sq, H, D]
    dk: np.ndarray  # [B, Skv, HKV, D]
    dv: np.ndarray  # [B, Skv, HKV, DV]
    dsinks: np.ndarray | None  # [H], when the variant has sinks


def _inputs(q, k, v, dout, convert):
    q, k, v, dout = (convert(to_numpy(t)) for t in (q, k, v, dout))
    group = _check_shapes(q, k, v)
    want = q.shape[:3] + (v.shape[3],)
    if dout.shape != want:
        raise InputError("dout", f"shape {dout.shape}", f"the output's shape {want} (q's [B, Sq, H] and v's head dim)")
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if not np.isfinite(t).all():
            raise InputError(name, "a non-finite value", "finite values (the gradient reference has no NaN semantics)")
    return q, k, v, dout, group


def _row_gradient(dlse, rows: tuple, convert) -> np.ndarray:
    """The LSE output's gradient [B, H, Sq] (zeros when None), checked."""
    if dlse is None:
        return np.zeros(rows)
    dlse = convert(to_numpy(dlse))
    if dlse.shape != rows:
        raise InputError("dlse", f"shape {dlse.shape}", f"the LSE's shape {rows} ([B, H, Sq])")
    if not np.isfinite(dlse).all():
        raise InputError("dlse", "a non-finite value", "finite values (the gradient reference has no NaN semantics)")
    return dlse


def attention_grad(q, k, v, dout, causal: bool = False, scale: float | None = None, *, batch_offset: int = 0,
                   dlse=None, **variant) -> Grads:
    """fp64 gradients of sum(out * dout) + sum(lse * dlse), (out, lse) = reference.attention(q, k, v,
    causal, scale, **variant); dlse [B, H, Sq] (None: the loss reads no LSE)."""
    return _attention_grad(q, k, v, dout, causal, scale, batch_offset, False, dlse=dlse, **variant)[0]


def learnable_shapes(learnable, variant) -> dict:
    """name -> shape of each learnable tensor (alibi_slopes or a score_mod tensor of `variant`)."""
    given = dict(variant.get("tensors") or {}, alibi_slopes=variant.get("alibi_slopes"))
    for name in learnable:
        if given.get(name) is None:
            raise InputError("learnable", name, f"a tensor the call gives: {sorted(n for n, t in given.items() if t is not None)}")
    return {n: np.shape(to_numpy(given[n])) for n in learnable}


def _scatter(dtensors: dict, terms, dz, visible, dtype) -> None:
    """dT[entry] += dZ * d(score)/d(entry) over the visible elements of each term (a masked one adds 0, never NaN)."""
    for name, at, value in terms:
        np.add.at(dtensors[name], at, np.where(visible, dz * np.where(visible, value, 0), 0).astype(dtype))


def tensor_grads(q, k, v, dout, causal: bool = False, scale: float | None = None, *, learnable=(), dlse=None,
                 lowprec: str | None = None, out=None, **variant) -> dict:
    """The learnable tensors' gradients {name: array of the tensor's shape}: fp64 (the oracle), or with
    `lowprec` the kernel's arithmetic in that dtype (attention_grad_lowprec's twin: dZ and each term
    in float32, summed in float32). dT[entry] = sum over (b, h, q, kv) of dZ * d(score)/d(entry)
    through the score_mod's symbolic derivative (expr.derivative with wrt), dZ = P (dP - D)."""
    if lowprec:
        return attention_grad_lowprec(q, k, v, dout, causal, lowprec, scale, out=out, dlse=dlse, learnable=learnable,
                                      **variant)[1]
    return _attention_grad(q, k, v, dout, causal, scale, 0, False, dlse=dlse, learnable=learnable, **variant)[2]


def _attention_grad(q, k, v, dout, causal, scale, batch_offset, magnitudes, dlse=None, learnable=(), **variant):
    """(Grads, magnitudes or None, the learnable tensors' gradients by name). With `magnitudes`, also
    the size of what cancels in dS = P (dP - D):
    dq_mag = scale * (P (|dO| |V|^T + |dO| . |O|) |dz/ds|) |K| and dk_mag likewise with |Q| (each dot
    product's sum of absolute terms), the scale of the float32 rounding noise that dq and dk carry
    where dP and D cancel (check_grads' floor)."""
    q, k, v, dout, group = _inputs(q, k, v, dout, lambda t: t.astype(np.float64))
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    dlse = _row_gradient(dlse, (b, h, sq), lambda t: t.astype(np.float64))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = np.zeros(h) if variant.get("sinks") is not None else None
    dq_mag, dk_mag = (np.zeros_like(q), np.zeros_like(k)) if magnitudes else (None, None)
    dtensors = {n: np.zeros(shape) for n, shape in learnable_shapes(learnable, variant).items()}
    for bi in range(b):
        for hk in range(hkv):
            heads = slice(hk * group, (hk + 1) * group)
            qg, do = q[bi, :, heads].transpose(1, 0, 2), dout[bi, :, heads].transpose(1, 0, 2)  # [g, Sq, D]
            s = qg @ k[bi, :, hk].T * scale
            z, visible, sink, dzds, *terms = _variant_scores(s, bi + batch_offset, range(hk * group, (hk + 1) * group),
                                                             sq, skv, causal, grad=True, learnable=learnable, **variant)
            m = z.max(axis=-1, keepdims=True, initial=-np.inf)  # (a sequence may have no key)
            if sink is not None:
                m = np.maximum(m, sink)
            m = np.where(np.isfinite(m), m, 0.0)
            den = np.exp(z - m).sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
            lse = np.where(den > 0, m + np.log(np.where(den > 0, den, 1.0)), -np.inf)
            p = np.where(visible, np.exp(z - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
            out = p @ v[bi, :, hk]
            dp = do @ v[bi, :, hk].T
            dpsum = (do * out).sum(axis=-1, keepdims=True) - dlse[bi, heads, :, None]
            ds = np.where(visible, p * (dp - dpsum) * np.where(visible, dzds, 0.0), 0.0)
            if terms:
                _scatter(dtensors, terms[0], np.where(visible, p * (dp - dpsum), 0.0), visible, np.float64)
            dq[bi, :, heads] = (ds @ k[bi, :, hk] * scale).transpose(1, 0, 2)
            dk[bi, :, hk] += np.einsum("gqk,gqd->kd", ds, qg) * scale
            dv[bi, :, hk] += np.einsum("gqk,gqd->kd", p, do)
            if dsinks is not None:
                p_sink = np.where(np.isfinite(lse), np.exp(sink - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
                dsinks[heads] -= (p_sink * dpsum).sum(axis=(1, 2))
            if magnitudes:
                terms = (np.abs(do) @ np.abs(v[bi, :, hk]).T + (np.abs(do) * np.abs(out)).sum(axis=-1, keepdims=True)
                         + np.abs(dlse[bi, heads, :, None]))
                m = np.where(visible, p * terms * np.abs(np.where(visible, dzds, 0.0)), 0.0)
                dq_mag[bi, :, heads] = (m @ np.abs(k[bi, :, hk]) * scale).transpose(1, 0, 2)
                dk_mag[bi, :, hk] += np.einsum("gqk,gqd->kd", m, np.abs(qg)) * scale
    return Grads(dq, dk, dv, dsinks), (Grads(dq_mag, dk_mag, None, None) if magnitudes else None), dtensors


def attention_grad_lowprec(q, k, v, dout, causal: bool = False, dtype: str = "float16", scale: float | None = None, *,
                           batch_offset: int = 0, out=None, dlse=None, learnable=(), **variant) -> Grads:
    """The backward kernel's arithmetic on the CPU (FlashAttention-3's): inputs and dout rounded to
    `dtype`; O the low-precision forward's output (in `dtype`, as the kernel reads it); S = Q K^T
    in float32; P = exp2(z - LSE2) in float32 with LSE2 the float32 log2-sum-exp (0 where it is
    -inf, as the preprocess writes); dP = dO V^T in float32; D = rowsum(dO * O) - dLSE in float32;
    dS = P (dP - D) dz/ds in float32; then P and dS rounded to `dtype` before dV = P^T dO,
    dK = dS^T Q and dQ = dS K (float32 accumulators, the scale applied to dQ and dK in float32);
    each gradient rounded to `dtype`. dsinks stays float32. Returns float64 arrays. `out`: the
    forward output the backward kernel read (rounded to `dtype`) in place of the twin's own, so that
    D holds the same rounding of O as the kernel's."""
    q, k, v, dout, group = _inputs(q, k, v, dout, lambda t: round_to(t, dtype))
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    dlse = _row_gradient(dlse, (b, h, sq), lambda t: t.astype(np.float32))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out is None:
        out = attention_lowprec(q, k, v, causal, dtype, scale, batch_offset=batch_offset, **variant)
    elif np.shape(to_numpy(out)) != q.shape[:3] + (v.shape[3],):
        raise InputError("out", f"shape {np.shape(to_numpy(out))}", f"the output's shape {q.shape[:3] + (v.shape[3],)}")
    out = round_to(to_numpy(out), dtype)
    prescaled = _prescaled(variant)
    c = np.float32(scale * LOG2E)
    f32 = np.float32
    dq = np.zeros(q.shape, f32)
    dk, dv = np.zeros(k.shape, f32), np.zeros(v.shape, f32)
    dsinks = np.zeros(h, f32) if variant.get("sinks") is not None else None
    dtensors = {n: np.zeros(shape, f32) for n, shape in learnable_shapes(learnable, variant).items()}
    terms = []
    for bi in range(b):
        for hk in range(hkv):
            heads = slice(hk * group, (hk + 1) * group)
            head_ids = range(hk * group, (hk + 1) * group)
            qg, do = q[bi, :, heads].transpose(1, 0, 2), dout[bi, :, heads].transpose(1, 0, 2)
            with np.errstate(invalid="ignore", over="ignore"):
                s = qg @ k[bi, :, hk].T  # float32
                if prescaled:  # the kernel's transform on q . k * scale, then base 2
                    z, visible, sink, dzds, *terms = _variant_scores(s * f32(scale), bi + batch_offset, head_ids, sq, skv,
                                                                     causal, dtype=f32, grad=True, learnable=learnable,
                                                                     **variant)
                    z = z * f32(LOG2E)
                else:
                    z, visible, sink, _ = _variant_scores(s, bi + batch_offset, head_ids, sq, skv, causal, dtype=f32,
                                                          grad=True, **variant)
                    z, dzds = z * c, f32(1)
                sink2 = None if sink is None else sink * f32(LOG2E)
                m = z.max(axis=-1, keepdims=True, initial=-np.inf)
                if sink2 is not None:
                    m = np.maximum(m, sink2)
                m = np.where(np.isfinite(m), m, f32(0))
                den = np.exp2(z - m).sum(axis=-1, keepdims=True, dtype=f32) + (f32(0) if sink2 is None else np.exp2(sink2 - m))
                lse2 = np.where(den > 0, m + np.log2(np.where(den > 0, den, f32(1))), f32(0)).astype(f32)
                p = np.where(visible, np.exp2(z - lse2), f32(0)).astype(f32)
                dp = do @ v[bi, :, hk].T
                dpsum = (do * out[bi, :, heads].transpose(1, 0, 2).astype(f32)).sum(axis=-1, keepdims=True, dtype=f32)
                dpsum = (dpsum - dlse[bi, heads, :, None]).astype(f32)
                ds = np.where(visible, p * (dp - dpsum) * np.where(visible, dzds, f32(0)), f32(0)).astype(f32)
                if terms:
                    _scatter(dtensors, terms[0], np.where(visible, p * (dp - dpsum), f32(0)).astype(f32), visible, f32)
            p16, ds16 = round_to(p, dtype), round_to(ds, dtype)
            dq[bi, :, heads] = (ds16 @ k[bi, :, hk]).transpose(1, 0, 2) * f32(scale)
            dk[bi, :, hk] += np.einsum("gqk,gqd->kd", ds16, qg, dtype=f32) * f32(scale)
            dv[bi, :, hk] += np.einsum("gqk,gqd->kd", p16, do, dtype=f32)
            if dsinks is not None:
                p_sink = np.where(den > 0, np.exp2(sink2 - lse2), f32(0))
                dsinks[heads] -= (p_sink * dpsum).sum(axis=(1, 2), dtype=f32)
    rounded = [round_to(g, dtype).astype(np.float64) for g in (dq, dk, dv)]
    grads = Grads(*rounded, None if dsinks is None else dsinks.astype(np.float64))
    if learnable:  # (tensor_grads' twin)
        return grads, {n: g.astype(np.float64) for n, g in dtensors.items()}
    return grads


def attention_grad_varlen(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale: float | None = None,
                          *, lowprec: str | None = None, dlse=None, **variant) -> Grads:
    """Packed sequences (q [total_q, H, D], k and v [total_k, HKV, D], dlse [H, total_q]): each
    sequence's gradients on its own lengths and bottom-right alignment (`lowprec`: the twin in that
    dtype instead of fp64)."""
    q, k, v, dout = (to_numpy(t).astype(np.float64) for t in (q, k, v, dout))
    cq, ck = (np.asarray(to_numpy(c), np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    if cq.shape != ck.shape or cq.ndim != 1 or len(cq) < 2:
        raise InputError("cu_seqlens_q/cu_seqlens_k", f"shapes {cq.shape} and {ck.shape}", "two [batch + 1] prefix sums")
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = np.zeros(q.shape[1]) if variant.get("sinks") is not None else None
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        args = (q[None, qs], k[None, ks], v[None, ks], dout[None, qs], causal)
        rows = None if dlse is None else to_numpy(dlse)[None, :, qs]
        if lowprec:
            g = attention_grad_lowprec(*args, lowprec, scale, batch_offset=b, dlse=rows, **variant)
        else:
            g = attention_grad(*args, scale, batch_offset=b, dlse=rows, **variant)
        dq[qs], dk[ks], dv[ks] = g.dq[0], g.dk[0], g.dv[0]
        if dsinks is not None:
            dsinks += g.dsinks
    return Grads(dq, dk, dv, dsinks)


def check_grads(grads, q, k, v, dout, causal: bool, *, dtype: str, eps: float | None = None,
                scale: float | None = None, out=None, dlse=None, learnable=(), **variant) -> dict:
    """Each gradient of `grads` (a Grads, or a dict with dq, dk, dv and dsinks) against the fp64
    reference under the rule above: {name: reference.Check}. The reference is computed from the
    inputs rounded to `dtype` (what the kernel reads). A shape mismatch is a FAIL (err = inf).
    `out`: the forward output the backward kernel read, for the twin's D (attention_grad_lowprec);
    check that output with reference.check_close, since this check then takes it as given.
    `dlse`: the LSE output's gradient [B, H, Sq] the backward was given (None: zeros). `learnable`:
    also each named tensor's gradient, got as "d<name>" (tensor_grads and its twin)."""
    if dtype not in ("float16", "bfloat16"):
        raise InputError("dtype", repr(dtype), "'float16' or 'bfloat16'")
    q, k, v, dout = (round_to(to_numpy(t), dtype) for t in (q, k, v, dout))
    ref, mag, dtensors = _attention_grad(q, k, v, dout, causal, scale, 0, True, dlse=dlse, learnable=learnable, **variant)
    low = attention_grad_lowprec(q, k, v, dout, causal, dtype, scale, out=out, dlse=dlse, learnable=learnable, **variant)
    low, low_tensors = low if learnable else (low, {})
    got = grads._asdict() if isinstance(grads, Grads) else dict(grads)
    out = {}
    for name in Grads._fields + tuple(f"d{n}" for n in learnable):
        if name in Grads._fields:
            r, lo, m = getattr(ref, name), getattr(low, name), getattr(mag, name)
        else:
            r, lo, m = dtensors[name[1:]], low_tensors[name[1:]], None
        if r is None:
            continue
        g = got.get(name)
        bound = tolerance(r, lo, dtype, eps)
        if eps is None and m is not None:  # the float32 noise where dP and D cancel
            bound = max(bound, tolerance(r, lo, dtype, CANCELLATION * float(m.max(initial=0.0))))
        if g is None or np.shape(to_numpy(g)) != r.shape:
            out[name] = Check(False, float("inf"), bound)
            continue
        g = to_numpy(g).astype(np.float64)
        err = float(np.abs(g - r).max(initial=0.0)) if nonfinite_agree(g, r) else float("inf")
        out[name] = Check(err <= bound, err, bound)
    return out
