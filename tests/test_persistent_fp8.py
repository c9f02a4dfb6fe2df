"""fp8 forward kernels under the persistent scheduler (issues 29 and 30) on the CPU model.

The fp8 producer warpgroup transposes V one tile behind its loads; under the persistent scheduler
all four of its warps take each tile's index, and a tile's last transpose is done before the next
tile is taken. The consumers read the tile's descales per tile. Outputs must equal the single-tile
fp8 kernel's bit for bit at every SM count, schedule and block order, and each mutant below must be
caught in every schedule.
"""

import numpy as np
import pytest

import attngen
from attngen.emulator import POLICIES, DeadlockError, EmulationError, HazardError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS, emulate_stats, stored_v, variant_inputs
from attngen.emulator.persistent import TileCounters
from attngen.hw import E4M3
from attngen.kernels.fwd.plan import make_plan

FP8 = {"dtype": E4M3, "head_dim": 64}
SHAPE = (2, 2, 300, 333)  # batch, heads, q_len, kv_len: 3 row tiles x 4 (batch, head) pairs, 1 to 3 K tiles each
VARIANTS = [{}, {"causal": True}, {"causal": True, "gqa_group": 2, "lse": True},
            {"v_layout": "transposed", "block_n": 64},
            {"window": (40, 8), "softcap": 20.0, "sinks": True, "lse": True}, {"alibi": True, "causal": True}]


def inputs(spec, shape):
    batch, heads, q_len, kv_len = shape
    kv_len = -(-kv_len // 16) * 16 if spec.v_layout == "transposed" else kv_len  # TMA's 16-byte strides
    q, k, v, tensors = variant_inputs(make_plan(spec), batch, heads * spec.gqa_group, heads, q_len, kv_len, seed=1)
    return q, k, stored_v(spec, v), tensors


def outputs(fields, shape=SHAPE, *, scheduler="persistent", source=None, **run):
    spec = attngen.Spec(**FP8, **fields, scheduler=scheduler)
    q, k, v, tensors = inputs(spec, shape)
    if scheduler == "persistent":
        run.setdefault("counters", TileCounters())
    result, _ = emulate_stats(spec, q, k, v, source=source, tensors=tensors, **run)
    return result if spec.lse else (result,)


def same(a, b) -> bool:
    return all(np.array_equal(x, y) and not np.isnan(x).any() for x, y in zip(a, b))


def test_fp8_takes_the_persistent_scheduler_and_only_its_name_changes():
    single = make_plan(attngen.Spec(**FP8, causal=True))
    persistent = make_plan(attngen.Spec(**FP8, causal=True, scheduler="persistent"))
    assert persistent.name == single.name + "_persistent"
    assert persistent.spec.block_n == single.spec.block_n


@pytest.mark.parametrize("fields", VARIANTS, ids=lambda f: ",".join(f) or "plain")
def test_equal_to_the_single_tile_fp8_kernel_bit_for_bit(fields):
    want = outputs(fields, scheduler="single")
    for num_sms in (1, 2, 5):
        assert same(outputs(fields, num_sms=num_sms, seed=num_sms), want), (fields, num_sms)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    want = outputs({"causal": True}, scheduler="single")
    for seed in range(2):
        assert same(outputs({"causal": True}, num_sms=3, seed=seed, policy=policy, block_order=block_order), want)


# -- mutants: what the fp8 producer's persistent loop must keep ------------------------------------------------
MUTANTS = {
    # the lagging transpose stops at the tile's last K load: that tile's V^T is never written
    "last_transpose_of_a_tile_dropped": ([("for k in T.serial(n_tiles + 1):", "for k in T.serial(n_tiles):")],
                                         (DeadlockError, HazardError)),
    # only the TMA warp's arrivals counted: the other three warps' run into the next phase, which then
    # completes before the consumers have read the index
    "tile_empty_counts_the_tma_warp_only": ([("RELEASE_ARRIVALS + WARPGROUP_THREADS]", "RELEASE_ARRIVALS + TMA_ARRIVALS]")],
                                            (HazardError, DeadlockError, KernelError)),
    # the producer carries one visit too few into the next tile: its stages and phases start a visit behind
    "producer_visits_carried_one_short": (
        [("                visit_base = visit_base + n_tiles  # the tile's last transpose is done",
          "                visit_base = visit_base + n_tiles - 1  # the tile's last transpose is done")],
        (HazardError, DeadlockError)),
}


def mutated(edits) -> str:
    text = attngen.render_source(attngen.Spec(**FP8, causal=True, scheduler="persistent"))
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught_in_every_schedule(name):
    edits, caught_by = MUTANTS[name]
    source = mutated(edits)
    for policy in POLICIES:
        for block_order in BLOCK_ORDERS:
            with pytest.raises(EmulationError) as e:
                outputs({"causal": True}, num_sms=2, seed=1, policy=policy, block_order=block_order, source=source)
            assert isinstance(e.value, caught_by), (policy, block_order, e.value.report)


def test_a_tile_that_kept_another_tiles_descales_gives_other_bits():
    """The descales differ per (batch, KV head), so the bit comparison above sees a tile scaled by another
    tile's descales (here: every tile takes (batch 0, KV head 0)'s, as a block that derived them once would)."""
    text = attngen.render_source(attngen.Spec(**FP8, causal=True, scheduler="persistent"))
    per_tile = "Q_descale[batch_idx, kv_head] * K_descale[batch_idx, kv_head]"
    assert text.count(per_tile) == 1
    want = outputs({"causal": True}, scheduler="single")
    got = outputs({"causal": True}, num_sms=2, source=text.replace(per_tile, "Q_descale[0, 0] * K_descale[0, 0]"))
    assert not same(got, want)


def test_a_varlen_fp8_batch_equals_the_single_tile_kernel_bit_for_bit():
    """A ragged batch (a long causal sequence, one row, no rows, more keys than rows), descales per
    (sequence, KV head): the tile list's tiles scale by their own sequence's descales."""
    from attngen.reference.forward import fa3_descale, round_to

    lq, lk = [300, 1, 0, 129], [300, 40, 7, 200]
    rng = np.random.default_rng(5)
    q = round_to(rng.standard_normal((sum(lq), 2, 64)), E4M3)
    k, v = (round_to(rng.standard_normal((sum(lk), 2, 64)), E4M3) for _ in range(2))
    serving = {"cu_seqlens_q": np.cumsum([0] + lq).astype(np.int32), "cu_seqlens_k": np.cumsum([0] + lk).astype(np.int32),
               "max_seqlen_q": max(lq)}
    tensors = {n: fa3_descale(rng, len(lq), 2) for n in ("q_descale", "k_descale", "v_descale")}

    def varlen(scheduler, **run):
        spec = attngen.Spec(**FP8, causal=True, lse=True, layout="varlen", scheduler=scheduler)
        return emulate_stats(spec, q, k, v, serving=serving, tensors=tensors, **run)[0]

    want = varlen("single")
    for num_sms, policy in ((1, "random"), (3, "producer-first"), (6, "consumers-first")):
        assert same(varlen("persistent", num_sms=num_sms, policy=policy, counters=TileCounters()), want)
