"""The KV-cache append family's plan: the numbers of the kernel that writes new keys and values
into a paged cache (flash_attn_with_kvcache's k=, v=). It depends on no Spec, only on the
cache's dtype, head dims and page size, so one build serves every forward spec of the cache.
"""

from __future__ import annotations

import dataclasses

from attngen import hw
from attngen.spec import HEAD_DIMS, KV_DTYPES, MAX_PAGE_SIZE, PAGE_SIZE_STEP, SpecError
from attngen.kernels.common.plan import COMPILE_FLAGS



# -- the KV-cache append (flash_attn_with_kvcache's k=, v=; docs/interfaces.md) -------------------
APPEND_ROWS = 8  # appended rows of one KV head per append block: 8 x 128 columns is one 16-byte store per thread
APPEND_THREADS = 128


@dataclasses.dataclass(frozen=True)
class AppendPlan:
    """The append companion kernel's numbers: it copies the new keys and values k, v
    [batch, seqlen_new, kv_heads, D(v)] into a paged cache [num_pages, page_size, kv_heads, D(v)]
    at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, through the block table
    (a dense cache is appended through its page view, as the forward reads it). No Spec: the
    kernel depends only on these fields, so one build serves every forward spec of the cache."""

    dtype: str
    head_dim: int
    head_dim_v: int
    page_size: int
    kv_dtype: str | None = None  # an e4m3 cache: new keys and values quantized by the page's descales
    rows: int = APPEND_ROWS
    threads: int = APPEND_THREADS
    compile_flags: tuple = COMPILE_FLAGS
    shape: None = None  # always dynamic (the runtime's cache entries read plan.shape)

    @property
    def name(self) -> str:
        dv = f"_dv{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        kv8 = "_kv8" if self.kv_dtype else ""
        return f"fa3_kvappend_hd{self.head_dim}{dv}_{hw.DTYPES[self.dtype].tag}_page{self.page_size}{kv8}"


def append_plan(dtype: str, head_dim: int, head_dim_v: int, page_size: int, kv_dtype: str | None = None) -> AppendPlan:
    """The append kernel of a cache: its dtype (the new keys'), head dims (the spec's HEAD_DIMS), page
    size (the spec's page rule) and, for an fp8 cache, kv_dtype (the cache's: the spec's KV_DTYPES).
    SpecError naming the value otherwise; callers validate tensors first."""
    if dtype not in hw.HALF_DTYPES:
        raise SpecError("dtype", dtype, f"expected one of {', '.join(hw.HALF_DTYPES)} (the new keys' and values')")
    if kv_dtype == dtype:
        kv_dtype = None
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise SpecError("kv_dtype", kv_dtype, f"expected {' or '.join(KV_DTYPES)} (an fp8 cache) or {dtype}, the new keys' dtype")
    for field, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if type(value) is not int or value not in HEAD_DIMS:
            raise SpecError(field, value, f"expected one of {', '.join(map(str, HEAD_DIMS))}")
    if type(page_size) is not int or not (PAGE_SIZE_STEP <= page_size <= MAX_PAGE_SIZE and page_size % PAGE_SIZE_STEP == 0):
        raise SpecError("page_size", page_size, f"expected a multiple of {PAGE_SIZE_STEP} from {PAGE_SIZE_STEP} to {MAX_PAGE_SIZE}")
    return AppendPlan(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size, kv_dtype=kv_dtype)
