"""Deliberately broken serving kernels (issue 11): the CPU model must catch each.

As in tests/test_variant_mutants.py, each mutant is a textual edit of the rendered source. The
test asserts that the edit applies, that the unmodified kernel passes on the same inputs, seed
and schedule (every sequence within the fp64 reference, padding rows left NaN), and that the
mutant is caught by what its `caught_by` names:

- "reference": the emulation completes and serving.check_serving_close fails (a sequence, or
  its LSE, is off the fp64 reference of that sequence alone);
- "ownership": the emulator raises KernelError for a store outside the rows the block owns,
  before any output is compared.

Inputs are small (head_dim 64, block_n 64, a few sequences) and ragged: an empty sequence,
lengths past a tile edge, a sequence with more queries than keys, shuffled pages whose unused
rows hold 1e4 (neighbour_fill), and padding rows after the last sequence.
"""

import dataclasses
import re

import numpy as np
import pytest

import attngen
from attngen.emulator import KernelError
from attngen.emulator.driver import emulate_stats
from attngen.reference.serving import check_serving_close, random_serving_inputs
from attngen.run.serving import check_serving

FILL = 1e4


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One serving call: lengths per sequence, heads, the cache's page size, splits, padding rows."""

    seq_lens_q: tuple
    seq_lens_k: tuple
    heads: int = 2
    kv_heads: int = 1
    num_splits: object = None
    pad: int = 0  # varlen: rows after cu_seqlens_q[-1] (and, dense, after cu_seqlens_k[-1])
    seed: int = 3
    policy: str = "random"


# Sequence 1 spans two 64-row query blocks and three 64-key tiles; sequence 2 is empty;
# sequence 3 has more queries than keys (its first 13 rows see no key when causal).
VARLEN = Inputs((5, 70, 0, 33), (9, 130, 4, 20), pad=3)
# Decode: one query per sequence against 191, 9 and 130 cached keys, GQA 4, three splits
# (sequence 1 fits in split 0's one tile: the other splits see no key, LSE -inf).
DECODE = Inputs((1, 1, 1), (191, 9, 130), heads=8, kv_heads=2, num_splits=3)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    caught_by: str  # "reference" or "ownership"
    spec: dict
    edit: object  # source -> mutated source
    inputs: Inputs = VARLEN


def replace(old, new, count=None):
    """Replace `old` by `new` (every occurrence, or exactly `count` of them) and assert it applied."""

    def edit(source):
        n = source.count(old)
        assert n >= 1, f"edit no longer applies to the rendered source: {old!r}"
        assert count is None or n == count, f"{old!r} occurs {n} times, expected {count}"
        return source.replace(old, new)

    return edit


def sub(pattern, new, count):
    """re.subn, asserting exactly `count` matches."""

    def edit(source):
        out, n = re.subn(pattern, new, source)
        assert n == count, f"edit no longer applies: {pattern!r} matched {n} times, expected {count}"
        return out

    return edit


def chain(*edits):
    def edit(source):
        for e in edits:
            source = e(source)
        return source

    return edit


VARLEN_SPEC = dict(head_dim=64, block_n=64, consumers=1, layout="varlen", gqa_group=2)
VARLEN_PAGED_SPEC = dict(VARLEN_SPEC, paged_kv=True, page_size=64)
DECODE_SPEC = dict(head_dim=64, block_n=64, consumers=1, gqa_group=4, paged_kv=True, page_size=64, splits="auto",
                   causal=True, lse=True)
VARLEN_SPLIT_SPEC = dict(VARLEN_SPEC, splits="auto", lse=True)

# The varlen store of one row at a time, and what a TMA-style whole-tile store would be instead.
ROW_STORE = (
    "        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):\n"
    "            if q0 + row0 + i < q_len:  # not a TMA store: a whole tile would overwrite the next sequence's rows\n"
    "                O[q_start + q0 + row0 + i, head, j] = O_shared[g, i, j]\n")
TILE_STORE = (
    "        T.fence_proxy_async()  # the O_shared stores visible to the TMA engine (the sync is above)\n"
    "        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)\n"
    "        T.copy(O_shared[g, :, :], O[q_start + q0 + row0:q_start + q0 + row0 + WG_ROWS, head, :])\n")

