"""Variants (docs/variants.md): spec fields, plan-derived tile ranges, the emitted kernel on the
CPU model against the fp64 reference, the reference against independent formulas, and the
call-time tensor checks of attngen.attention / attngen.emulate."""

import math

import numpy as np
import pytest
import torch

import attngen
from attngen.kernels.fwd import render  # FIXME split
from attngen.emulator import POLICIES, emulate
from attngen.emulator.driver import check_emulated, variant_inputs
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import attention, check_lse, random_inputs, variant_of
from attngen.run.inputs import check_extra, check_tensors
from attngen.run.runtime import InputError
from attngen.spec import Spec, SpecError
from strategies import window_edge_kv_lens

VARIANT_FIELDS = dict(lse=True, window=[64, 3], softcap=20.0, alibi=True, sinks=True, head_dim_v=64,
                      score_mod="score + bias[h]", mask_mod="kv_idx != 5")


# -- spec fields ---------------------------------------------------------------------
@pytest.mark.parametrize("field, value, fragment", [
    ("lse", 1, "expected true or false"),
    ("window", [1, 2, 3], "expected [left, right]"),
    ("window", [-2, 0], "integers >= -1"),
    ("window", 5, "expected [left, right]"),
    ("window", [1.5, 0], "expected [left, right]"),
    ("softcap", -1.0, "finite number >= 0"),
    ("softcap", float("inf"), "finite number >= 0"),
    ("softcap", "30", "finite number >= 0"),
    ("alibi", "yes", "expected true or false"),
    ("sinks", None, "expected true or false"),
    ("head_dim_v", 100, "expected one of 64, 96, 128, 192, 256"),
    ("score_mod", "score +* 2", "not a valid expression"),
    ("mask_mod", "q_idx", "must give a boolean"),
])
def test_bad_variant_fields_name_the_field(field, value, fragment):
    with pytest.raises(SpecError) as info:
        Spec(**{field: value})
    assert info.value.field == field and fragment in str(info.value), str(info.value)


def test_defaults_written_out_give_the_same_kernel_name_hash_and_text():
    for base in ({}, {"causal": True, "gqa_group": 4, "head_dim": 64}):
        plain = make_plan(Spec(**base))
        explicit = make_plan(Spec(**base, lse=False, window=[-1, -1], softcap=0, alibi=False, sinks=False,
                                  head_dim_v=base.get("head_dim", 128), score_mod="", mask_mod=""))
        assert (plain.name, plain.hash) == (explicit.name, explicit.hash)
        assert attngen.render_source(plain) == attngen.render_source(explicit)


@pytest.mark.parametrize("same, canonical", [
    # issue 21: under causal a right window bound is meaningless, yet it named (and changed) the kernel
    (dict(causal=True, window=[-1, 50]), dict(causal=True)),
    (dict(causal=True, window=[100, 0]), dict(causal=True, window=[100, -1])),
    # comments, spacing, parentheses, a full-width letter (NFKC, as Python reads identifiers), blank text
    (dict(score_mod="score*2  # twice"), dict(score_mod="score * 2")),
    (dict(score_mod="((score)) * (2)"), dict(score_mod="score * 2")),
    (dict(score_mod="\uff53core * 2"), dict(score_mod="score * 2")),
    (dict(mask_mod="doc[b,q_idx]==doc[b,kv_idx]"), dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]")),
    (dict(score_mod="   "), {}),
])
def test_equal_kernels_get_one_name_hash_and_text(same, canonical):
    a, b = make_plan(Spec(**same)), make_plan(Spec(**canonical))
    assert (a.name, a.hash, a.spec) == (b.name, b.hash, b.spec)
    assert attngen.render_source(a) == attngen.render_source(b)


def test_the_canonical_form_keeps_what_changes_the_kernel():
    assert make_plan(Spec(window=[-1, 50])).name.endswith("_winf_50")  # without causal the bound counts
    assert make_plan(Spec(score_mod="score * 2")).name != make_plan(Spec(score_mod="score * 3")).name
    assert make_plan(Spec(score_mod="(score + 1) * 2")).name != make_plan(Spec(score_mod="score + 1 * 2")).name


