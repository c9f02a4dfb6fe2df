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
    ({**FP8, "v_stages": 1}, "v_stages", "two V tiles"),
    ({**FP8, "layout": "varlen", "consumers": 3}, "consumers", "spills"),
])
def test_what_fp8_does_not_take_is_refused_naming_the_field(fields, field, words):
    with pytest.raises(SpecError) as info:
        make_plan(Spec(**fields))
    assert info.value.field == field and words in str(info.value)
    assert "\n" not in str(info.value)


# Built with ptxas (docs/hw-measurements.md, "FP8_PRODUCER_SPILL_TILES"): the first of each pair
# spilled in its V-transposing producer, the second (the same spec at the next block_n) did not.
GQA8_3C = dict(head_dim=128, causal=True, gqa_group=8, consumers=3, k_stages=2, v_stages=3, **FP8)
HD64_2C = dict(head_dim=64, causal=True, consumers=2, k_stages=2, v_stages=4, pingpong=False, **FP8)
HD64_3C = dict(head_dim=64, causal=True, gqa_group=4, consumers=3, k_stages=2, v_stages=2, **FP8)


@pytest.mark.parametrize("spilled, clean, fits", [
    ({**GQA8_3C, "block_n": 64}, {**GQA8_3C, "block_n": 96}, "block_n in [32, 96] fits"),
    ({**HD64_2C, "block_n": 128}, {**HD64_2C, "block_n": 160}, "block_n in [32, 64, 160] fits"),
    ({**HD64_3C, "block_n": 128}, {**HD64_3C, "block_n": 96}, "block_n in [32, 64, 96] fits"),
])
def test_a_tile_whose_producer_spilled_is_refused_and_its_neighbour_is_not(spilled, clean, fits):
    with pytest.raises(SpecError) as info:
        make_plan(Spec(**spilled))
    assert info.value.field == "block_n" and info.value.value == spilled["block_n"]
    assert "producer" in str(info.value) and fits in str(info.value) and "\n" not in str(info.value)
    assert make_plan(Spec(**clean)).spec.block_n == clean["block_n"]


def test_the_producer_spill_is_causal_only_where_it_was_measured_so():
    """hd128 with 3 consumers at block_n 64 built clean without the causal mask (and with a window)."""
    assert make_plan(Spec(**{**GQA8_3C, "causal": False, "block_n": 64})).spec.block_n == 64
    assert make_plan(Spec(**{**HD64_3C, "causal": False, "block_n": 128})).spec.block_n == 128


def test_the_default_skips_a_tile_whose_producer_spilled():
    """hd64 causal with 3 consumers took 128 (8 B spilled in the producer): now 96, which built clean."""
    assert make_plan(Spec(**{**HD64_3C, "block_n": None})).spec.block_n == 96


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
    assert "Vt_shared[t_stage, d, c * TRANSPOSE_KEYS + j] = V_shared[t_stage, c * TRANSPOSE_KEYS + j, d]" in source
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
    {"block_mask": True, "mask_mod": "kv_idx <= q_idx"},
    {"layout": "varlen", "causal": True, "lse": True},  # a ragged batch; descales per sequence
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


# -- the CPU model: fp8 wgmma as Hopper runs it, the transpose in the race detector ------------------
def _fp8_inputs(plan, q_len=70, kv_len=333, seed=0):
    from attngen.reference.forward import random_inputs
    return random_inputs(E4M3, 64, 1, 2, 2, q_len, kv_len, seed)


def test_an_fp8_gemm_on_an_operand_that_is_not_k_major_is_refused():
    """V as [keys, dim] is not K-major for PV: Hopper has no such fp8 wgmma (TileLang would fall back to mma.sync)."""
    from attngen.emulator import EmulationError

    plan = make_plan(Spec(head_dim=64, **FP8))
    source = attngen.render_source(plan)
    wrong = source.replace("T.wgmma_gemm(P_shared[g, :, :], Vt_shared[v_stage_last, :, :], acc_o, transpose_B=True,",
                           "T.wgmma_gemm(P_shared[g, :, :], V_shared[v_stage_last, :, :], acc_o,")
    assert wrong != source
    q, k, v = _fp8_inputs(plan)
    with pytest.raises(EmulationError, match="fp8 wgmma reads both operands K-major.*not transposed"):
        attngen.emulate(plan, q, k, v, source=wrong)


