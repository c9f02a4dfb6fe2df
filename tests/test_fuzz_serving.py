"""Hypothesis: ragged serving batches on the CPU model of Hopper (issue 11, docs/serving.md).

Each example draws a serving kernel from a small set (varlen with a dense KV, causal or not;
varlen over a paged cache; bshd over a paged cache with splits and packed GQA; varlen with
splits), a ragged batch for it (tests/strategies.py ragged_batches: empty sequences, length 1,
block and page multiples plus and minus one, q_len > kv_len, shuffled pages, num_splits from 1 to
more than there are tiles), padding rows after the last sequence (cu_seqlens_q[-1] <
q.shape[0]) and a schedule, emulates the rendered kernel (and, split, its combine kernel) and
requires:

- every sequence within the fp64 reference's tolerance (serving.check_serving_close), the LSE
  too for a spec with lse;
- no NaN in a row some sequence owns (outputs start NaN-poisoned: a row no block wrote stays NaN);
- the NaN poison untouched in padding rows, of the output and of the LSE;
- no store outside the rows its block owns (the emulator's ownership rule raises KernelError).

Unused cache rows and spare pages hold 1e4 (neighbour_fill) in most examples, and padding key
rows of a dense varlen KV do too, so a read past a sequence's last key is far off the reference.
Profiles (tests/conftest.py): ci (default) runs 4x the profile's examples (80, each 0.1-1 s:
about 25 s on two cores) plus the hand-picked ones; dev 1200.
"""

import numpy as np
import pytest
from hypothesis import event, example, given, note, settings, strategies as st

import attngen
from attngen.emulator import POLICIES
from attngen.emulator.driver import emulate_stats
from attngen.reference.serving import check_serving_close, random_serving_inputs
from attngen.run.serving import check_serving
from strategies import ragged_batches, softmax_scales

EXAMPLES = 4 * settings().max_examples
FILL = 1e4  # neighbour_fill: keys 0, values 1e4 in every KV row no sequence owns

# (name, layout, paged, spec fields, query heads per KV head, split): small kernels, hd64, block_n 64.
KINDS = [
    ("varlen_dense", "varlen", False, {}, (1, 2), False),
    ("varlen_paged", "varlen", True, {}, (1, 2), False),
    ("bshd_paged_split_pack_gqa", "bshd", True, {"consumers": 1}, (2, 4), True),
    ("varlen_split", "varlen", False, {"consumers": 1}, (1, 2), True),
    ("varlen_paged_split", "varlen", True, {"consumers": 1}, (1, 2), True),
]


@st.composite
def serving_cases(draw, kinds=tuple(range(len(KINDS)))):
    """(kind name, spec, the batch from ragged_batches, padding rows, num_splits or None, policy, softmax scale)."""
    name, layout, paged, fixed, groups, split = KINDS[draw(st.sampled_from(kinds))]
    consumers = fixed.get("consumers", draw(st.integers(1, 2)))
    batch = draw(ragged_batches(block_m=64 * consumers, block_n=64, max_batch=4, max_tiles=3, layouts=(layout,),
                                paged=(paged,), groups=groups))
    a = batch["inputs"]
    spec = attngen.Spec(head_dim=64, dtype=a["dtype"], causal=draw(st.booleans()), lse=draw(st.booleans()),
                        gqa_group=a["heads"] // a["kv_heads"], consumers=consumers, block_n=64, layout=layout,
                        paged_kv=paged, page_size=a["page_size"], splits="auto" if split else 1)
    # 1 .. two more than the KV tiles (ragged_batches), sometimes "auto" (1 for these short batches)
    num_splits = draw(st.sampled_from(["auto"] + [batch["num_splits"]] * 3)) if split else None
    pad = draw(st.sampled_from([0, 0, 1, 5])) if layout == "varlen" else 0
    return name, spec, batch, pad, num_splits, draw(st.sampled_from(POLICIES)), draw(softmax_scales())


def padded(x, layout, paged, pad):
    """q (and a dense varlen KV) with `pad` rows past the last sequence: q's hold 1e4 (a sequence's
    row computed from one would be far off), the KV's keys 0 and values FILL, as neighbour_fill
    does in a cache (a key past the last sequence's end that is not masked drags its rows to 1e4)."""
    q, k, v = x.q, x.k, x.v
    if layout != "varlen" or not pad:
        return q, k, v
    q = np.concatenate([q, np.full((pad, *q.shape[1:]), FILL, np.float32)])
    if not paged:
        k = np.concatenate([k, np.zeros((pad, *k.shape[1:]), np.float32)])
        v = np.concatenate([v, np.full((pad, *v.shape[1:]), FILL, np.float32)])
    return q, k, v


