"""The persistent forward on a Hopper GPU (skipped without one): bit-identical to the single-tile
kernel of the same tiles over successive calls (the counters' slots rotate and zero each other).
The timing rows are bench/persistent_gpu.py's.

    pytest -m gpu tests/test_gpu_persistent.py -s
"""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.kernels.fwd.plan import make_plan
from attngen.run import forward
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY


FORWARD_CASES = [({"causal": True}, (2, 16, 1000)), ({}, (1, 8, 777)),
                 ({"causal": True, "gqa_group": 4, "lse": True, "head_dim": 64}, (3, 8, 1500)),
                 ({"causal": True, "head_dim": 128, "dtype": "float8_e4m3fn"}, (2, 16, 1000))]
VARLEN_FIELDS = {"causal": True, "layout": "varlen", "lse": True}
BACKWARD_CASES = [({"causal": True}, (2, 16, 1000)), ({"causal": True, "deterministic": True}, (1, 8, 777))]


def pair_specs(fields) -> tuple:
    """The single-tile spec of the persistent one's tiles, and the persistent spec."""
    persistent = make_plan(attngen.Spec(**fields, scheduler="persistent"))
    return make_plan(attngen.Spec(**fields, block_n=persistent.spec.block_n)).spec, persistent.spec


def kernels() -> list:
    """Every forward spec these tests launch: the GPU check's build stage builds them first
    (bench/bench_gpu.py: gpu_test_keys), so the tests only load them."""
    from attngen.kernels.bwd.plan import autograd_spec

    specs = [s for fields, _ in FORWARD_CASES for s in pair_specs(fields)] + list(pair_specs(VARLEN_FIELDS))
    return specs + [make_plan(autograd_spec(attngen.Spec(**fields))).spec for fields, _ in BACKWARD_CASES]


def backward_kernels() -> list:
    """Every backward module's spec these tests launch (built first, as kernels())."""
    return [attngen.Spec(**fields, scheduler=s) for fields, _ in BACKWARD_CASES for s in ("single", "persistent")]


def pair(fields):
    return tuple(forward.compile_kernel(spec) for spec in pair_specs(fields))


def fp8_inputs(spec, *shapes, generator):
    """Standard normal values in the spec's dtype (fp8: rounded to e4m3), on the GPU."""
    return [torch.randn(*shape, device="cuda", generator=generator).to(getattr(torch, spec.dtype)) for shape in shapes]


@pytest.mark.parametrize("fields, shape", FORWARD_CASES)
def test_persistent_equals_single_tile_bit_for_bit_call_after_call(fields, shape):
    single, persistent = pair(fields)
    batch, heads, seq = shape
    spec = persistent.spec
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_shape = (batch, seq, heads // spec.gqa_group, spec.head_dim)
    q, k, v = fp8_inputs(spec, (batch, seq, heads, spec.head_dim), kv_shape, kv_shape, generator=g)
    want = single(q, k, v)
    for call in range(7):  # every counter slot used more than twice
        got = persistent(q, k, v, out=torch.full(q.shape, float("nan"), dtype=want[0].dtype if spec.lse else want.dtype,
                                                  device="cuda"))
        for a, b in zip(got if spec.lse else [got], want if spec.lse else [want]):
            assert torch.equal(a, b), call


@pytest.mark.parametrize("check", [True, False])  # False: the launcher reads cu_seqlens itself (a sync)
def test_persistent_varlen_equals_single_tile_bit_for_bit_call_after_call(check):
    single, persistent = pair(VARLEN_FIELDS)
    lengths, heads, dim = [1000, 1, 0, 129, 4000, 77], 16, persistent.spec.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths)}
    want = single(q, k, v, **kw)
    for call in range(7):  # every counter slot used more than twice
        got = persistent(q, k, v, out=torch.full_like(q, float("nan")), check=check, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), call


@pytest.mark.parametrize("fields, shape", BACKWARD_CASES)
def test_persistent_backward_equals_single_tile_call_after_call(fields, shape):
    """dK and dV (stored by one block) and the deterministic dQ bit for bit; the atomic dQ within a
    unit in the last place (its reduce-adds sum in the blocks' order on either kernel)."""
    from attngen.run import backward

    batch, heads, seq = shape
    fwd = forward.compile_kernel(make_plan(attngen.Spec(**fields, lse=True)))
    single, persistent = (backward.compile_backward(attngen.Spec(**fields, scheduler=s)) for s in ("single", "persistent"))
    dt = getattr(torch, fwd.spec.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, 128, device="cuda", dtype=dt, generator=g) for _ in range(4))
    out, lse = fwd(q, k, v)
    scale = 128 ** -0.5
    want = single.run(q, k, v, out, lse, dout, softmax_scale=scale)
    for call in range(5):  # the counters' slots rotate, shared with the forward's calls on the stream
        got = persistent.run(q, k, v, out, lse, dout, softmax_scale=scale)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), call
        if fields.get("deterministic"):
            assert torch.equal(got[0], want[0]), call
        else:
            torch.testing.assert_close(got[0], want[0], rtol=2 ** -9, atol=1e-3)