MUTANTS = [
    # -- cu_seqlens off by one ---------------------------------------------------------------
    Mutant("q_len_plus_one", "q_len = cu_seqlens_q[b + 1] - q_start + 1: each sequence stores one row of the next",
           "ownership", dict(VARLEN_SPEC, causal=True),
           replace("q_len = cu_seqlens_q[batch_idx + 1] - q_start", "q_len = cu_seqlens_q[batch_idx + 1] - q_start + 1", 1)),
    Mutant("q_start_plus_one", "q_start = cu_seqlens_q[b] + 1: every row lands one row late, the last in the next sequence",
           "ownership", dict(VARLEN_SPEC, causal=False),
           replace("q_start = cu_seqlens_q[batch_idx]  #", "q_start = cu_seqlens_q[batch_idx] + 1  #", 1)),
    Mutant("k_start_plus_one", "k_start = cu_seqlens_k[b] + 1: keys shifted by one (the next sequence's first key read)",
           "reference", dict(VARLEN_SPEC, causal=True),
           replace("k_start = cu_seqlens_k[batch_idx]", "k_start = cu_seqlens_k[batch_idx] + 1", 1)),
    Mutant("kv_len_plus_one", "kv_len = cu_seqlens_k[b + 1] - k_start + 1: one key of the next sequence joins",
           "reference", dict(VARLEN_SPEC, causal=False, lse=True),
           replace("kv_len = cu_seqlens_k[batch_idx + 1] - k_start", "kv_len = cu_seqlens_k[batch_idx + 1] - k_start + 1", 1)),
    Mutant("seqused_k_plus_one", "kv_len = seqused_k[b] + 1: one poisoned cache row (1e4) joins",
           "reference", dict(VARLEN_PAGED_SPEC, causal=True),
           replace("kv_len = seqused_k[batch_idx]", "kv_len = seqused_k[batch_idx] + 1", 1)),
    # -- paging ------------------------------------------------------------------------------
    Mutant("page_from_next_batch", "block_table[(b + 1) % batch, ...]: the next sequence's pages",
           "reference", dict(VARLEN_PAGED_SPEC, causal=True),
           replace("block_table[batch_idx, ", "block_table[(batch_idx + 1) % batch, ", 1)),
    Mutant("decode_page_from_next_batch", "block_table[(b + 1) % batch, ...] in the split decode kernel",
           "reference", DECODE_SPEC, replace("block_table[batch_idx, ", "block_table[(batch_idx + 1) % batch, ", 1),
           DECODE),
    Mutant("page_row_ignores_tile_in_page", "page_row = 0: a 128-key page's second tile rereads its first",
           "reference", dict(VARLEN_PAGED_SPEC, page_size=128, causal=False),
           sub(r"page_row = k % TILES_PER_PAGE \* BLOCK_N", "page_row = 0 * BLOCK_N", 1)),
    # -- the combine step --------------------------------------------------------------------
    Mutant("combine_weights_use_split0_lse", "every split weighed by split 0's LSE: the splits' LSEs differ",
           "reference", DECODE_SPEC,
           sub(r"T\.exp2\(\(LSE_partial\[s, ", "T.exp2((LSE_partial[0, ", 1), DECODE),
    Mutant("combine_max_skips_split0", "the max over the splits' LSEs starts at split 1: rows only split 0 saw get 0",
           "reference", DECODE_SPEC,
           sub(r"for s in T\.serial\(num_splits\):\n(\s+for i in T\.Parallel\(COMBINE_ROWS\):\n\s+lse_max)",
               r"for s in T.serial(1, num_splits):\n\1", 1), DECODE),
    Mutant("combine_sum_skips_last_split", "the denominator leaves out the last split's weight",
           "reference", DECODE_SPEC,
           replace("weight_sum[i] += weight[i]", "weight_sum[i] += T.if_then_else(s == num_splits - 1, 0.0, weight[i])", 1),
           DECODE),
    Mutant("varlen_combine_weights_use_split0_lse", "varlen split: every split weighed by split 0's LSE",
           "reference", VARLEN_SPLIT_SPEC,
           sub(r"T\.exp2\(\(LSE_partial\[s, ", "T.exp2((LSE_partial[0, ", 1), dataclasses.replace(VARLEN, num_splits=2)),
    Mutant("split_range_off_by_one", "first_tile = s * tiles_per_split + 1: each split skips its first tile",
           "reference", DECODE_SPEC,
           replace("first_tile = split_idx * tiles_per_split", "first_tile = split_idx * tiles_per_split + 1", 1), DECODE),
    Mutant("combine_store_into_padding", "varlen combine bounded by total_q, not cu_seqlens_q[-1]: padding rows written",
           "ownership", VARLEN_SPLIT_SPEC, replace("if r0 + i < used_rows:", "if r0 + i < total_q:", 2),
           dataclasses.replace(VARLEN, num_splits=2)),
    # -- unclipped stores of the last partial tile ------------------------------------------
    Mutant("varlen_store_unpredicated", "the row-by-row O store without `if q0 + row0 + i < q_len`",
           "ownership", dict(VARLEN_SPEC, causal=True),
           replace("if q0 + row0 + i < q_len:  # not a TMA store", "if True:  # not a TMA store", 1)),
    Mutant("varlen_store_whole_tile", "a whole-tile T.copy (a TMA store) of O_shared into O[q_start + q0 + row0:+WG_ROWS]",
           "ownership", dict(VARLEN_SPEC, causal=False), replace(ROW_STORE, TILE_STORE, 1)),
    Mutant("varlen_lse_store_unpredicated", "the LSE store without its row predicate",
           "ownership", dict(VARLEN_SPEC, causal=True, lse=True),
           replace("if q0 + row0 + i < q_len:  # only this block's rows", "if True:  # only this block's rows", 1)),
    Mutant("split_partial_store_unpredicated", "varlen split, packed GQA: O_partial stored for every row of the tile",
           "ownership", VARLEN_SPLIT_SPEC,
           replace("if (q0 + row0 + i) // GQA_GROUP < q_len:  # float32, straight", "if True:  # float32, straight", 1),
           dataclasses.replace(VARLEN, num_splits=2)),
    # -- masks and offsets -------------------------------------------------------------------
    Mutant("mask_without_sequence_kv_len", "non-causal varlen: keys masked by the packed tensor's end, not the sequence's",
           "reference", dict(VARLEN_SPEC, causal=False),
           chain(replace("T.if_then_else(j < kv_len,", "T.if_then_else(k_start + j < total_k,", 1),
                 replace("T.if_then_else(k * BLOCK_N + j < kv_len,", "T.if_then_else(k_start + k * BLOCK_N + j < total_k,", 1),
                 # the macro's def and call
                 replace("q_len, kv_len, q_start, softmax_scale)", "q_len, kv_len, q_start, k_start, softmax_scale)", 2))),
    Mutant("causal_offset_of_sequence_0", "causal_offset from sequence 0's lengths, not this sequence's",
           "reference", dict(VARLEN_SPEC, causal=True),
           replace("causal_offset = kv_len - q_len",
                   "causal_offset = (cu_seqlens_k[1] - cu_seqlens_k[0]) - (cu_seqlens_q[1] - cu_seqlens_q[0])", 1)),
    Mutant("pack_gqa_heads_reversed", "packed GQA loads row r's query from head head + G - 1 - r % G",
           "reference", DECODE_SPEC,
           replace("head + (q0 + row0 + r) % GQA_GROUP, d]", "head + GQA_GROUP - 1 - (q0 + row0 + r) % GQA_GROUP, d]", 1),
           DECODE),
    Mutant("pack_gqa_store_heads_shifted", "packed GQA stores row r to head head + 1 + r % G: the last KV head's "
           "group wraps to head 0, which another block owns", "ownership", DECODE_SPEC,
           replace("O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, (head + (q0 + row0 + i) % GQA_GROUP), j]",
                   "O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, (head + 1 + (q0 + row0 + i) % GQA_GROUP) % heads, j]",
                   1), DECODE),
    # Every row of a group stored to the group's first head stays inside the block's own elements
    # (several rows write one element, which the emulator does not report); the other heads' rows
    # are never written, so the combine gives NaN there and the reference check fails.
    Mutant("pack_gqa_store_one_head", "packed GQA stores every row of the tile to the group's first head",
           "reference", DECODE_SPEC,
           replace("O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, (head + (q0 + row0 + i) % GQA_GROUP), j]",
                   "O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, head, j]", 1), DECODE),
]