def test_the_fp8_wgmma_takes_exact_e4m3_inputs_and_accumulates_in_fp32():
    """One tile, every descale 1: P_shared holds e4m3 values and the output is their float32 product
    with V, divided by the float32 row sum, then rounded to bfloat16; nothing rounds in between."""
    from attngen.reference.forward import attention_lowprec

    plan = make_plan(Spec(head_dim=64, **FP8))
    q, k, v = _fp8_inputs(plan, q_len=64, kv_len=160, seed=5)
    out = attngen.emulate(plan, q, k, v)
    twin = attention_lowprec(q, k, v, False, E4M3, block_n=plan.spec.block_n)
    assert np.array_equal(out, twin)  # the same roundings, bit for bit
    assert not np.array_equal(out, attention_lowprec(q, k, v, False, E4M3, block_n=plan.spec.block_n, twin={"offset": 0}))


FP8_SWEEP = [("random", s) for s in range(3)] + [("producer-first", 0), ("consumers-first", 0)]
VT_WAIT = ("            T.mbarrier_wait_parity(vt_full[v_stage_prev], ((k - 1) // V_STAGES) % 2)"
           "  # V^T of that tile is in shared memory\n")
PV_STEADY = ("            T.wgmma_gemm(P_shared[g, :, :], Vt_shared[v_stage_prev, :, :], acc_o, transpose_B=True, policy=POLICY, "
             "clear_accum=False)  # delayed PV of tile k-1\n")
TRANSPOSE_FENCE = ("                        T.fence_proxy_async()"
                   "  # the generic-proxy stores must be visible to the consumers' wgmma reads\n")
V_LANDED = "                        T.mbarrier_wait_parity(v_full[t_stage], ((k - 1) // V_STAGES) % 2)  # V tile k - 1 landed\n"
P_FENCE = "            T.fence_proxy_async()  # these stores must be visible to the next PV's async-proxy reads...\n"

FP8_HAZARDS = {
    # the consumer reads the transposed tile before its barrier says the producer wrote it
    "vt_read_before_its_barrier": ([(VT_WAIT + PV_STEADY, PV_STEADY + VT_WAIT)], ("Vt_shared[",)),
    # the producer transposes a V tile whose TMA load has not landed
    "transpose_before_v_landed": ([(V_LANDED, "")], ("V_shared[",)),
    # the transposed tile's generic stores reach the wgmma's async proxy without a fence
    "transpose_fence_missing": ([(TRANSPOSE_FENCE, "")], ("Vt_shared[", "fence_proxy_async")),
    # P's stores likewise
    "p_fence_missing": ([(P_FENCE, "")], ("P_shared[", "fence_proxy_async")),
}


def _race_in_every_schedule(plan, source, broken, words, q, k, v):
    """The unmodified kernel runs clean and the broken one is reported, naming `words`, in every schedule."""
    from attngen.emulator import HazardError

    for policy, seed in FP8_SWEEP:
        attngen.emulate(plan, q, k, v, source=source, policy=policy, seed=seed)  # the unmodified kernel: no report
        with pytest.raises(HazardError) as info:
            attngen.emulate(plan, q, k, v, source=broken, policy=policy, seed=seed)
        for w in words:
            assert w in info.value.report, f"{policy} seed {seed}:\n{info.value.report}"


@pytest.mark.parametrize("name", FP8_HAZARDS)
def test_an_fp8_race_is_reported_in_every_schedule(name):
    plan = make_plan(Spec(head_dim=64, **FP8, causal=True))
    source = attngen.render_source(plan)
    edits, words = FP8_HAZARDS[name]
    broken = source
    for old, new in edits:
        assert old in broken, old
        broken = broken.replace(old, new)
    q, k, v = _fp8_inputs(plan, 130, 700)
    _race_in_every_schedule(plan, source, broken, words, q, k, v)


# -- the SASS census and `attngen check`'s verdict --------------------------------------------------------
PLANTED_SASS = """
        /*0a10*/                   QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0a20*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR8], R88, gsb0 ;
        /*0a30*/                   QGMMA.64x128x32.F32.E5M2.E5M2 R88, gdesc[UR8], R88, gsb0 ;
        /*0a40*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0a50*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
"""


def test_the_census_counts_qgmma_by_element_type_and_hmma():
    from attngen.build.nvcc import mma_census
    assert mma_census(PLANTED_SASS) == {"QGMMA": 3, "QGMMA_E4M3": 2, "QGMMA_E5M2": 1, "HMMA": 1}


