"""The three serving presets on the CPU model: ragged batches against the per-sequence fp64 reference.

Unused cache rows and pages hold 1e4 (serving.random_serving_inputs' neighbour_fill), so a
kernel that reads a key past its sequence, or a page of another sequence, moves the output far
outside the tolerance; outputs start as NaN, so a row no block wrote stays NaN, and every
store is checked against the rows its block owns (emulator/driver.py, ownership).
"""

from pathlib import Path

import numpy as np
import pytest

import attngen
from attngen.emulator.driver import check_emulated, emulate_stats, serving_lengths
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError
from attngen.kernels.fwd.render import render_source
from attngen.reference.serving import check_serving_close, random_serving_inputs
from attngen.run.serving import check_serving

ROOT = Path(__file__).resolve().parent.parent
VARLEN = make_plan(attngen.load_spec(ROOT / "examples" / "varlen_hd128_bf16_causal.toml"))
VARLEN_PAGED = make_plan(attngen.load_spec(ROOT / "examples" / "varlen_paged_hd64_f16.toml"))
DECODE = make_plan(attngen.load_spec(ROOT / "examples" / "paged_decode_hd128_bf16_gqa8_splits.toml"))


def run(plan, lq, lk, *, heads=None, kv_heads=2, seed=0, padding=0, num_splits=None, fill=1e4, source=None):
    """Emulate `plan` on one ragged batch; returns (out, lse or None, inputs, call, stats)."""
    spec = plan.spec
    heads = heads or kv_heads * spec.gqa_group
    x = random_serving_inputs(spec.layout, spec.paged_kv, plan.page_size or None, spec.dtype, spec.head_dim, None,
                              lq, lk, heads, kv_heads, seed=seed, neighbour_fill=fill)
    q = np.concatenate([x.q, np.full((padding, *x.q.shape[1:]), 7.0, np.float32)]) if padding else x.q
    kw = dict(x.keywords, **({"num_splits": num_splits} if num_splits else {}))
    result, stats = emulate_stats(plan, q, x.k, x.v, seed=seed, serving=kw, source=source)
    out, lse = result if spec.lse else (result, None)
    return out, lse, (q, x), check_serving(plan, q, x.k, x.v, **kw), stats


def close(plan, out, lse, inputs, call):
    q, x = inputs
    return check_serving_close(out, q, x.k, x.v, call, plan.spec.causal, plan.spec.dtype, lse=lse)


# Ragged batches: an empty sequence, one row, block multiples and one off, more queries than keys.
VARLEN_BATCHES = [
    ([128, 1, 0, 129, 127], [128, 300, 7, 129, 255]),
    ([200, 64], [40, 64]),  # the first sequence has more rows than keys: its top rows see nothing
    ([1], [1]),
]


@pytest.mark.parametrize("plan", [VARLEN, VARLEN_PAGED], ids=["varlen", "varlen_paged"])
@pytest.mark.parametrize("lq, lk", VARLEN_BATCHES)
def test_varlen_presets_match_each_sequence_and_leave_padding_alone(plan, lq, lk):
    out, lse, inputs, call, _ = run(plan, lq, lk, padding=9)
    res = close(plan, out, lse, inputs, call)
    assert res.ok, res
    end = sum(lq)
    assert np.isfinite(out[:end]).all()  # every real row written, and finite
    assert np.isnan(out[end:]).all()  # the padding rows after the last sequence never written


def test_a_sequence_without_keys_outputs_zero():
    out, _, inputs, call, _ = run(VARLEN_PAGED, [3, 5], [0, 130])
    assert np.array_equal(out[:3], np.zeros_like(out[:3]))
    assert close(VARLEN_PAGED, out, None, inputs, call).ok


@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])  # 40: more splits than the 8 K tiles there are
def test_decode_preset_with_any_number_of_splits(num_splits):
    lk = [1000, 129, 1, 0]  # 8 tiles, two tiles (one key into the second), one key, none
    out, _, inputs, call, stats = run(DECODE, [1] * 4, lk, num_splits=num_splits)
    res = close(DECODE, out, None, inputs, call)
    assert res.ok, res
    assert call.num_splits == num_splits
    lse_partial = stats.partials["LSE_partial"]
    assert lse_partial.shape[0] == num_splits
    # a split past a sequence's tiles saw nothing: -inf, which the combine weighs 0
    assert np.isneginf(lse_partial[:, 3]).all()
    if num_splits == 40:
        assert np.isneginf(lse_partial[8:, 0]).all() and np.isfinite(lse_partial[:8, 0]).all()


def test_decode_preset_chooses_its_splits_when_auto():
    out, _, inputs, call, stats = run(DECODE, [1, 1], [4000, 2000])  # 2 sequences x 2 KV heads: a near-empty grid
    assert call.num_splits > 1 and stats.partials["O_partial"].shape[0] == call.num_splits
    assert close(DECODE, out, None, inputs, call).ok


