"""Hypothesis: random backward specs x variants x shapes x schedules, the emitted backward kernels
emulated (emulate_backward) and held to the fp64 gradient reference (reference_bwd.check_grads).

Profiles (tests/conftest.py): ci (default: derandomized, 20 examples, ~20 s) or dev (300).
Every example must finish without a hazard or a deadlock and pass the tolerance rule for each
gradient; a deterministic spec must also give the same bits under a second schedule.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, note, settings, strategies as st

import attngen
from attngen.emulator import POLICIES, emulate_backward
from attngen.emulator.driver import variant_inputs
from attngen.plan import make_plan, plan_backward
from attngen.reference import variant_of
from attngen.reference_bwd import check_grads
from strategies import softmax_scales

WORK_CAP = 400_000  # B * H * Sq * Skv of one example: well under a second on the CPU model
NAMES = ("dq", "dk", "dv", "dsinks")


@st.composite
def specs(draw):
    hd, dv = draw(st.sampled_from([(64, None), (128, None), (64, None), (96, None), (128, 64), (192, 128), (256, None)]))
    fields = {"head_dim": hd, "head_dim_v": dv, "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
              "causal": draw(st.booleans()), "gqa_group": draw(st.sampled_from([1, 1, 2, 3])),
              "deterministic": draw(st.booleans())}
    if draw(st.booleans()):
        fields["window"] = (draw(st.sampled_from([-1, 0, 17, 64, 200])), draw(st.sampled_from([-1, 0, 5, 130])))
    variant = draw(st.sampled_from(["", "softcap", "alibi", "sinks", "score_mod", "mask_mod"]))
    if variant == "softcap":
        fields["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    elif variant == "alibi":
        fields["alibi"] = True
    elif variant == "sinks":
        fields["sinks"] = True
    elif variant == "score_mod":
        fields["score_mod"] = draw(st.sampled_from(["score * 0.5 + tanh(score)", "score - abs(q_idx - kv_idx) * 0.01",
                                                    "where(score > 0, score, score * 0.25)"]))
    elif variant == "mask_mod":
        fields["mask_mod"] = draw(st.sampled_from(["(q_idx + kv_idx) % 3 != 0", "kv_idx <= q_idx + 40"]))
    if draw(st.booleans()):
        fields["layout"] = "varlen"
    try:
        spec = attngen.Spec(**fields)
        plan_backward(spec)
    except attngen.SpecError:
        assume(False)
    return spec


@st.composite
def cases(draw):
    spec = draw(specs())
    kv_heads = draw(st.integers(1, 2))
    q_len, kv_len = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    batch = draw(st.integers(1, 2))
    if batch * kv_heads * spec.gqa_group * q_len * kv_len > WORK_CAP:
        batch = kv_heads = 1
    return spec, (batch, kv_heads, q_len, kv_len), draw(st.integers(0, 2**16)), draw(st.sampled_from(POLICIES)), draw(softmax_scales())


def one_key_rows_only(spec, sq, skv) -> bool:
    """Does every row see at most one key? Then P is 1 or 0, dS = P (dP - dPsum) is exactly 0 and what
    any float32 kernel returns is rounding noise of dP - dPsum (two sums of the same products in
    different orders), while the rule's bound is the dtype's smallest step times max|ref| ~ 0; no
    honest kernel can pass it there (docs/backward.md, "The tolerance rule", cancelling sums)."""
    from attngen import tiles

    rows = np.arange(sq)[:, None]
    seen = tiles.visible(rows, np.arange(skv)[None, :], sq, skv, tiles.edges(spec.causal, spec.window)).sum(axis=1)
    return bool(seen.max(initial=0) <= 1)


def run_case(spec, shape, seed, policy, scale):
    b, hkv, sq, skv = shape
    assume(not one_key_rows_only(spec, sq, skv))
    h = hkv * spec.gqa_group
    bp = plan_backward(spec)
    note(f"{bp.name} B={b} HKV={hkv} Sq={sq} Skv={skv} seed={seed} policy={policy} softmax_scale={scale}")
    if spec.layout == "varlen":  # a bshd draw of one sequence per batch, packed; the reference per sequence
        return run_varlen(spec, b, h, hkv, sq, skv, seed, policy, scale)
    q, k, v, tensors = variant_inputs(make_plan(spec), b, h, hkv, sq, skv, seed)
    dout = np.random.default_rng(seed + 3).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    grads = emulate_backward(spec, q, k, v, dout, seed=seed, policy=policy, softmax_scale=scale, **tensors)
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    checks = check_grads(dict(zip(NAMES, grads)), q, k, v, dout, spec.causal, dtype=spec.dtype, scale=scale, **variant)
    bad = {n: str(c) for n, c in checks.items() if not c.ok}
    assert not bad, bad
    if spec.deterministic:
        again = emulate_backward(spec, q, k, v, dout, seed=seed + 1, policy=POLICIES[(POLICIES.index(policy) + 1) % 3],
                                 softmax_scale=scale, **tensors)
        assert all(np.array_equal(x, y) for x, y in zip(grads, again))


def run_varlen(spec, b, h, hkv, sq, skv, seed, policy, scale):
    from attngen.reference import nonfinite_agree, round_to, tolerance
    from attngen.reference_bwd import attention_grad_varlen

    assume(not (spec.alibi or spec.sinks or "[" in spec.score_mod + spec.mask_mod))  # call-time tensors: the bshd path
    rng = np.random.default_rng(seed)
    lq = [sq] + [int(x) for x in rng.integers(0, sq + 1, b - 1)]
    lk = [skv] + [int(x) for x in rng.integers(0, skv + 1, b - 1)]
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    dv = spec.head_dim_v or spec.head_dim
    q = round_to(rng.standard_normal((cq[-1], h, spec.head_dim)), spec.dtype)
    k = round_to(rng.standard_normal((ck[-1], hkv, spec.head_dim)), spec.dtype)
    v = round_to(rng.standard_normal((ck[-1], hkv, dv)), spec.dtype)
    do = round_to(rng.standard_normal((cq[-1], h, dv)), spec.dtype)
    grads = emulate_backward(spec, q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck, seed=seed, policy=policy, softmax_scale=scale)
    variant = dict(window=spec.window, softcap=spec.softcap, score_mod=spec.score_mod, mask_mod=spec.mask_mod)
    ref = attention_grad_varlen(q, k, v, do, cq, ck, spec.causal, scale, **variant)
    low = attention_grad_varlen(q, k, v, do, cq, ck, spec.causal, scale, lowprec=spec.dtype, **variant)
    for name, got in zip(("dq", "dk", "dv"), grads):
        r = getattr(ref, name)
        bound = tolerance(r, getattr(low, name), spec.dtype, None)
        assert nonfinite_agree(np.asarray(got, np.float64), r), name
        err = float(np.abs(got - r).max(initial=0))
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (sequences q {lq}, kv {lk})"


@pytest.mark.expensive
@settings(max_examples=settings().max_examples)
@given(case=cases())
@example(case=(attngen.Spec(head_dim=128, causal=True), (1, 1, 300, 70), 0, "random", None))
@example(case=(attngen.Spec(head_dim=64, gqa_group=2, deterministic=True, window=(17, 5)), (2, 1, 113, 203), 1, "producer-first", 1.0))
@example(case=(attngen.Spec(head_dim=256, causal=True, layout="varlen"), (2, 2, 70, 130), 2, "consumers-first", 0.01))
def test_random_backward_specs_shapes_and_schedules_match_the_reference(case):
    run_case(*case)