def _report(**sass):
    base = {"HGMMA": 0, "HGMMA_A_FROM_REGISTERS": 0, "LDL": 0, "STL": 0, "QGMMA": 40, "QGMMA_E4M3": 40, "HMMA": 0}
    return {"sass": {**base, **sass}, "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_frame_bytes": 0,
            "setmaxnreg_applied": True, "dynamic_smem_bytes": 1, "plan_smem_bytes": 1}


def test_check_fails_an_fp8_kernel_whose_gemms_run_as_hmma():
    from attngen.build.nvcc import mma_census
    from attngen.cli.build import build_verdicts

    def gemm_verdict(report):
        return [ok for ok, what in build_verdicts(report, fp8=True) if "QGMMA" in what][0]

    assert gemm_verdict(_report())
    fallback = mma_census(PLANTED_SASS.replace("QGMMA.64x128x32.F32.E4M3.E4M3", "HMMA.16816.F32.BF16"))
    assert not gemm_verdict(_report(**fallback))  # one GEMM fell back to mma.sync
    assert not gemm_verdict(_report(QGMMA=0, QGMMA_E4M3=0, HGMMA=40))  # a 16-bit wgmma is not fp8


# -- the tolerance rule: FA3's shape plus the tile-exact twin; each way a kernel can be wrong fails it ------
ROUND_P = "for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n{0}    acc_s[i, j] = T.float8_e4m3fn(acc_s[i, j])\n{0}"
ROW_SUM_ROUNDED = [("            T.reduce_sum(acc_s, row_sum_tile, dim=1)\n",  # the steady loop's tiles
                    "            " + ROUND_P.format(" " * 12) + "T.reduce_sum(acc_s, row_sum_tile, dim=1)\n"),
                   ("        T.reduce_sum(acc_s, row_sum, dim=1)",  # the prologue's
                    "        " + ROUND_P.format(" " * 8) + "T.reduce_sum(acc_s, row_sum, dim=1)")]
WRONG_KERNELS = {
    "q_descale_ignored": [("softmax_scale * Q_descale[batch_idx, kv_head] * K_descale", "softmax_scale * K_descale")],
    "v_descale_ignored": [("v_descale = V_descale[batch_idx, kv_head]", "v_descale = 1.0")],
    "max_offset_missing": [(" + MAX_OFFSET)", ")")],
    "p_rounded_before_its_row_sum": ROW_SUM_ROUNDED,
    # with block_n = head_dim the tile's buffers have one shape: the copy runs, untransposed
    "v_used_untransposed": [("Vt_shared[t_stage, d, c * TRANSPOSE_KEYS + j] = V_shared[t_stage, c * TRANSPOSE_KEYS + j, d]",
                             "Vt_shared[t_stage, d, c * TRANSPOSE_KEYS + j] = V_shared[t_stage, d, c * TRANSPOSE_KEYS + j]")],
    "output_x1.05": [],
}


def _fp8_case(name, fields, q_len, kv_len, seed, scale, gap=None):
    """The emitted kernel (or a wrong one) on drawn e4m3 inputs and descales, held to the fp8 rule. `gap`:
    key 0 scores about `gap` nats above the others (a peaked row: the rest of its P is below 2**-6 without
    the max offset, where e4m3 is subnormal)."""
    from attngen.reference.forward import check_close, random_inputs, round_to

    plan = make_plan(Spec(head_dim=64, **FP8, block_n=64, **fields))
    rng = np.random.default_rng(seed)
    q, k, v = random_inputs(E4M3, 64, 1, 2, 2, q_len, kv_len, seed)
    descales = [(0.5 + rng.random((1, 2))).astype(np.float32) for _ in range(3)]
    if gap is not None:  # dimension 0 carries the peak: q . k0 gains 4 * b, the other keys nothing
        q[..., 0], k[:, :, :, 0] = 4.0, 0.0
        b = gap / (4.0 * scale * descales[0][0] * descales[1][0])
        k[:, 0, :, 0] = round_to(np.minimum(b, 448.0), E4M3)
    source = attngen.render_source(plan)
    for old, new in WRONG_KERNELS.get(name, []):
        assert old in source, old
        source = source.replace(old, new)
    out = attngen.emulate(plan, q, k, v, source=source, softmax_scale=scale,
                          **dict(zip(("q_descale", "k_descale", "v_descale"), descales)))
    if name == "output_x1.05":
        out = out * 1.05
    return check_close(out, q, k, v, plan.spec.causal, dtype=E4M3, scale=scale, descales=descales, block_n=64)


