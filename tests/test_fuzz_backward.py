"""Hypothesis: backward specs x variants x shapes x schedules, emulated and held to the fp64 gradients.

Profiles (tests/conftest.py): ATTNGEN_HYPOTHESIS_PROFILE=ci (default: derandomized, EXAMPLES
below) or dev (many more). Every example runs the emitted backward module on the CPU model
(emulate_backward: the forward with its LSE, then the backward's kernels) under a drawn policy,
seed and block order, and must finish without a hazard or a deadlock, pass
reference.backward.check_grads for every gradient, be finite, and give a row that sees no key an
exactly zero dQ; a deterministic spec must also give the same bits under another policy, seed
and block order. Drawn: what plan_backward supports (head_dim 64 to 256, head_dim_v, both dtypes,
causal, windows, softcap, ALiBi, sinks, score_mod, mask_mod, GQA and MQA, deterministic, varlen
batches), lengths from 1 with q_len > kv_len, window edges on Q-tile boundaries, and the run-time
softmax scale.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, note, settings, strategies as st

from attngen import tiles
from attngen.emulator import POLICIES, emulate, emulate_backward
from attngen.emulator.driver import BLOCK_ORDERS, variant_inputs
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import _variant_scores, check_close, variant_of
from attngen.reference.backward import check_grads
from attngen.spec import Spec, SpecError
from strategies import softmax_scales

NAMES = ("dq", "dk", "dv", "dsinks")
WORK_CAP = 120_000  # B*H*Sq*Skv per example (the fp64 reference and its twin run too)
# An example costs about 0.5 s on the 2-core machine: 2 x the profile's examples, ~20 s under "ci".
EXAMPLES = 2 * settings().max_examples
MAX_LEN = 300

SCORE_MODS = ["", "", "", "score * 0.5 + tanh(score)", "score + bias[h]",
              "score + rel[h, min(max(q_idx - kv_idx, -63), 63) + 63] / 4", "where(q_idx >= kv_idx, score, score - 2)"]
MASK_MODS = ["", "", "", "doc[b, q_idx] == doc[b, kv_idx]", "kv_idx != q_idx + 1 and kv_idx > 3"]
WINDOWS = [(-1, -1), (-1, -1), (-1, -1), (0, 0), (37, 21), (100, -1), (-1, 5), (200, 0), (1, 130)]


@st.composite
def backward_specs(draw):
    hd, dv = draw(st.sampled_from([(64, None), (64, None), (128, None), (96, None), (64, 128), (128, 64), (192, 128),
                                   (256, None)]))
    fields = {
        "head_dim": hd,
        "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
        "causal": draw(st.booleans()),
        "gqa_group": draw(st.sampled_from([1, 1, 2, 3])),
        "window": draw(st.sampled_from(WINDOWS)),
        "softcap": draw(st.sampled_from([0.0, 0.0, 2.0, 30.0])),
        "alibi": draw(st.booleans()),
        "sinks": draw(st.booleans()),
        "head_dim_v": dv,
        "score_mod": draw(st.sampled_from(SCORE_MODS)),
        "mask_mod": draw(st.sampled_from(MASK_MODS)),
        "deterministic": draw(st.booleans()),
    }
    if draw(st.integers(0, 4)) == 0:
        fields["layout"] = "varlen"
    try:
        spec = Spec(**fields)
        plan_backward(spec)
    except SpecError:
        assume(False)
    return spec


def q_tile_edge_kv_lens(spec, q_len: int) -> list:
    """Key lengths at which a window edge of a row at a Q-tile boundary (m * BLOCK_M - 1 or
    m * BLOCK_M) falls on a KV-tile boundary (c * BLOCK_N - 1 or c * BLOCK_N): where q_first or
    n_q off by one would skip or add a Q tile."""
    bp = plan_backward(spec)
    left, right = bp.forward.window_left, bp.forward.window_right
    reach = ([-left] if left is not None else []) + ([right] if right is not None else [])
    lens = set()
    for m in range(0, q_len // bp.block_m + 1):
        for r in (m * bp.block_m - 1, m * bp.block_m):
            if not 0 <= r < q_len:
                continue
            for e in reach:
                for c in range(0, MAX_LEN // bp.block_n + 2):
                    for key in (c * bp.block_n - 1, c * bp.block_n):
                        kv = key - r + q_len - e  # r + (kv - q_len) + e = key
                        if 1 <= kv <= MAX_LEN:
                            lens.add(kv)
    return sorted(lens)


@st.composite
def cases(draw):
    spec = draw(backward_specs())
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    special = [1, 2, 63, 64, 65, 127, 128, 129, 200, MAX_LEN]
    q_len = draw(st.one_of(st.sampled_from(special), st.integers(1, MAX_LEN)))
    kv_len = draw(st.one_of(st.sampled_from(special), st.integers(1, MAX_LEN)))
    if draw(st.booleans()) and q_len > 1:  # more queries than keys: causal rows see no key
        kv_len = draw(st.integers(1, q_len - 1))
    edges = q_tile_edge_kv_lens(spec, q_len) if spec.window != (-1, -1) or spec.causal else []
    if edges and draw(st.booleans()):
        kv_len = draw(st.sampled_from(edges))
    if batch * kv_heads * spec.gqa_group * q_len * kv_len > WORK_CAP:
        batch = kv_heads = 1
    schedule = (draw(st.sampled_from(POLICIES)), draw(st.integers(0, 2**16)), draw(st.sampled_from(BLOCK_ORDERS)))
    return spec, (batch, kv_heads, q_len, kv_len), schedule, draw(softmax_scales())


def run(spec, shape, schedule, scale, input_seed=None, lse_grad=None):
    b, hkv, sq, skv = shape
    policy, seed, order = schedule
    input_seed = seed if input_seed is None else input_seed
    q, k, v, tensors = variant_inputs(make_plan(spec), b, hkv * spec.gqa_group, hkv, sq, skv, input_seed % 97)
    dout = np.random.default_rng(input_seed).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    # the forward kernel (with its LSE) on the CPU model, checked here; the backward reads its out and lse
    out, lse = emulate(plan_backward(spec).forward, q, k, v, seed=seed, policy=policy, softmax_scale=scale, **tensors)
    fwd = check_close(out, q, k, v, spec.causal, dtype=spec.dtype, scale=scale, **variant)
    assert fwd.ok, f"forward: {fwd}"
    # a loss that reads the LSE too (its gradient folded into the row term): by default every odd input seed
    lse_grad = input_seed % 2 == 1 if lse_grad is None else lse_grad
    dlse = np.random.default_rng(input_seed + 1).standard_normal(lse.shape).astype(np.float32) if lse_grad else None
    grads = dict(zip(NAMES, emulate_backward(spec, q, k, v, dout, seed=seed, policy=policy, block_order=order, out=out,
                                             lse=lse, dlse=dlse, softmax_scale=scale, **tensors)))
    return grads, (q, k, v, dout), dict(variant, out=out, dlse=dlse)


def one_key_rows_only(spec, sq, skv) -> bool:
    """Does every row see at most one key? Then dS = P (dP - dPsum) is exactly 0 and the kernel's dq
    and dk are float32 noise, which check_grads' cancellation floor covers (reference.backward.CANCELLATION)
    but the varlen check below, with the plain rule, does not."""
    rows = np.arange(sq)[:, None]
    seen = tiles.visible(rows, np.arange(skv)[None, :], sq, skv, tiles.edges(spec.causal, spec.window)).sum(axis=1)
    return bool(seen.max(initial=0) <= 1)


def run_varlen(spec, shape, schedule, scale):
    """A varlen batch: sequence 0 of the drawn lengths, the others shorter (0 included), packed; the
    reference per sequence (attention_grad_varlen and its twin)."""
    from attngen.reference.forward import nonfinite_agree, round_to, tolerance
    from attngen.reference.backward import attention_grad_varlen

    b, hkv, sq, skv = shape
    policy, seed, order = schedule
    h = hkv * spec.gqa_group
    assume(not (spec.alibi or spec.sinks or "[" in spec.score_mod + spec.mask_mod))  # call-time tensors: the bshd path
    assume(not one_key_rows_only(spec, sq, skv))
    rng = np.random.default_rng(seed)
    lq = [sq] + [int(x) for x in rng.integers(0, sq + 1, b - 1)]
    lk = [skv] + [int(x) for x in rng.integers(0, skv + 1, b - 1)]
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    dv = spec.head_dim_v or spec.head_dim
    q = round_to(rng.standard_normal((cq[-1], h, spec.head_dim)), spec.dtype)
    k = round_to(rng.standard_normal((ck[-1], hkv, spec.head_dim)), spec.dtype)
    v = round_to(rng.standard_normal((ck[-1], hkv, dv)), spec.dtype)
    do = round_to(rng.standard_normal((cq[-1], h, dv)), spec.dtype)
    grads = emulate_backward(spec, q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck, seed=seed, policy=policy,
                             block_order=order, softmax_scale=scale)
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
@settings(max_examples=EXAMPLES)
@given(case=cases())
@example(case=(Spec(head_dim=64, causal=True), (1, 1, 1, 1), ("random", 0, "grid"), None))  # lengths 1
@example(case=(Spec(head_dim=64, causal=True, sinks=True), (1, 1, 200, 70), ("producer-first", 1, "shuffled"), None))
@example(case=(Spec(head_dim=128, gqa_group=3, window=(37, 21)), (1, 1, 129, 65), ("consumers-first", 2, "shuffled"), 0.3))
@example(case=(Spec(head_dim=128, causal=True), (1, 1, 300, 70), ("random", 0, "grid"), None))
@example(case=(Spec(head_dim=64, gqa_group=2, deterministic=True, window=(17, 5)), (2, 1, 113, 203),
               ("producer-first", 1, "shuffled"), 1.0))
@example(case=(Spec(head_dim=256, causal=True, layout="varlen"), (2, 2, 70, 130), ("consumers-first", 2, "grid"), 0.01))
# the dev profile's find: dsinks cancels 1600-fold over two batches, and the bfloat16 rounding of O
# in D = rowsum(dO * O) was the twin's own, not the kernel's (check_grads(out=) fixes that)
@example(case=(Spec(head_dim=128, dtype="bfloat16", causal=True, alibi=True, sinks=True, head_dim_v=64,
                    score_mod="where(q_idx >= kv_idx, score, score - 2)", mask_mod="kv_idx != q_idx + 1 and kv_idx > 3"),
               (2, 1, 1, 256), ("random", 0, "grid"), 0.061121646932747686))
def test_random_backward_cases_match_the_fp64_gradients(case):
    spec, shape, schedule, scale = case
    note(f"{spec} shape (B, HKV, Sq, Skv)={shape} schedule={schedule} softmax_scale={scale}")
    if spec.layout == "varlen":
        return run_varlen(spec, shape, schedule, scale)
    grads, args, variant = run(spec, shape, schedule, scale)
    checks = check_grads(grads, *args, spec.causal, dtype=spec.dtype, scale=scale, **variant)
    bad = {n: str(c) for n, c in checks.items() if not c.ok}
    assert not bad, bad
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(grads[name]).all(), name
    # a row that sees no key (the reference's own visibility: masks, window, mask_mod) gets dq exactly 0, never NaN
    q, k = args[0], args[1]
    b, sq, h, _ = q.shape
    dq = np.asarray(grads["dq"])
    for bi in range(b):
        masks = {n: x for n, x in variant.items() if n not in ("out", "dlse")}
        visible = _variant_scores(np.zeros((h, sq, k.shape[1])), bi, range(h), sq, k.shape[1], spec.causal, **masks)[1]
        empty = ~visible.any(axis=-1)  # [h, sq]
        assert (dq[bi].transpose(1, 0, 2)[empty] == 0).all()
    if spec.deterministic:  # the same bits under another policy, seed and block order
        policy, seed, order = schedule
        other = (POLICIES[(POLICIES.index(policy) + 1) % 3], seed + 1, "grid" if order == "shuffled" else "shuffled")
        again, _, _ = run(spec, shape, other, scale, input_seed=seed)
        assert all(np.array_equal(grads[n], again[n]) for n in grads)


ZERO_CASES = [  # every row sees one key: the exact dq and dk are 0, the kernel's hold float32 noise (or 0)
    (Spec(head_dim=128), (1, 1, 1, 1), ("random", 0, "grid")),  # what the dev profile found
    (Spec(head_dim=64, causal=True), (1, 1, 5, 1), ("random", 1, "grid")),
    (Spec(head_dim=64), (1, 1, 1, 1), ("random", 2, "grid")),
]


@pytest.mark.parametrize("spec, shape, schedule", ZERO_CASES)
def test_gradients_that_cancel_to_zero_pass_and_a_small_error_still_fails(spec, shape, schedule):
    """check_grads' cancellation floor (reference.backward.CANCELLATION), free of one machine's rounding:
    the exact dq and dk are 0 but the terms that cancel are not, and the float32 noise left (0 with
    some BLAS and releases) is no fact to assert. The kernel's gradients pass; noise of 2 x 2^-24 x
    what cancels (the most measured: 1.42 x) passes, where the plain eps (one float16 subnormal for
    an exact 0) fails it; dq + 1e-4 (a fraction of a float16 ulp at 1) fails."""
    from attngen.reference.forward import round_to, tolerance
    from attngen.reference.backward import _attention_grad

    grads, args, variant = run(spec, shape, schedule, None, lse_grad=False)  # (a dLSE makes dS nonzero there)
    checks = check_grads(grads, *args, spec.causal, dtype=spec.dtype, **variant)
    assert all(c.ok for c in checks.values()), {n: str(c) for n, c in checks.items()}
    rounded = [round_to(np.asarray(x), spec.dtype) for x in args]  # what check_grads compares against
    masks = {n: x for n, x in variant.items() if n not in ("out", "dlse")}
    exact, size, _ = _attention_grad(*rounded, spec.causal, None, 0, True, **masks)  # size: what cancels
    for name in ("dq", "dk"):
        zero = getattr(exact, name)
        assert np.abs(zero).max() < 1e-12  # really a cancellation
        noise = 2 * 2.0 ** -24 * float(getattr(size, name).max())  # float32's unit roundoff x what cancels, x 2
        assert noise > tolerance(zero, zero, spec.dtype)  # the rule without the floor fails it, even with a perfect twin
        noisy = dict(grads, **{name: zero + noise})
        assert check_grads(noisy, *args, spec.causal, dtype=spec.dtype, **variant)[name].ok, name
    broken = dict(grads, dq=np.asarray(grads["dq"]) + 1e-4)
    assert not check_grads(broken, *args, spec.causal, dtype=spec.dtype, **variant)["dq"].ok
