"""The persistent forward over a paged K/V cache (issue 30), with bshd or varlen queries: the counter's
tile t is head t % heads of the (sequence, row tile) pair t // heads of a list sorted the most KV
tiles first, built on the device from seqused_k (and cu_seqlens_q for varlen queries) with no host
read (schedulers.varlen_tile_list, call_lengths). On the CPU model at 1-8 SMs its outputs and LSE equal
the single-tile paged kernel's of the same tiles bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen.emulator import POLICIES, EmulationError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS, emulate_stats
from attngen.emulator.persistent import TileCounters
from attngen.kernels.common.schedulers import call_lengths, varlen_tile_list
from attngen.kernels.fwd.plan import make_plan
from test_persistent_varlen import skipping_last_sequence

HEADS, DIM, PAGE = 2, 64, 128
USED = [300, 0, 700, 1]  # keys per sequence: partial pages, none, several pages, one key
Q_LENS = [200, 1, 77, 0]  # varlen queries


def spec(scheduler="persistent", varlen=False, **fields):
    return attngen.Spec(head_dim=DIM, causal=True, paged_kv=True, page_size=PAGE, lse=True, scheduler=scheduler,
                        **({"layout": "varlen"} if varlen else {}), **fields)


def problem(varlen=False, used=USED, q_lens=Q_LENS, q_len=150, seed=0):
    """q, the cache's k and v (pages in a shuffled order) and the serving keywords."""
    rng = np.random.default_rng(seed)
    batch, pages = len(used), max(1, -(-max(used) // PAGE))
    q_shape = (sum(q_lens), HEADS, DIM) if varlen else (batch, q_len, HEADS, DIM)
    q = rng.standard_normal(q_shape).astype(np.float32)
    k, v = (rng.standard_normal((batch * pages, PAGE, HEADS, DIM)).astype(np.float32) for _ in range(2))
    serving = {"block_table": rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages),
               "seqused_k": np.array(used, np.int32)}
    if varlen:
        serving.update(cu_seqlens_q=np.cumsum([0] + list(q_lens)).astype(np.int32), max_seqlen_q=max(q_lens))
    return q, k, v, serving


def run(data, varlen=False, persistent=True, **kw):
    q, k, v, serving = data
    if not persistent:  # the single-tile kernel of the persistent one's tiles
        block_n = make_plan(spec(varlen=varlen)).spec.block_n
        return emulate_stats(spec("single", varlen, block_n=block_n), q, k, v, serving=serving)[0]
    kw.setdefault("counters", TileCounters())
    return emulate_stats(spec(varlen=varlen), q, k, v, serving=serving, **kw)[0]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) and not np.isnan(x).any() for x, y in zip(a, b))


def test_a_per_sequence_persistent_producer_holds_56_registers():
    """It decodes each tile from the list (and a paged one looks up pages): at 40 it spilled (attngen build)."""
    from attngen import hw

    for fields in ({"paged_kv": True}, {"layout": "varlen"}, {"paged_kv": True, "layout": "varlen"}):
        plan = make_plan(attngen.Spec(head_dim=DIM, causal=True, scheduler="persistent", **fields))
        assert (plan.producer_regs, plan.consumer_regs) == (hw.PER_SEQUENCE_PERSISTENT_PRODUCER_REGS, 224) == (56, 224)
    assert make_plan(attngen.Spec(head_dim=DIM, causal=True, scheduler="persistent")).producer_regs == 40  # bshd, dense
    assert make_plan(attngen.Spec(head_dim=DIM, causal=True, paged_kv=True)).producer_regs == 40  # single-tile paged


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("num_sms", [1, 2, 5, 8])
def test_equal_to_the_single_tile_paged_kernel_bit_for_bit(varlen, num_sms):
    data = problem(varlen)
    assert same(run(data, varlen, num_sms=num_sms, seed=num_sms), run(data, varlen, persistent=False))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    for varlen in (False, True):
        data = problem(varlen)
        want = run(data, varlen, persistent=False)
        for seed in range(2):
            assert same(run(data, varlen, num_sms=3, seed=seed, policy=policy, block_order=block_order), want)