CASES = dict(fields=st.sampled_from([{}, {"causal": True}]), q_len=st.integers(1, 80), kv_len=st.integers(64, 260),
             seed=st.integers(0, 2**16), scale=st.sampled_from([0.25, 0.5, 1.0]))


@settings(max_examples=4, deadline=None)
@given(**CASES, gap=st.sampled_from([None, 5.0, 8.0]))
def test_the_kernel_passes_the_fp8_rule(fields, q_len, kv_len, seed, scale, gap):
    res = _fp8_case("correct", fields, q_len, kv_len, seed, scale, gap)
    assert res.ok, res


@pytest.mark.parametrize("name", WRONG_KERNELS)
@settings(max_examples=3, deadline=None)
@given(**{**CASES, "q_len": st.integers(16, 80)}, gap=st.sampled_from([None, 5.0, 6.5, 8.0]))
def test_each_wrong_kernel_fails_the_fp8_rule(name, fields, q_len, kv_len, seed, scale, gap):
    """Every edit shows on drawn inputs of 16 rows or more (in one row, a row sum of rounded P can stay
    within the output's last bit); the missing max offset only where some P falls below e4m3's normal
    range (2**-6) and matters to the sum: a peaked row (a `gap`), whose many small P the offset keeps.
    Without one (gap None) a missing offset can change nothing: 2**8 P rounds as P for normal values."""
    if name == "max_offset_missing" and gap is None:
        gap = 6.5
    res = _fp8_case(name, fields, q_len, kv_len, seed, scale, gap)
    assert not res.ok, res


def test_fa3s_clause_alone_passes_an_output_5_percent_off():
    """Why the rule has a second clause: e4m3's P is noisy (3 mantissa bits), and 2 x the twin's error
    covers a 5% scaling on this case (measured: FA3's clause err/bound 0.84, the twin's clause fails it)."""
    from attngen.reference import forward as reference

    res = _fp8_case("output_x1.05", {}, 70, 333, 2, 0.125)
    assert not res.ok
    saved = reference.TWIN_SHARE
    try:
        reference.TWIN_SHARE = float("inf")
        assert _fp8_case("output_x1.05", {}, 70, 333, 2, 0.125).ok
    finally:
        reference.TWIN_SHARE = saved


# -- the doors: attngen.attention (the torch op, its fake, torch.compile) and FA3's functions ----------------
def _torch_fp8(seed=0, q_len=70, kv_len=100, heads=2, kv_heads=2):
    import torch
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, 64, generator=g).to(torch.float8_e4m3fn)
               for n, h in ((q_len, heads), (kv_len, kv_heads), (kv_len, kv_heads)))
    descales = tuple(torch.rand(1, kv_heads, generator=g) * 2 for _ in range(3))
    return q, k, v, descales


def test_attention_takes_fp8_with_fa3s_descales_and_returns_bfloat16():
    import torch
    from attngen.reference.forward import check_close

    q, k, v, d = _torch_fp8()
    out = attngen.attention(q, k, v, causal=True, q_descale=d[0], k_descale=d[1], v_descale=d[2])
    assert out.dtype == torch.bfloat16 and out.shape == (1, 70, 2, 64)
    block_n = make_plan(Spec(head_dim=64, **FP8)).spec.block_n
    assert check_close(out, q, k, v, True, dtype=E4M3, descales=d, block_n=block_n).ok
    half = attngen.attention(q, k, v, causal=True, out_dtype="float16", q_descale=d[0], k_descale=d[1], v_descale=d[2])
    assert half.dtype == torch.float16 and torch.allclose(half.float(), out.float(), atol=2e-2)


def test_fa3s_functions_take_fp8_and_descales():
    import torch
    from attngen import flash_attn_interface as fa

    q, k, v, d = _torch_fp8(1, heads=4)
    kw = dict(q_descale=d[0], k_descale=d[1], v_descale=d[2], causal=True)
    dense = fa.flash_attn_func(q, k, v, **kw)
    cu_q, cu_k = torch.tensor([0, 70], dtype=torch.int32), torch.tensor([0, 100], dtype=torch.int32)
    packed = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 70, 100, **kw)
    assert dense.dtype == packed.dtype == torch.bfloat16
    assert torch.equal(dense[0], packed)  # one sequence: the same kernel arithmetic, packed or not
    assert not torch.equal(dense, fa.flash_attn_func(q, k, v, causal=True))  # the descales were used


