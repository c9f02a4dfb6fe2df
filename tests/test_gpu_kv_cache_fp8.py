"""The fp8 KV cache on an sm_90 GPU (docs/fp8-kv-cache.md): the compiled kernels against the fp64
reference on the dequantized cache, as tests/test_kv_cache_fp8.py holds the CPU model. Skipped
without a compute capability 9.0 device (written without one: not yet run on silicon)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attngen
from attngen.hw import E4M3
from attngen.interfaces.flash_attn_interface import flash_attn_with_kvcache
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.kv_cache import dequantize, quantize, random_descales
from attngen.reference.serving import check_serving_close, random_serving_inputs
from attngen.run.serving import check_serving
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY
FP8 = getattr(torch, E4M3)


CASES = [("bfloat16", False, "auto", 8), ("float16", True, 1, 4)]


def call_spec(dtype, causal, splits, group, kv_heads=2, page=64):
    """The spec attngen.attention resolves for a case's call (runtime.call_spec on meta tensors)."""
    from attngen.run.runtime import call_spec as resolve

    q = torch.empty(4, 3, group * kv_heads, 128, dtype=getattr(torch, dtype), device="meta")
    cache = torch.empty(32, page, kv_heads, 128, dtype=FP8, device="meta")
    table = torch.empty(4, 16, dtype=torch.int32, device="meta")
    return resolve(q, cache, cache, {}, causal=causal, block_table=table, num_splits=None if splits == 1 else "auto")


KERNELS = [(call_spec(*case), False) for case in CASES]  # the GPU check prebuilds them (bench_gpu.gpu_test_keys)


@pytest.mark.parametrize("dtype, causal, splits, group", CASES)
def test_a_paged_fp8_cache_matches_the_reference_per_sequence(dtype, causal, splits, group):
    kv_heads, page = 2, 64
    x = random_serving_inputs("bshd", True, page, dtype, 128, 128, [3] * 4, [1000, 333, 64, 5], group * kv_heads,
                              kv_heads, seed=5, neighbour_fill=1e4)
    kd, vd = random_descales(x.k.shape[0], kv_heads, seed=6)
    k8, v8 = quantize(x.k, kd), quantize(x.v, vd)
    cuda = {n: torch.from_numpy(a).cuda() for n, a in (("block_table", x.block_table), ("seqused_k", x.seqused_k),
                                                        ("k_descale", kd), ("v_descale", vd))}
    q = torch.from_numpy(x.q).to(getattr(torch, dtype)).cuda()
    num_splits = None if splits == 1 else "auto"
    out = attngen.attention(q, torch.from_numpy(k8).to(FP8).cuda(), torch.from_numpy(v8).to(FP8).cuda(),
                            causal=causal, num_splits=num_splits, **cuda)
    plan = make_plan(attngen.Spec(head_dim=128, dtype=dtype, gqa_group=group, causal=causal, paged_kv=True,
                                  page_size=page, splits=splits, kv_dtype=E4M3))
    call = check_serving(plan, x.q, k8, v8, block_table=x.block_table, seqused_k=x.seqused_k)
    res = check_serving_close(out.float().cpu(), x.q, dequantize(k8, kd), dequantize(v8, vd), call, causal, dtype)
    assert res.ok, res


def test_flash_attn_with_kvcache_appends_into_an_fp8_cache_on_the_gpu():
    g = torch.Generator().manual_seed(3)
    batch, kv_heads, page, pages = 3, 2, 64, 16
    k_cache = (torch.randn(pages, page, kv_heads, 128, generator=g) * 2).to(FP8).cuda()
    v_cache = (torch.randn(pages, page, kv_heads, 128, generator=g) * 2).to(FP8).cuda()
    table = torch.randperm(pages, generator=g)[:batch * 4].reshape(batch, 4).to(torch.int32).cuda()
    seqlens = torch.tensor([0, 100, 200], dtype=torch.int32).cuda()
    kd, vd = ((torch.rand(batch, kv_heads, generator=g) + 0.5).cuda() for _ in range(2))
    q = torch.randn(batch, 1, 8, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(batch, 1, kv_heads, 128, generator=g).bfloat16().cuda() for _ in range(2))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, page_table=table,
                                  k_descale=kd, v_descale=vd)
    from attngen.reference.forward import check_close

    for b in range(batch):
        pos = int(seqlens[b])
        p, row = int(table[b, pos // page]), pos % page
        want = quantize(k[b, 0].float().cpu().numpy()[None, None], kd[b:b + 1].cpu().numpy())[0, 0]
        assert np.array_equal(k_cache[p, row].float().cpu().numpy(), want)
        rows = table[b].tolist()
        kb, vb = (dequantize(c[rows].float().cpu().reshape(-1, kv_heads, 128)[:pos + 1].numpy()[None], d[b:b + 1].cpu().numpy())
                  for c, d in ((k_cache, kd), (v_cache, vd)))
        res = check_close(out[b:b + 1].float().cpu().numpy(), q[b:b + 1].float().cpu().numpy(), kb, vb, False, dtype="bfloat16")
        assert res.ok, (b, res)
