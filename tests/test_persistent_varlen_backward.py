"""The persistent backward over a varlen batch (issue 30): the main kernel's counter hands out head
t % heads of the (sequence, KV tile) pair t // heads of a list sorted the most Q tiles first, and the
deterministic dq kernel's blocks take every num_sms-th tile of a (sequence, Q tile) list sorted the
fewest KV tiles first; both lists are built on cu_seqlens' device (bwd/persistent.py: varlen_main_list,
varlen_dq_list; no host read). On the CPU model at 1-8 SMs, the gradients equal the single-tile varlen
backward's of the same tiles: bit for bit where no float atomics sum them (test_persistent_backward.agree)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import tiles
from attngen.emulator import POLICIES, EmulationError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS
from attngen.emulator.persistent import TileCounters
from attngen.kernels.bwd import persistent as bwd_persistent
from attngen.kernels.bwd.persistent import varlen_dq_list, varlen_main_list
from attngen.kernels.bwd.plan import plan_backward, single_tile_twin
from attngen.kernels.bwd.render import render_backward_source
from attngen.spec import SpecError
from test_persistent_backward import agree
from test_persistent_varlen import host_order, skipping_last_sequence

HEADS = 2
CAUSAL = {"causal": True, "head_dim": 64}
DET = {**CAUSAL, "deterministic": True}
LENGTHS = ([300, 1, 0, 129, 64], [300, 40, 7, 200, 64])  # a long causal sequence, one row, no rows, more keys than rows


def spec(fields, scheduler="persistent"):
    return attngen.Spec(**fields, layout="varlen", scheduler=scheduler)


def problem(fields, lq=LENGTHS[0], lk=LENGTHS[1], seed=0):
    """Packed q, k, v, dout, the prefix sums, and the forward's out and lse (single-tile)."""
    group, dim = attngen.Spec(**fields).gqa_group, attngen.Spec(**fields).head_dim
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(lq), HEADS * group, dim)).astype(np.float32)
    k, v = (rng.standard_normal((sum(lk), HEADS, dim)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    # ALiBi's call-time slopes, one per query head
    tensors = {"alibi_slopes": rng.uniform(0.05, 0.5, q.shape[1]).astype(np.float32)} if fields.get("alibi") else {}
    seq = {"cu_seqlens_q": np.cumsum([0] + list(lq)).astype(np.int32),
           "cu_seqlens_k": np.cumsum([0] + list(lk)).astype(np.int32), "max_seqlen_q": max(lq)}
    out, lse = attngen.emulate(attngen.Spec(**fields, layout="varlen", lse=True), q, k, v, **seq, **tensors)
    return q, k, v, dout, {**seq, **tensors}, out, lse


def backward(fields, data, persistent=True, **run):
    """The persistent varlen backward's gradients, or the single-tile one's of the same tiles."""
    q, k, v, dout, seq, out, lse = data
    if persistent:
        run.setdefault("counters", TileCounters())
    else:
        run.setdefault("source", render_backward_source(single_tile_twin(spec(fields))))
    return attngen.emulate_backward(spec(fields, "persistent" if persistent else "single"), q, k, v, dout, out=out,
                                    lse=lse, **seq, **run)


def cumulative(lens):
    import torch

    return torch.tensor([0] + list(lens)).cumsum(0).int()


# -- the lists ------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=6),
       mask=st.sampled_from([{"causal": True}, {}, {"window": (100, 20)}, {"window": (-1, 50)}, {"window": (70, -1)}]),
       fields=st.sampled_from([{"head_dim": 64, "deterministic": True}, {"head_dim": 128, "deterministic": True}]))
def test_the_lists_equal_a_host_sort_of_the_frames_ranges(lengths, mask, fields):
    bp = plan_backward(spec({**fields, **mask}))
    edges = tiles.Edges(bp.forward.window_left, bp.forward.window_right)
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    for kv_tiles, build, (m, n), total in [(True, varlen_main_list, (bp.block_m, bp.block_n), sum(lk)),
                                           (False, varlen_dq_list, (bp.dq_block_m, bp.dq_block_n), sum(lq))]:
        listed = build(bp, cumulative(lq), cumulative(lk), total).tolist()
        want = host_order(lq, lk, edges, m, n, kv_tiles, "longest" if kv_tiles else "shortest")
        assert listed[-1][0] == len(want) and listed[:len(want)] == want, (kv_tiles, lq, lk)
        assert len(listed) == total // (n if kv_tiles else m) + len(lengths) + 1  # the bound from shapes, and the count


def test_the_builders_read_no_value_on_the_host():
    """On meta tensors (no values at all) both run and return their bound's shape: no device-to-host copy."""
    import torch

    bp = plan_backward(spec(DET))
    cu = torch.empty(9, dtype=torch.int32, device="meta")
    main, dq = varlen_main_list(bp, cu, cu, 5000), varlen_dq_list(bp, cu, cu, 6000)
    assert main.device.type == dq.device.type == "meta"
    assert main.shape == (5000 // bp.block_n + 8 + 1, 2) and dq.shape == (6000 // bp.dq_block_m + 8 + 1, 2)


def test_the_gpu_launcher_passes_both_lists_built_from_the_calls_tensors(monkeypatch):
    """run/persistent.varlen_backward_args on cu_seqlens the call's check did not read: the main kernel's
    counters, epoch, grid and list; the dq kernel's grid and list (CPU torch tensors stand in for the device's)."""
    import torch

    from attngen.run import persistent, serving
    from attngen.kernels.fwd.plan import make_plan

    bp = plan_backward(spec(DET))
    q, k, v = (torch.zeros(n, HEADS, 64, dtype=torch.float16) for n in (sum(LENGTHS[0]), sum(LENGTHS[1]), sum(LENGTHS[1])))
    cu = {n: cumulative(lens) for n, lens in zip(("cu_seqlens_q", "cu_seqlens_k"), LENGTHS)}
    call = serving.check_serving(make_plan(spec(DET)), q, k, v, read_values=False, max_seqlen_q=300, **cu)
    assert call.arrays["cu_seqlens_q"] is None
    monkeypatch.setattr(persistent, "launch_args", lambda plan, q, k: ["counters", "epoch", "sms"])
    monkeypatch.setattr(persistent, "sm_count", lambda q: 132)
    main, dq = persistent.varlen_backward_args(bp, call, q, k)
    assert main[:3] == ["counters", "epoch", "sms"] and dq[0] == 132
    assert torch.equal(main[3], varlen_main_list(bp, cu["cu_seqlens_q"], cu["cu_seqlens_k"], k.shape[0]))
    assert torch.equal(dq[1], varlen_dq_list(bp, cu["cu_seqlens_q"], cu["cu_seqlens_k"], q.shape[0]))
    assert persistent.varlen_backward_args(plan_backward(spec(DET, "single")), call, q, k) == ([], [])


# -- equal to the single-tile varlen backward ---------------------------------------------------------------
SPECS = [CAUSAL, {"head_dim": 64}, {**CAUSAL, "gqa_group": 2}, {"head_dim": 64, "window": (100, 20)}, DET,
         {**DET, "gqa_group": 2}, {"causal": True, "head_dim": 128}, {**CAUSAL, "alibi": True}, {**DET, "softcap": 20.0}]


def test_alibi_with_softcap_is_refused_in_one_line():
    """Its main kernel spilled (attngen build --backward); each alone built with none."""
    with pytest.raises(SpecError) as e:
        plan_backward(spec({**CAUSAL, "alibi": True, "softcap": 20.0}))
    assert e.value.field == "scheduler" and "36 B" in str(e.value) and "\n" not in str(e.value)
    assert plan_backward(spec({**CAUSAL, "alibi": True})) and plan_backward(spec({**CAUSAL, "softcap": 20.0}))
    assert plan_backward(spec({**CAUSAL, "alibi": True, "softcap": 20.0}, "single"))


@pytest.mark.parametrize("fields", SPECS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_gradients_equal_the_single_tile_varlen_backward(fields):
    data = problem(fields)
    want = backward(fields, data, persistent=False)
    for num_sms in (1, 2, 5, 8):
        assert agree(backward(fields, data, num_sms=num_sms, seed=num_sms), want, fields), (fields, num_sms)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    for fields in (CAUSAL, DET):
        data = problem(fields)
        want = backward(fields, data, persistent=False)
        for seed in range(2):
            got = backward(fields, data, num_sms=3, seed=seed, policy=policy, block_order=block_order)
            assert agree(got, want, fields), (fields, policy, block_order, seed)


MUTANTS = {  # name: (fields, old, new); old occurs in the producer's and the consumers' tile lines
    "a KV tile read from the sequence column": (CAUSAL, "kv_block = tile_list[pair, 1]", "kv_block = tile_list[pair, 0]"),
    "a sequence read one entry late": (CAUSAL, "batch_idx = tile_list[pair, 0]",
                                       "batch_idx = tile_list[T.min(pair + 1, tile_rows - 2), 0]"),
    "the padding handed out as work": (CAUSAL, "total_tiles = tile_list[tile_rows - 1, 0] * heads",
                                       "total_tiles = (tile_rows - 1) * heads"),
    "dq: a Q tile read from the sequence column": (DET, "q_block = dq_tile_list[pair, 1]", "q_block = dq_tile_list[pair, 0]"),
    "dq: one pair short": (DET, "total_tiles = dq_tile_list[dq_tile_rows - 1, 0] * heads",
                           "total_tiles = (dq_tile_list[dq_tile_rows - 1, 0] - 1) * heads"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_list_read_is_caught_in_every_schedule(name):
    fields, old, new = MUTANTS[name]
    source = render_backward_source(spec(fields))
    assert old in source
    data = problem(fields)
    for policy in POLICIES:
        for block_order in BLOCK_ORDERS:
            with pytest.raises(EmulationError):  # a tile twice or skipped: a race on its rows, or the once-per-tile check
                backward(fields, data, num_sms=2, policy=policy, block_order=block_order, source=source.replace(old, new))


@pytest.mark.parametrize("builder", ["varlen_main_list", "varlen_dq_list"])
def test_a_list_that_skips_a_sequence_is_caught(monkeypatch, builder):
    monkeypatch.setattr(bwd_persistent, builder, skipping_last_sequence(getattr(bwd_persistent, builder)))
    for policy in POLICIES:
        with pytest.raises(KernelError, match="exactly once"):
            backward(DET, problem(DET), num_sms=2, policy=policy)


# -- drawn: lengths x specs x SM counts x schedules ------------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(0, 260), st.integers(0, 260)), min_size=1, max_size=4),
       fields=st.sampled_from(SPECS[:6]), num_sms=st.integers(1, 6), policy=st.sampled_from(POLICIES),
       block_order=st.sampled_from(BLOCK_ORDERS), seed=st.integers(0, 5))
def test_drawn_lengths_specs_and_schedules_match_the_single_tile_backward(lengths, fields, num_sms, policy,
                                                                          block_order, seed):
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    if sum(lq) == 0 or sum(lk) == 0:
        return
    data = problem(fields, lq, lk, seed)
    want = backward(fields, data, persistent=False)
    got = backward(fields, data, num_sms=num_sms, seed=seed, policy=policy, block_order=block_order)
    assert agree(got, want, fields), (lq, lk, fields, num_sms)