def test_the_ops_fake_gives_fp8s_output_type_and_compile_has_no_graph_break():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, d = _torch_fp8(2)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = attngen.attention(fq, fk, fv, q_descale=mode.from_tensor(d[0]))
        assert fake.dtype == torch.bfloat16 and fake.shape == (1, 70, 2, 64)
        assert attngen.attention(fq, fk, fv, out_dtype="float16").dtype == torch.float16
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    f = torch.compile(lambda q, k, v, a, b, c: attngen.attention(q, k, v, q_descale=a, k_descale=b, v_descale=c),
                      fullgraph=True)
    assert torch.equal(f(q, k, v, *d), attngen.attention(q, k, v, q_descale=d[0], k_descale=d[1], v_descale=d[2]))
    assert not counters["graph_break"]


# -- v_layout = "transposed": V arrives as [batch, kv_heads, head_dim_v, kv_len] (FA3's V_colmajor) -------
def test_v_layout_is_fp8_only_and_named_only_when_set():
    assert make_plan(Spec(head_dim=64, **FP8)).name == make_plan(Spec(head_dim=64, v_layout="keys", **FP8)).name
    assert make_plan(Spec(head_dim=64, v_layout="transposed", **FP8)).name.endswith("_vtransposed")
    for fields, words in (({"v_layout": "transposed"}, "only an fp8 kernel"), ({"v_layout": "cols", **FP8}, '"transposed"'),
                          ({"v_layout": "transposed", "layout": "varlen", **FP8}, "bshd")):
        with pytest.raises(SpecError, match="v_layout") as e:
            Spec(**fields)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_transposed_v_is_landed_by_the_tma_with_no_transpose():
    src = fwd.render_source(Spec(head_dim=64, v_layout="transposed", **FP8))
    code = "\n".join(line.split("#")[0] for line in src.splitlines())  # comments may name what is gone
    assert "V_shared" not in code and "v_full" not in code and "TRANSPOSE_KEYS" not in code
    assert "V: T.Tensor([batch, kv_heads, HEAD_DIM, kv_len], DTYPE)" in src
    assert "Vt_shared[v_stage, :, :], barrier=vt_full[v_stage]" in src


@pytest.mark.parametrize("fields", [{"head_dim": 64}, {"head_dim": 64, "causal": True, "gqa_group": 2, "lse": True}])
def test_a_transposed_v_runs_bit_identically_to_the_transposing_kernel(fields):
    """The same values, V stored [dim, keys] per KV head: the CPU model gives the same bits as the kernel
    that transposes V in shared memory (kv_len a multiple of 16: TMA's 16-byte strides)."""
    keys = make_plan(Spec(block_n=64, **fields, **FP8))
    transposed = make_plan(Spec(block_n=64, v_layout="transposed", **fields, **FP8))
    from attngen.reference.forward import fa3_descale, random_inputs
    heads = 2 * keys.spec.gqa_group
    q, k, v = random_inputs(E4M3, 64, 1, heads, 2, 70, 336, 3)
    v_t = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    rng = np.random.default_rng(4)
    descales = {n: fa3_descale(rng, 1, 2) for n in ("q_descale", "k_descale", "v_descale")}
    a = attngen.emulate(keys, q, k, v, **descales)
    b = attngen.emulate(transposed, q, k, v_t, **descales)
    for x, y in zip(a if keys.spec.lse else [a], b if keys.spec.lse else [b]):
        assert np.array_equal(x, y)
    c = attngen.emulate(transposed, q, k, v_t[:, :, :, ::-1].copy(), **descales)  # keys reversed: must differ
    assert not np.array_equal(a[0] if keys.spec.lse else a, c[0] if keys.spec.lse else c)


@settings(max_examples=4, deadline=None)
@given(fields=st.sampled_from(VARIANTS[:6]), q_len=st.integers(1, 140), kv_tiles=st.integers(1, 25),
       seed=st.integers(0, 2**16), policy=st.sampled_from(["random", "producer-first", "consumers-first"]))
