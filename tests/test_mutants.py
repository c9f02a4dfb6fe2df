"""Deliberately broken kernels: the emulator must catch every one.

Each mutant is a textual edit of the *rendered* source, so it follows template changes; the
test first asserts the edit applied, then that the unmodified kernel passes for the same
spec, shape and schedule, then that the mutant is caught the way it should be: a hazard
report, a deadlock report, or a numeric mismatch against the fp64 reference.

Every hazard mutant is an edit of the DEFAULT preset (`attngen.Spec(causal=True)`, which
is examples/default.toml) and must be reported under every schedule policy and 20 seeds:
races are found by happens-before, not by a schedule that happens to interleave them.
"""

import dataclasses

import pytest

import attngen
from attngen.emulator import POLICIES, DeadlockError, HazardError, emulate
from attngen.reference.forward import check_close, random_inputs

WAIT_PV = "            T.wait_wgmma(0)  # PV(k-1) done: p_reg and V stage may be reused\n"
WAIT_QK = "            T.wait_wgmma(1)  # QK(k) done; PV(k-1) may still run under the softmax below\n"
RELEASE_K = "            T.mbarrier_arrive(k_empty[k_stage])\n"
RELEASE_V = "            T.mbarrier_arrive(v_empty[v_stage_prev])\n"
ROW_SUM = "            for i in T.Parallel(WG_ROWS):\n                row_sum[i] = row_sum[i] * alpha[i] + row_sum_tile[i]\n"
COPY_P = "            T.copy(acc_s, p_reg)\n"
PROLOGUE_WAIT_QK = "        T.wait_wgmma(0)\n        T.mbarrier_arrive(k_empty[0])\n"
EPILOGUE_FENCE = "        T.fence_proxy_async()  # each thread's O_shared stores must be visible to the TMA engine...\n"
EPILOGUE_BARRIER = "        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and all 128 done before one thread issues the store\n"

DEFAULT = {"causal": True}  # == examples/default.toml: hd128, causal, 2 consumers, k_stages = v_stages = 2
SWEEP_SHAPE = (1, 1, 256, 700)  # causal: blocks of 5 and 6 K tiles (a partial last one), so every stage is reused
SWEEP_SEEDS = range(20)


@dataclasses.dataclass
class Mutant:
    name: str
    why: str
    edits: list  # (old, new): every occurrence of old is replaced
    expect: str  # "hazard", "deadlock" or "numeric"
    spec: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT))
    shape: tuple = (1, 1, 256, 700)  # batch, kv heads, q_len, kv_len
    policy: str = "producer-first"  # deadlock and numeric mutants: the schedule they run under
    report: tuple = ()  # strings the hazard/deadlock report must contain
    corrupts: bool = True  # hazards: with race detection off, the race also shows in the numbers


