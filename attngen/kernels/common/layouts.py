"""Where a serving layout puts its rows: the tensor shapes of dense (bshd), packed (varlen) and
paged layouts, shared by the forward, the combine and the backward kernels.
"""

from __future__ import annotations






def q_shape(plan, dim: str = "HEAD_DIM") -> list:
    return ["total_q", "heads", dim] if plan.varlen else ["batch", "q_len", "heads", dim]


def kv_shape(plan, dim: str) -> list:
    if plan.page_size:
        return ["num_pages", "PAGE_SIZE", "kv_heads", dim]
    return ["total_k", "kv_heads", dim] if plan.varlen else ["batch", "kv_len", "kv_heads", dim]


def lse_shape(plan) -> list:
    return ["heads", "total_q"] if plan.varlen else ["batch", "heads", "q_len"]