def test_decode_preset_with_several_query_tokens():
    """Speculative decoding / chunked prefill: q_len 9 packs 72 rows per KV head into two tiles."""
    out, _, inputs, call, _ = run(DECODE, [9, 9, 9], [9, 500, 3], num_splits=3)
    res = close(DECODE, out, None, inputs, call)
    assert res.ok, res


def test_emulate_takes_the_serving_keywords_and_validates_them():
    spec = VARLEN.spec
    x = random_serving_inputs("varlen", False, None, spec.dtype, 128, None, [5, 3], [5, 9], 2, 2, seed=3)
    out = attngen.emulate(spec, x.q, x.k, x.v, **x.keywords)
    assert out.shape == x.q.shape
    with pytest.raises(InputError) as e:  # the varlen spec needs the offsets
        attngen.emulate(spec, x.q, x.k, x.v)
    assert "cu_seqlens_q" in str(e.value)
    bad = dict(x.keywords, cu_seqlens_k=np.array([0, 9, 5], np.int32))
    with pytest.raises(InputError) as e:
        attngen.emulate(spec, x.q, x.k, x.v, **bad)
    assert "cu_seqlens_k[2] = 5" in str(e.value)


@pytest.mark.parametrize("plan", [VARLEN, VARLEN_PAGED, DECODE], ids=["varlen", "varlen_paged", "decode"])
def test_check_runs_the_ragged_batch_and_fails_a_broken_kernel(plan):
    ok, text, _ = check_emulated(plan, 1, 2 * plan.spec.gqa_group, 2, 130, 200)
    assert ok, text
    lq, lk = serving_lengths(plan.spec.layout, 130, 200, paged=plan.spec.paged_kv)
    assert f"q {lq}, kv {lk}" in text
    # a kernel that takes one key too many for every sequence: the 1e4 neighbours show
    broken = render_source(plan).replace("kv_len = ", "kv_len = 1 + ", 1)
    assert broken != render_source(plan)
    ok, text, _ = check_emulated(plan, 1, 2 * plan.spec.gqa_group, 2, 130, 200, source=broken)
    assert not ok and "FAIL" in text


@pytest.mark.parametrize("fields, old, new", [
    ({"alibi": True}, "Alibi[head]", "Alibi[0]"),  # every head takes head 0's slope
    ({"sinks": True}, "Sinks[head] / softmax_scale", "0.0"),  # the sink's logit dropped
    ({"alibi": True, "paged_kv": True}, "Alibi[head]", "Alibi[0]"),
], ids=["alibi", "sinks", "alibi_paged"])
def test_the_serving_check_passes_the_variants_call_time_tensors(fields, old, new):
    """check_emulated on a ragged batch draws the variant's tensors (as variant_inputs does) and holds the
    kernel to the reference with them (attngen check on a varlen ALiBi spec stopped: alibi_slopes = None)."""
    plan = make_plan(attngen.Spec(head_dim=64, causal=True, layout="varlen", **fields))
    ok, text, _ = check_emulated(plan, 1, 2, 2, 130, 200)
    assert ok, text
    broken = render_source(plan).replace(old, new)
    assert broken != render_source(plan)
    ok, text, _ = check_emulated(plan, 1, 2, 2, 130, 200, source=broken)
    assert not ok and "FAIL" in text


def test_check_runs_a_dense_split_kv_kernel_at_the_given_shape():
    """split-KV alone keeps a dense bshd KV, one key length per batch: the check runs the lengths it
    was given (issue 25: it drew the ragged batch and crashed on its unequal key lengths)."""
    plan = make_plan(attngen.Spec(head_dim=64, splits=2))
    ok, text, _ = check_emulated(plan, 2, 2, 2, 70, 333)
    assert ok and text.startswith("2 sequences (q [70, 70], kv [333, 333], 3 splits): "), text
    broken = render_source(plan).replace("first_tile = split_idx * tiles_per_split", "first_tile = split_idx * tiles_per_split + 1", 1)
    assert broken != render_source(plan)  # each split skips its first tile
    ok, text, _ = check_emulated(plan, 2, 2, 2, 70, 333, source=broken)
    assert not ok and "FAIL" in text


def test_windows_softcap_and_lse_align_per_sequence():
    """A sliding window and softcap on a varlen batch: bottom-right per sequence, LSE included."""
    from attngen.reference.forward import variant_of

    plan = make_plan(attngen.Spec(head_dim=64, causal=True, layout="varlen", window=(70, 0), softcap=20.0, lse=True))
    out, lse, inputs, call, _ = run(plan, [150, 1, 40, 0], [300, 90, 20, 6])
    q, x = inputs
    res = check_serving_close(out, q, x.k, x.v, call, True, plan.spec.dtype, lse=lse, **variant_of(plan.spec))
    assert res.ok, res
    wrong = check_serving_close(out, q, x.k, x.v, call, True, plan.spec.dtype, lse=lse,
                                **variant_of(attngen.Spec(head_dim=64, causal=True, window=(71, 0), softcap=20.0)))
    assert not wrong.ok  # the check sees a window one key wider