MUTANTS = [
    Mutant("p_overwritten_before_pv_waited",
           "P of tile k is written into p_reg while PV(k-1), which reads p_reg, is still in flight",
           [(WAIT_PV + RELEASE_V + ROW_SUM + COPY_P, COPY_P + WAIT_PV + RELEASE_V + ROW_SUM)],
           "hazard", report=("writes p_reg", "in-flight wgmma", "T.copy(acc_s, p_reg)")),
    Mutant("k_stage_released_before_qk_waited_prologue",
           "the prologue arrives on k_empty[0] before the QK(0) wgmma reading K_shared[0] retires; nothing else "
           "orders the producer's load of tile 2 into that stage after it",
           [(PROLOGUE_WAIT_QK, "        T.mbarrier_arrive(k_empty[0])\n        T.wait_wgmma(0)\n")],
           "hazard", report=("producer (TMA load) writes K_shared[0] while the in-flight wgmma of consumer",
                             "T.wgmma_gemm(Q_shared[g, :, :], K_shared[0, :, :]")),
    Mutant("v_stage_released_before_pv_waited",
           "v_empty is arrived on before PV(k-1) retires; the producer reloads the V stage under it",
           [(WAIT_PV + RELEASE_V, RELEASE_V + WAIT_PV)],
           "hazard", report=("producer (TMA load) writes V_shared[", "in-flight wgmma", "T.wgmma_gemm(p_reg, V_shared")),
    Mutant("qk_not_waited",
           "wait_wgmma(2) instead of (1): the softmax reads acc_s while QK(k) is still writing it",
           [("T.wait_wgmma(1)  # QK(k) done", "T.wait_wgmma(2)  # QK(k) done")],
           "hazard", report=("reads acc_s", "in-flight wgmma")),
    Mutant("v_full_wait_dropped",
           "the steady state issues PV(k-1) without waiting for V(k-1) to land",
           [("            T.mbarrier_wait_parity(v_full[v_stage_prev], ((k - 1) // V_STAGES) % 2)\n", "")],
           "hazard", report=("(wgmma) reads V_shared[", "in-flight TMA load of producer", "not landed first"),
           # The model lands a load when its phase completes, i.e. at the producer's arrive right
           # after the issue and before it loads K(k), which the consumer did wait for: in the
           # model's timeline V(k-1) is always there in time. Only happens-before sees this race.
           corrupts=False),
    Mutant("epilogue_fence_missing",
           "O_shared is written by 128 threads and stored by TMA without fence.proxy.async",
           [(EPILOGUE_FENCE, "")],
           "hazard", report=("(TMA store) reads O_shared[", "without T.fence_proxy_async()"),
           corrupts=False),  # one memory for both proxies on the CPU: the numbers cannot show it
    Mutant("epilogue_barrier_missing",
           "the elected thread's TMA store is not ordered after the other 127 threads' O_shared writes",
           [(EPILOGUE_BARRIER, "")],
           "hazard", report=("(TMA store) reads O_shared[", "a named barrier after its fence"),
           corrupts=False),  # a warpgroup's statement runs for all its threads at once on the CPU
    Mutant("producer_empty_wait_parity",
           "the producer's first 'empty' waits lose their ^ 1: a fresh barrier's parity-0 phase never completes",
           [("T.mbarrier_wait_parity(k_empty[k_stage], ((k // K_STAGES) % 2) ^ 1)",
             "T.mbarrier_wait_parity(k_empty[k_stage], (k // K_STAGES) % 2)")],
           "deadlock", report=("producer: blocked at line", "k_empty[0] to complete its phase of parity 0")),
    Mutant("consumer_full_wait_parity",
           "consumers wait on the wrong parity of k_full: they run ahead of the loads or wait for a phase that never comes",
           [("T.mbarrier_wait_parity(k_full[k_stage], (k // K_STAGES) % 2)",
             "T.mbarrier_wait_parity(k_full[k_stage], ((k // K_STAGES) % 2) ^ 1)")],
           "deadlock", report=("k_full[1] to complete its phase of parity 1",)),
    Mutant("pingpong_arrive_missing",
           "a consumer never signals the next warpgroup in the steady state: the ping-pong ring stops",
           [("            T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # next warpgroup may issue\n", "")],
           "deadlock", report=("T.sync_threads(wait_bar, PINGPONG_THREADS)", "threads arrived")),
    Mutant("pingpong_primer_missing",
           "the last consumer does not prime the ring, so warpgroup 0 never gets its first turn",
           [("T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # prime the ring", "pass  # primer removed")],
           "deadlock", policy="random", report=("named barrier 1 to release (128 of 256",)),
    Mutant("tma_branch_whole_warpgroup",
           "all 128 producer threads arrive on the 'full' barriers that expect the 32 of one warp: "
           "each arrival completes four phases and the parity waits never see their phase",
           [("if tx >= CONSUMER_THREADS and tx < TMA_THREAD_END:", "if tx >= CONSUMER_THREADS:")],
           "deadlock", report=("q_full to complete its phase of parity 0",)),
    Mutant("causal_split_off_by_one",
           "the first diagonal tile is counted as a full tile and runs unmasked",
           [("if k >= full_tiles:", "if k >= full_tiles + 1:")],
           "numeric", shape=(1, 1, 256, 256)),
    Mutant("partial_last_tile_unmasked",
           "the last K tile is treated as full although kv_len is not a multiple of BLOCK_N: TMA's zero rows score 0",
           [("full_tiles = T.floordiv(kv_len, BLOCK_N)", "full_tiles = T.ceildiv(kv_len, BLOCK_N)")],
           "numeric", spec={}, shape=(1, 1, 128, 203)),
    Mutant("prologue_mask_removed",
           "the seed kernel's bug: block 0's first tile is a diagonal tile but was never masked",
           [("        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile\n",
             "        if False:  # (prologue mask removed)\n")],
           "numeric", shape=(1, 1, 256, 256)),
    Mutant("empty_rows_divide_by_zero",
           "without the guard, rows that see no key (Sq > Skv, causal) divide 0 by 0",
           [("T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])", "acc_o[i, j] / row_sum[i]")],
           "numeric", shape=(1, 1, 300, 100)),
    Mutant("running_max_starts_at_minus_inf",
           "the running max starts at -inf instead of the lowest float: a row that sees no key in a tile "
           "subtracts -inf from -inf in its exp2 (NaN)",
           [("T.fill(m_cur, T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0))", "T.fill(m_cur, -T.infinity(ACCUM))")],
           "numeric", shape=(1, 1, 300, 100)),
]


def mutate(source: str, edits) -> str:
    out = source
    for old, new in edits:
        assert old in out, f"edit no longer applies to the rendered source: {old!r}"
        out = out.replace(old, new)
    assert out != source
    return out


def inputs(spec, b, hkv, sq, skv):
    return random_inputs(spec.dtype, spec.head_dim, b, hkv * spec.gqa_group, hkv, sq, skv, seed=11)


HAZARDS = [m for m in MUTANTS if m.expect == "hazard"]
OTHERS = [m for m in MUTANTS if m.expect != "hazard"]


