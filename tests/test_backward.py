"""The generated backward kernels (issue 17), run on the CPU model and held to the fp64 gradient
reference by FlashAttention-3's backward tolerance rule (reference.backward.check_grads).

Every case runs the emitted preprocess, main and postprocess kernels (emulate_backward), never
the reference in their place; a deliberately broken kernel text shows that the checks fail.
"""

import dataclasses

import numpy as np
import pytest

import attngen
from attngen import tiles
from attngen.emulator import HazardError, emulate_backward
from attngen.emulator.driver import variant_inputs
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError, variant_of
from attngen.reference.backward import check_grads
from attngen.kernels.fwd.render import render_source
from attngen.kernels.bwd.render import q_range, render_backward_source
from attngen.spec import Spec, SpecError

NAMES = ("dq", "dk", "dv", "dsinks")


def run_case(spec, sq, skv, heads=2, kv_heads=2, batch=1, seed=0, policy="random", source=None, scale=None,
             lse_grad=False):
    """The emulated gradients and their checks: (grads dict, {name: Check}). lse_grad: the loss
    reads the LSE too (a random dLSE [B, H, Sq])."""
    plan = make_plan(spec)
    q, k, v, tensors = variant_inputs(plan, batch, heads, kv_heads, sq, skv, seed)
    dout = np.random.default_rng(seed + 7).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    dlse = np.random.default_rng(seed + 8).standard_normal((batch, heads, sq)).astype(np.float32) if lse_grad else None
    grads = emulate_backward(spec, q, k, v, dout, seed=seed, policy=policy, source=source, softmax_scale=scale,
                             dlse=dlse, **tensors)
    grads = dict(zip(NAMES, grads))
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    return grads, check_grads(grads, q, k, v, dout, spec.causal, dtype=spec.dtype, scale=scale, dlse=dlse, **variant)


def assert_pass(checks):
    bad = {n: str(c) for n, c in checks.items() if not c.ok}
    assert not bad, bad


# -- step 1: the base kernels ---------------------------------------------------------------
BASE = [  # head_dim, causal, dtype, q_len, kv_len, heads
    (64, False, "float16", 70, 90, 2),
    (64, True, "float16", 70, 90, 2),
    (64, True, "bfloat16", 200, 90, 1),  # q_len > kv_len: the first 110 rows see no key
    (64, True, "float16", 5, 1, 2),
    # one query; rows that see one key have dS = 0 exactly, which the rule cannot judge (test_fuzz_backward)
    (128, False, "float16", 1, 2, 1),
    (128, True, "float16", 130, 300, 2),
    (128, False, "bfloat16", 257, 129, 1),
    (128, True, "bfloat16", 64, 128, 2),  # whole tiles
]


@pytest.mark.parametrize("hd, causal, dtype, sq, skv, heads", BASE)
def test_base_kernels_pass_the_fp64_reference(hd, causal, dtype, sq, skv, heads):
    grads, checks = run_case(Spec(head_dim=hd, causal=causal, dtype=dtype), sq, skv, heads, heads)
    assert_pass(checks)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(grads[name]).all()


def test_rows_that_see_no_key_get_an_exact_zero_gradient():
    grads, checks = run_case(Spec(head_dim=64, causal=True), 150, 40, seed=3)
    assert_pass(checks)
    assert (grads["dq"][:, :110] == 0).all()  # rows 0..109 see no key (bottom-right alignment)
    assert np.abs(grads["dq"][:, 110:]).max() > 0


def test_a_run_time_scale_reaches_dq_and_dk():
    _, checks = run_case(Spec(head_dim=64, causal=True), 90, 100, scale=0.3)
    assert_pass(checks)


@pytest.mark.parametrize("policy", ["producer-first", "consumers-first"])
def test_every_schedule_passes(policy):
    _, checks = run_case(Spec(head_dim=64, causal=True), 200, 260, policy=policy, seed=2)
    assert_pass(checks)


def test_batches_and_heads_are_kept_apart():
    _, checks = run_case(Spec(head_dim=64, causal=True), 65, 70, heads=3, kv_heads=3, batch=2, seed=4)
    assert_pass(checks)


