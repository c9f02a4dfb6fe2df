"""The persistent forward on a Hopper GPU (skipped without one): bit-identical to the single-tile
kernel of the same tiles over successive calls (the counters' slots rotate and zero each other).
The timing rows are the GPU benchmark's (bench/bench_pairs.py).

    pytest -m gpu tests/test_gpu_persistent.py -s
"""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.kernels.fwd.plan import make_plan
from attngen.run import forward
from attngen.run.checks import out_torch_dtype
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY


FORWARD = [({"causal": True}, (2, 16, 1000)), ({}, (1, 8, 777)),
           ({"causal": True, "gqa_group": 4, "lse": True, "head_dim": 64}, (3, 8, 1500)),
           ({"causal": True, "dtype": "float8_e4m3fn"}, (2, 16, 1000))]  # fp8: descales absent (ones)
VARLEN = {"causal": True, "layout": "varlen", "lse": True}
PAGED = {"causal": True, "paged_kv": True, "lse": True}
BACKWARD = [({"causal": True}, (2, 16, 1000)), ({"causal": True, "deterministic": True}, (1, 8, 777)),
            ({"causal": True, "layout": "varlen"}, (1, 16, [1000, 1, 0, 129, 4000, 77]))]  # varlen: its lengths


def specs(fields):
    """The single-tile spec with the persistent plan's block_n, and the persistent one."""
    persistent = make_plan(attngen.Spec(**fields, scheduler="persistent"))
    return make_plan(attngen.Spec(**fields, block_n=persistent.spec.block_n)).spec, persistent.spec


# every kernel these tests launch, as (spec, backward): the GPU check prebuilds them (bench_gpu.gpu_test_keys)
KERNELS = [(s, False) for fields, _ in FORWARD for s in specs(fields)] + [(s, False) for s in specs(VARLEN) + specs(PAGED)]
KERNELS += [(attngen.Spec(**fields, lse=True), False) for fields, _ in BACKWARD]
# the backward's: its persistent module (True), and the single-tile twin of its tiles ("twin": bwd/plan.single_tile_twin)
KERNELS += [(attngen.Spec(**fields, scheduler="persistent"), True) for fields, _ in BACKWARD]
KERNELS += [(attngen.Spec(**fields), "twin") for fields, _ in BACKWARD]


def pair(fields):
    return tuple(forward.compile_kernel(make_plan(s)) for s in specs(fields))


@pytest.mark.parametrize("fields, shape", FORWARD)
def test_persistent_equals_single_tile_bit_for_bit_call_after_call(fields, shape):
    single, persistent = pair(fields)
    batch, heads, seq = shape
    spec = persistent.spec
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, spec.dtype)  # fp8: standard normal values rounded to e4m3 (torch has no fp8 randn)
    q = torch.randn(batch, seq, heads, spec.head_dim, device="cuda", generator=g).to(dt)
    k, v = (torch.randn(batch, seq, heads // spec.gqa_group, spec.head_dim, device="cuda", generator=g).to(dt)
            for _ in range(2))
    want = single(q, k, v)
    for call in range(7):  # every counter slot used more than twice
        got = persistent(q, k, v, out=torch.full(q.shape, float("nan"), dtype=out_torch_dtype(persistent.plan),
                                                  device="cuda"))
        for a, b in zip(got if spec.lse else [got], want if spec.lse else [want]):
            assert torch.equal(a, b), call


@pytest.mark.parametrize("check", [True, False])  # False: no host check of cu_seqlens; the tile list is built on the device either way
def test_persistent_varlen_equals_single_tile_bit_for_bit_call_after_call(check):
    single, persistent = pair(VARLEN)
    lengths, heads, dim = [1000, 1, 0, 129, 4000, 77], 16, persistent.spec.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths)}
    want = single(q, k, v, **kw)
    for call in range(7):  # every counter slot used more than twice
        got = persistent(q, k, v, out=torch.full_like(q, float("nan")), check=check, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), call


def test_persistent_paged_equals_single_tile_bit_for_bit_call_after_call():
    """A paged cache (pages in a shuffled order) with bshd queries: the list comes from seqused_k on the device."""
    single, persistent = pair(PAGED)
    used, heads, dim, page = [1000, 1, 0, 129, 4000, 77], 16, persistent.spec.head_dim, persistent.spec.page_size
    pages = -(-max(used) // page)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(len(used), 640, heads, dim, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(len(used) * pages, page, heads, dim, device="cuda", dtype=torch.float16, generator=g)
            for _ in range(2))
    table = torch.randperm(len(used) * pages, device="cuda", generator=g).to(torch.int32).view(len(used), pages)
    kw = {"block_table": table, "seqused_k": torch.tensor(used, device="cuda", dtype=torch.int32)}
    want = single(q, k, v, **kw)
    for call in range(7):  # every counter slot used more than twice
        got = persistent(q, k, v, out=torch.full_like(q, float("nan")), **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), call


@pytest.mark.parametrize("fields, shape", BACKWARD)
def test_persistent_backward_equals_single_tile_call_after_call(fields, shape):
    """dK and dV (stored by one block) and the deterministic dQ bit for bit; the atomic dQ within a
    unit in the last place (its reduce-adds sum in the blocks' order on either kernel)."""
    from attngen.kernels.bwd.plan import single_tile_twin
    from attngen.run import backward

    batch, heads, seq = shape
    fwd = forward.compile_kernel(make_plan(attngen.Spec(**fields, lse=True)))
    single = backward.compile_backward(single_tile_twin(attngen.Spec(**fields)))
    persistent = backward.compile_backward(attngen.Spec(**fields, scheduler="persistent"))
    dt = getattr(torch, fwd.spec.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = (sum(seq),) if isinstance(seq, list) else (batch, seq)  # varlen: packed rows
    q, k, v, dout = (torch.randn(*rows, heads, 128, device="cuda", dtype=dt, generator=g) for _ in range(4))
    kw, call_kw = {}, {}
    if isinstance(seq, list):  # the backward takes the forward's checked call
        from attngen.run import serving

        cu = torch.tensor([0] + seq, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(seq)}
        call_kw = {"call": serving.check_serving(fwd.plan, q, k, v, **kw)}
    out, lse = fwd(q, k, v, **kw)
    scale = 128 ** -0.5
    want = single.run(q, k, v, out, lse, dout, softmax_scale=scale, **call_kw)
    for call in range(5):  # the counters' slots rotate, shared with the forward's calls on the stream
        got = persistent.run(q, k, v, out, lse, dout, softmax_scale=scale, **call_kw)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), call
        if fields.get("deterministic"):
            assert torch.equal(got[0], want[0]), call
        else:
            torch.testing.assert_close(got[0], want[0], rtol=2 ** -9, atol=1e-3)