def test_drawn_transposed_v_specs_shapes_and_schedules_pass_and_match_the_transposing_kernel(fields, q_len, kv_tiles,
                                                                                             seed, policy):
    """Drawn variants, shapes, descales and schedules with V stored [dim, keys]: the fp8 rule holds, and the bits
    are the transposing kernel's. kv_len is a multiple of 16 (TMA's 16-byte strides)."""
    from attngen.emulator.driver import stored_v, variant_inputs
    keys = make_plan(Spec(head_dim=64, block_n=64, **FP8, **fields))
    transposed = make_plan(Spec(head_dim=64, block_n=64, v_layout="transposed", **FP8, **fields))
    shape = (1, 2 * keys.spec.gqa_group, 2, q_len, 16 * kv_tiles)
    ok, text, _ = check_emulated(transposed, *shape, seed=seed, policy=policy)
    assert ok, text
    q, k, v, tensors = variant_inputs(keys, *shape, seed)
    a = attngen.emulate(keys, q, k, v, policy=policy, seed=seed, **tensors)
    b = attngen.emulate(transposed, q, k, stored_v(transposed.spec, v), policy=policy, seed=seed, **tensors)
    for x, y in zip(a if keys.spec.lse else [a], b if keys.spec.lse else [b]):
        assert np.array_equal(x, y, equal_nan=True)


def test_a_v_not_transposed_is_refused_naming_its_shape():
    from attngen.reference.forward import InputError, random_inputs
    plan = make_plan(Spec(head_dim=64, v_layout="transposed", **FP8))
    q, k, v = random_inputs(E4M3, 64, 1, 2, 2, 70, 336, 0)
    with pytest.raises(InputError, match=r"v.shape.*\[1, 2, 64, 336\].*head_dim_v, kv_len"):
        attngen.emulate(plan, q, k, v)


def test_attention_and_the_ops_fake_take_a_transposed_v():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, d = _torch_fp8(5, kv_len=112)
    kw = dict(causal=True, q_descale=d[0], k_descale=d[1], v_descale=d[2])
    v_t = v.permute(0, 2, 3, 1).contiguous()  # [batch, kv_heads, head_dim_v, seqlen_k]
    out = attngen.attention(q, k, v_t, v_layout="transposed", **kw)
    assert torch.equal(out, attngen.attention(q, k, v, **kw))
    with FakeTensorMode() as mode:
        fake = attngen.attention(*(mode.from_tensor(t) for t in (q, k, v_t)), v_layout="transposed")
    assert fake.shape == out.shape and fake.dtype == torch.bfloat16


VT_FREE = "                        T.mbarrier_wait_parity(vt_empty[v_stage], ((k // V_STAGES) % 2) ^ 1)\n"
VT_LANDED_HAZARDS = {
    # the consumer reads V^T before the barrier its TMA load completes
    "vt_read_before_its_barrier": ((VT_WAIT + PV_STEADY, PV_STEADY + VT_WAIT), ("Vt_shared[",)),
    # the TMA lands the next V^T tile over a stage a consumer's PV still reads
    "vt_loaded_over_a_stage_in_use": ((VT_FREE, ""), ("Vt_shared[",)),
}


@pytest.mark.parametrize("name", VT_LANDED_HAZARDS)
def test_a_transposed_v_race_is_reported_in_every_schedule(name):
    from attngen.reference.forward import random_inputs

    plan = make_plan(Spec(head_dim=64, causal=True, v_layout="transposed", **FP8))
    source = attngen.render_source(plan)
    (old, new), words = VT_LANDED_HAZARDS[name]
    assert old in source, old
    broken = source.replace(old, new)
    q, k, v = random_inputs(E4M3, 64, 1, 2, 2, 130, 704, 0)
    v = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    _race_in_every_schedule(plan, source, broken, words, q, k, v)


@pytest.mark.parametrize("fields", [{}, {"head_dim_v": 128, "causal": True, "gqa_group": 2},
                                    {"block_mask": True, "mask_mod": "kv_idx <= q_idx", "lse": True}],
                         ids=lambda f: ",".join(f) or "plain")
def test_a_transposed_v_kernel_passes_the_fp8_rule_on_the_cpu_model(fields):
    """check_emulated (attngen emulate's path) stores v transposed for the kernel, the reference keeps it keys-major."""
    plan = make_plan(Spec(head_dim=64, v_layout="transposed", **FP8, **fields))
    ok, text, stats = check_emulated(plan, 1, 2 * plan.spec.gqa_group, 2, 70, 336, seed=1)
    assert ok, text
    assert stats.wgmma > 0


def test_the_ops_plan_memo_tells_transposed_vs_by_their_head_dim():
    """Two transposed v of one seqlen_k and different head_dim_v: two plans, not one memoized for both."""
    import torch

    q, k, _, _ = _torch_fp8(6, kv_len=112)
    for dv in (64, 128):
        v_t = torch.randn(1, 2, dv, 112).to(torch.float8_e4m3fn)
        assert attngen.attention(q, k, v_t, v_layout="transposed").shape == (1, 70, 2, dv)
