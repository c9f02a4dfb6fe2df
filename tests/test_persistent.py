"""The persistent scheduler (spec.scheduler = "persistent", issue 30) on the CPU model.

A persistent kernel runs `num_sms` blocks at once, each looping over the tiles an atomic counter
hands out; the model interleaves every block's warpgroups in one scheduler, so the blocks race
for tiles. Its outputs and LSE must equal the single-tile kernel's bit for bit, in every
schedule and block order, and its mutants must be caught in every schedule.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import attngen
from attngen.emulator import POLICIES, DeadlockError, EmulationError, HazardError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS, emulate_stats, variant_inputs
from attngen.emulator.persistent import TileCounters
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError
from attngen.spec import SpecError

CAUSAL = {"causal": True}
SHAPE = (2, 2, 700, 700)  # batch, heads, q_len, kv_len: 6 row tiles x 4 = 24 tiles, 1 to 6 K tiles each


def inputs(spec, shape=SHAPE, seed=0):
    """q, k, v and the call-time tensors (ALiBi slopes, sinks) the spec takes."""
    batch, heads, q_len, kv_len = shape
    return variant_inputs(make_plan(spec), batch, heads, heads // spec.gqa_group, q_len, kv_len, seed)


def run(fields, shape=SHAPE, *, num_sms=3, seed=0, policy="random", block_order="grid", source=None, counters=None):
    spec = attngen.Spec(**fields, scheduler="persistent")
    q, k, v, tensors = inputs(spec, shape)
    return emulate_stats(spec, q, k, v, seed=seed, policy=policy, block_order=block_order, num_sms=num_sms,
                         source=source, counters=counters or TileCounters(), tensors=tensors)


def single(fields, shape=SHAPE):
    """The single-tile kernel of the persistent one's tiles (its producer's larger register share may
    let the plan choose a smaller block_n, and other tiles sum in another order)."""
    block_n = make_plan(attngen.Spec(**fields, scheduler="persistent")).spec.block_n
    spec = attngen.Spec(**fields, block_n=block_n)
    q, k, v, tensors = inputs(spec, shape)
    return emulate_stats(spec, q, k, v, tensors=tensors)[0]


def same(a, b) -> bool:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return all(np.array_equal(x, y) and not np.isnan(x).any() for x, y in pairs)


# -- the spec -------------------------------------------------------------------------------------
def test_the_default_is_single_and_names_change_only_for_persistent():
    plain = make_plan(attngen.Spec(causal=True))
    assert attngen.Spec().scheduler == "single"
    assert make_plan(attngen.Spec(causal=True, scheduler="single")).hash == plain.hash
    persistent = make_plan(attngen.Spec(causal=True, scheduler="persistent"))
    assert persistent.name == plain.name + "_persistent" and persistent.hash != plain.hash
    assert "num_sms" not in attngen.render_source(plain)


@pytest.mark.parametrize("fields, field, text", [
    ({"scheduler": "dynamic"}, "scheduler", '"single"'),
    ({"scheduler": 1}, "scheduler", '"persistent"'),
    ({"scheduler": "persistent", "splits": 2}, "splits", 'scheduler = "persistent"'),
    ({"scheduler": "persistent", "paged_kv": True, "kv_dtype": "float8_e4m3fn"}, "kv_dtype", "fp8 cache"),
    ({"scheduler": "persistent", "block_mask": True, "mask_mod": "q_idx >= kv_idx"}, "block_mask", "block mask"),
    ({"scheduler": "persistent", "consumers": 3, "head_dim": 64}, "consumers", "spilled"),
])
def test_what_it_refuses_is_named_in_one_line(fields, field, text):
    with pytest.raises(SpecError) as e:
        make_plan(attngen.Spec(**fields))
    assert e.value.field == field and text in str(e.value) and "\n" not in str(e.value)


def test_num_sms_belongs_to_a_persistent_spec_only():
    spec = attngen.Spec(causal=True)
    q, k, v, _ = inputs(spec, (1, 1, 64, 64))
    with pytest.raises(InputError, match="num_sms"):
        attngen.emulate(spec, q, k, v, num_sms=4)
    with pytest.raises(InputError, match="num_sms"):
        attngen.emulate(attngen.Spec(causal=True, scheduler="persistent"), q, k, v, num_sms=0)


# -- bit-identical to the single-tile kernel ---------------------------------------------------------
@pytest.mark.parametrize("fields", [CAUSAL, {}, {"causal": True, "lse": True, "gqa_group": 2},
                                    {"window": (200, 0), "lse": True}, {"causal": True, "consumers": 1},
                                    {"causal": True, "alibi": True, "softcap": 30.0, "k_stages": 3},
                                    {"sinks": True, "lse": True, "head_dim": 64, "dtype": "bfloat16"},
                                    {"causal": True, "consumers": 1, "head_dim": 64, "steady_loop": "split"},
                                    {"score_mod": "score * 0.5 + kv_idx * 0.01", "head_dim_v": 64}])
def test_equal_to_the_single_tile_kernel_bit_for_bit(fields):
    want = single(fields)
    for num_sms in (1, 2, 5, 8):
        got, stats = run(fields, num_sms=num_sms, seed=num_sms)
        assert same(got, want), (fields, num_sms)
        assert stats.ctas == num_sms


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    want = single(CAUSAL)
    digests = set()
    for seed in range(3):
        got, stats = run(CAUSAL, num_sms=4, seed=seed, policy=policy, block_order=block_order)
        assert same(got, want)
        digests.add(stats.schedule)
    assert policy != "random" or len(digests) > 1  # the seeds did draw different interleavings


def test_each_block_walks_many_tiles_and_together_they_take_each_once():
    _, stats = run(CAUSAL, num_sms=2)
    tiles_by_block = [n // 2 for n in stats.q_tiles_by_cta.values()]  # 2 consumers load a tile's Q each
    assert sum(tiles_by_block) == 24 and max(tiles_by_block) >= 12
    assert stats.atomics == 24 + 2 + 1  # each tile once, one end mark per block, the reset to 0


@pytest.mark.parametrize("fields, rows", [(CAUSAL, [640, 512, 384, 256, 128, 0]), ({}, [0, 128, 256, 384, 512, 640])])
def test_the_longest_row_tiles_go_first_under_causal(fields, rows):
    """One block: it loads the row tiles' Q in the order the counter hands them out."""
    _, stats = run(fields, (1, 1, 700, 700), num_sms=1)
    assert [row for _, row, _, _ in stats.q_boxes[::2]] == rows  # consumer 0's slice of each tile
    assert stats.k_tiles == (6 + 5 + 4 + 3 + 2 + 1 if fields else 36)


