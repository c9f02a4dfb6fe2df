"""Hypothesis: variants drawn together with specs, shapes and schedules; the CPU model must match
the fp64 reference (output, and LSE where the spec has it) for every example.

Same profiles as tests/test_fuzz_emulator.py (ATTNGEN_HYPOTHESIS_PROFILE=ci|dev).
"""

import pytest
from hypothesis import assume, given, note, settings, strategies as st

import attngen
from attngen.emulator import POLICIES
from attngen.emulator.driver import check_emulated
from strategies import softmax_scales, window_edge_kv_lens

WORK_CAP = 600_000  # B*H*Sq*Skv per example: the variants' extra element-wise work costs a little more
EXAMPLES = 6 * settings().max_examples

SCORE_MODS = ["", "", "score + bias[h]", "score * (1 + gain[h]) - 0.01 * abs(q_idx - kv_idx)",
              "where(q_idx >= kv_idx, score, score - 2) + rel[q_idx - kv_idx + 32] / 4", "tanh(score / 4) * 4"]
MASK_MODS = ["", "", "doc[b, q_idx] == doc[b, kv_idx]", "kv_idx != q_idx + 1 and kv_idx > 3", "q_idx - kv_idx < 150"]


@st.composite
def variant_specs(draw):
    fields = {
        "head_dim": draw(st.sampled_from([64, 128, 64, 96])),
        "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
        "causal": draw(st.booleans()),
        "gqa_group": draw(st.sampled_from([1, 2])),
        "consumers": draw(st.integers(1, 3)),
        "k_stages": draw(st.integers(1, 3)),
        "v_stages": draw(st.integers(1, 3)),
        "aligned": draw(st.booleans()),
        "lse": draw(st.booleans()),
        "window": draw(st.sampled_from([(-1, -1), (-1, -1), (0, 0), (37, 21), (100, -1), (-1, 5), (300, 0), (1, 200)])),
        "softcap": draw(st.sampled_from([0.0, 0.0, 2.0, 30.0])),
        "alibi": draw(st.booleans()),
        "sinks": draw(st.booleans()),
        "head_dim_v": draw(st.sampled_from([None, None, 64, 128])),
        "score_mod": draw(st.sampled_from(SCORE_MODS)),
        "mask_mod": draw(st.sampled_from(MASK_MODS)),
    }
    if fields["consumers"] >= 2:
        fields["pingpong"] = draw(st.booleans())
    if draw(st.booleans()):
        fields["block_n"] = draw(st.sampled_from([32, 48, 64, 128]))
    try:
        return attngen.make_plan(attngen.Spec(**fields))
    except attngen.SpecError:
        assume(False)


@st.composite
def cases(draw):
    plan = draw(variant_specs())
    spec = plan.spec
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    if spec.aligned:
        q_len, kv_len = spec.block_m * draw(st.integers(1, 3)), spec.block_n * draw(st.integers(1, 5))
    else:
        q_len, kv_len = draw(st.integers(1, 500)), draw(st.integers(1, 500))
        edges = window_edge_kv_lens(plan, q_len, 500) if plan.window_left is not None or plan.window_right is not None else []
        if edges and draw(st.booleans()):  # an edge at m * BLOCK_N + {-1, 0, 1} (a row bound off by one shows there)
            kv_len = draw(st.sampled_from(edges))
    if batch * kv_heads * spec.gqa_group * q_len * kv_len > WORK_CAP:
        batch = kv_heads = 1
    return (plan, (batch, kv_heads, q_len, kv_len), draw(st.integers(0, 2**16)), draw(st.sampled_from(POLICIES)),
            draw(softmax_scales()))


@pytest.mark.expensive
@settings(max_examples=EXAMPLES)
@given(case=cases())
def test_random_variants_match_reference(case):
    plan, (b, hkv, sq, skv), seed, policy, scale = case
    note(f"{plan.name} B={b} HKV={hkv} Sq={sq} Skv={skv} seed={seed} policy={policy} softmax_scale={scale}")
    ok, text, _ = check_emulated(plan, b, hkv * plan.spec.gqa_group, hkv, sq, skv, seed=seed, policy=policy,
                                 softmax_scale=scale)
    assert ok, f"{plan.name} {(b, hkv, sq, skv)} seed={seed} policy={policy} softmax_scale={scale}: {text}"
