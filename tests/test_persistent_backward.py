"""The persistent backward (spec.scheduler = "persistent", issue 30) on the CPU model.

The main kernel runs `num_sms` blocks at once, each looping over the KV tiles an atomic counter
hands out (the forward's handover, templates/common/persistent.py.j2); the deterministic dq kernel's
blocks take every num_sms-th Q tile of a fixed shortest-first order. Gradients must equal the
single-tile backward's: bit for bit where no float atomics sum them (dK and dV stored by one block,
the whole deterministic backward), within the atomics' reordering elsewhere (dQ's reduce-adds, GQA's
dK/dV accumulators). Mutants of the handover must be caught in every schedule.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import attngen
from attngen import tiles
from attngen.emulator import POLICIES, EmulationError, KernelError
from attngen.emulator.driver import BLOCK_ORDERS, Stats, variant_inputs
from attngen.emulator.persistent import TileCounters
from attngen.kernels.bwd.persistent import dq_backwards, main_backwards
from attngen.kernels.bwd.plan import plan_backward, single_tile_twin
from attngen.kernels.bwd.render import render_backward_source
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError
from attngen.spec import SpecError
from test_persistent import CAUGHT_BY, INDEX_READ_EARLY, TAKE, edited, killed  # the forward's: the shared handover's texts

CAUSAL = {"causal": True, "head_dim": 64}
DET = {"causal": True, "head_dim": 64, "deterministic": True}
SHAPE = (1, 2, 300, 300)  # batch, heads, q_len, kv_len: 3 KV tiles x 2 heads in the main kernel, 3 Q tiles x 2 in dq's
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def problem(fields, shape=SHAPE, seed=0):
    """q, k, v, dout, the call-time tensors, and the forward's out and lse (run once, single-tile)."""
    spec = attngen.Spec(**fields)
    batch, heads, q_len, kv_len = shape
    q, k, v, tensors = variant_inputs(make_plan(spec), batch, heads, heads // spec.gqa_group, q_len, kv_len, seed)
    dout = np.random.default_rng(seed + 9).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    out, lse = attngen.emulate(attngen.Spec(**fields, lse=True), q, k, v, **tensors)
    return q, k, v, dout, tensors, out, lse


def backward(fields, data, persistent=True, **run):
    """The persistent backward's gradients, or (persistent=False) the single-tile backward's of the same
    tiles (the persistent producer's larger register share may move a head dim to the column split)."""
    q, k, v, dout, tensors, out, lse = data
    spec = attngen.Spec(**fields, scheduler="persistent") if persistent else attngen.Spec(**fields)
    if persistent:
        run.setdefault("counters", TileCounters())
    else:
        run.setdefault("source", render_backward_source(single_tile_twin(spec)))
    return attngen.emulate_backward(spec, q, k, v, dout, out=out, lse=lse, **run, **tensors)


def summed_by_atomics(fields) -> set:
    """Which gradients (by position) float atomics sum in the non-deterministic backward."""
    bp = plan_backward(attngen.Spec(**fields))
    if bp.deterministic:
        return set()
    return {0} | ({1, 2} if bp.kv_accum else set()) | (set(range(3, 4 + len(bp.spec.learnable))))


def agree(got, want, fields) -> bool:
    """Bit for bit, except where atomics sum: there within one unit in the last place of the dtype at
    the value, plus 1e-4 of the largest (a float32 sum reordered, then rounded)."""
    atomics = summed_by_atomics(fields)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if np.isnan(a).any() or a.shape != b.shape:
            return False
        if i not in atomics and not np.array_equal(a, b):
            return False
        if i in atomics and (np.abs(a - b) > ULP[attngen.Spec(**fields).dtype] * np.abs(b) + 1e-4 * np.abs(b).max()).any():
            return False
    return True


# -- the spec and the order --------------------------------------------------------------------------
def test_names_change_only_for_persistent():
    plain, persistent = (plan_backward(attngen.Spec(head_dim=64, causal=True, scheduler=s)) for s in ("single", "persistent"))
    assert persistent.name == plain.name + "_persistent" and persistent.hash != plain.hash
    assert plan_backward(attngen.Spec(head_dim=64, causal=True, scheduler="single")).hash == plain.hash
    assert "num_sms" not in render_backward_source(plain) and "tile_counter" in render_backward_source(persistent)


def test_the_producer_takes_40_registers_so_hd128_splits_columns_and_hd256_is_refused():
    """At 24 producer registers the persistent backward spilled (hd128 causal 52 B; attngen build)."""
    plain, persistent = (plan_backward(attngen.Spec(causal=True, scheduler=s)) for s in ("single", "persistent"))
    assert (plain.producer_regs, persistent.producer_regs) == (24, 40) and (plain.columns, persistent.columns) == (False, True)
    with pytest.raises(SpecError) as e:
        plan_backward(attngen.Spec(head_dim=256, scheduler="persistent"))
    assert e.value.field == "scheduler" and "head_dim = 256" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fields, field", [({"block_mask": True, "mask_mod": "q_idx >= kv_idx"}, "block_mask")])
def test_what_it_refuses_is_named_in_one_line(fields, field):
    with pytest.raises(SpecError) as e:
        plan_backward(attngen.Spec(**fields, scheduler="persistent"))
    assert e.value.field == field and "persistent" in str(e.value) and "\n" not in str(e.value)


def test_two_backward_plans_of_one_spec_are_two_kernels(monkeypatch):
    """The GPU test compares the persistent backward with the single-tile one of its tiles: a plan of the
    spec's (its default tiles differ), which compile_backward must not take for the default one."""
    from attngen.run import backward as run_backward

    keys = []
    monkeypatch.setattr(run_backward, "_once", lambda memo, key, build: keys.append(key))
    for plan in (plan_backward(attngen.Spec(causal=True)), single_tile_twin(attngen.Spec(causal=True))):
        run_backward.compile_backward(plan)
    assert len(set(keys)) == 2


def test_num_sms_belongs_to_a_persistent_spec_only():
    q, k, v, dout, tensors, out, lse = problem(CAUSAL, (1, 1, 64, 64))
    with pytest.raises(InputError, match="num_sms"):
        attngen.emulate_backward(attngen.Spec(**CAUSAL), q, k, v, dout, out=out, lse=lse, num_sms=2)


def visits(fields, main: bool, n: int = 6):
    """Each tile's visits along the kernel's tile axis at 6 tiles (tiles.Frame: Q tiles of a KV tile, or
    KV tiles of a Q tile)."""
    bp = plan_backward(attngen.Spec(**fields))
    m, b = (bp.block_m, bp.block_n) if main else (bp.dq_block_m, bp.dq_block_n)
    length = n * (b if main else m)
    fr = tiles.Frame.of(length, length, tiles.edges(bp.spec.causal, bp.spec.window), m, b)
    if main:
        return [len(fr.q_span(t).tiles) for t in range(n)]
    return [len(fr.kv_span(tiles.Rows(t * m, t * m + m - 1)).tiles) for t in range(n)]


@pytest.mark.parametrize("fields", [CAUSAL, {"head_dim": 64}, {"head_dim": 64, "window": (150, -1)},
                                    {"head_dim": 64, "window": (-1, 100)}])
def test_one_block_walks_the_longest_kv_tiles_first_and_dq_the_shortest_q_tiles_first(fields):
    """One block on a 6-tile problem: the K tiles its main kernel loads, and the Q tiles its dq kernel
    loads, in order; their visit counts (tiles.Frame's ranges) fall, and rise."""
    bp = plan_backward(attngen.Spec(**fields, deterministic=True))
    data = problem({**fields, "deterministic": True}, (1, 1, 6 * bp.block_n, 6 * bp.block_n))
    stats = Stats()
    backward({**fields, "deterministic": True}, data, num_sms=1, stats=stats)
    kv_order = [key // bp.block_n for _, key, _, col in stats.k_boxes[:12] if col == 0][::bp.consumers if not bp.columns else 1]
    main = visits(fields, True)
    assert sorted(kv_order) == list(range(6)) and [main[t] for t in kv_order] == sorted(main, reverse=True)
    assert bp.dq_block_m == bp.block_n  # so the dq kernel has 6 Q tiles too
    q_order = [row // bp.dq_block_m for _, row, _, _ in stats.q_boxes[-2 * 6:][::2]]  # consumer 0's slice of each
    dq = visits(fields, False)
    assert sorted(q_order) == list(range(6)) and [dq[t] for t in q_order] == sorted(dq)
    assert main_backwards(bp) == (main[-1] > main[0]) and dq_backwards(bp) == (dq[-1] < dq[0])


# -- equal to the single-tile backward --------------------------------------------------------------------
SPECS = [CAUSAL, {"head_dim": 64}, {"causal": True}, {"causal": True, "head_dim": 64, "gqa_group": 2},
         {"head_dim": 64, "window": (100, 20), "dtype": "bfloat16"}, DET,
         {**DET, "gqa_group": 2, "sinks": True}, {"head_dim": 64, "causal": True, "alibi": True, "softcap": 20.0},
         {"head_dim": 64, "alibi": True, "learnable": ("alibi_slopes",)},
         {**DET, "alibi": True, "learnable": ("alibi_slopes",)}]


@pytest.mark.parametrize("fields", SPECS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_gradients_equal_the_single_tile_backward(fields):
    data = problem(fields)
    want = backward(fields, data, persistent=False)
    for num_sms in (1, 2, 5, 8):
        got = backward(fields, data, num_sms=num_sms, seed=num_sms)
        assert agree(got, want, fields), (fields, num_sms)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
def test_every_schedule_and_block_order_gives_the_same_bits(policy, block_order):
    for fields in (CAUSAL, DET):
        data = problem(fields)
        want = backward(fields, data, persistent=False)
        for seed in range(2):
            got = backward(fields, data, num_sms=3, seed=seed, policy=policy, block_order=block_order)
            assert agree(got, want, fields), (fields, seed)


def test_the_deterministic_backward_is_bit_identical_run_to_run_where_the_atomic_one_is_not():
    data = problem(DET)
    runs = [backward(DET, data, num_sms=n, seed=s, block_order=o) for n, s, o in [(2, 0, "grid"), (7, 3, "shuffled")]]
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    data = problem(CAUSAL)
    dq = {backward(CAUSAL, data, num_sms=n, seed=s)[0].tobytes() for n, s in [(1, 0), (3, 1), (8, 2)]}
    assert len(dq) > 1  # the comparison above could fail: dQ's reduce-adds sum in the blocks' order


def test_each_block_walks_many_tiles_and_together_they_take_each_once():
    stats = Stats()
    backward(CAUSAL, problem(CAUSAL), num_sms=2, stats=stats)
    assert len(stats.k_boxes) == 6 * 2  # 6 KV tiles, a K slice per consumer
    assert stats.ctas >= 2 + 2  # the main kernel's blocks (and the forward's, the preprocess's, ...)


def test_a_call_after_a_crashed_call_still_works():
    data, counters = problem(CAUSAL), TileCounters()
    want = backward(CAUSAL, data, persistent=False)
    dies = killed(render_backward_source(attngen.Spec(**CAUSAL, scheduler="persistent")))
    for crashed in range(2):
        with pytest.raises(KernelError, match="killed"):
            backward(CAUSAL, data, num_sms=1, counters=counters, source=dies)
        assert counters.slots.any()
        assert agree(backward(CAUSAL, data, num_sms=3, counters=counters), want, CAUSAL)


# -- mutants ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Mutant:
    name: str
    edits: list  # (old, new): every occurrence of old is replaced
    expect: tuple  # "hazard", "deadlock", "kernel" (a KernelError: a tile twice or skipped)
    report: str = ""
    fields: dict = dataclasses.field(default_factory=lambda: CAUSAL)
    calls: int = 1  # caught at the last of this many calls at one epoch (a replayed CUDA graph)


DQ_TILE = "tile = sm + tile_iter * num_sms"
MUTANTS = [
    Mutant("q_phases_reset_per_tile",  # the consumers' count of Q visits restarts with each tile
           [("            visit_base = visit_base + n_q\n            tile_iter", "            visit_base = 0\n            tile_iter")],
           ("hazard", "deadlock")),
    Mutant("kv_phase_reset_per_tile", [("T.mbarrier_wait_parity(kv_full, tile_iter % 2)", "T.mbarrier_wait_parity(kv_full, 0)")],
           ("hazard", "deadlock")),
    Mutant("a_tile_handed_out_twice", [(TAKE, TAKE.replace("T.atomic_add(", "T.max(0, -1 + T.atomic_add(") + ")")],
           ("hazard", "kernel")),
    Mutant("a_tile_skipped", [(TAKE, TAKE + " + 1")], ("kernel",), "0 time(s), expected 2"),
    Mutant("next_kv_load_over_the_last_visit",  # the consumers release K/V as they land, not after their last visit
           [("            T.mbarrier_arrive(tile_empty)\n", ""),
            ("            T.mbarrier_wait_parity(kv_full, tile_iter % 2)\n",
             "            T.mbarrier_wait_parity(kv_full, tile_iter % 2)\n            T.mbarrier_arrive(tile_empty)\n")],
           ("hazard",), "K_shared"),
    Mutant("next_index_read_before_its_barrier",
           INDEX_READ_EARLY, ("hazard",), "tile_shared"),
    Mutant("counter_not_reset_between_calls",
           [("        T.atomic_add(tile_counter[slot], -(total_tiles + num_sms))", "        pass")],
           ("kernel",), "0 time(s)", calls=2),
    Mutant("dq_a_tile_skipped", [(DQ_TILE, "tile = sm + (tile_iter + 1) * num_sms")], ("kernel",), "0 time(s)", DET),
    Mutant("dq_a_tile_run_twice", [(DQ_TILE, "tile = T.max(sm + tile_iter * num_sms - 1, 0)")], ("kernel", "hazard"),
           fields=DET),
    Mutant("dq_q_phase_reset_per_tile", [("T.mbarrier_wait_parity(q_full, tile_iter % 2)", "T.mbarrier_wait_parity(q_full, 0)")],
           ("hazard", "deadlock"), fields=DET),
    Mutant("dq_next_q_load_over_the_last_visit", [("T.mbarrier_wait_parity(q_empty, (tile_iter % 2) ^ 1)", "pass")],
           ("hazard",), fields=DET),
]


def mutated(m: Mutant) -> str:
    return edited(render_backward_source(attngen.Spec(**m.fields, scheduler="persistent")), m)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_caught_in_every_schedule(m: Mutant):
    source, data = mutated(m), problem(m.fields)
    for policy in POLICIES:
        for block_order in BLOCK_ORDERS:
            for seed in range(2):
                counters = TileCounters()
                for _ in range(m.calls - 1):  # the earlier calls pass: the mutant shows at the last
                    counters.epoch = 0
                    backward(m.fields, data, num_sms=2, seed=seed, policy=policy, block_order=block_order,
                             source=source, counters=counters)
                counters.epoch = 0
                with pytest.raises(EmulationError) as e:
                    backward(m.fields, data, num_sms=2, seed=seed, policy=policy, block_order=block_order,
                             source=source, counters=counters)
                assert isinstance(e.value, tuple(CAUGHT_BY[x] for x in m.expect)), (policy, seed, e.value.report)
                assert m.report in e.value.report, e.value.report


def test_the_unmutated_kernels_pass_where_the_mutants_run():
    for fields in (CAUSAL, DET):
        data = problem(fields)
        want = backward(fields, data, persistent=False)
        for policy in POLICIES:
            counters = TileCounters()
            for call in range(2):
                counters.epoch = 0
                assert agree(backward(fields, data, num_sms=2, seed=call, policy=policy, counters=counters), want, fields)


# -- drawn: specs x shapes x SM counts x schedules --------------------------------------------------------------
DRAWN = st.sampled_from([CAUSAL, {"head_dim": 64}, DET, {**DET, "gqa_group": 2}, {"causal": True, "head_dim": 64, "gqa_group": 2},
                         {"head_dim": 64, "window": (90, 40)}, {"head_dim": 64, "sinks": True},
                         {"head_dim": 64, "deterministic": True, "mask_mod": "(q_idx + kv_idx) % 3 != 0"}])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DRAWN, st.integers(1, 2), st.integers(1, 300), st.integers(1, 300), st.integers(1, 8),
       st.sampled_from(POLICIES), st.sampled_from(BLOCK_ORDERS), st.integers(0, 9))
def test_drawn_specs_shapes_and_schedules_match_the_single_tile_backward(fields, batch, q_len, kv_len, num_sms, policy,
                                                                         block_order, seed):
    heads = 2 * attngen.Spec(**fields).gqa_group
    data = problem(fields, (batch, heads, q_len, kv_len), seed)
    want = backward(fields, data, persistent=False)
    got = backward(fields, data, num_sms=num_sms, seed=seed, policy=policy, block_order=block_order)
    assert agree(got, want, fields)
