"""The persistent forward over a varlen batch (issue 30): the counter's tile t is the host's tile list's
t-th (sequence, head, row tile), sorted longest first (schedulers.varlen_tile_order). Run on the CPU
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
from attngen.kernels.common.schedulers import varlen_tile_list, varlen_tile_order
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import SpecError

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


def test_the_order_is_longest_first_over_sequence_and_row_tile_with_heads_innermost():
    order = varlen_tile_order([300, 0, 100], [300, 5, 200], 2, tiles.edges(True), 128, 128)
    # sequence 0's row tile 2 sees 3 KV tiles; its tile 1 and sequence 2's only tile 2 each (ties in order)
    assert order == [(0, 0, 2), (0, 1, 2), (0, 0, 1), (0, 1, 1), (2, 0, 0), (2, 1, 0), (0, 0, 0), (0, 1, 0)]


def test_the_backward_refuses_it_in_one_line():
    from attngen.kernels.bwd.plan import plan_backward

    with pytest.raises(SpecError) as e:
        plan_backward(spec("persistent"))
    assert e.value.field == "layout" and "persistent backward" in str(e.value) and "\n" not in str(e.value)


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
    "a sequence read one entry late": ("batch_idx = tile_list[tile, 0]", "batch_idx = tile_list[T.min(tile + 1, total_tiles - 1), 0]"),
    "a row tile read from the wrong column": ("q_block = tile_list[tile, 2]", "q_block = tile_list[tile, 1]"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_a_mutant_tile_list_read_is_caught_in_every_schedule(name, policy, block_order):
    old, new = MUTANTS[name]
    source = attngen.render_source(spec("persistent"))
    assert source.count(old) == 2  # the producer's and the consumer's
    with pytest.raises((HazardError, KernelError)):  # a tile run twice: a race on its rows, or the once-per-tile check
        run(num_sms=2, policy=policy, block_order=block_order, source=source.replace(old, new))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_list_that_skips_a_sequence_is_caught(monkeypatch, policy):
    from attngen.emulator import persistent

    def without_last_sequence(*args):
        listed = varlen_tile_list(*args)
        return listed[listed[:, 0] != listed[:, 0].max()]

    monkeypatch.setattr(persistent, "varlen_tile_list", without_last_sequence)
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


def test_the_gpu_launcher_reads_the_lengths_on_the_host_and_passes_the_sorted_list(monkeypatch):
    """run/persistent.varlen_launch_args with cu_seqlens the call's check did not read (read_values=False):
    it copies them to the host and passes the list varlen_tile_list sorts (CPU torch tensors stand in)."""
    import torch

    from attngen.run import persistent, serving

    plan = make_plan(spec("persistent"))
    q, k, _, lens = batch(*LENGTHS)
    q, k = torch.from_numpy(q).half(), torch.from_numpy(k).half()
    cu = {n: torch.from_numpy(lens[n]) for n in ("cu_seqlens_q", "cu_seqlens_k")}
    call = serving.check_serving(plan, q, k, k, read_values=False, max_seqlen_q=lens["max_seqlen_q"], **cu)
    assert call.arrays["cu_seqlens_q"] is None  # not read by the check: the launcher reads them
    monkeypatch.setattr(persistent, "launch_args", lambda plan, q, k: ["counters", "epoch", "sms"])
    args = persistent.varlen_launch_args(plan, call, q, k)
    assert args[:3] == ["counters", "epoch", "sms"]
    assert np.array_equal(args[3].numpy(), varlen_tile_list(plan, lens["cu_seqlens_q"], lens["cu_seqlens_k"], HEADS))
    assert args[3][0].tolist() == [0, 0, 2]  # sequence 0's last row tile sees the most keys