def killed(text: str) -> str:
    """The kernel dying once a consumer has finished two tiles (its blocks took tiles from the counter)."""
    dies = text.replace("            T.mbarrier_arrive(tile_empty)\n",
                        "            T.mbarrier_arrive(tile_empty)\n            assert tile_iter < 2, 'killed'\n", 1)
    assert dies != text
    return dies


def test_a_call_after_a_crashed_call_still_works():
    """A kernel that dies after its blocks took some tiles leaves its counter dirty; the next call
    (the launcher counts the crashed one) takes another, zeroed slot and gives the same bits."""
    dies = killed(attngen.render_source(attngen.Spec(causal=True, scheduler="persistent")))
    want, counters = single(CAUSAL), TileCounters()
    for crashed in range(2):
        with pytest.raises(KernelError, match="killed"):
            run(CAUSAL, counters=counters, source=dies)
        assert counters.slots.any()  # it did take tiles
        got, _ = run(CAUSAL, counters=counters)
        assert same(got, want)


def test_a_replayed_call_at_one_epoch_resets_its_own_counter():
    """A CUDA graph replays one epoch: the block that takes the last end mark puts the slot back to 0."""
    want, counters = single(CAUSAL), TileCounters()
    for call in range(4):
        counters.epoch = 1
        got, _ = run(CAUSAL, counters=counters, seed=call, num_sms=1 + call)
        assert same(got, want) and not counters.slots.any(), call


def test_successive_calls_share_the_counters():
    want, counters = single(CAUSAL), TileCounters()
    for call in range(5):  # every slot used twice
        got, _ = run(CAUSAL, counters=counters, seed=call)
        assert same(got, want), call


# -- mutants ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Mutant:
    name: str
    edits: list  # (old, new): every occurrence of old is replaced
    expect: tuple  # what catches it: "hazard", "deadlock", "kernel" (a KernelError: a tile twice or skipped)
    report: str = ""  # text the report must contain
    calls: int = 1  # the mutant is caught at the last of this many calls sharing one set of counters
    replay: bool = False  # every call at one epoch (a replayed CUDA graph)
    crash_first: bool = False  # a killed call first (killed()): its slot is left dirty


TAKE = "tile_shared[0] = T.atomic_add(tile_counter[slot], 1, return_prev=True)"
INDEX_READ_EARLY = [("            T.mbarrier_wait_parity(tile_full, tile_iter % 2)  # the producer took the block's next tile\n"
                     "            tile = tile_shared[0]\n",
                     "            tile = tile_shared[0]\n"
                     "            T.mbarrier_wait_parity(tile_full, tile_iter % 2)  # the producer took the block's next tile\n")]