# -- broken kernel texts: the checks catch them ---------------------------------------------
BROKEN = [
    ("(acc_dp[i, j] - dPsum_shared[stage, j])", "acc_dp[i, j]", "dPsum not subtracted"),
    ("- LSE_shared[stage, j])", "- LSE_shared[stage, j] * 0.5)", "LSE2 taken as half"),
    ("acc_dk[i, j] *= softmax_scale", "acc_dk[i, j] *= 1.0", "dK not scaled"),
    ("dQ_accum[batch_idx, r0 + i, head, d] * softmax_scale", "dQ_accum[batch_idx, r0 + i, head, d]", "dQ not scaled"),
    ("j + diag >= i and ", "", "the causal mask dropped"),
    ("LSE[batch_idx, head, r0 + i] * LOG2E)", "LSE[batch_idx, head, r0 + i])", "LSE2 not in log2 units"),
]


@pytest.mark.parametrize("old, new, what", BROKEN, ids=[b[2] for b in BROKEN])
def test_a_broken_kernel_text_fails_the_check(old, new, what):
    spec = Spec(head_dim=64, causal=True)
    text = render_backward_source(spec)
    assert old in text, what
    _, checks = run_case(spec, 100, 150, source=text.replace(old, new, 1))
    assert not all(c.ok for c in checks.values()), what


def test_one_q_tile_skipped_at_the_windows_edge_fails():
    spec = Spec(head_dim=64, causal=True, window=(40, -1))
    text = render_backward_source(spec)
    old = "- causal_offset + 40, BLOCK_M)) - q_first, 0)"
    assert old in text
    _, checks = run_case(spec, 300, 330, source=text.replace(old, "- causal_offset + 40, BLOCK_M)) - q_first - 1, 0)"))
    assert not checks["dk"].ok and not checks["dv"].ok


def test_dq_stored_instead_of_reduce_added_is_a_race():
    spec = Spec(head_dim=64, causal=True)
    text = render_backward_source(spec)
    old = "T.atomic_add(dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :], dQ_shared[g, :, :], use_tma=True)"
    assert old in text
    with pytest.raises(HazardError, match="dQ_accum"):
        run_case(spec, 100, 150, source=text.replace(old, "T.copy(dQ_shared[g, :, :], dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :])"))


def test_a_stage_released_before_its_gemm_retires_is_a_race():
    spec = Spec(head_dim=64, causal=True)
    text = render_backward_source(spec)
    old = ("            T.wait_wgmma(0)\n            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n")
    new = ("            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n            T.wait_wgmma(0)\n")
    assert old in text
    with pytest.raises(HazardError, match="Q_shared"):
        run_case(spec, 300, 150, source=text.replace(old, new, 1))