def run_serving_case(name, spec, batch, pad, num_splits, policy, scale=None):
    """Emulate one drawn case and hold it to every rule of the module docstring; returns the plan,
    the call and the outputs (out, and lse or None) for a caller that checks more. `scale`: the
    run-time softmax scale, given to the kernel and the reference (None: 1/sqrt(head_dim))."""
    plan = attngen.make_plan(spec)
    a = batch["inputs"]
    x = random_serving_inputs(**a)
    layout, paged = a["layout"], a["paged"]
    q, k, v = padded(x, layout, paged, pad)
    keywords = dict(x.keywords)
    if num_splits is not None:
        keywords["num_splits"] = num_splits
    call = check_serving(plan, q, k, v, **keywords)
    event(f"{name}, {call.num_splits if spec.splits != 1 else 'no'} split(s)")
    note(f"{name}: {plan.name} q_lens={list(a['seq_lens_q'])} kv_lens={list(a['seq_lens_k'])} pad={pad} "
         f"heads={a['heads']}/{a['kv_heads']} page_size={a['page_size']} shuffle={a['shuffle_pages']} "
         f"fill={a['neighbour_fill']} num_splits={num_splits}->{call.num_splits} seed={a['seed']} policy={policy} softmax_scale={scale}")
    result, _ = emulate_stats(plan, q, k, v, seed=a["seed"], policy=policy, serving=keywords,
                              softmax_scale=scale)  # KernelError: a bad store
    out, lse = result if spec.lse else (result, None)
    res = check_serving_close(out, q, k, v, call, spec.causal, spec.dtype, lse=lse, scale=scale)
    assert res.ok, f"{plan.name}: {res}"

    # rows some sequence owns: written (no NaN); padding rows: the poison untouched
    if layout == "varlen":
        used = int(x.cu_seqlens_q[-1])
        assert not np.isnan(out[:used]).any(), f"rows of a sequence left unwritten: {np.argwhere(np.isnan(out[:used]))[:4]}"
        assert np.isnan(out[used:]).all(), f"padding rows {used}..{out.shape[0] - 1} written"
        if lse is not None:
            assert not np.isnan(lse[:, :used]).any(), "LSE of a sequence's row left unwritten"
            assert np.isnan(lse[:, used:]).all(), f"LSE padding rows {used}.. written"
    else:
        assert not np.isnan(out).any(), "rows left unwritten"
        assert lse is None or not np.isnan(lse).any(), "LSE rows left unwritten"
    return plan, call, out, lse


# A few cases picked by hand, run before the drawn ones: every kind, with empty sequences,
# q_len > kv_len, block multiples +- 1, padding rows, and more splits than tiles.
def _batch(layout, paged, lq, lk, heads, kv_heads, page_size=None, seed=1, num_splits=1, fill=FILL):
    return {"inputs": dict(layout=layout, paged=paged, page_size=page_size, dtype="float16", head_dim=64,
                           head_dim_v=None, seq_lens_q=lq, seq_lens_k=lk, heads=heads, kv_heads=kv_heads, seed=seed,
                           shuffle_pages=True, neighbour_fill=fill if paged else None),
            "block_m": 64, "block_n": 64, "num_splits": num_splits}


def _spec(layout, paged, causal, lse=False, page_size=None, split=False, gqa_group=1, consumers=1):
    return attngen.Spec(head_dim=64, causal=causal, lse=lse, gqa_group=gqa_group, consumers=consumers, block_n=64,
                        layout=layout, paged_kv=paged, page_size=page_size, splits="auto" if split else 1)


HAND = [
    ("varlen_dense", _spec("varlen", False, True, lse=True), _batch("varlen", False, [0, 1, 65, 63, 9], [3, 64, 129, 0, 5], 2, 2), 5, None),
    ("varlen_dense", _spec("varlen", False, False, gqa_group=2, consumers=2),
     _batch("varlen", False, [129, 0, 2], [63, 7, 1], 4, 2), 1, None),
    ("varlen_paged", _spec("varlen", True, True, lse=True, page_size=128),
     _batch("varlen", True, [70, 0, 1], [129, 5, 0], 1, 1, page_size=128), 3, None),
    ("bshd_paged_split_pack_gqa", _spec("bshd", True, True, lse=True, page_size=64, split=True, gqa_group=4),
     _batch("bshd", True, [1, 1, 1], [191, 0, 65], 8, 2, page_size=64), 0, 5),
    ("varlen_split", _spec("varlen", False, True, lse=True, split=True, gqa_group=2),
     _batch("varlen", False, [3, 0, 70], [150, 4, 20], 4, 2), 2, 4),
]


def _hand_examples(fn):
    for i, (name, spec, batch, pad, splits) in enumerate(HAND):
        fn = example(case=(name, spec, batch, pad, splits, POLICIES[i % len(POLICIES)], [None, 1.0, 0.01][i % 3]))(fn)
    return fn


@pytest.mark.expensive
@settings(max_examples=EXAMPLES)
@given(case=serving_cases())
@_hand_examples
def test_ragged_serving_batches_match_the_reference_and_keep_padding_poisoned(case):
    run_serving_case(*case)