def inputs_for(plan, inp: Inputs):
    """Packed q, k, v (with padding rows), the serving keywords, and the checked call."""
    s = plan.spec
    x = random_serving_inputs(s.layout, s.paged_kv, s.page_size if s.paged_kv else None, s.dtype, s.head_dim, None,
                              inp.seq_lens_q, inp.seq_lens_k, inp.heads, inp.kv_heads, inp.seed, neighbour_fill=FILL)
    q, k, v = x.q, x.k, x.v
    if inp.pad and s.layout == "varlen":
        q = np.concatenate([q, np.full((inp.pad, *q.shape[1:]), FILL, np.float32)])
        if not s.paged_kv:
            k = np.concatenate([k, np.zeros((inp.pad, *k.shape[1:]), np.float32)])
            v = np.concatenate([v, np.full((inp.pad, *v.shape[1:]), FILL, np.float32)])
    keywords = dict(x.keywords)
    if inp.num_splits is not None:
        keywords["num_splits"] = inp.num_splits
    return q, k, v, keywords, check_serving(plan, q, k, v, **keywords), x


def run(plan, inp: Inputs, source):
    """Emulate `source` on the inputs; (check_serving_close's result, out, lse, rows the sequences use)."""
    q, k, v, keywords, call, x = inputs_for(plan, inp)
    result, _ = emulate_stats(plan, q, k, v, seed=inp.seed, policy=inp.policy, source=source, serving=keywords)
    out, lse = result if plan.spec.lse else (result, None)
    res = check_serving_close(out, q, k, v, call, plan.spec.causal, plan.spec.dtype, lse=lse)
    used = int(x.cu_seqlens_q[-1]) if plan.varlen else out.shape[0]
    return res, out, lse, used