# -- GQA / MQA, head_dim_v -------------------------------------------------------------------
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa_sum_dk_dv_over_the_group(heads, kv_heads, causal):
    spec = Spec(head_dim=64, causal=causal, gqa_group=heads // kv_heads)
    assert plan_backward(spec).kv_accum
    assert "T.atomic_add(dK_accum" in render_backward_source(spec)
    _, checks = run_case(spec, 70, 90, heads, kv_heads)
    assert_pass(checks)


def test_gqa_dk_overwritten_per_query_head_is_a_race():
    spec = Spec(head_dim=64, gqa_group=2)
    text = render_backward_source(spec)
    old = "T.atomic_add(dK_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :], acc_dk)"
    assert old in text
    with pytest.raises(HazardError, match="dK_accum"):  # two query heads' blocks store the same rows
        run_case(spec, 70, 90, 4, 2, source=text.replace(old, "T.copy(acc_dk, dK_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :])"))


def test_head_dim_v_differs_from_head_dim():
    _, checks = run_case(Spec(head_dim=128, head_dim_v=64, causal=True), 70, 90)
    assert_pass(checks)


# -- variants ----------------------------------------------------------------------------------
VARIANTS = {
    "window": dict(window=(20, 10)),
    "causal window": dict(causal=True, window=(30, -1)),
    "softcap": dict(softcap=5.0),
    "alibi causal": dict(alibi=True, causal=True),
    "sinks": dict(sinks=True),
    "sinks causal, rows without keys": dict(sinks=True, causal=True),
    "score_mod": dict(score_mod="score * 0.5 + tanh(score)"),
    "score_mod table": dict(score_mod="score + rel_bias[h, min(max(q_idx - kv_idx, -255), 255) + 255]"),
    "mask_mod": dict(mask_mod="doc_id[b, q_idx] == doc_id[b, kv_idx]", causal=True),
    "softcap and score_mod": dict(softcap=3.0, score_mod="score + log(abs(score) + 1)", causal=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_pass_the_fp64_reference(name):
    grads, checks = run_case(Spec(head_dim=64, **VARIANTS[name]), 100, 150 if "rows" not in name else 60)
    assert_pass(checks)
    assert ("dsinks" in checks) == bool(VARIANTS[name].get("sinks"))


LSE_GRAD = [dict(causal=True), dict(sinks=True, gqa_group=2), dict(softcap=2.0, causal=True),
            dict(deterministic=True, sinks=True, causal=True), dict(alibi=True, window=(20, 5)),
            dict(score_mod="score * 0.5 + tanh(score)", gqa_group=3)]
LSE_FOLD = "dpsum[i] = dpsum[i] - dLSE["


@pytest.mark.parametrize("fields", LSE_GRAD, ids=[",".join(f"{k}={v}" for k, v in d.items()) for d in LSE_GRAD])
def test_the_lse_gradient_folds_into_the_row_term(fields):
    """A loss that reads the LSE: the emitted preprocess subtracts dLSE from dPsum, and the main,
    dq and dsinks kernels read that (q_len 90 > kv_len 70: rows that see no key). A kernel that
    drops dLSE or adds it fails on dq and dk (and dsinks), in both directions of the sign."""
    spec = Spec(head_dim=64, **fields)
    heads = 2 * spec.gqa_group
    _, checks = run_case(spec, 90, 70, heads, 2, lse_grad=True)
    assert_pass(checks)
    text = render_backward_source(spec)
    assert text.count(LSE_FOLD) == 1
    for wrong in ("dpsum[i] = dpsum[i] + 0 * dLSE[", "dpsum[i] = dpsum[i] + dLSE["):
        _, checks = run_case(spec, 90, 70, heads, 2, lse_grad=True, source=text.replace(LSE_FOLD, wrong))
        failed = {n for n, c in checks.items() if not c.ok}
        assert {"dq", "dk"} | ({"dsinks"} if spec.sinks else set()) <= failed, (wrong, checks)


def test_the_softcap_derivative_is_needed():
    spec = Spec(head_dim=64, softcap=2.0)
    text = render_backward_source(spec)
    old = " * (1.0 - T.tanh(acc_s[i, j] * softcap_scale) * T.tanh(acc_s[i, j] * softcap_scale))  # (dP^T - dPsum) dz/ds"
    assert old in text
    _, checks = run_case(spec, 100, 150, source=text.replace(old, "", 1))
    assert not checks["dq"].ok


@pytest.mark.parametrize("field, value", [("paged_kv", True), ("splits", 2)])
def test_inference_layouts_are_refused(field, value):
    with pytest.raises(SpecError, match="inference layout"):
        plan_backward(Spec(head_dim=64, **{field: value}))


@pytest.mark.parametrize("hd, dv, columns", [(64, None, False), (128, None, False), (128, 64, False), (192, 128, True), (256, None, True)])
def test_warpgroups_split_keys_or_where_dk_dv_do_not_fit_head_dim_columns(hd, dv, columns):
    bp = plan_backward(Spec(head_dim=hd, head_dim_v=dv))
    assert bp.columns is columns
    assert bp.block_n == (bp.wg_keys if columns else bp.consumers * bp.wg_keys)
    assert ("DK_COLS" in render_backward_source(bp)) is columns


@pytest.mark.parametrize("fields", [dict(head_dim=192, head_dim_v=128, causal=True), dict(head_dim=256, softcap=5.0),
                                    dict(head_dim=192, sinks=True, gqa_group=3)])
def test_column_split_kernels_pass_the_fp64_reference(fields):
    spec = Spec(**fields)
    _, checks = run_case(spec, 70, 90, heads=spec.gqa_group * 2 if spec.gqa_group > 1 else 2,
                         kv_heads=2 if spec.gqa_group > 1 else 2)
    assert_pass(checks)


# -- the plan and the forward ----------------------------------------------------------------
def test_the_backward_leaves_the_forward_kernel_alone():
    spec = Spec(head_dim=128, causal=True)
    before = render_source(spec)
    bp = plan_backward(spec)
    assert render_source(spec) == before and bp.forward.spec.lse
    assert bp.name.startswith("fa3_bwd_hd128_f16_causal_g1_c2") and bp.hash != make_plan(spec).hash


@pytest.mark.parametrize("hd", [64, 96, 128])
def test_the_plan_fits_its_budgets(hd):
    from attngen import hw

    bp = plan_backward(Spec(head_dim=hd, causal=True))
    assert bp.smem_bytes <= hw.SMEM_PER_BLOCK
    assert bp.consumer_regs_needed <= bp.consumer_regs
    assert bp.producer_regs + bp.consumers * bp.consumer_regs <= (bp.consumers + 1) * hw.launch_regs(bp.threads)
    assert bp.block_m % hw.WGMMA_M == 0 and bp.block_n == bp.consumers * bp.wg_keys


class _T:  # the emitted range text is TileLang: evaluate it on integers
    min, max = staticmethod(min), staticmethod(max)
    floordiv = staticmethod(lambda a, b: a // b)
    ceildiv = staticmethod(lambda a, b: -(-a // b))


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 10)), (True, (70, -1)), (False, (-1, 5))])
def test_the_emitted_q_ranges_are_tiles_q_span(causal, window):
    bp = plan_backward(Spec(head_dim=64, causal=causal, window=window))
    r = q_range(bp)
    for sq, skv in [(1, 1), (64, 128), (200, 90), (90, 300), (257, 129)]:
        fr = tiles.Frame.of(sq, skv, tiles.edges(causal, window), bp.block_m, bp.block_n)
        for c in range(-(-skv // bp.block_n)):
            env = {"T": _T, "q_len": sq, "kv_len": skv, "causal_offset": skv - sq, "BLOCK_M": bp.block_m,
                   "BLOCK_N": bp.block_n, "kv_block": c}
            first = eval(r["q_first"], env)
            n = eval(r["n_q"], dict(env, q_first=first))
            span = fr.q_span(c)
            if not span.tiles:
                assert n == 0
                continue
            assert range(first, first + n) == span.tiles, (sq, skv, c)
            if "full_first" in r and span.full:
                full = range(max(eval(r["full_first"], env), first), min(eval(r["full_stop"], env), first + n))
                assert [t for t in span.tiles if t in full] == list(span.full), (sq, skv, c)


def test_emulate_backward_is_exported_and_takes_torch():
    torch = pytest.importorskip("torch")
    assert attngen.emulate_backward is emulate_backward
    spec = Spec(head_dim=64, causal=True)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 33, 1, 64, generator=g).to(torch.float16) for _ in range(4))
    dq, dk, dv = attngen.emulate_backward(spec, q, k, v, do)
    assert dq.dtype == torch.float16 and dq.shape == q.shape and dk.shape == k.shape
    checks = check_grads({"dq": dq, "dk": dk, "dv": dv}, q, k, v, do, True, dtype="float16")
    assert_pass(checks)


# -- deterministic = true ----------------------------------------------------------------------
DET = [dict(causal=True), dict(gqa_group=2, causal=True), dict(gqa_group=3, window=(20, 10)), dict(sinks=True, causal=True),
       dict(softcap=3.0, score_mod="score + log(abs(score) + 1)", sinks=True),
       dict(alibi=True, mask_mod="doc_id[b, q_idx] == doc_id[b, kv_idx]")]


@pytest.mark.parametrize("fields", DET, ids=[",".join(d) for d in DET])
def test_deterministic_gradients_pass_the_fp64_reference(fields):
    spec = Spec(head_dim=64, deterministic=True, **fields)
    bp = plan_backward(spec)
    text = render_backward_source(spec)
    assert "T.atomic_add(dQ_accum" not in text and "dK_accum" not in text and "def build_dq_kernel" in text
    heads = 2 * spec.gqa_group
    _, checks = run_case(spec, 150, 170, heads, 2, policy="producer-first")
    assert_pass(checks)
    assert bp.kv_accum is False


@pytest.mark.parametrize("fields", DET[:4], ids=[",".join(d) for d in DET[:4]])
def test_deterministic_bits_do_not_depend_on_the_schedule(fields):
    spec = Spec(head_dim=64, deterministic=True, **fields)
    plan = make_plan(spec)
    heads = 2 * spec.gqa_group
    q, k, v, tensors = variant_inputs(plan, 1, heads, 2, 150, 170, 0)
    dout = np.random.default_rng(9).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    dlse = np.random.default_rng(10).standard_normal((1, heads, 150)).astype(np.float32)  # the LSE's gradient too
    runs = [emulate_backward(spec, q, k, v, dout, seed=s, policy=p, block_order=o, dlse=dlse, **tensors)
            for s, p, o in [(0, "random", "grid"), (5, "random", "shuffled"), (1, "producer-first", "shuffled"),
                            (2, "consumers-first", "shuffled")]]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


def test_without_deterministic_the_dq_bits_depend_on_the_block_order():
    """The check above can fail: the reduce-adds of dQ sum in the order the blocks run."""
    spec = Spec(head_dim=64, causal=True)
    q, k, v, _ = variant_inputs(make_plan(spec), 1, 2, 2, 300, 300, 0)
    dout = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    grid = emulate_backward(spec, q, k, v, dout, seed=0)
    shuffled = emulate_backward(spec, q, k, v, dout, seed=5, block_order="shuffled")
    assert not np.array_equal(grid[0], shuffled[0])
    assert np.array_equal(grid[1], shuffled[1]) and np.array_equal(grid[2], shuffled[2])  # dK, dV: one block each


def test_deterministic_leaves_the_forward_kernel_and_hash_alone():
    spec = Spec(head_dim=64, causal=True)
    assert Spec(head_dim=64, causal=True, deterministic=False) == spec
    assert make_plan(spec).hash == make_plan(Spec(head_dim=64, causal=True, deterministic=False)).hash
    det = plan_backward(dataclasses.replace(spec, deterministic=True))
    assert det.forward.hash == plan_backward(spec).forward.hash and det.hash != plan_backward(spec).hash
    assert det.name.endswith("_det")


# -- varlen (packed training) ------------------------------------------------------------------
def run_varlen(spec, lq, lk, heads, kv_heads, seed=0, policy="random", source=None):
    """Packed sequences through the emitted kernels, each sequence against its own fp64 reference."""
    from attngen.reference.forward import nonfinite_agree, round_to, tolerance
    from attngen.reference.backward import attention_grad_varlen

    rng = np.random.default_rng(seed)
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    dv = spec.head_dim_v or spec.head_dim
    q = round_to(rng.standard_normal((cq[-1], heads, spec.head_dim)), spec.dtype)
    k = round_to(rng.standard_normal((ck[-1], kv_heads, spec.head_dim)), spec.dtype)
    v = round_to(rng.standard_normal((ck[-1], kv_heads, dv)), spec.dtype)
    do = round_to(rng.standard_normal((cq[-1], heads, dv)), spec.dtype)
    grads = emulate_backward(spec, q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck, seed=seed, policy=policy, source=source)
    variant = dict(window=spec.window)
    ref = attention_grad_varlen(q, k, v, do, cq, ck, spec.causal, **variant)
    low = attention_grad_varlen(q, k, v, do, cq, ck, spec.causal, lowprec=spec.dtype, **variant)
    checks = {}
    for name, got in zip(("dq", "dk", "dv"), grads):
        r = getattr(ref, name)
        bound = tolerance(r, getattr(low, name), spec.dtype, None)
        err = float(np.abs(got - r).max(initial=0)) if nonfinite_agree(np.asarray(got, np.float64), r) else float("inf")
        checks[name] = (err <= bound, err, bound)
    return grads, checks


VARLEN = [dict(causal=True), dict(), dict(causal=True, gqa_group=2), dict(causal=True, deterministic=True),
          dict(window=(10, 5), deterministic=True, gqa_group=2)]


@pytest.mark.parametrize("fields", VARLEN, ids=[",".join(f"{k}={v}" for k, v in d.items()) or "plain" for d in VARLEN])
def test_varlen_sequences_pass_their_own_references(fields):
    spec = Spec(head_dim=64, layout="varlen", **fields)
    # a long sequence, a 1-row one, one with no query, more queries than keys
    _, checks = run_varlen(spec, [70, 1, 0, 130], [90, 5, 7, 60], 2 * spec.gqa_group, 2)
    assert all(ok for ok, _, _ in checks.values()), checks


def test_varlen_dk_stored_past_its_sequence_is_caught():
    spec = Spec(head_dim=64, layout="varlen", causal=True)
    text = render_backward_source(spec)
    old = "            if key0 + i < kv_len:\n                dK["
    assert old in text
    broken = text.replace(old, "            if key0 + i < kv_len + 64:\n                dK[", 1)
    try:
        _, checks = run_varlen(spec, [70, 30, 130], [90, 20, 60], 2, 2, source=broken)
    except HazardError:  # the next sequence's rows: a race with the block that owns them
        return
    assert not checks["dk"][0]


def test_a_column_split_dq_added_into_the_wrong_columns_fails():
    spec = Spec(head_dim=256)
    text = render_backward_source(spec)
    old = "dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, g * DK_COLS:(g + 1) * DK_COLS]"
    assert old in text
    _, checks = run_case(spec, 70, 90, source=text.replace(old, "dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, 0:DK_COLS]"))
    assert not checks["dq"].ok and checks["dk"].ok


def test_given_out_and_lse_skip_the_forward_with_the_same_result():
    spec = Spec(head_dim=64, causal=True)
    plan = plan_backward(spec)
    q, k, v, _ = variant_inputs(plan.forward, 1, 2, 2, 90, 120, 0)
    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    out, lse = attngen.emulate(plan.forward, q, k, v)
    given = emulate_backward(spec, q, k, v, dout, out=out, lse=lse)
    for a, b in zip(given, emulate_backward(spec, q, k, v, dout)):
        assert np.array_equal(a, b)
    with pytest.raises(InputError, match="lse"):
        emulate_backward(spec, q, k, v, dout, out=out)
    with pytest.raises(InputError, match="dout"):
        emulate_backward(spec, q, k, v, dout[:, :-1], out=out, lse=lse)
    with pytest.raises(InputError, match=r"^dlse = shape \(1, 90, 2\): expected the LSE's shape \(1, 2, 90\)"):
        emulate_backward(spec, q, k, v, dout, out=out, lse=lse, dlse=lse.transpose(0, 2, 1))


def test_a_score_mod_tensor_that_requires_grad_is_refused():
    torch = pytest.importorskip("torch")
    spec = Spec(head_dim=64, score_mod="score + rel_bias[h, min(max(q_idx - kv_idx, -255), 255) + 255]")
    plan = make_plan(spec)
    q, k, v, tensors = variant_inputs(plan, 1, 2, 2, 40, 40, 0)
    dout = np.ones(q.shape, np.float32)
    bias = torch.from_numpy(tensors["rel_bias"]).requires_grad_()
    with pytest.raises(InputError, match="rel_bias.*requires grad"):
        emulate_backward(spec, q, k, v, dout, rel_bias=bias)


def test_one_backward_name_is_one_text_over_every_preset_and_forward_only_field():
    """The backward's name, hash and header depend only on what its kernels read: presets and specs
    that differ in the forward's tiling, stages, ping-pong, alignment or loop form share one module
    (default and seed_parity once had one name with two headers), and a backward field does change it."""
    from pathlib import Path

    from attngen.spec import load
    texts = {}
    for path in sorted(Path(__file__).resolve().parent.parent.glob("examples/*.toml")):
        try:
            bp = plan_backward(load(path))
        except SpecError:
            continue  # paged or split-KV: an inference layout
        texts.setdefault(bp.name, set()).add(render_backward_source(load(path)))
    assert texts and all(len(t) == 1 for t in texts.values()), [n for n, t in texts.items() if len(t) > 1]
    base = Spec(causal=True)
    variants = [dict(block_n=64), dict(k_stages=3, v_stages=3), dict(aligned=True), dict(steady_loop="split"),
                dict(consumers=1), dict(pingpong=False)]
    ref = render_backward_source(base)
    for fields in variants:
        assert render_backward_source(dataclasses.replace(base, **fields)) == ref, fields
    assert render_backward_source(dataclasses.replace(base, deterministic=True)) != ref