MUTANTS = [
    Mutant("q_phase_reset_per_tile", [("T.mbarrier_wait_parity(q_full, tile_iter % 2)", "T.mbarrier_wait_parity(q_full, 0)")],
           ("hazard", "deadlock")),
    Mutant("kv_phases_reset_per_tile",
           [("            visit_base = visit_base + n_tiles\n            tile_iter", "            visit_base = 0\n            tile_iter")],
           ("hazard", "deadlock")),
    Mutant("next_index_read_before_its_barrier",
           INDEX_READ_EARLY, ("hazard",), "tile_shared"),
    Mutant("a_tile_handed_out_twice", [(TAKE, TAKE.replace("T.atomic_add(", "T.max(0, -1 + T.atomic_add(") + ")")],
           ("hazard", "kernel")),
    Mutant("a_tile_skipped", [(TAKE, TAKE + " + 1")], ("kernel",), "0 time(s), expected 1"),
    Mutant("counter_not_reset_between_calls",
           [("        T.atomic_add(tile_counter[slot], -(total_tiles + num_sms))", "        pass")],
           ("kernel",), "0 time(s)", calls=2, replay=True),
    Mutant("next_calls_counters_not_zeroed_after_a_crash",
           [("tile_counter[T.truncmod(epoch + 1, COUNTER_SLOTS)] = 0", "pass"),
            ("tile_counter[T.truncmod(epoch + 2, COUNTER_SLOTS)] = 0", "pass")],
           ("kernel",), "0 time(s)", calls=3, crash_first=True),
    Mutant("next_kv_load_over_the_last_pv",
           [("            T.wait_wgmma(0)\n            T.mbarrier_arrive(v_empty[v_stage_last])\n",
             "            T.mbarrier_arrive(v_empty[v_stage_last])\n            T.wait_wgmma(0)\n")],
           ("hazard",), "in-flight wgmma"),
    Mutant("tile_empty_counts_one_too_many", [("RELEASE_ARRIVALS + TMA_ARRIVALS]", "RELEASE_ARRIVALS + TMA_ARRIVALS + 1]")],
           ("deadlock",), "tile_empty"),
]
CAUGHT_BY = {"hazard": HazardError, "deadlock": DeadlockError, "kernel": KernelError}


def mutated(m: Mutant) -> str:
    return edited(attngen.render_source(attngen.Spec(causal=True, scheduler="persistent")), m)


def edited(text: str, m) -> str:
    """`text` with each of the mutant's (old, new) edits, every occurrence (old must occur)."""
    for old, new in m.edits:
        assert old in text, (m.name, old)
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_caught_in_every_schedule(m: Mutant):
    source = mutated(m)
    for policy in POLICIES:
        for block_order in BLOCK_ORDERS:
            for seed in range(2):
                counters = TileCounters()
                if m.crash_first:
                    with pytest.raises(KernelError, match="killed"):
                        run(CAUSAL, num_sms=2, seed=seed, policy=policy, source=killed(source), counters=counters)
                for _ in range(m.calls - 1):  # the earlier calls pass: the mutant shows at the last
                    counters.epoch = 0 if m.replay else counters.epoch
                    run(CAUSAL, num_sms=2, seed=seed, policy=policy, block_order=block_order, source=source,
                        counters=counters)
                counters.epoch = 0 if m.replay else counters.epoch
                with pytest.raises(EmulationError) as e:
                    run(CAUSAL, num_sms=2, seed=seed, policy=policy, block_order=block_order, source=source,
                        counters=counters)
                assert isinstance(e.value, tuple(CAUGHT_BY[x] for x in m.expect)), (policy, seed, e.value.report)
                assert m.report in e.value.report, e.value.report


def test_the_unmutated_kernel_passes_where_the_mutants_run():
    for policy in POLICIES:
        counters = TileCounters()
        for call in range(4):
            got, _ = run(CAUSAL, num_sms=2, seed=call, policy=policy, counters=counters)
            assert same(got, single(CAUSAL))


# -- drawn: specs x shapes x SM counts x schedules -------------------------------------------------------
FIELDS = st.sampled_from([CAUSAL, {}, {"causal": True, "gqa_group": 2, "lse": True}, {"window": (100, 30)},
                          {"causal": True, "consumers": 1, "k_stages": 1, "v_stages": 3}, {"lse": True, "sinks": True},
                          {"causal": True, "alibi": True, "head_dim": 64}, {"mask_mod": "(q_idx + kv_idx) % 3 != 0"},
                          {"causal": True, "steady_loop": "split", "dtype": "bfloat16"},
                          {"causal": True, "head_dim": 64, "dtype": "float8_e4m3fn", "lse": True}])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FIELDS, st.integers(1, 2), st.sampled_from([2, 4]), st.integers(1, 400), st.integers(1, 400), st.integers(1, 8),
       st.sampled_from(POLICIES), st.sampled_from(BLOCK_ORDERS), st.integers(0, 9))
