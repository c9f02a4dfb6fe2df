"""Serving kernels on a Hopper GPU (docs/serving.md): varlen, paged KV and split-KV calls through
attngen.attention, each sequence against the fp64 reference (serving.check_serving_close).

Skipped without a CUDA 9.0 device. The output buffer is poisoned with NaN, so a row the kernels
never wrote fails.
"""

from __future__ import annotations

import pytest
import torch

from attngen.run import checks, forward, runtime
from attngen.reference.serving import check_serving_close, random_serving_inputs
from attngen.run.serving import check_serving
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY

# (layout, paged, head_dim, gqa_group, causal, num_splits, seq_lens_q, seq_lens_k): the three presets' shapes
CASES = [
    ("varlen", False, 128, 1, True, None, [1, 0, 127, 129, 300], [1, 5, 127, 129, 300]),
    ("bshd", True, 128, 8, True, "auto", [1] * 4, [4097, 0, 1, 300]),
    ("bshd", True, 128, 8, True, 7, [1] * 3, [1000, 129, 2]),
    ("varlen", True, 64, 1, True, None, [3, 0, 200, 1], [700, 5, 190, 128]),
]


def cuda_inputs(x, dtype):
    t = {n: torch.from_numpy(a).cuda() for n, a in (("q", x.q), ("k", x.k), ("v", x.v))}
    t = {n: a.to(getattr(torch, dtype)) for n, a in t.items()}
    kw = {n: torch.from_numpy(a).cuda() if hasattr(a, "dtype") else a for n, a in x.keywords.items()}
    return t["q"], t["k"], t["v"], kw


@pytest.mark.parametrize("layout, paged, hd, group, causal, num_splits, lq, lk", CASES)
def test_serving_call_matches_the_reference_per_sequence(layout, paged, hd, group, causal, num_splits, lq, lk):
    kv_heads = 2
    x = random_serving_inputs(layout, paged, 128 if paged else None, "bfloat16", hd, None, lq, lk, kv_heads * group,
                              kv_heads, seed=1, neighbour_fill=1e4)
    q, k, v, kw = cuda_inputs(x, "bfloat16")
    out = torch.full((*q.shape[:-1], hd), float("nan"), dtype=q.dtype, device="cuda")
    res_out, lse = runtime.attention(q, k, v, causal=causal, out=out, return_lse=True, num_splits=num_splits, **kw)
    torch.cuda.synchronize()
    checks.check_written(res_out)
    plan = forward.compile_kernel(runtime.spec_for(q, k, causal=causal, lse=True, num_splits=num_splits,
                                                   cu_seqlens_q=kw.get("cu_seqlens_q"), block_table=kw.get("block_table")))
    call = check_serving(plan.plan, x.q, x.k, x.v, num_splits=num_splits if plan.serving.split else None, **x.keywords)
    res = check_serving_close(res_out.cpu(), x.q, x.k, x.v, call, causal, "bfloat16", lse=lse.cpu())
    assert res.ok, str(res)
