"""The persistent forward over a varlen batch (issue 30): the counter's tile t is head t % heads of the
tile list's pair t // heads, (sequence, row tile) pairs sorted longest first on cu_seqlens' device
(schedulers.varlen_tile_list, no host read). Run on the CPU
model at 1-8 SMs, its outputs and LSE equal the single-tile varlen kernel's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attngen
from attngen import tiles
from attngen.emulator import POLICIES, HazardError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS, emulate_stats
from attngen.emulator.persistent import TileCounters
from attngen.kernels.common.schedulers import varlen_pairs, varlen_tile_list
from attngen.kernels.fwd.plan import make_plan

HEADS = 2
LENGTHS = ([300, 1, 0, 129], [300, 40, 7, 200])  # a long causal sequence, one row, no rows, more keys than rows


def batch(lq, lk, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(lq), HEADS, 64)).astype(np.float32)
    k, v = (rng.standard_normal((sum(lk), HEADS, 64)).astype(np.float32) for _ in range(2))
    serving = {"cu_seqlens_q": np.cumsum([0] + list(lq)).astype(np.int32),
               "cu_seqlens_k": np.cumsum([0] + list(lk)).astype(np.int32), "max_seqlen_q": max(lq)}
    return q, k, v, serving


def spec(scheduler, **fields):
    return attngen.Spec(head_dim=64, causal=True, layout="varlen", lse=True, scheduler=scheduler, **fields)


def run(lq=LENGTHS[0], lk=LENGTHS[1], *, num_sms=3, seed=0, policy="random", block_order="grid", source=None):
    q, k, v, serving = batch(lq, lk)
    return emulate_stats(spec("persistent"), q, k, v, serving=serving, num_sms=num_sms, seed=seed, policy=policy,
                         block_order=block_order, source=source, counters=TileCounters())


def single(lq=LENGTHS[0], lk=LENGTHS[1]):
    """The single-tile varlen kernel of the persistent one's tiles."""
    block_n = make_plan(spec("persistent")).spec.block_n
    q, k, v, serving = batch(lq, lk)
    return emulate_stats(spec("single", block_n=block_n), q, k, v, serving=serving)[0]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) and not np.isnan(x).any() for x, y in zip(a, b))


def host_order(q_lens, kv_lens, edges, block_m, block_n, kv_tiles: bool = False, first: str = "longest") -> list:
    """The old host sort (the reference; the backward's lists too): Python tuples per (sequence, row
    tile), or (sequence, KV tile) by the Q tiles that see it, with tiles.Frame's scalar ranges, sorted."""
    sign = -1 if first == "longest" else 1
    pairs = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        fr = tiles.Frame.of(q_len, kv_len, edges, block_m, block_n)
        if kv_tiles:
            pairs += [(sign * len(fr.q_span(t).tiles), b, t) for t in range(-(-kv_len // block_n))]
        else:
            pairs += [(sign * fr.row_tile_visits(t), b, t) for t in range(fr.q_tiles())]
    return [[b, t] for _, b, t in sorted(pairs)]


def pairs_of(q_lens, kv_lens, edges, block_m=128, block_n=128, extra_rows=0):
    import torch

    cu = [torch.tensor([0] + list(lens)).cumsum(0).int() for lens in (q_lens, kv_lens)]
    return varlen_pairs(*cu, sum(q_lens) + extra_rows, edges, block_m, block_n)


def test_the_order_is_longest_first_over_sequence_and_row_tile():
    listed = pairs_of([300, 0, 100], [300, 5, 200], tiles.edges(True))
    # sequence 0's row tile 2 sees 3 KV tiles; its tile 1 and sequence 2's only tile 2 each (ties in order)
    assert listed[:4].tolist() == [[0, 2], [0, 1], [2, 0], [0, 0]]
    assert listed[-1].tolist() == [4, 0]  # the real pairs' count
    # the bound 400 // 128 + 3 = 6 pairs: two of padding, the last sequence's row tiles past its end
    assert listed.shape == (7, 2) and listed[4:6].tolist() == [[2, 1], [2, 2]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400)), min_size=1, max_size=6),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (100, -1), (-1, 30), (64, 0), (0, 0)]),
       blocks=st.sampled_from([(128, 128), (64, 128), (128, 64), (64, 176)]), extra_rows=st.integers(0, 300))
def test_the_pairs_equal_the_old_host_sort(lengths, causal, window, blocks, extra_rows):
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    edges = tiles.edges(causal, window)
    listed = pairs_of(lq, lk, edges, *blocks, extra_rows=extra_rows)
    want = host_order(lq, lk, edges, *blocks)
    assert int(listed[-1, 0]) == len(want) and listed[:len(want)].tolist() == want
    assert len(listed) == (sum(lq) + extra_rows) // blocks[0] + len(lq) + 1  # the host's bound, from shapes
    padding = listed[len(want):-1]
    assert (padding[:, 0] == len(lq) - 1).all() and (padding[:, 1] * blocks[0] >= lq[-1]).all()  # past its end


