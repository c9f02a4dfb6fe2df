"""Serving calls on the CPU (issue 11, docs/serving.md): validation of varlen / paged / split-KV
calls, the split heuristic, the per-sequence fp64 reference, the random inputs, and the
runtime's argument assembly. The spec's serving fields are read by attribute, so these tests
describe specs with a small stand-in (`fake`): serving.py reads only the fields it needs.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from attngen import hw
from attngen.run import checks, forward, runtime, serving
from attngen.reference.forward import InputError, attention, attention_lowprec
from attngen.reference.serving import check_serving_close, random_serving_inputs, serving_reference
from attngen.run.serving import check_serving, choose_splits, serving_fields
from attngen.spec import Spec
from strategies import ragged_batches


def fake(layout="varlen", paged=False, page_size=None, splits=1, head_dim=64, head_dim_v=None, gqa_group=2, block_m=128,
         block_n=64, lse=False, aligned=False, dtype="float16"):
    """A planned spec as the serving ABI reads it (plan.spec.<field>), with no plan behind it."""
    spec = SimpleNamespace(layout=layout, paged_kv=paged, page_size=page_size, splits=splits, head_dim=head_dim,
                           head_dim_v=head_dim_v, gqa_group=gqa_group, block_m=block_m, block_n=block_n, lse=lse,
                           aligned=aligned, dtype=dtype, window=(-1, -1), scheduler="single")
    return SimpleNamespace(spec=spec, extra=(), shape=None, name="fake")


def raises(argument, *fragments):
    """pytest.raises(InputError) whose argument is `argument` and whose message has `fragments`."""

    @contextlib.contextmanager
    def ctx():
        with pytest.raises(InputError) as info:
            yield info
        assert info.value.argument == argument, str(info.value)
        for f in fragments:
            assert f in str(info.value), f"{f!r} not in {str(info.value)!r}"

    return ctx()


def inputs(layout="varlen", paged=False, page_size=64, lq=(3, 0, 70), lk=(5, 9, 130), heads=4, kv_heads=2, seed=0,
           dtype="float16", **kw):
    if layout == "bshd":
        lq = (lq[0],) * len(lq) if lq[0] else (4,) * len(lq)
        if not paged:
            lk = (lk[0],) * len(lk)
    return random_serving_inputs(layout, paged, page_size if paged else None, dtype, 64, None, lq, lk, heads, kv_heads,
                                 seed, **kw)


COMBOS = [("varlen", False), ("varlen", True), ("bshd", True), ("bshd", False)]


def spec_and_inputs(layout, paged, **kw):
    return fake(layout, paged, 64 if paged else None), inputs(layout, paged, **kw)


# -- the spec's fields ---------------------------------------------------------------------------------


def test_todays_spec_reads_as_a_dense_bshd_kernel():
    f = serving_fields(Spec())  # no serving field yet: the ABI's defaults, tile sizes resolved by the plan
    assert (f.layout, f.paged, f.page_size, f.splits, f.block_m, f.block_n) == ("bshd", False, None, 1, 128, 128)
    assert not f.uses_serving and not f.pack_gqa
    assert serving_fields(fake("varlen", True)).page_size == serving.DEFAULT_PAGE_SIZE
    assert serving_fields(fake("bshd", splits="auto", gqa_group=8)).pack_gqa
    assert not serving_fields(fake("bshd", splits="auto", gqa_group=1)).pack_gqa
    assert not serving_fields(fake("bshd", splits=1, gqa_group=8)).pack_gqa


# -- the split heuristic -------------------------------------------------------------------------------


def test_a_grid_that_fills_80_percent_of_the_sms_is_not_split():
    assert hw.SM_COUNT == 132
    assert choose_splits(106, 1, 1, 1000) == 1  # 106 >= 0.8 * 132
    assert choose_splits(105, 1, 1, 1000) > 1
    assert choose_splits(1, 1, 106, 1000) == 1  # any factor of the grid counts


def test_four_kv_tiles_or_fewer_are_not_split():
    assert choose_splits(1, 8, 1, 4) == 1
    assert choose_splits(1, 8, 1, 5) == 5  # 8 blocks * 5 splits: the most the tiles allow, all one wave


def test_worked_examples():
    # FA3's comment: 48 blocks on 108 SMs -> 2 splits (efficiency 0.89), not 9 (1.0, but 4.5x the partials)
    assert choose_splits(48, 1, 1, 100, sms=108) == 2
    # decode, batch 1, 8 KV heads (GQA packed), 128k keys in 128-wide tiles: 15 splits fill 120 of 132 SMs
    assert choose_splits(1, 8, 1, 1024) == 15
    # batch 16: 128 blocks already fill the chip
    assert choose_splits(16, 8, 1, 1024) == 1


@settings(max_examples=200)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 8), st.integers(0, 2000), st.sampled_from([108, 132]),
       st.integers(1, 256))
def test_choice_is_the_fewest_splits_within_85_percent_of_the_best(batch, heads, q_blocks, tiles, sms, cap):
    s = choose_splits(batch, heads, q_blocks, tiles, sms=sms, max_splits=cap)
    blocks = batch * heads * q_blocks
    assert 1 <= s <= max(1, min(cap, sms, tiles))
    if blocks >= 0.8 * sms or tiles <= 4:
        assert s == 1
        return

    def eff(n):
        w = blocks * n / sms
        return w / math.ceil(w)

    best = max(eff(n) for n in range(1, min(cap, sms, tiles) + 1))
    assert eff(s) >= 0.85 * best
    assert all(eff(n) < 0.85 * best for n in range(1, s))


# -- check_serving: what passes ------------------------------------------------------------------------


@pytest.mark.parametrize("layout, paged", COMBOS)
@pytest.mark.parametrize("as_torch", [False, True])
def test_good_calls_pass_and_report_dims_lengths_and_arguments(layout, paged, as_torch):
    spec, x = spec_and_inputs(layout, paged)
    kw = x.keywords
    q, k, v = x.q, x.k, x.v
    if as_torch:
        q, k, v = (torch.from_numpy(a).half() for a in (q, k, v))
        kw = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    call = check_serving(spec, q, k, v, **kw)
    lq = [len(s[0]) for s in x.sequences]
    lk = [len(s[1]) for s in x.sequences]
    assert call.q_lens.tolist() == lq and call.kv_lens.tolist() == lk
    assert call.batch == 3 and call.heads == 4 and call.kv_heads == 2
    want = {"batch": 3, "heads": 4, "kv_heads": 2}
    if layout == "varlen":
        want["total_q"] = sum(lq)
        assert call.max_seqlen_q == max(lq) and call.out_shape == (sum(lq), 4, 64) and call.lse_shape == (4, sum(lq))
    else:
        want["q_len"] = lq[0]
        assert call.out_shape == (3, lq[0], 4, 64) and call.lse_shape == (3, 4, lq[0])
    if paged:
        want["num_pages"], want["max_pages"] = x.k.shape[0], x.block_table.shape[1]
    elif layout == "varlen":
        want["total_k"] = sum(lk)
    else:
        want["kv_len"] = lk[0]
    assert call.dims == want
    order = {("varlen", False): ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q"),
             ("varlen", True): ("cu_seqlens_q", "block_table", "seqused_k", "max_seqlen_q"),
             ("bshd", True): ("block_table", "seqused_k"), ("bshd", False): ()}[layout, paged]
    assert call.arg_names == order
    assert all(a is kw[n] for n, a in zip(order, call.args) if n != "max_seqlen_q")  # the caller's own tensors
    host = call.host_args()
    assert [type(a) for a in host] == [int if n == "max_seqlen_q" else np.ndarray for n in order]
    assert all(a.dtype == np.int32 for a in host if isinstance(a, np.ndarray))
    assert call.num_splits == 1 and "num_splits" not in call.dims


def test_an_all_empty_batch_is_an_empty_call():
    spec = fake("varlen", True, 64)
    x = inputs("varlen", True, lq=(0, 0), lk=(5, 0))
    call = check_serving(spec, x.q, x.k, x.v, **x.keywords)
    assert call.empty and call.out_shape == (0, 4, 64) and call.grid[0] == 0


def test_device_int_tensors_are_copied_to_the_host_once_each():
    class DeviceInts:  # an int32 tensor on a device: only .detach().cpu() reads its values
        copies = 0

        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, "torch.int32"

        def detach(self):
            return self

        def cpu(self):
            DeviceInts.copies += 1
            return torch.from_numpy(self.a)

    x = inputs("varlen", True)
    kw = dict(cu_seqlens_q=DeviceInts(x.cu_seqlens_q), block_table=DeviceInts(x.block_table),
              seqused_k=DeviceInts(x.seqused_k), max_seqlen_q=x.max_seqlen_q)
    call = check_serving(fake("varlen", True, 64), x.q, x.k, x.v, **kw)
    assert DeviceInts.copies == 3 and call.kv_lens.tolist() == x.seqused_k.tolist()
    DeviceInts.copies = 0
    call = check_serving(fake("varlen", True, 64), x.q, x.k, x.v, read_values=False, **kw)
    assert DeviceInts.copies == 0 and call.q_lens is None
    with pytest.raises(ValueError, match="not read"):
        call.host_args()


# -- check_serving: one broken input per rule ------------------------------------------------------------


def with_changed(a, index, value):
    a = a.copy()
    a[index] = value
    return a


def test_int_tensors_must_be_int32():
    spec, x = spec_and_inputs("varlen", False)
    with raises("cu_seqlens_q.dtype", "int64", "int32"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_q": x.cu_seqlens_q.astype(np.int64)})
    with raises("cu_seqlens_k.dtype", "torch.int64", "torch.int32"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_k": torch.from_numpy(x.cu_seqlens_k).long()})
    spec, x = spec_and_inputs("varlen", True)
    with raises("block_table.dtype", "int64"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "block_table": x.block_table.astype(np.int64)})
    with raises("seqused_k.dtype", "float32"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": x.seqused_k.astype(np.float32)})
    with raises("seqused_k", "list"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": x.seqused_k.tolist()})


def test_ranks_and_shapes_of_q_k_v():
    spec, x = spec_and_inputs("varlen", False)
    with raises("q.shape", "3 dimensions", "[total_q, heads, head_dim]"):
        check_serving(spec, x.q[None], x.k, x.v, **x.keywords)
    with raises("k.shape", "3 dimensions", "[total_k, kv_heads, head_dim]"):
        check_serving(spec, x.q, x.k[None], x.v, **x.keywords)
    with raises("v.shape[2] (head_dim_v)", "= 32", "64"):
        check_serving(spec, x.q, x.k, x.v[..., :32], **x.keywords)
    with raises("q.shape[2] (head_dim)", "128"):
        check_serving(spec, np.zeros((x.q.shape[0], 4, 128)), x.k, x.v, **x.keywords)
    with raises("v.shape"):
        check_serving(spec, x.q, x.k, x.v[:-1], **x.keywords)
    with raises("heads / kv_heads (gqa group)", "8/2 = 4", "2, the spec's gqa_group"):
        check_serving(spec, np.zeros((x.q.shape[0], 8, 64)), x.k, x.v, **x.keywords)
    spec, x = spec_and_inputs("varlen", True)
    with raises("k.shape", "4 dimensions", "[num_pages, page_size, kv_heads, head_dim]"):
        check_serving(spec, x.q, x.k[0], x.v[0], **x.keywords)
    with raises("k.shape[1] (page_size)", "= 32", "64, the spec's page_size"):
        check_serving(spec, x.q, x.k[:, :32], x.v[:, :32], **x.keywords)
    spec, x = spec_and_inputs("bshd", False)
    with raises("k.shape[0] (batch)", "= 2", "3, the batch of q"):
        check_serving(spec, x.q, x.k[:2], x.v[:2])
    with raises("q.shape", "4 dimensions"):
        check_serving(spec, x.q[0], x.k, x.v)


def test_an_empty_kv_tensor_is_refused():
    spec = fake("varlen")
    x = inputs("varlen", lq=(2,), lk=(3,))
    with raises("k.shape[0] (total_k)", "TMA"):
        check_serving(spec, x.q, x.k[:0], x.v[:0], cu_seqlens_q=x.cu_seqlens_q, max_seqlen_q=2,
                      cu_seqlens_k=np.zeros(2, np.int32))


def test_cu_seqlens_must_start_at_zero():
    spec, x = spec_and_inputs("varlen", False)
    with raises("cu_seqlens_q[0]", "= 1", "0"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_q": with_changed(x.cu_seqlens_q, 0, 1)})


def test_cu_seqlens_must_not_decrease_and_the_bad_index_is_named():
    spec = fake("varlen")
    x = inputs("varlen", lq=(3, 4, 2, 5), lk=(1, 2, 3, 4))
    cu = np.array([0, 3, 9, 7, 14], np.int32)  # sequence 2 would have length -2
    with raises("cu_seqlens_q[3]", "cu_seqlens_q[3] = 7", "at least cu_seqlens_q[2] = 9", "length -2"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_q": cu, "max_seqlen_q": 9})
    with raises("cu_seqlens_k[1]", "= -1"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_k": with_changed(x.cu_seqlens_k, 1, -1)})


def test_the_last_offset_is_the_packed_row_count():
    spec, x = spec_and_inputs("varlen", False)
    with raises("cu_seqlens_q[3]", f"{x.q.shape[0] - 1} = q.shape[0] (total_q)"):
        check_serving(spec, x.q[:-1], x.k, x.v, **x.keywords)
    with raises("cu_seqlens_k[3]", f"{x.k.shape[0] - 1} = k.shape[0] (total_k)"):
        check_serving(spec, x.q, x.k[:-1], x.v[:-1], **x.keywords)


def test_batch_sizes_must_agree():
    spec, x = spec_and_inputs("varlen", False)
    with raises("cu_seqlens_k.shape", "[5]", "[4]: batch + 1 with batch = 3 from cu_seqlens_q"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "cu_seqlens_k": np.append(x.cu_seqlens_k, x.k.shape[0]).astype(np.int32)})
    spec, x = spec_and_inputs("varlen", True)
    with raises("block_table.shape[0] (batch)", "= 2", "3, the batch of cu_seqlens_q"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "block_table": x.block_table[:2]})
    with raises("seqused_k.shape[0] (batch)", "= 4"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": np.append(x.seqused_k, 1).astype(np.int32)})
    spec, x = spec_and_inputs("bshd", True)
    with raises("seqused_k.shape[0] (batch)", "= 2", "3, the batch of q.shape[0]"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": x.seqused_k[:2]})


@pytest.mark.parametrize("bad, fragment", [(None, "an int, the longest"), (69, "at least 70"), (70.0, "an int"),
                                           (True, "an int"), (np.float32(70), "an int"), (-1, "0 or more")])
def test_max_seqlen_q_must_be_an_int_at_least_the_longest_sequence(bad, fragment):
    spec, x = spec_and_inputs("varlen", False)  # lengths 3, 0, 70
    with raises("max_seqlen_q", fragment):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "max_seqlen_q": bad})


def test_a_larger_max_seqlen_q_is_taken_and_sizes_the_grid():
    spec, x = spec_and_inputs("varlen", False)
    call = check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "max_seqlen_q": np.int64(300)})
    assert call.max_seqlen_q == 300 and call.grid == (3, 4, 3)  # ceil(300 / 128) row blocks


def test_block_table_entries_of_used_pages_must_be_pages():
    spec, x = spec_and_inputs("varlen", True)  # seqused_k 5, 9, 130 with page_size 64: 1, 1 and 3 pages
    num_pages = x.k.shape[0]
    for value in (num_pages, -1):
        with raises("block_table[2, 2]", f"= {value}", f"[0, {num_pages})", "first 3 entries", "seqused_k[2] = 130"):
            check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "block_table": with_changed(x.block_table, (2, 2), value)})
    # the entries past a sequence's pages are never read: any value passes
    ignored = with_changed(with_changed(x.block_table, (0, 1), 10**6), (1, 3), -5)
    check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "block_table": ignored})


def test_seqused_k_must_fit_the_pages_given():
    spec, x = spec_and_inputs("varlen", True)
    cap = x.block_table.shape[1] * 64
    with raises("seqused_k[1]", "= -1", "0 or more"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": with_changed(x.seqused_k, 1, -1)})
    with raises("seqused_k[0]", f"= {cap + 1}", f"at most max_pages * page_size = {x.block_table.shape[1]} * 64 = {cap}"):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": with_changed(x.seqused_k, 0, cap + 1)})
    full = with_changed(x.seqused_k, 0, cap)  # every entry of row 0 is a page, so the longest length passes
    check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "seqused_k": full,
                                          "block_table": with_changed(x.block_table, (0, slice(None)), 0)})


@pytest.mark.parametrize("spec, keyword, fragment", [
    (fake("varlen", False), "block_table", "paged_kv = false; set paged_kv = true"),
    (fake("varlen", False), "seqused_k", "paged_kv = false; set paged_kv = true"),
    (fake("bshd", True, 64), "cu_seqlens_q", 'layout = "bshd"; set layout = "varlen"'),
    (fake("bshd", True, 64), "max_seqlen_q", 'layout = "bshd"; set layout = "varlen"'),
    (fake("varlen", True, 64), "cu_seqlens_k", "paged spec (paged_kv = true) reads each sequence's key length from seqused_k"),
    (fake("bshd", False), "cu_seqlens_k", 'layout = "bshd"'),
    (fake("varlen", False), "num_splits", 'splits = 1; set splits = "auto"'),
])
def test_a_keyword_the_spec_does_not_use_names_the_field_that_enables_it(spec, keyword, fragment):
    layout, paged = spec.spec.layout, spec.spec.paged_kv
    x = inputs(layout, paged)
    value = {"max_seqlen_q": 4, "num_splits": 2}.get(keyword, np.zeros(4, np.int32))
    with raises(keyword, "expected None", fragment):
        check_serving(spec, x.q, x.k, x.v, **{**x.keywords, keyword: value})


@pytest.mark.parametrize("layout, paged, keyword, fragment", [
    ("varlen", False, "cu_seqlens_q", 'layout = "varlen"'),
    ("varlen", False, "cu_seqlens_k", "dense KV"),
    ("varlen", True, "block_table", "paged_kv = true"),
    ("bshd", True, "seqused_k", "paged_kv = true"),
])
def test_a_keyword_the_spec_needs_must_be_given(layout, paged, keyword, fragment):
    spec, x = spec_and_inputs(layout, paged)
    kw = {n: a for n, a in x.keywords.items() if n != keyword}
    with raises(keyword, "= None", fragment):
        check_serving(spec, x.q, x.k, x.v, **kw)


@pytest.mark.parametrize("bad", [0, -1, "max", 2.5, True, "AUTO"])
def test_num_splits_is_none_auto_or_a_positive_int(bad):
    spec = fake("varlen", True, 64, splits="auto")
    x = inputs("varlen", True)
    with raises("num_splits", 'None, "auto" or an int >= 1'):
        check_serving(spec, x.q, x.k, x.v, num_splits=bad, **x.keywords)


def test_num_splits_resolution():
    x = inputs("varlen", True, lq=(1, 1), lk=(2000, 700), page_size=128)  # decode: 16 KV tiles of 128 at most
    auto, four = fake("varlen", True, 128, splits="auto", block_n=128), fake("varlen", True, 128, splits=4, block_n=128)
    call = check_serving(auto, x.q, x.k, x.v, **x.keywords)
    # the heuristic on the shapes: batch 2, 2 KV heads (GQA packed), 1 row block, max_pages * page_size keys
    tiles = x.block_table.shape[1]
    assert call.num_splits == choose_splits(2, 2, 1, tiles) > 1 and call.dims["num_splits"] == call.num_splits
    assert call.grid == (1, 2, 2 * call.num_splits)
    assert check_serving(four, x.q, x.k, x.v, **x.keywords).num_splits == 4  # the spec's count
    assert check_serving(four, x.q, x.k, x.v, num_splits=7, **x.keywords).num_splits == 7  # the call's wins
    assert check_serving(four, x.q, x.k, x.v, num_splits="auto", **x.keywords).num_splits == call.num_splits
    many = check_serving(auto, x.q, x.k, x.v, num_splits=tiles + 5, **x.keywords)  # more splits than tiles: allowed
    assert many.num_splits == tiles + 5 and many.o_partial_shape == (tiles + 5, 2, 4, 64)
    assert many.lse_partial_shape == (tiles + 5, 4, 2)


def test_dense_varlen_auto_splits_read_the_longest_key_sequence():
    x = inputs("varlen", False, lq=(1, 1), lk=(1000, 10))
    spec = fake("varlen", False, splits="auto")
    call = check_serving(spec, x.q, x.k, x.v, **x.keywords)
    assert call.max_kv_len == 1000 and call.num_splits == choose_splits(2, 2, 1, math.ceil(1000 / 64))
    unread = check_serving(spec, x.q, x.k, x.v, read_values=False, **x.keywords)
    assert unread.num_splits == call.num_splits  # check=False launches what check=True would


def test_grid_z_limits_the_number_of_splits():
    x = inputs("bshd", False, lq=(1,) * 3, lk=(64,) * 3)
    spec = fake("bshd", False, splits="auto")
    limit = hw.GRID_YZ_MAX // 3
    assert check_serving(spec, x.q, x.k, x.v, num_splits=limit).grid[2] == 3 * limit
    with raises("num_splits", f"at most {limit}", "grid z"):
        check_serving(spec, x.q, x.k, x.v, num_splits=limit + 1)


def test_aligned_specs_need_whole_tiles_per_sequence():
    spec = fake("varlen", True, 64, aligned=True)
    x = inputs("varlen", True, lq=(128, 256), lk=(64, 100))
    with raises("sequence 1 key length", "= 100", "multiple of block_n = 64"):
        check_serving(spec, x.q, x.k, x.v, **x.keywords)


@settings(max_examples=40)
@given(batch=ragged_batches(), data=st.data())
def test_drawn_batches_pass_and_one_broken_entry_is_named(batch, data):
    x = random_serving_inputs(**batch["inputs"])
    a = batch["inputs"]
    spec = fake(a["layout"], a["paged"], a["page_size"], splits="auto", gqa_group=a["heads"] // a["kv_heads"])
    call = check_serving(spec, x.q, x.k, x.v, num_splits=batch["num_splits"], **x.keywords)
    assert call.q_lens.tolist() == list(a["seq_lens_q"]) and call.kv_lens.tolist() == list(a["seq_lens_k"])
    assert call.num_splits == batch["num_splits"]
    # one corruption drawn at random, caught and named
    choices = []
    if x.cu_seqlens_q is not None:
        choices += ["cu_q_first", "cu_q_last"]
    if x.cu_seqlens_k is not None:
        choices += ["cu_k_last"]
    if x.block_table is not None:
        choices += ["seqused"]
        if any(n > 0 for n in a["seq_lens_k"]):
            choices += ["page"]
    if not choices:
        return
    kind = data.draw(st.sampled_from(choices))
    kw = dict(x.keywords)
    if kind == "cu_q_first":
        kw["cu_seqlens_q"], name = with_changed(x.cu_seqlens_q, 0, -1), "cu_seqlens_q[0]"
    elif kind == "cu_q_last":
        kw["cu_seqlens_q"], name = with_changed(x.cu_seqlens_q, -1, x.cu_seqlens_q[-1] + 1), f"cu_seqlens_q[{call.batch}]"
    elif kind == "cu_k_last":
        kw["cu_seqlens_k"], name = with_changed(x.cu_seqlens_k, -1, x.cu_seqlens_k[-1] + 1), f"cu_seqlens_k[{call.batch}]"
    elif kind == "seqused":
        b = data.draw(st.integers(0, call.batch - 1))
        kw["seqused_k"], name = with_changed(x.seqused_k, b, x.block_table.shape[1] * a["page_size"] + 1), f"seqused_k[{b}]"
    else:
        b = data.draw(st.sampled_from([i for i, n in enumerate(a["seq_lens_k"]) if n > 0]))
        j = data.draw(st.integers(0, -(-a["seq_lens_k"][b] // a["page_size"]) - 1))
        kw["block_table"], name = with_changed(x.block_table, (b, j), x.k.shape[0]), f"block_table[{b}, {j}]"
    with raises(name):
        check_serving(spec, x.q, x.k, x.v, num_splits=batch["num_splits"], **kw)


# -- the random inputs ---------------------------------------------------------------------------------


def test_random_paged_inputs_shuffle_pages_and_fill_what_no_sequence_owns():
    x = inputs("varlen", True, lq=(2, 3, 1), lk=(64, 0, 65), page_size=64, neighbour_fill=1e4, seed=3)
    need = [1, 0, 2]
    assert x.k.shape == (sum(need) + 2, 64, 2, 64) and x.block_table.shape == (3, 3)
    used = {int(x.block_table[b, j]) for b in range(3) for j in range(need[b])}
    assert len(used) == 3  # each page belongs to one sequence
    spare = set(range(x.k.shape[0])) - used
    for b in range(3):  # the ignored entries point at pages no sequence owns
        assert set(x.block_table[b, need[b]:].tolist()) <= spare
    owned_rows = sum(x.seqused_k)
    poisoned = (x.v[..., 0, 0] == 1e4) & (x.k[..., 0, 0] == 0)
    assert np.count_nonzero(poisoned) == x.k.shape[0] * 64 - owned_rows
    for b in range(3):  # the pages, read through the table, are the sequence
        k = x.k[x.block_table[b, :need[b]]].reshape(-1, 2, 64)[:x.seqused_k[b]]
        np.testing.assert_array_equal(k, x.sequences[b][1])
    orders = {tuple(inputs("varlen", True, lq=(1,) * 4, lk=(64,) * 4, seed=s).block_table[:, 0]) for s in range(4)}
    assert len(orders - {(0, 1, 2, 3)}) >= 3  # shuffled: neighbours in the batch are not neighbours in the cache
    plain = inputs("varlen", True, lq=(1,) * 4, lk=(64,) * 4, shuffle_pages=False)
    assert plain.block_table[:, 0].tolist() == [0, 1, 2, 3]


def test_random_inputs_refuse_ragged_bshd():
    with pytest.raises(ValueError, match="equal query lengths"):
        random_serving_inputs("bshd", False, None, "float16", 64, None, [1, 2], [3, 3], 2, 2)
    with pytest.raises(ValueError, match="equal key lengths"):
        random_serving_inputs("bshd", False, None, "float16", 64, None, [2, 2], [3, 4], 2, 2)


# -- the per-sequence reference ------------------------------------------------------------------------


def ground_truth(x, causal, lowprec_dtype=None, **variant):
    """Each sequence's own dense attention from the generator's record, packed like serving_reference."""
    outs, lses = [], []
    for b, (q, k, v) in enumerate(x.sequences):
        if len(q) == 0 or len(k) == 0:
            outs.append(np.zeros((len(q), q.shape[1], v.shape[2])))
            lses.append(np.full((q.shape[1], len(q)), -np.inf))
            continue
        if lowprec_dtype:
            o = attention_lowprec(q[None], k[None], v[None], causal, lowprec_dtype, batch_offset=b, **variant)
            lse = np.zeros((1, q.shape[1], len(q)))
        else:
            o, lse = attention(q[None], k[None], v[None], causal, batch_offset=b, **variant)
        outs.append(o[0])
        lses.append(lse[0])
    return outs, lses


def pack(x, call, outs, lses):
    if call.fields.varlen:
        return np.concatenate(outs), np.concatenate(lses, axis=1)
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("layout, paged", COMBOS)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_each_sequence_on_its_own(layout, paged, causal):
    spec, x = spec_and_inputs(layout, paged, neighbour_fill=1e4)
    call = check_serving(spec, x.q, x.k, x.v, **x.keywords)
    out, lse = serving_reference(x.q, x.k, x.v, call, causal)
    want_out, want_lse = pack(x, call, *ground_truth(x, causal))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    assert np.abs(out).max() < 10  # no 1e4 padding reached it


def test_causal_aligns_bottom_right_per_sequence():
    x = inputs("varlen", lq=(5, 3), lk=(2, 9))  # q_len > kv_len, then q_len < kv_len
    call = check_serving(fake("varlen"), x.q, x.k, x.v, **x.keywords)
    out, lse = serving_reference(x.q, x.k, x.v, call, causal=True)
    assert np.all(np.isneginf(lse[:, :3])) and np.all(out[:3] == 0)  # rows 0-2 of sequence 0 see no key
    assert np.all(np.isfinite(lse[:, 3:]))
    # sequence 1's first row sees keys 0..6 (offset 9 - 3), not key 0 alone (top-left alignment)
    q, k, v = x.sequences[1]
    top_left = attention(q[None, :1], k[None, :1], v[None, :1], False)[0][0, 0]
    assert not np.allclose(out[5], top_left)
    assert check_serving_close(out, x.q, x.k, x.v, call, True, "float16").ok
    shifted = out.copy()
    shifted[5] = top_left
    assert not check_serving_close(shifted, x.q, x.k, x.v, call, True, "float16").ok


@pytest.mark.parametrize("layout, paged", COMBOS)
def test_the_kernels_own_rounding_passes(layout, paged):
    spec, x = spec_and_inputs(layout, paged, neighbour_fill=1e4)
    call = check_serving(spec, x.q, x.k, x.v, **x.keywords)
    outs, _ = ground_truth(x, True, lowprec_dtype="float16")
    out = pack(x, call, outs, [np.zeros((4, len(o))) for o in outs])[0]
    _, lse = serving_reference(x.q, x.k, x.v, call, True)
    res = check_serving_close(out, x.q, x.k, x.v, call, True, "float16", lse=lse.astype(np.float32))
    assert res.ok, str(res)
    assert "PASS" in str(res) and res.failed == ()


def test_a_leak_of_one_neighbouring_key_fails_and_names_the_sequence():
    x = inputs("varlen", lq=(4, 6, 3), lk=(20, 30, 25), seed=5)
    call = check_serving(fake("varlen"), x.q, x.k, x.v, **x.keywords)
    out, _ = serving_reference(x.q, x.k, x.v, call, False)
    assert check_serving_close(out, x.q, x.k, x.v, call, False, "float16").ok
    # sequence 1 reads one key (and value) past its end: the first of sequence 2
    k0, n = int(x.cu_seqlens_k[1]), 30
    q0 = int(x.cu_seqlens_q[1])
    leaky = attention(x.q[None, q0:q0 + 6], x.k[None, k0:k0 + n + 1], x.v[None, k0:k0 + n + 1], False)[0][0]
    bad = out.copy()
    bad[q0:q0 + 6] = leaky
    res = check_serving_close(bad, x.q, x.k, x.v, call, False, "float16")
    assert not res.ok and res.failed == (1,) and res.worst == (1, 6, 30), str(res)
    assert "worst sequence 1 (q_len 6, kv_len 30)" in str(res) and "FAIL" in str(res)


def test_a_leak_of_a_page_tail_is_far_outside_the_tolerance():
    x = inputs("varlen", True, lq=(2, 2), lk=(70, 10), neighbour_fill=1e4, seed=2)
    call = check_serving(fake("varlen", True, 64), x.q, x.k, x.v, **x.keywords)
    out, _ = serving_reference(x.q, x.k, x.v, call, False)
    # sequence 0 reads its whole last page (rows 70..127 hold the 1e4 fill), as an unmasked tile would
    pages = x.block_table[0, :2]
    k = x.k[pages].reshape(-1, 2, 64)[None]
    v = x.v[pages].reshape(-1, 2, 64)[None]
    bad = out.copy()
    bad[:2] = attention(x.q[None, :2], k, v, False)[0][0]
    res = check_serving_close(bad, x.q, x.k, x.v, call, False, "float16")
    assert not res.ok and res.failed == (0,) and res.out.err > 1e3  # the 58 poisoned rows weigh about half


def test_a_page_taken_from_the_wrong_sequence_fails():
    x = inputs("bshd", True, lq=(3, 3), lk=(64, 64), seed=4)
    call = check_serving(fake("bshd", True, 64), x.q, x.k, x.v, **x.keywords)
    out, _ = serving_reference(x.q, x.k, x.v, call, True)
    swapped = x.block_table.copy()
    swapped[[0, 1], 0] = swapped[[1, 0], 0]
    wrong = check_serving(fake("bshd", True, 64), x.q, x.k, x.v, block_table=swapped, seqused_k=x.seqused_k)
    res = check_serving_close(out, x.q, x.k, x.v, wrong, True, "float16")
    assert not res.ok and res.failed == (0, 1)


def test_a_cu_seqlens_off_by_one_fails():
    x = inputs("varlen", lq=(5, 7), lk=(9, 11), seed=6)
    call = check_serving(fake("varlen"), x.q, x.k, x.v, **x.keywords)
    out, _ = serving_reference(x.q, x.k, x.v, call, True)
    off = dict(x.keywords, cu_seqlens_k=with_changed(x.cu_seqlens_k, 1, x.cu_seqlens_k[1] + 1))
    res = check_serving_close(out, x.q, x.k, x.v, check_serving(fake("varlen"), x.q, x.k, x.v, **off), True, "float16")
    assert not res.ok and set(res.failed) == {0, 1}


def test_lse_is_checked_per_sequence_in_the_kernels_layout():
    x = inputs("varlen", lq=(4, 0, 6), lk=(8, 3, 0))
    call = check_serving(fake("varlen"), x.q, x.k, x.v, **x.keywords)
    out, lse = serving_reference(x.q, x.k, x.v, call, False)
    assert lse.shape == (4, 10) and np.all(np.isneginf(lse[:, 4:]))  # sequence 2 has no key
    assert check_serving_close(out, x.q, x.k, x.v, call, False, "float16", lse=lse).ok
    bad = lse.copy()
    bad[3, 2] += 0.1
    res = check_serving_close(out, x.q, x.k, x.v, call, False, "float16", lse=bad)
    assert not res.ok and res.failed == (0,) and res.worst[0] == 0
    finite = lse.copy()
    finite[1, 7] = 0.0  # a row that sees no key must keep -inf
    assert check_serving_close(out, x.q, x.k, x.v, call, False, "float16", lse=finite).failed == (2,)
    with pytest.raises(ValueError, match="lse has shape"):
        check_serving_close(out, x.q, x.k, x.v, call, False, "float16", lse=lse.T)


def test_a_sequence_without_keys_must_output_zero():
    x = inputs("varlen", True, lq=(3, 2), lk=(0, 5))
    call = check_serving(fake("varlen", True, 64), x.q, x.k, x.v, **x.keywords)
    out, _ = serving_reference(x.q, x.k, x.v, call, False)
    assert np.all(out[:3] == 0) and check_serving_close(out, x.q, x.k, x.v, call, False, "float16").ok
    bad = out.copy()
    bad[1, 0, 0] = 1e-3
    assert check_serving_close(bad, x.q, x.k, x.v, call, False, "float16").failed == (0,)


def test_score_mod_sees_the_sequences_batch_index():
    x = inputs("bshd", False, lq=(3, 3, 3), lk=(5, 5, 5))
    call = check_serving(fake("bshd"), x.q, x.k, x.v)
    variant = {"score_mod": "where(kv_idx == 0, score + 2 * b, score)"}
    out, lse = serving_reference(x.q, x.k, x.v, call, False, **variant)
    whole, whole_lse = attention(x.q, x.k, x.v, False, **variant)  # the dense batch: b is 0, 1, 2
    np.testing.assert_allclose(out, whole, atol=1e-12)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-12)
    plain, _ = serving_reference(x.q, x.k, x.v, call, False)
    assert not np.allclose(out[2], plain[2])  # b reached the score


@settings(max_examples=25)
@given(batch=ragged_batches(max_batch=3))
def test_drawn_batches_reference_matches_each_sequence_alone(batch):
    x = random_serving_inputs(**batch["inputs"])
    a = batch["inputs"]
    spec = fake(a["layout"], a["paged"], a["page_size"], gqa_group=a["heads"] // a["kv_heads"])
    call = check_serving(spec, x.q, x.k, x.v, **x.keywords)
    out, lse = serving_reference(x.q, x.k, x.v, call, True)
    want_out, want_lse = pack(x, call, *ground_truth(x, True))
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    res = check_serving_close(out.astype(np.float32), x.q, x.k, x.v, call, True, a["dtype"], lse=lse)
    assert res.ok, str(res)
    # a page from another sequence, where there is one to take, is caught
    if a["paged"] and sum(1 for n in a["seq_lens_k"] if n) >= 2:
        owners = [b for b, n in enumerate(a["seq_lens_k"]) if n]
        b0, b1 = owners[0], owners[1]
        table = x.block_table.copy()
        table[b0, 0] = x.block_table[b1, 0]
        wrong = check_serving(spec, x.q, x.k, x.v, **{**x.keywords, "block_table": table})
        res = check_serving_close(out.astype(np.float32), x.q, x.k, x.v, wrong, True, a["dtype"])
        seq_b0_rows = a["seq_lens_q"][b0]
        if seq_b0_rows:  # a sequence with no query row has no output to be wrong
            assert b0 in res.failed, str(res)


# -- the runtime: inferred fields, buffers, argument order, a call that never launches ------------------


def test_serving_overrides_infer_the_spec_from_the_call():
    k_cache = torch.empty(10, 64, 2, 64)
    assert runtime.serving_overrides(None, k_cache) == {}
    assert runtime.serving_overrides(None, k_cache, cu_seqlens_q=1) == {"layout": "varlen"}
    assert runtime.serving_overrides(None, k_cache, block_table=1) == {"paged_kv": True, "page_size": 64}
    assert runtime.serving_overrides(None, k_cache, num_splits="auto") == {"splits": "auto"}
    assert runtime.serving_overrides(None, k_cache, num_splits=3) == {"splits": "auto"}
    assert runtime.serving_overrides(None, k_cache, num_splits=1) == {}


def test_spec_for_wants_packed_q_with_cu_seqlens_q():
    q = torch.empty(2, 5, 4, 64, dtype=torch.float16)
    with raises("q.shape", "3 dimensions", "[total_q, heads, head_dim]"):
        runtime.spec_for(q, q, cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    with raises("k.shape", "4 dimensions", "[num_pages, page_size, kv_heads, head_dim]"):
        runtime.spec_for(q[0], q[0], cu_seqlens_q=torch.zeros(3, dtype=torch.int32), block_table=torch.zeros(2, 1))
    with raises("q.shape", "4 dimensions"):
        runtime.spec_for(q[0], q[0])


def cpu_call(layout, paged, splits=1, lse=False, **kw):
    spec = fake(layout, paged, 64 if paged else None, splits=splits, lse=lse)
    x = inputs(layout, paged, **kw)
    q, k, v = (torch.from_numpy(a).half() for a in (x.q, x.k, x.v))
    keywords = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in x.keywords.items()}
    return spec, q, k, v, keywords


@pytest.mark.parametrize("splits, lse", [(1, False), (1, True), (3, False), (3, True)])
def test_launch_arguments_follow_the_abi(splits, lse):
    spec, q, k, v, kw = cpu_call("varlen", True, splits=splits, lse=lse)
    call = check_serving(spec, q, k, v, **kw)
    bufs = checks.serving_outputs(spec, call, q)
    assert bufs["out"].shape == call.out_shape and bufs["out"].dtype == torch.float16
    assert (bufs["lse"] is not None) == lse and (not lse or bufs["lse"].shape == call.lse_shape)
    main, combine = checks.launch_arguments(spec, call, q, k, v, extra=["alibi"], softmax_scale=0.25, **bufs)
    ints = [kw["cu_seqlens_q"], kw["block_table"], kw["seqused_k"], call.max_seqlen_q, 0.25]  # the scale comes last
    if splits == 1:
        assert bufs["o_partial"] is None and combine is None
        want = [q, k, v, bufs["out"]] + ([bufs["lse"]] if lse else []) + ["alibi"] + ints
    else:
        assert bufs["o_partial"].shape == (3, *call.out_shape) and bufs["o_partial"].dtype == torch.float32
        assert bufs["lse_partial"].shape == (3, *call.lse_shape)
        want = [q, k, v, bufs["o_partial"], bufs["lse_partial"], "alibi"] + ints
        # varlen: the combine also takes cu_seqlens_q (rows past its last entry are padding, never written)
        assert combine == [bufs["o_partial"], bufs["lse_partial"], bufs["out"]] + ([bufs["lse"]] if lse else []) + [kw["cu_seqlens_q"]]
    assert len(main) == len(want) and all(a is b for a, b in zip(main[:-2], want[:-2])) and main[-2:] == want[-2:]
    if lse:
        with pytest.raises(ValueError, match="lse buffer"):
            checks.launch_arguments(spec, call, q, k, v, softmax_scale=0.25, **{**bufs, "lse": None})
    if splits != 1:
        with pytest.raises(ValueError, match="O_partial and LSE_partial"):
            checks.launch_arguments(spec, call, q, k, v, softmax_scale=0.25, **{**bufs, "o_partial": None})


def kernel_for(plan, launched):
    return forward.Kernel(plan=plan, jit=lambda *a: launched.append(("main", a)), cache_path=None, origin="compiled",
                          compile_seconds=0.0, combine_jit=lambda *a: launched.append(("combine", a)))


def test_kernel_call_checks_a_serving_call_before_launching():
    launched = []
    spec, q, k, v, kw = cpu_call("varlen", True, splits="auto")
    kernel = kernel_for(spec, launched)
    with raises("q.device", "cpu"):
        kernel(q, k, v, **kw)
    with raises("block_table[0, 0]"):
        kernel(q, k, v, **{**kw, "block_table": torch.full_like(kw["block_table"], 99)})
    with raises("k.dtype", "torch.float32"):
        kernel(q, k.float(), v, **kw)
    with raises("out.shape"):
        kernel(q, k, v, out=torch.empty(1, 4, 64, dtype=torch.float16), **kw)
    with raises("block_table.stride()", "contiguous"):
        kernel(q, k, v, **{**kw, "block_table": torch.zeros(kw["block_table"].shape[::-1], dtype=torch.int32).T})
    assert launched == []


def test_a_dense_kernel_rejects_serving_keywords_before_launching():
    from attngen.kernels.fwd.plan import make_plan

    launched = []
    kernel = kernel_for(make_plan(Spec()), launched)
    q = torch.empty(1, 4, 2, 128, dtype=torch.float16)
    with raises("block_table", "expected None", "set paged_kv = true"):
        kernel(q, q, q, block_table=torch.zeros(1, 1, dtype=torch.int32), seqused_k=torch.zeros(1, dtype=torch.int32))
    with raises("num_splits", "splits = 1"):
        kernel(q, q, q, num_splits=2, check=False)
    assert launched == []


@pytest.mark.parametrize("splits", [1, 2])
def test_an_unchecked_serving_call_launches_main_then_combine(monkeypatch, splits):
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())  # CPU tensors stand in
    launched = []
    spec, q, k, v, kw = cpu_call("varlen", False, splits=splits, lse=True)
    out, lse = kernel_for(spec, launched)(q, k, v, check=False, softmax_scale=0.5, **kw)
    assert out.shape == (q.shape[0], 4, 64) and lse.shape == (4, q.shape[0])
    assert [name for name, _ in launched] == (["main"] if splits == 1 else ["main", "combine"])
    def same(a, b):  # the launch gets detached views of the caller's tensors
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape

    main = launched[0][1]
    assert all(same(a, b) for a, b in zip(main, (q, k, v)))
    assert same(main[-4], kw["cu_seqlens_q"]) and same(main[-3], kw["cu_seqlens_k"]) and main[-2] == kw["max_seqlen_q"]
    assert main[-1] == 0.5  # the run-time softmax scale, last (docs/serving.md's ABI)
    if splits == 1:
        assert same(main[3], out) and same(main[4], lse) and len(main) == 9
    else:
        assert main[3].shape == (2, *out.shape) and main[4].shape == (2, *lse.shape) and len(main) == 9
        combine = launched[1][1]
        assert same(combine[0], main[3]) and same(combine[1], main[4]) and same(combine[2], out) and same(combine[3], lse)
        assert len(combine) == 5 and same(combine[4], kw["cu_seqlens_q"])


def test_an_empty_call_launches_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    launched = []
    spec, q, k, v, kw = cpu_call("varlen", True, lq=(0, 0), lk=(3, 4))
    out = kernel_for(spec, launched)(q, k, v, check=False, **kw)
    assert out.shape == (0, 4, 64) and launched == []