@pytest.mark.parametrize("m", MUTANTS, ids=[f"{m.name}-by-{m.caught_by}" for m in MUTANTS])
def test_serving_mutant_is_caught(m: Mutant):
    plan = attngen.make_plan(attngen.Spec(**m.spec))
    source = attngen.render_source(plan)
    broken = m.edit(source)
    assert broken != source, "the edit changed nothing"

    res, out, lse, used = run(plan, m.inputs, source)
    assert res.ok, f"the unmodified kernel fails: {res}"
    assert not np.isnan(out[:used]).any() and np.isnan(out[used:]).all(), "the unmodified kernel's rows"
    assert lse is None or np.isnan(lse[..., used:]).all()

    if m.caught_by == "ownership":
        with pytest.raises(KernelError, match="which it does not own"):
            run(plan, m.inputs, broken)
    else:
        assert m.caught_by == "reference"
        res, *_ = run(plan, m.inputs, broken)
        assert not res.ok, f"{m.name} passed the per-sequence reference check: {res}"


def test_every_required_serving_mutant_is_present():
    names = {m.name for m in MUTANTS}
    assert {"q_len_plus_one", "k_start_plus_one", "page_from_next_batch", "combine_weights_use_split0_lse",
            "varlen_store_unpredicated", "varlen_store_whole_tile"} <= names
    assert len(names) == len(MUTANTS)
    assert {m.caught_by for m in MUTANTS} == {"reference", "ownership"}


def test_the_decode_inputs_give_the_splits_different_lses():
    """The combine mutants need splits whose LSEs differ (and one sequence only split 0 sees)."""
    plan = attngen.make_plan(attngen.Spec(**DECODE_SPEC))
    q, k, v, keywords, call, _ = inputs_for(plan, DECODE)
    assert call.num_splits == 3
    _, stats = emulate_stats(plan, q, k, v, seed=DECODE.seed, policy=DECODE.policy, serving=keywords)
    lse = stats.partials["LSE_partial"]  # [splits, batch, heads, q_len]
    assert np.all(np.isfinite(lse[:, 0])) and np.ptp(lse[:, 0], axis=0).min() > 0.1  # sequence 0: three splits, all differ
    assert np.all(np.isfinite(lse[0, 1])) and np.all(np.isneginf(lse[1:, 1]))  # sequence 1: split 0 only