def test_the_builder_reads_no_value_on_the_host():
    """On meta tensors (no values at all) it runs and returns the bound's shape: no device-to-host copy."""
    import torch

    cu = torch.empty(249, dtype=torch.int32, device="meta")
    listed = varlen_pairs(cu, cu, 65152 * 128 // 16, tiles.edges(True), 128, 128)
    assert listed.device.type == "meta" and listed.shape == (65152 // 16 + 248 + 1, 2) and listed.dtype == torch.int32


@pytest.mark.parametrize("num_sms", [1, 2, 5, 8])
def test_equal_to_the_single_tile_varlen_kernel_bit_for_bit(num_sms):
    got, stats = run(num_sms=num_sms, seed=num_sms)
    assert same(got, single()), num_sms
    assert stats.ctas == num_sms


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    want = single()
    digests = set()
    for seed in range(2):
        got, stats = run(num_sms=4, seed=seed, policy=policy, block_order=block_order)
        assert same(got, want), (policy, block_order, seed)
        digests.add(stats.schedule)
    assert policy != "random" or len(digests) > 1  # the seeds did draw different interleavings


MUTANTS = {
    # (a cyclic shift of a column can be a permutation of the same tiles: clamped, the last entry's repeats)
    "a sequence read one entry late": ("batch_idx = tile_list[pair, 0]", "batch_idx = tile_list[T.min(pair + 1, tile_rows - 2), 0]"),
    "a row tile read from the wrong column": ("q_block = tile_list[pair, 1]", "q_block = tile_list[pair, 0]"),
    "the padding handed out as work": ("total_tiles = tile_list[tile_rows - 1, 0] * heads", "total_tiles = (tile_rows - 1) * heads"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_a_mutant_tile_list_read_is_caught_in_every_schedule(name, policy, block_order):
    old, new = MUTANTS[name]
    source = attngen.render_source(spec("persistent"))
    assert source.count(old) == (1 if old.startswith("total_tiles") else 2)  # the producer's and the consumer's
    with pytest.raises((HazardError, KernelError)):  # a tile run twice: a race on its rows, or the once-per-tile check
        run(num_sms=2, policy=policy, block_order=block_order, source=source.replace(old, new))


def skipping_last_sequence(build):
    """A tile-list builder whose lists leave out the last sequence's pairs (and count them out): a
    schedule that skips a sequence (this file's, test_persistent_paged's and the backward's tests)."""
    def built(*args):
        listed = build(*args).clone()
        real = listed[:int(listed[-1, 0])]
        kept = real[real[:, 0] != real[:, 0].max()]
        listed[:len(kept)], listed[-1, 0] = kept, len(kept)
        return listed
    return built


@pytest.mark.parametrize("policy", POLICIES)
def test_a_list_that_skips_a_sequence_is_caught(monkeypatch, policy):
    from attngen.emulator import persistent

    monkeypatch.setattr(persistent, "varlen_tile_list", skipping_last_sequence(varlen_tile_list))
    with pytest.raises(KernelError, match="exactly once"):
        run(num_sms=2, policy=policy)


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 260), st.integers(0, 260)), min_size=1, max_size=4),
       num_sms=st.integers(1, 6), seed=st.integers(0, 3))
def test_drawn_lengths_and_sm_counts_match_the_single_tile_kernel(lengths, num_sms, seed):
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    if sum(lq) == 0 or sum(lk) == 0:
        return
    got, _ = run(lq, lk, num_sms=num_sms, seed=seed)
    assert same(got, single(lq, lk)), (lq, lk, num_sms)


def test_the_gpu_launcher_builds_the_list_without_reading_the_lengths_on_the_host(monkeypatch):
    """run/persistent.varlen_launch_args with cu_seqlens the call's check did not read (read_values=False):
    it passes varlen_tile_list's tensor, sized by q's rows (CPU torch tensors stand in for the device's)."""
    import torch

    from attngen.run import persistent, serving

    plan = make_plan(spec("persistent"))
    q, k, _, lens = batch(*LENGTHS)
    q, k = torch.from_numpy(q).half(), torch.from_numpy(k).half()
    cu = {n: torch.from_numpy(lens[n]) for n in ("cu_seqlens_q", "cu_seqlens_k")}
    call = serving.check_serving(plan, q, k, k, read_values=False, max_seqlen_q=lens["max_seqlen_q"], **cu)
    assert call.arrays["cu_seqlens_q"] is None  # not read by the check, nor by the launcher
    monkeypatch.setattr(persistent, "launch_args", lambda plan, q, k: ["counters", "epoch", "sms"])
    args = persistent.varlen_launch_args(plan, call, q, k)
    assert args[:3] == ["counters", "epoch", "sms"]
    assert torch.equal(args[3], varlen_tile_list(plan, cu, q.shape))
    assert args[3][0].tolist() == [0, 2]  # sequence 0's last row tile sees the most keys