@pytest.mark.parametrize("field", sorted(VARIANT_FIELDS))
def test_each_variant_changes_name_and_hash(field):
    base = make_plan(Spec())
    plan = make_plan(Spec(**{field: VARIANT_FIELDS[field]}))
    assert plan.name != base.name and plan.hash != base.hash
    assert plan.name.startswith(base.name)


def test_the_header_names_the_call_time_tensors_and_their_shapes():
    def header(**fields):
        source = attngen.render_source(Spec(**fields))
        return [line for line in source.splitlines() if line.startswith("# tensors:")]

    assert header() == [] and header(lse=True) == []  # no call-time input; the LSE is an output
    assert header(score_mod="score + rpb[h, q_idx - kv_idx + 7]", alibi=True, sinks=True) == [
        "# tensors:   alibi_slopes [heads], sinks [heads], rpb [heads, any] (float32, passed by name at call time)"]
    assert header(mask_mod="doc[b, q_idx] == doc[b, kv_idx]") == [
        "# tensors:   doc [batch, any] (float32, passed by name at call time)"]  # q_len and kv_len: either extent


def test_window_from_toml_is_a_tuple(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text("window = [128, 0]\ncausal = true\nlse = true\n")
    spec = attngen.load_spec(path)
    assert spec.window == (128, 0) and hash(spec)
    assert "window = [128, 0]" in attngen.spec.to_toml(spec)


def test_a_tensor_named_like_a_spec_field_is_refused():
    with pytest.raises(SpecError) as info:
        make_plan(Spec(score_mod="score + consumers[h]"))
    assert info.value.field == "score_mod" and "spec field" in str(info.value)


def test_head_dim_v_enters_the_budgets():
    plan = make_plan(Spec(head_dim=192, head_dim_v=128, causal=True))
    assert plan.smem["V"] == plan.spec.v_stages * plan.spec.block_n * 128 * 2
    assert plan.smem["O"] == 128 * 128 * 2
    from attngen.kernels.fwd.plan import regs_needed
    bn = plan.spec.block_n
    assert plan.consumer_regs_needed == regs_needed(plan.spec, bn) == regs_needed(Spec(head_dim=128), bn)  # O is 128 wide


# -- window tile ranges: exact ---------------------------------------------------------
class _T:
    """The integer T.* the tile-range expressions use, on Python ints (floor division)."""
    min, max = staticmethod(min), staticmethod(max)
    floordiv = staticmethod(lambda a, b: a // b)
    ceildiv = staticmethod(lambda a, b: -(-a // b))


def _tiles(plan, q0, q_len, kv_len):
    env = {"T": _T, "q0": q0, "q_len": q_len, "kv_len": kv_len, "causal_offset": kv_len - q_len,
           "BLOCK_M": plan.spec.block_m, "BLOCK_N": plan.spec.block_n}
    first = eval(render.first_tile_expr(plan), env) if render.first_tile_expr(plan) else 0
    env["first_tile"] = first
    n = eval(render.n_tiles_expr(plan).split("  #")[0], env)
    return first, n


@pytest.mark.parametrize("window, causal", [((37, 21), False), ((0, 0), False), ((200, -1), True), ((-1, 5), False),
                                            ((130, 300), True), ((1, -1), False)])
def test_window_kernels_visit_exactly_the_tiles_holding_visible_keys(window, causal):
    plan = make_plan(Spec(window=list(window), causal=causal, head_dim=64, block_n=64))
    bm, bn = plan.spec.block_m, plan.spec.block_n
    rng = np.random.default_rng(0)
    for q_len, kv_len in [(1, 1), (300, 100), (100, 300), (129, 257), *rng.integers(1, 700, (20, 2)).tolist()]:
        off = kv_len - q_len
        keys = np.arange(kv_len)
        for q0 in range(0, q_len, bm):
            rows = np.arange(q0, q0 + bm)[:, None]  # the block's rows (past q_len too: they are computed, not stored)
            vis = np.ones((bm, kv_len), bool)
            if causal:
                vis &= keys <= rows + off
            if window[0] >= 0:
                vis &= keys >= rows + off - window[0]
            if window[1] >= 0:
                vis &= keys <= rows + off + window[1]
            needed = sorted({int(j) // bn for j in np.nonzero(vis.any(axis=0))[0]})
            first, n = _tiles(plan, q0, q_len, kv_len)
            visited = list(range(first, first + n))
            if needed:
                assert visited == list(range(needed[0], needed[-1] + 1)), (q_len, kv_len, q0)
            else:
                assert n == 1 and 0 <= first < -(-kv_len // bn)  # one fully masked tile, inside the tensor


@pytest.mark.parametrize("window, causal, consumers", [((270, -1), False, 1), ((100, -1), True, 2), ((37, 21), False, 3),
                                                       ((300, 0), False, 2), ((1, 200), False, 1), ((0, 0), False, 2)])
def test_unmasked_visits_are_whole_for_every_row_of_the_warpgroup(window, causal, consumers):
    """Exact, on the tile-count expressions: a visit the steady loop leaves unmasked (lead <= k < full_tiles)
    holds only keys every valid row of the warpgroup sees, at shapes that put an edge of a warpgroup's
    first or last row on m * BLOCK_N + {-1, 0, 1} (the `WG_ROWS - 2` left-edge count fails here)."""
    plan = make_plan(Spec(window=list(window), causal=causal, consumers=consumers, head_dim=64, block_n=64))
    bm, bn, rows = plan.spec.block_m, plan.spec.block_n, plan.wg_rows
    lead_text = render.lead_tiles_expr(plan) or "0"
    for q_len in (1, 64, 100, 130, 193):
        for kv_len in window_edge_kv_lens(plan, q_len, 400):
            off, keys = kv_len - q_len, np.arange(kv_len)
            for q0 in range(0, q_len, bm):
                first, n = _tiles(plan, q0, q_len, kv_len)
                for g in range(consumers):
                    env = {"T": _T, "q0": q0, "row0": g * rows, "WG_ROWS": rows, "BLOCK_N": bn, "kv_len": kv_len,
                           "causal_offset": off, "first_tile": first}
                    lead, full = eval(lead_text, env), eval(render.full_tiles_expr(plan), env)
                    r = np.arange(q0 + g * rows, min(q0 + g * rows + rows, q_len))[:, None]  # valid rows only
                    if not len(r):
                        continue  # rows past q_len are computed, never stored
                    vis = np.ones((len(r), kv_len), bool)
                    if causal:
                        vis &= keys <= r + off
                    if window[0] >= 0:
                        vis &= keys >= r + off - window[0]
                    if window[1] >= 0:
                        vis &= keys <= r + off + window[1]
                    for k in range(max(lead, 1), min(full, n)):  # unmasked steady visits
                        t = first + k
                        assert (t + 1) * bn <= kv_len and vis[:, t * bn:(t + 1) * bn].all(), (q_len, kv_len, q0, g, k)


# -- the kernel on the CPU model vs the fp64 reference ------------------------------------
CASES = [
    (dict(causal=True, window=[100, -1], softcap=30.0, lse=True), (1, 1, 300, 100)),
    (dict(window=[37, 21], consumers=3, head_dim=64, k_stages=3, lse=True), (2, 1, 129, 257)),
    (dict(window=[-1, 5], lse=True, consumers=1, dtype="bfloat16"), (1, 2, 333, 200)),
    (dict(window=[0, 0], sinks=True, lse=True, pingpong=False, v_stages=1), (1, 1, 200, 190)),
    (dict(head_dim=64, alibi=True, lse=True, causal=True), (1, 2, 77, 301)),
    (dict(gqa_group=2, sinks=True, lse=True, causal=True), (1, 1, 300, 100)),
    (dict(head_dim=192, head_dim_v=128, causal=True, dtype="bfloat16"), (1, 1, 129, 257)),
    (dict(head_dim=128, head_dim_v=64, consumers=3, block_n=64), (1, 1, 200, 333)),
    (dict(score_mod="score + rel[h, q_idx - kv_idx + 64] * 0.5", lse=True, gqa_group=2), (1, 1, 150, 180)),
    (dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]", causal=True, lse=True), (2, 1, 190, 257)),
    (dict(softcap=5.0, alibi=True, sinks=True, score_mod="score * 0.5 + bias[h]", mask_mod="kv_idx != q_idx + 3", window=[90, 40],
          lse=True, head_dim=64, head_dim_v=128, aligned=True),
     (1, 1, 256, 384)),
]


@pytest.mark.parametrize("fields, shape", CASES, ids=lambda x: make_plan(Spec(**x)).name if isinstance(x, dict) else None)
@pytest.mark.parametrize("policy", POLICIES)
def test_variant_kernel_matches_the_reference(fields, shape, policy):
    plan = make_plan(Spec(**fields))
    b, hkv, sq, skv = shape
    ok, text, _ = check_emulated(plan, b, hkv * plan.spec.gqa_group, hkv, sq, skv, seed=5, policy=policy)
    assert ok, f"{plan.name} {shape} {policy}: {text}"


# Window edges on a tile boundary and one key either side (issue 21): a bound off by one (the
# left-edge count `WG_ROWS - 2`, an edge test `>` for `>=`) changes which keys a row sees only there.
WINDOW_EDGE_CASES = [
    (dict(window=[270, -1], consumers=1), 64, 420),  # kv_len 400: the last row's left edge is 128 + 1
    (dict(window=[100, -1], causal=True, head_dim=64, block_n=64), 100, 200),
    (dict(window=[37, 21], head_dim=64, consumers=3, k_stages=3, lse=True), 70, 150),
]


@pytest.mark.parametrize("fields, q_len, max_kv", WINDOW_EDGE_CASES,
                         ids=lambda x: make_plan(Spec(**x)).name if isinstance(x, dict) else None)
def test_window_edges_at_tile_multiples_match_the_reference(fields, q_len, max_kv):
    plan = make_plan(Spec(**fields))
    lens = window_edge_kv_lens(plan, q_len, max_kv)
    assert len(lens) >= 9
    for kv_len in lens:
        ok, text, _ = check_emulated(plan, 1, plan.spec.gqa_group, 1, q_len, kv_len, seed=3)
        assert ok, f"{plan.name} q_len={q_len} kv_len={kv_len}: {text}"


def test_variant_inputs_make_the_document_mask_non_trivial():
    plan = make_plan(Spec(mask_mod="doc[b, q_idx] == doc[b, kv_idx]", causal=True, lse=True))
    _, _, _, tensors = variant_inputs(plan, 2, 1, 1, 190, 257, seed=5)
    doc = tensors["doc"]
    assert doc.shape == (2, 265) and 1 < len(np.unique(doc[0])) and np.all(np.diff(doc, axis=1) >= 0)
    out, lse = attention(*random_inputs("float16", 128, 2, 1, 1, 190, 257), True, **variant_of(plan.spec, tensors={"doc": doc}))
    assert np.isfinite(lse).mean() > 0.5  # most rows see some key of their document


def test_lse_of_rows_that_see_no_key_is_minus_inf_and_their_output_zero():
    spec = Spec(causal=True, lse=True, head_dim=64)
    q, k, v = random_inputs("float16", 64, 1, 1, 1, 200, 50)
    out, lse = emulate(spec, q, k, v)
    assert np.all(np.isneginf(lse[0, 0, :150])) and np.all(np.isfinite(lse[0, 0, 150:]))
    assert np.all(out[0, :150] == 0)
    assert check_lse(lse, q, k, v, True, dtype="float16").ok
    assert not check_lse(lse + math.log(2), q, k, v, True, dtype="float16").ok


def test_emulate_returns_torch_out_and_lse_for_torch_input():
    spec = Spec(lse=True, head_dim=64, sinks=True)
    q, k, v = (torch.from_numpy(x).half() for x in random_inputs("float16", 64, 1, 2, 2, 70, 90))
    out, lse = emulate(spec, q, k, v, sinks=torch.zeros(2))
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and tuple(lse.shape) == (1, 2, 70)


# -- the reference against independent formulas -------------------------------------------
def _naive(q, k, v, bias=None, visible=None, sink=None):
    """One head, fp64, no tricks: softmax over (scores + bias) with masked keys dropped."""
    s = q @ k.T / math.sqrt(q.shape[1]) + (0 if bias is None else bias)
    s = np.where(visible if visible is not None else True, s, -np.inf)
    e = np.exp(s)
    den = e.sum(1, keepdims=True) + (0 if sink is None else math.exp(sink))
    return e @ v / den, np.log(den[:, 0])


def test_reference_variants_against_naive_formulas():
    rng = np.random.default_rng(1)
    sq, skv, d = 7, 11, 16
    q, k, v = rng.standard_normal((1, sq, 1, d)), rng.standard_normal((1, skv, 1, d)), rng.standard_normal((1, skv, 1, 8))
    Q, K, V = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    i, j = np.arange(sq)[:, None] + (skv - sq), np.arange(skv)[None, :]
    raw = Q @ K.T / math.sqrt(d)
    checks = [
        (dict(window=(2, 1)), _naive(Q, K, V, visible=(j >= i - 2) & (j <= i + 1))),
        (dict(softcap=0.5), _naive(Q, K, V, bias=0.5 * np.tanh(raw / 0.5) - raw)),
        (dict(alibi_slopes=np.array([0.25])), _naive(Q, K, V, bias=-0.25 * np.abs(i - j))),
        (dict(sinks=np.array([1.5])), _naive(Q, K, V, sink=1.5)),
        (dict(score_mod="score * 2 + t[kv_idx]", tensors={"t": np.arange(skv) / 10}), _naive(Q, K, V, bias=raw + j / 10)),
        (dict(mask_mod="kv_idx != 3"), _naive(Q, K, V, visible=j != 3)),
    ]
    for variant, (want_o, want_lse) in checks:
        out, lse = attention(q, k, v, False, **variant)
        np.testing.assert_allclose(out[0, :, 0], want_o, atol=1e-12, err_msg=str(variant))
        np.testing.assert_allclose(lse[0, 0], want_lse, atol=1e-12, err_msg=str(variant))
    # causal is the window [-1, 0]; softcap runs before the mask (a masked key stays out whatever the cap)
    np.testing.assert_array_equal(attention(q, k, v, True)[0], attention(q, k, v, False, window=(-1, 0))[0])
    out, _ = attention(q, k, v, True, softcap=0.5)
    np.testing.assert_allclose(out[0, :, 0], _naive(Q, K, V, bias=0.5 * np.tanh(raw / 0.5) - raw, visible=j <= i)[0], atol=1e-12)


def test_variant_of_reads_the_spec():
    spec = Spec(window=[3, 4], softcap=2.0, alibi=True, sinks=False, score_mod="score", mask_mod="q_idx >= 0")
    v = variant_of(spec, alibi_slopes=[1.0], sinks=[2.0], tensors={"x": [1]})
    assert v == {"window": (3, 4), "softcap": 2.0, "alibi_slopes": [1.0], "sinks": None, "score_mod": "score",
                 "mask_mod": "q_idx >= 0", "tensors": {"x": [1]}}


# -- call-time tensors ----------------------------------------------------------------------
def _torch_inputs(plan, b=1, hkv=2, sq=5, skv=7):
    q, k, v, tensors = variant_inputs(plan, b, hkv * plan.spec.gqa_group, hkv, sq, skv)
    dt = getattr(torch, plan.spec.dtype)
    return [torch.from_numpy(x).to(dt) for x in (q, k, v)], {n: torch.from_numpy(x) for n, x in tensors.items()}


@pytest.mark.parametrize("mutate, argument, fragment", [
    (lambda t: t.pop("sinks"), "sinks", "a float32 tensor of shape [heads = 2]: the spec uses it"),
    (lambda t: t.update(sinks=t["sinks"].half()), "sinks.dtype", "torch.float32"),
    (lambda t: t.update(sinks=torch.zeros(3)), "sinks.shape", "[heads = 2]"),
    (lambda t: t.update(sinks=[0.0, 1.0]), "sinks", "a torch.Tensor"),
    (lambda t: t.update(rel=torch.zeros(2, 3)), "rel", "no such tensor: the spec takes sinks, bias"),
    (lambda t: t.update(bias=torch.zeros(4, 2)[:, 0]), "bias.shape", "[heads = 2]"),
    (lambda t: t.update(bias=torch.zeros(4)[::2]), "bias.stride()", "a contiguous tensor"),
])
def test_call_time_tensors_are_checked(mutate, argument, fragment):
    plan = make_plan(Spec(sinks=True, score_mod="score + bias[h]", lse=True))
    (q, k, v), tensors = _torch_inputs(plan)
    dims = check_tensors(plan, q, k, v)
    assert [x.shape for x in check_extra(plan, dims, tensors)] == [(2,), (2,)]
    mutate(tensors)
    with pytest.raises(InputError) as info:
        check_extra(plan, dims, tensors)
    assert info.value.argument == argument and fragment in str(info.value), str(info.value)


def test_head_dim_v_shapes_are_checked():
    plan = make_plan(Spec(head_dim=192, head_dim_v=128))
    (q, k, v), _ = _torch_inputs(plan)
    assert check_tensors(plan, q, k, v, torch.empty(*q.shape[:3], 128, dtype=q.dtype)) == (1, 2, 2, 5, 7)
    with pytest.raises(InputError) as info:
        check_tensors(plan, q, k, torch.empty(*k.shape[:3], 192, dtype=q.dtype))
    assert info.value.argument == "v.shape[3] (head_dim_v)"
    with pytest.raises(InputError) as info:
        check_tensors(plan, q, k, v, torch.empty_like(q))
    assert info.value.argument == "out.shape[3] (head_dim_v)"


def test_emulate_checks_call_time_tensors():
    spec = Spec(head_dim=64, alibi=True)
    q, k, v = random_inputs("float16", 64, 1, 2, 2, 9, 9)
    with pytest.raises(InputError, match=r"alibi_slopes = None: expected a float32 tensor of shape \[heads = 2\]"):
        emulate(spec, q, k, v)
    with pytest.raises(InputError, match=r"alibi_slopes.shape = \[3\]: expected \[heads = 2\]"):
        emulate(spec, q, k, v, alibi_slopes=np.zeros(3))
    with pytest.raises(InputError, match=r"bias = a tensor of shape \[2\]: expected no such tensor: the spec takes alibi_slopes"):
        emulate(spec, q, k, v, alibi_slopes=np.zeros(2), bias=np.zeros(2))


def test_a_misspelt_keyword_of_the_emulators_names_the_nearest_tensor_or_spec_field():
    """issue 25: emulate_backward(..., casual=True) said only "no such tensor"; attention's did-you-mean
    (spec.did_you_mean) now names the nearest call-time tensor, or else the spec field meant."""
    from attngen.emulator import emulate_backward

    spec = Spec(head_dim=64, sinks=True)
    q, k, v = random_inputs("float16", 64, 1, 2, 2, 9, 9)
    sinks = np.zeros(2, np.float32)
    with pytest.raises(InputError, match=r"casual = bool: expected no such tensor: did you mean `causal`, a spec field "
                                         r"\(set on the spec\)\? the spec takes sinks"):
        emulate_backward(spec, q, k, v, q, sinks=sinks, casual=True)
    with pytest.raises(InputError, match=r"sink = a tensor of shape \[2\]: expected no such tensor: did you mean `sinks`\? "):
        emulate(spec, q, k, v, sinks=sinks, sink=sinks)
    with pytest.raises(InputError, match=r"alibi_slope = .*: did you mean `alibi_slopes`\? the spec takes no extra tensors"):
        attngen.attention(*(torch.from_numpy(x).half() for x in (q, k, v)), alibi_slope=torch.ones(2))


def test_attention_builds_the_variant_spec_from_its_keywords(monkeypatch):
    """attngen.attention maps its keywords to spec fields and tensors (compile stubbed: no GPU)."""
    from attngen.run import runtime

    seen = {}

    def fake_compile(plan):
        seen["plan"] = plan

        def kernel(q, k, v, *, out=None, check=True, softmax_scale=None, **tensors):
            seen.update(tensors=tensors, scale=softmax_scale)

        return kernel

    monkeypatch.setattr(runtime, "compile_kernel", fake_compile)
    monkeypatch.setattr(runtime, "check_device", lambda tensors: seen.setdefault("devices", sorted(tensors)))
    q, k, v = (torch.zeros(1, 5, 2, 64, dtype=torch.float16) for _ in range(3))
    v = torch.zeros(1, 5, 2, 128, dtype=torch.float16)
    runtime.attention(q, k, v, causal=True, window=(16, 0), softcap=30.0, alibi_slopes=torch.ones(2), sinks=torch.ones(2),
                      return_lse=True, score_mod="score + bias[h]", bias=torch.zeros(2), consumers=1)
    spec = seen["plan"].spec
    assert (spec.causal, spec.window, spec.softcap, spec.alibi, spec.sinks, spec.lse, spec.head_dim_v, spec.consumers) == \
        (True, (16, -1), 30.0, True, True, True, 128, 1)  # canonical: under causal the right bound 0 says nothing
    assert sorted(seen["tensors"]) == ["alibi_slopes", "bias", "sinks"]
    assert seen["scale"] == 64 ** -0.5  # the default, resolved before the kernel is called
    assert seen["devices"] == ["alibi_slopes", "bias", "k", "q", "sinks", "v"]
    with pytest.raises(InputError) as info:
        runtime.attention(q, k, v, score_mod="score + bias[h]")
    assert info.value.argument == "bias"


def test_builtin_variants_agree_with_the_same_maths_as_mods():
    """softcap and (with q_len == kv_len) ALiBi written as score_mods give the built-in fields' outputs."""
    q, k, v = random_inputs("float16", 64, 1, 2, 2, 150, 150)
    slopes = np.array([0.5, 0.125], np.float32)
    pairs = [(Spec(head_dim=64, softcap=3.0), Spec(head_dim=64, score_mod="3 * tanh(score / 3)"), {}, {}),
             (Spec(head_dim=64, alibi=True), Spec(head_dim=64, score_mod="score - slope[h] * abs(q_idx - kv_idx)"),
              {"alibi_slopes": slopes}, {"slope": slopes})]
    for builtin, mod, t1, t2 in pairs:
        a, b = emulate(builtin, q, k, v, **t1), emulate(mod, q, k, v, **t2)
        assert np.abs(a - b).max() <= 2e-3, (builtin, mod)


def test_element_wise_variants_enter_the_register_estimate():
    from attngen import hw
    from attngen.kernels.fwd.plan import regs_needed

    base = regs_needed(Spec(consumers=3), 80)
    for fields in (dict(softcap=30.0), dict(alibi=True), dict(score_mod="score"), dict(mask_mod="kv_idx >= 0")):
        assert regs_needed(Spec(consumers=3, **fields), 80) == base + hw.VARIANT_REG_OVERHEAD, fields
    for fields in (dict(lse=True), dict(sinks=True)):  # fit with the base estimate (ptxas)
        assert regs_needed(Spec(consumers=3, **fields), 80) == base, fields
    # a window masks along a diagonal, as causal does (issue 21); the variants' share already covers it
    assert regs_needed(Spec(consumers=3, window=[300, -1]), 80) == base + hw.DIAGONAL_MASK_REG_OVERHEAD[3]
    assert regs_needed(Spec(consumers=3, window=[300, -1], softcap=30.0), 80) == base + hw.VARIANT_REG_OVERHEAD
    assert make_plan(Spec(consumers=3, softcap=30.0)).spec.block_n < make_plan(Spec(consumers=3)).spec.block_n
    with pytest.raises(SpecError) as info:
        make_plan(Spec(consumers=3, block_n=80, softcap=30.0))
    assert info.value.field == "block_n" and f"variants {hw.VARIANT_REG_OVERHEAD}" in str(info.value)


@pytest.mark.parametrize("fields, shape", [
    (dict(causal=True, window=[100, -1], softcap=30.0, lse=True), (1, 1, 300, 100)),
    (dict(window=[37, 21], consumers=3, head_dim=64, lse=True, sinks=True), (1, 1, 129, 257)),
    (dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]", causal=True, lse=True, alibi=True), (2, 1, 190, 257)),
])
def test_variant_kernels_specialised_to_a_static_shape(fields, shape):
    spec = Spec(**fields)
    b, hkv, sq, skv = shape
    h = hkv * spec.gqa_group
    static = make_plan(spec, attngen.Shape(b, h, hkv, sq, skv))
    source = attngen.render_source(static)
    assert "T.dynamic(\"q_len\")" not in source
    ok, text, _ = check_emulated(make_plan(spec), b, h, hkv, sq, skv, seed=2, source=source)
    assert ok, text