@pytest.mark.parametrize("m", OTHERS, ids=[m.name for m in OTHERS])
def test_mutant_is_caught(m: Mutant):
    spec = attngen.Spec(**m.spec)
    source = attngen.render_source(spec)
    broken = mutate(source, m.edits)
    q, k, v = inputs(spec, *m.shape)

    # The unmodified kernel passes for this spec, shape and schedule ...
    good = emulate(spec, q, k, v, source=source, policy=m.policy)
    assert check_close(good, q, k, v, spec.causal, dtype=spec.dtype).ok

    # ... and the mutant is caught the way it should be.
    if m.expect == "numeric":
        out = emulate(spec, q, k, v, source=broken, policy=m.policy)
        res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype)
        assert not res.ok, f"{m.name} passed: {res}"
        return
    with pytest.raises(DeadlockError) as info:
        emulate(spec, q, k, v, source=broken, policy=m.policy)
    for text in m.report:
        assert text in info.value.report, info.value.report


@pytest.fixture(scope="module")
def default_case():
    spec = attngen.Spec(**DEFAULT)
    return spec, attngen.render_source(spec), inputs(spec, *SWEEP_SHAPE)


def test_unmodified_default_kernel_passes_every_schedule(default_case):
    """No false positives: the sweep below reports races only where the edit made one."""
    spec, source, (q, k, v) = default_case
    for policy in POLICIES:
        for seed in SWEEP_SEEDS:
            out = emulate(spec, q, k, v, source=source, policy=policy, seed=seed)
            res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype)
            assert res.ok, f"{policy} seed {seed}: {res}"


@pytest.mark.parametrize("m", HAZARDS, ids=[m.name for m in HAZARDS])
def test_hazard_mutant_is_reported_in_every_schedule(m: Mutant, default_case):
    spec, source, (q, k, v) = default_case
    assert m.spec == DEFAULT and m.shape == SWEEP_SHAPE, "hazard mutants use the default preset, nothing chosen to expose them"
    broken = mutate(source, m.edits)
    for policy in POLICIES:
        for seed in SWEEP_SEEDS:
            with pytest.raises(HazardError) as info:
                emulate(spec, q, k, v, source=broken, policy=policy, seed=seed)
            report = info.value.report
            for text in m.report:
                assert text in report, f"{policy} seed {seed}:\n{report}"
            assert f"policy={policy}" in report and report.count(", line ") >= 2  # both accesses, located


def test_there_are_enough_mutants_of_each_kind():
    kinds = [m.expect for m in MUTANTS]
    assert len(MUTANTS) >= 8 and all(kinds.count(k) >= 2 for k in ("hazard", "deadlock", "numeric"))
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("m", [m for m in HAZARDS if m.corrupts], ids=lambda m: m.name)
def test_hazard_mutants_also_corrupt_the_output(m: Mutant, monkeypatch):
    """A second, independent line of defence: wgmma operands are read when a wait retires the
    wgmma and TMA data lands when its phase completes, so with race detection switched off
    these races still show up as wrong numbers, in a schedule that lets the racing agent run
    ahead (m.policy; unlike the race reports, the numbers depend on the schedule). Excluded
    (corrupts=False, each says why): races whose effect the model's timeline cannot show."""
    from attngen.emulator.hazards import Tracker

    monkeypatch.setattr(Tracker, "enabled", False)
    spec = attngen.Spec(**m.spec)
    broken = mutate(attngen.render_source(spec), m.edits)
    q, k, v = inputs(spec, *m.shape)
    out = emulate(spec, q, k, v, source=broken, policy=m.policy)
    assert not check_close(out, q, k, v, spec.causal, dtype=spec.dtype).ok


STEADY_STATE_EARLY_K_RELEASE = [(WAIT_QK + RELEASE_K, RELEASE_K + WAIT_QK)]


@pytest.mark.parametrize("fields, races", [
    (DEFAULT, False),  # k_stages = v_stages = 2: ordered through v_empty, not a race
    ({"causal": True, "k_stages": 2, "v_stages": 3}, True),
    ({"causal": True, "k_stages": 1, "v_stages": 2}, True),
])
def test_early_k_release_in_the_steady_state_races_only_when_v_stages_exceed_k_stages(fields, races):
    """Arriving on k_empty[k % K] before wait_wgmma(1) retires QK(k) lets the producer load tile
    k + K into that stage. Before it does, it loads V(k + K - 1), which waits for the release
    of V(k + K - 1 - V) at the end of iteration k + K - V, after that iteration's wait_wgmma(0).
    With K >= V that iteration is k or later, so QK(k) has retired before the load: a chain of
    happens-before through v_empty, and no race (docs/emulator.md). With V > K there is none."""
    spec = attngen.Spec(**fields)
    source = attngen.render_source(spec)
    broken = mutate(source, STEADY_STATE_EARLY_K_RELEASE)
    q, k, v = inputs(spec, *SWEEP_SHAPE)
    for policy in POLICIES:
        for seed in range(3):
            if races:
                with pytest.raises(HazardError, match=r"producer \(TMA load\) writes K_shared\[\d\] while the in-flight wgmma"):
                    emulate(spec, q, k, v, source=broken, policy=policy, seed=seed)
            else:
                out = emulate(spec, q, k, v, source=broken, policy=policy, seed=seed)
                assert check_close(out, q, k, v, spec.causal, dtype=spec.dtype).ok
