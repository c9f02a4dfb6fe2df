"""The fp64 oracle for attention, its low-precision twin, and the tolerance rule every test uses.

Layout is BSHD: q [B, Sq, H, D], k and v [B, Skv, HKV, D]. Query head h reads KV head
h // (H // HKV) (GQA; MQA when HKV = 1). Causal masks are aligned bottom-right: query i
sees key j when j <= i + Skv - Sq, so with Sq > Skv the first Sq - Skv rows see no key;
such rows give output 0 (never NaN) and log-sum-exp -inf.

Tolerance (FlashAttention's rule): a kernel output passes when

    max|out - ref| <= 2 * max|lowprec - ref| + eps

where `ref` is this module's fp64 attention and `lowprec` the same math carried out in the
kernel's input precision (`attention_lowprec`). eps covers shapes where the low-precision
error is ~0 (one key, exact averages): 1e-3 for float16, 8e-3 for bfloat16 (about one
bfloat16 ulp at 1.0, 2**-7); both far below the O(0.1) errors a wrong mask or a stale tile
produces.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from attngen.hw import DTYPES

EPS = {name: d.eps for name, d in DTYPES.items()}


def round_to(x, dtype: str) -> np.ndarray:
    """Round to float16/bfloat16 (round to nearest even) and return float32 holding those values.

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
    if dtype in ("float32", "float"):
        return x
    raise ValueError(f"dtype {dtype!r}: expected one of float16, bfloat16, float32")


def random_inputs(dtype: str, head_dim: int, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                  seed: int = 0):
    """Standard-normal q [B, Sq, H, D], k and v [B, Skv, HKV, D], rounded to `dtype` (float32 arrays)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim), (batch, kv_len, kv_heads, head_dim)]
    return [round_to(rng.standard_normal(s), dtype) for s in shapes]


def to_numpy(x) -> np.ndarray:
    """A torch tensor or array-like as a numpy array (bfloat16 tensors become float32, exactly)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
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
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [B, Skv, HKV, D] matching q [B, Sq, H, D]: q {q.shape}, k {k.shape}, v {v.shape}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {hkv}")
    return h // hkv


def causal_visible(sq: int, skv: int) -> np.ndarray:
    """[Sq, Skv] bool: query i sees key j when j <= i + Skv - Sq (bottom-right alignment)."""
    return np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)


def attention(q, k, v, causal: bool = False, scale: float | None = None):
    """fp64 attention. Returns (out [B, Sq, H, D] float64, lse [B, H, Sq] float64, natural log)."""
    q, k, v = (to_numpy(t).astype(np.float64) for t in (q, k, v))
    group = _check_shapes(q, k, v)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), -np.inf)
    visible = causal_visible(sq, skv) if causal else np.ones((sq, skv), bool)
    for bi in range(b):
        for hk in range(k.shape[2]):
            heads = slice(hk * group, (hk + 1) * group)
            s = np.einsum("qgd,kd->gqk", q[bi, :, heads], k[bi, :, hk]) * scale  # [group, Sq, Skv]
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m_safe = np.where(np.isfinite(m), m, 0.0)  # a row with no key: exp(-inf) = 0, not NaN
            p = np.exp(s - m_safe)
            den = p.sum(axis=-1, keepdims=True)
            o = np.einsum("gqk,kd->qgd", p / np.where(den > 0, den, 1.0), v[bi, :, hk])
            out[bi, :, heads] = o
            with np.errstate(divide="ignore"):
                lse[bi, heads] = (m_safe + np.log(den))[..., 0]
    return out, lse


def attention_lowprec(q, k, v, causal: bool = False, dtype: str = "float16", scale: float | None = None) -> np.ndarray:
    """The same math in the kernel's input precision (FlashAttention's `upcast=False` reference).

    Inputs rounded to `dtype`; scores = round(round(q * scale) @ k^T); P = round(softmax(scores));
    out = round(P @ v). Products accumulate in float32, as tensor cores do. Returns float64.
    """
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    group = _check_shapes(q, k, v)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, h, d))
    visible = causal_visible(sq, skv) if causal else np.ones((sq, skv), bool)
    for bi in range(b):
        for hk in range(k.shape[2]):
            heads = slice(hk * group, (hk + 1) * group)
            qs = round_to(q[bi, :, heads] * np.float32(scale), dtype).transpose(1, 0, 2)  # [group, Sq, D]
            s = round_to(qs @ k[bi, :, hk].T, dtype)
            s = np.where(visible, s, np.float32(-np.inf))
            m = s.max(axis=-1, keepdims=True)
            p = np.exp(s - np.where(np.isfinite(m), m, np.float32(0)))
            den = p.sum(axis=-1, keepdims=True)
            p = round_to(p / np.where(den > 0, den, np.float32(1)), dtype)
            out[bi, :, heads] = round_to(p @ v[bi, :, hk], dtype).transpose(1, 0, 2)
    return out


class Check(NamedTuple):
    ok: bool
    err: float  # max |out - ref|
    bound: float  # 2 * max |lowprec - ref| + eps

    def __str__(self):
        verdict = "PASS" if self.ok else "FAIL"
        return f"max |out - ref| = {self.err:.3e}, bound = {self.bound:.3e}: {verdict}"


def check_close(out, q, k, v, causal: bool, *, dtype: str | None = None, eps: float | None = None, scale: float | None = None) -> Check:
    """Compare a kernel output with the fp64 reference under the tolerance rule above.

    The reference is computed from the inputs rounded to `dtype` (what the kernel reads);
    `dtype` defaults to the dtype of q when q is a float16/bfloat16 tensor. A NaN in `out`
    fails (err = inf).
    """
    dtype = dtype or dtype_of(q)
    if dtype not in EPS:
        raise ValueError(f"check_close: pass dtype='float16' or 'bfloat16' (q has dtype {getattr(q, 'dtype', None)})")
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    out = to_numpy(out).astype(np.float64)
    ref, _ = attention(q, k, v, causal, scale)
    if out.shape != ref.shape:
        raise ValueError(f"check_close: out has shape {out.shape}, expected {ref.shape}")
    low = attention_lowprec(q, k, v, causal, dtype, scale)
    diff = np.abs(out - ref)
    err = float("inf") if diff.size and not np.all(np.isfinite(diff)) else float(diff.max(initial=0.0))
    bound = 2.0 * float(np.abs(low - ref).max(initial=0.0)) + (EPS[dtype] if eps is None else eps)
    return Check(err <= bound, err, bound)
