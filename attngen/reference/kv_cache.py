"""An fp8 KV cache's values (docs/fp8-kv-cache.md): e4m3 keys and values with float32 descales per
(batch, or page of a paged cache; KV head), FlashAttention-3's k_descale / v_descale.

The reference is the fp64 attention on the dequantized cache as the kernel's GEMMs read it: each
stored value times its descale, the product in float32, then rounded to the queries' 16-bit
dtype (the kernel's conversion store). `dequantize` gives the float32 product; the checks' own
round_to(dtype) then makes it the GEMM's input exactly, so the 16-bit rule holds unchanged: a
16-bit kernel on those 16-bit inputs. The append's quantization is `quantize`: x / descale
rounded to e4m3, saturating at +-448 (cvt.rn.satfinite).
"""

from __future__ import annotations

import numpy as np

from attngen.hw import E4M3
from attngen.reference.forward import round_to, to_numpy

DESCALE_RANGE = (0.25, 2.25)  # drawn descales (FA3's test draws rand * 2); never 0


def _per_row(descale: np.ndarray, x: np.ndarray, row_batch) -> np.ndarray:
    """The descale of each element of x: a 4-d cache [batch or page, rows, kv_heads, D] by its first
    axis; a packed one [total_k, kv_heads, D] by each row's batch (`row_batch`)."""
    if x.ndim == 4:
        return descale[:, None, :, None]
    if row_batch is None:
        raise ValueError("a packed cache [total_k, kv_heads, D] needs each row's batch (row_batch)")
    return descale[np.asarray(row_batch)][:, :, None]


def dequantize(x, descale, row_batch=None) -> np.ndarray:
    """float32: each e4m3 value of the cache x times its (batch or page, KV head) descale."""
    x, d = to_numpy(x).astype(np.float32), to_numpy(descale).astype(np.float32)
    return x * _per_row(d, x, row_batch)


def quantize(x, descale, row_batch=None) -> np.ndarray:
    """float32 holding e4m3 values: x / descale rounded to nearest even, saturating (the append's store)."""
    x, d = to_numpy(x).astype(np.float32), to_numpy(descale).astype(np.float32)
    return round_to(x / _per_row(d, x, row_batch), E4M3)


def row_batches(k_starts, kv_lens, total_k: int) -> np.ndarray:
    """Each row's sequence in a packed cache [total_k, ...] whose sequence b holds rows
    k_starts[b] .. k_starts[b] + kv_lens[b] - 1 (rows no sequence owns: 0, never read)."""
    rows = np.zeros(total_k, np.int64)
    for b, (start, n) in enumerate(zip(k_starts, kv_lens)):
        rows[int(start):int(start) + int(n)] = b
    return rows


def random_descales(rows: int, kv_heads: int, seed: int = 0) -> tuple:
    """k_descale and v_descale, float32 [rows, kv_heads], uniform in DESCALE_RANGE, distinct per row and head."""
    rng = np.random.default_rng(seed)
    lo, hi = DESCALE_RANGE
    return tuple((lo + (hi - lo) * rng.random((rows, kv_heads))).astype(np.float32) for _ in range(2))