def test_drawn_specs_shapes_and_schedules_match_the_single_tile_kernel(fields, batch, heads, q_len, kv_len, num_sms,
                                                                       policy, block_order, seed):
    shape = (batch, heads, q_len, kv_len)
    got, _ = run(fields, shape, num_sms=num_sms, seed=seed, policy=policy, block_order=block_order)
    assert same(got, single(fields, shape))


# -- attngen tune ----------------------------------------------------------------------------------------
def test_tune_explores_both_schedulers_where_the_spec_takes_both(tmp_path):
    from attngen.run import tune

    found = tune.neighbours(attngen.Spec(head_dim=64, causal=True))
    twins = {dataclasses.replace(s, scheduler="single") for s in found if s.scheduler == "persistent"}
    assert twins and twins <= {s for s in found if s.scheduler == "single"}  # the same schedules, fewer (registers)
    chosen = [p.spec for p in tune.candidates(attngen.Spec(head_dim=64, causal=True), 16)]
    persistent = [s for s in chosen if s.scheduler == "persistent"]
    assert len(persistent) == 4 and len(chosen) == 16  # a quarter: the two best persistent schedules, both loop forms
    best = sorted((s for s in found if s.scheduler == "persistent"), key=tune.promise)[:4]
    assert [make_plan(s).name for s in persistent] == [make_plan(s).name for s in best]
    assert [tune.promise(s) for s in chosen] == sorted(tune.promise(s) for s in chosen)
    assert {s.scheduler for s in tune.neighbours(attngen.Spec(head_dim=64, paged_kv=True, splits=2))} == {"single"}
    assert "persistent" in {s.scheduler for s in tune.neighbours(attngen.Spec(head_dim=64, paged_kv=True))}
    four = persistent
    winner = tune.Candidate(make_plan(four[2]), tflops=1.0)
    key = tune.record_winner(four[2], 4096, winner, "a GPU", path=tmp_path / "t.json")
    import json
    assert json.loads((tmp_path / "t.json").read_text())["entries"][key]["scheduler"] == "persistent"


# -- the model's fetch-and-add and concurrent launch, on a hand-written kernel ----------------------------
TICKETS = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def tickets(C: T.Tensor([1], "int32"), Got: T.Tensor([8, 4], "int32")):
        with T.Kernel(8, threads=128) as bx:
            tx = T.get_thread_binding()
            for r in T.serial(4):
                {take}

    return tickets
'''


def run_tickets(take, *, seed=0, policy="random", concurrent=True):
    from attngen.emulator.driver import Runtime, Stats

    rt = Runtime(TICKETS.format(take=take), "<tickets>", {})
    rt.run([np.zeros(1, np.int32), np.full((8, 4), -1, np.int32)], seed=seed, policy=policy, stats=Stats(),
           concurrent=concurrent)
    return rt.tensors["Got"]


ONE_THREAD = "if tx == 0:\n                    Got[bx, r] = T.atomic_add(C[0], 1, return_prev=True)"


@pytest.mark.parametrize("policy", POLICIES)
def test_fetch_and_add_hands_out_each_ticket_once_and_blocks_interleave(policy):
    interleaved = False
    for seed in range(4):
        got = run_tickets(ONE_THREAD, seed=seed, policy=policy)
        assert sorted(got.ravel()) == list(range(32))
        assert all(list(row) == sorted(row) for row in got)  # each block's own tickets in program order
        interleaved |= any(row[-1] - row[0] > 3 for row in got)  # another block took one between two of its own
    assert interleaved
    sequential = run_tickets(ONE_THREAD, concurrent=False)  # one block after another: block b takes 4b..4b+3
    assert [list(row) for row in sequential] == [list(range(4 * b, 4 * b + 4)) for b in range(8)]


def test_fetch_and_add_by_a_whole_warpgroup_is_refused():
    with pytest.raises(EmulationError, match="return_prev=True\\) by 128 threads"):
        run_tickets("Got[bx, r] = T.atomic_add(C[0], 1, return_prev=True)")


def test_a_plain_read_of_the_counter_races_with_the_other_blocks_atomics():
    with pytest.raises(HazardError, match="atomic"):
        run_tickets(ONE_THREAD + "\n                Got[bx, r] = C[0]")