def test_the_list_takes_each_sequences_keys_from_seqused_k():
    """call_lengths: bshd queries count q's rows for every sequence, a paged cache's keys are seqused_k;
    the list is sorted by the KV tiles each (sequence, row tile) visits, most first."""
    import torch

    plan = make_plan(spec())
    seqused = torch.tensor(USED, dtype=torch.int32)
    q_lens, kv_lens, total = call_lengths(plan, {"seqused_k": seqused}, (4, 150, HEADS, DIM))
    assert q_lens.tolist() == [150] * 4 and kv_lens.tolist() == USED and total == 600
    listed = varlen_tile_list(plan, {"seqused_k": seqused}, (4, 150, HEADS, DIM))
    # 8 pairs; sequence 2 (700 keys) sees the most, both its row tiles 6 KV tiles: ties keep row-tile order
    assert listed[-1, 0] == 4 * 2 and listed[:2].tolist() == [[2, 0], [2, 1]]
    plan = make_plan(spec(varlen=True))
    cu = torch.tensor(np.cumsum([0] + Q_LENS), dtype=torch.int32)
    q_lens, kv_lens, total = call_lengths(plan, {"seqused_k": seqused, "cu_seqlens_q": cu}, (sum(Q_LENS), HEADS, DIM))
    assert q_lens.tolist() == Q_LENS and kv_lens.tolist() == USED and total == sum(Q_LENS)


def test_the_gpu_launcher_builds_the_list_without_reading_the_lengths_on_the_host(monkeypatch):
    """run/persistent.varlen_launch_args on meta tensors (no values at all): no device-to-host copy."""
    import torch

    from attngen.run import persistent

    class Call:
        arg_names = ("block_table", "seqused_k")
        args = (torch.empty(4, 6, dtype=torch.int32, device="meta"), torch.empty(4, dtype=torch.int32, device="meta"))

    plan = make_plan(spec())
    monkeypatch.setattr(persistent, "launch_args", lambda plan, q, k: ["counters", "epoch", "sms"])
    q = torch.empty(4, 1000, HEADS, DIM, dtype=torch.float16, device="meta")
    args = persistent.varlen_launch_args(plan, Call(), q, None)
    assert args[:3] == ["counters", "epoch", "sms"]
    assert args[3].device.type == "meta" and args[3].shape == (4000 // plan.spec.block_m + 4 + 1, 2)


MUTANTS = {  # name: (old, new); each replaces the producer's and the consumers' line
    "a key count read from the next sequence": ("kv_len = seqused_k[batch_idx]", "kv_len = seqused_k[T.min(batch_idx + 1, batch - 1)]"),
    "a row tile read from the sequence column": ("q_block = tile_list[pair, 1]", "q_block = tile_list[pair, 0]"),
    "the padding handed out as work": ("total_tiles = tile_list[tile_rows - 1, 0] * heads", "total_tiles = (tile_rows - 1) * heads"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_is_caught_in_every_schedule(name):
    """A misread list runs a tile twice or skips one (a race, or the once-per-tile check); a misread key
    count changes the bits (the comparison with the single-tile kernel is the check)."""
    old, new = MUTANTS[name]
    source = attngen.render_source(spec())
    assert old in source
    data = problem(q_len=100)  # a row tile per sequence: the shape-bound list has padding pairs
    want = run(data, persistent=False)
    for policy in POLICIES:
        for block_order in BLOCK_ORDERS:
            try:
                got = run(data, num_sms=2, policy=policy, block_order=block_order, source=source.replace(old, new))
            except EmulationError:
                continue
            assert not same(got, want), (name, policy, block_order)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_list_that_skips_a_sequence_is_caught(monkeypatch, policy):
    from attngen.emulator import persistent

    monkeypatch.setattr(persistent, "varlen_tile_list", skipping_last_sequence(varlen_tile_list))
    with pytest.raises(KernelError, match="exactly once"):
        run(problem(), num_sms=2, policy=policy)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(used=st.lists(st.integers(0, 400), min_size=1, max_size=4), q_len=st.integers(1, 260),
       varlen=st.booleans(), num_sms=st.integers(1, 6), policy=st.sampled_from(POLICIES), seed=st.integers(0, 5))
def test_drawn_caches_and_sm_counts_match_the_single_tile_kernel(used, q_len, varlen, num_sms, policy, seed):
    q_lens = [(q_len * (i + 1)) % 261 for i in range(len(used))]
    if varlen and sum(q_lens) == 0:
        return
    data = problem(varlen, used, q_lens, q_len, seed)
    assert same(run(data, varlen, num_sms=num_sms, seed=seed, policy=policy), run(data, varlen, persistent=False))
