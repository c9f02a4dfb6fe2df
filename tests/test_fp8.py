"""fp8 forward (issue 29, e4m3 Q, K and V): the spec, the plan, the emitted kernel on the CPU model
against the fp8 tolerance rule, and the refusals (docs/fp8.md)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attngen
from attngen.emulator.driver import check_emulated
from attngen.hw import E4M3
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.common import contract
from attngen.kernels.fwd import render as fwd
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec, SpecError

FP8 = {"dtype": E4M3}


# -- the spec ------------------------------------------------------------------------------------
def test_fp8_is_a_dtype_and_its_output_is_bfloat16_unless_float16_is_asked():
    plan = make_plan(Spec(**FP8))
    assert plan.fp8 and plan.spec.out_dtype == "bfloat16" and "_e4m3_obf16_" in plan.name
    half = make_plan(Spec(**FP8, out_dtype="float16"))
    assert half.spec.out_dtype == "float16" and "_e4m3_of16_" in half.name and half.hash != plan.hash


def test_sixteen_bit_specs_keep_their_names_and_hashes():
    """out_dtype left out or equal to the dtype: the same spec as before the field existed."""
    for dtype in ("float16", "bfloat16"):
        a, b = make_plan(Spec(dtype=dtype)), make_plan(Spec(dtype=dtype, out_dtype=None))
        assert a.name == b.name and a.hash == b.hash and not a.fp8
        assert "out_dtype" not in a.spec.canonical_dict()


@pytest.mark.parametrize("fields, field, words", [
    ({"dtype": "float8_e5m2"}, "dtype", "float8_e4m3fn"),
    ({"out_dtype": "bfloat16"}, "out_dtype", "16-bit kernel writes O in its input dtype"),
    ({**FP8, "out_dtype": "float32"}, "out_dtype", "16-bit"),
    ({**FP8, "splits": 2}, "splits", "fp8 runs unsplit"),
    ({**FP8, "paged_kv": True}, "paged_kv", "paged cache"),
    ({**FP8, "block_n": 48}, "block_n", "32 per fp8 wgmma"),
])
def test_what_fp8_does_not_take_is_refused_naming_the_field(fields, field, words):
    with pytest.raises(SpecError) as info:
        make_plan(Spec(**fields))
    assert info.value.field == field and words in str(info.value)
    assert "\n" not in str(info.value)


def test_the_backward_is_refused():
    with pytest.raises(SpecError, match="fp8 has no backward: train in 16 bits"):
        plan_backward(Spec(**FP8))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_the_tile_starts_from_fa3s_and_fits_the_budgets(head_dim):
    """FA3's fp8 block_n (tile_size.h) or the largest multiple of 32 below it that the plan's register
    and shared-memory budgets admit (P and V^T in shared memory counted)."""
    from attngen.kernels.fwd.plan import FA3_FP8_BLOCK_N, regs_needed
    from attngen.hw import SMEM_PER_BLOCK

    plan = make_plan(Spec(head_dim=head_dim, **FP8))
    bn = plan.spec.block_n
    assert bn <= FA3_FP8_BLOCK_N[head_dim] and bn % 32 == 0
    assert {"P", "Vt"} <= set(plan.smem) and plan.smem_bytes <= SMEM_PER_BLOCK
    assert plan.consumer_regs_needed <= plan.consumer_regs
    bigger = bn + 32
    if bigger <= FA3_FP8_BLOCK_N[head_dim]:  # the next candidate up breaks a budget
        from attngen.kernels.fwd.plan import smem_layout
        assert regs_needed(plan.spec, bigger) > plan.consumer_regs or sum(smem_layout(plan.spec, bigger).values()) > SMEM_PER_BLOCK


def test_the_fp8_template_receives_what_it_declares():
    for fields in ({}, {"causal": True, "lse": True, "sinks": True}, {"softcap": 30.0, "gqa_group": 2}):
        plan = make_plan(Spec(**FP8, **fields))
        assert contract.contract_errors(fwd.TEMPLATE, fwd.template_context(plan)) == []


def test_the_emitted_kernel_has_both_gemms_on_shared_memory_k_major():
    source = attngen.render_source(make_plan(Spec(**FP8, causal=True)))
    assert "p_reg" not in source
    assert source.count("T.wgmma_gemm(P_shared[g, :, :], Vt_shared[") == 2  # the steady loop's and the epilogue's
    assert "Vt_shared[v_stage, d, c * TRANSPOSE_KEYS + j] = V_shared[v_stage, c * TRANSPOSE_KEYS + j, d]" in source
    assert "+ MAX_OFFSET)" in source


# -- the emitted kernel on the CPU model ---------------------------------------------------------------
VARIANTS = [
    {},
    {"causal": True},
    {"causal": True, "lse": True, "gqa_group": 2},
    {"window": (40, 8)},
    {"softcap": 20.0, "sinks": True, "lse": True},
    {"alibi": True, "causal": True},
    {"score_mod": "score + 0.1 * (q_idx - kv_idx) / 64", "mask_mod": "kv_idx <= q_idx + 16"},
    {"head_dim_v": 128},
    {"consumers": 1},
    {"consumers": 3, "causal": True},
]


@pytest.mark.parametrize("fields", VARIANTS, ids=lambda f: ",".join(f) or "plain")
def test_emitted_fp8_kernel_passes_the_fp8_rule_on_the_cpu_model(fields):
    plan = make_plan(Spec(head_dim=64, **FP8, **fields))
    ok, text, stats = check_emulated(plan, 1, 2 * plan.spec.gqa_group, 2, 70, 333, seed=1)
    assert ok, text
    assert stats.wgmma > 0


@settings(max_examples=6, deadline=None)
@given(fields=st.sampled_from(VARIANTS[:6]), q_len=st.integers(1, 140), kv_len=st.integers(1, 400),
       seed=st.integers(0, 2**16), policy=st.sampled_from(["random", "producer-first", "consumers-first"]))
def test_drawn_fp8_specs_shapes_descales_and_schedules_pass(fields, q_len, kv_len, seed, policy):
    plan = make_plan(Spec(head_dim=64, **FP8, **fields))
    ok, text, _ = check_emulated(plan, 1, 2 * plan.spec.gqa_group, 2, q_len, kv_len, seed=seed, policy=policy)
    assert ok, text


def test_descales_left_out_are_ones():
    rng = np.random.default_rng(3)
    plan = make_plan(Spec(head_dim=64, **FP8))
    q, k, v = (rng.standard_normal((1, n, 2, 64)).astype(np.float32) for n in (70, 100, 100))
    ones = np.ones((1, 2), np.float32)
    a = attngen.emulate(plan, q, k, v)
    b = attngen.emulate(plan, q, k, v, q_descale=ones, k_descale=ones, v_descale=ones)
    assert np.array_equal(a, b)
    c = attngen.emulate(plan, q, k, v, v_descale=2 * ones)
    assert np.array_equal(c, 2 * a)  # a power of two: exact in bfloat16
