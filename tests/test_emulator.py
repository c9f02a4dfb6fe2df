"""The CPU emulator: correct kernels pass under every schedule policy; the model's rules hold.

Every end-to-end check compares with the fp64 reference through attngen.reference.forward.check_close.
"""

import argparse
import re

import numpy as np
import pytest
import torch

import attngen
from attngen.emulator import (
    POLICIES, DeadlockError, EmulationError, HazardError, KernelError, UnsupportedConstruct, emulate,
    emulate_stats,
)
from attngen.emulator.agents import MBarrier, NamedBarrier
from attngen.emulator.memory import Buffer, Region
from attngen.reference.forward import InputError, check_close, random_inputs, round_to


def inputs(spec, b, hkv, sq, skv, seed=0):
    return random_inputs(spec.dtype, spec.head_dim, b, hkv * spec.gqa_group, hkv, sq, skv, seed)


def line_of(source, text, start=1):
    """1-based line number of the first line at or after `start` containing `text`."""
    for n, line in enumerate(source.splitlines()[start - 1:], start):
        if text in line:
            return n
    raise AssertionError(f"{text!r} not in source")


# -- correct kernels pass ---------------------------------------------------------------------
CASES = [
    # spec fields, (batch, kv heads, q_len, kv_len), policy
    ({}, (1, 2, 200, 300), "random"),
    ({"causal": True}, (2, 1, 300, 200), "producer-first"),  # Sq > Skv: leading rows see no key
    ({"causal": True, "gqa_group": 3, "head_dim": 64}, (1, 2, 150, 257), "consumers-first"),
    ({"consumers": 1, "causal": True}, (1, 1, 100, 130), "random"),
    ({"consumers": 3, "head_dim": 64, "causal": True}, (1, 1, 400, 390), "random"),
    ({"consumers": 3}, (1, 1, 200, 200), "producer-first"),
    ({"pingpong": False, "causal": True}, (1, 1, 256, 256), "producer-first"),
    ({"aligned": True, "causal": True}, (1, 1, 256, 384), "random"),
    ({"dtype": "bfloat16", "causal": True, "k_stages": 1, "v_stages": 3}, (1, 2, 129, 511), "consumers-first"),
    ({"block_n": 64, "k_stages": 3, "v_stages": 1}, (1, 1, 128, 333), "random"),
    ({"head_dim": 256, "causal": True}, (1, 1, 70, 100), "producer-first"),
    ({"head_dim": 192, "causal": True, "gqa_group": 2}, (1, 1, 1, 1), "random"),
]


@pytest.mark.parametrize("fields, shape, policy", CASES, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(CASES)])
def test_emitted_kernels_match_reference(fields, shape, policy):
    spec = attngen.Spec(**fields)
    q, k, v = inputs(spec, *shape)
    out = emulate(spec, q, k, v, seed=3, policy=policy)
    assert out.shape == q.shape and np.isfinite(out).all()
    res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype)
    assert res.ok, res


def test_torch_in_torch_out_numpy_in_numpy_out():
    spec = attngen.Spec(causal=True, dtype="bfloat16", head_dim=64)
    q, k, v = inputs(spec, 1, 1, 70, 90)
    out_np = emulate(spec, q, k, v, seed=1)
    out_t = emulate(spec, *(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)), seed=1)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.bfloat16
    np.testing.assert_array_equal(out_t.float().numpy(), out_np)
    np.testing.assert_array_equal(round_to(out_np, "bfloat16"), out_np)  # values are bfloat16 values
    assert check_close(out_t, *(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)), True).ok


def test_inputs_are_rounded_to_the_kernel_dtype():
    spec = attngen.Spec(head_dim=64)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in [(1, 64, 1, 64), (1, 64, 1, 64), (1, 64, 1, 64)])  # float64
    rounded = [round_to(x, "float16") for x in (q, k, v)]
    np.testing.assert_array_equal(emulate(spec, q, k, v), emulate(spec, *rounded))


def test_schedule_is_deterministic_per_seed_and_varies_with_seed_and_policy():
    spec = attngen.Spec(causal=True, consumers=3, head_dim=64)
    q, k, v = inputs(spec, 1, 1, 300, 300)
    a_out, a = emulate_stats(spec, q, k, v, seed=7, policy="random")
    b_out, b = emulate_stats(spec, q, k, v, seed=7, policy="random")
    assert a.schedule == b.schedule and a.handovers == b.handovers
    np.testing.assert_array_equal(a_out, b_out)
    others = {emulate_stats(spec, q, k, v, seed=s, policy="random")[1].schedule for s in range(4)}
    assert len(others) > 1
    by_policy = {emulate_stats(spec, q, k, v, seed=7, policy=p)[1].schedule for p in POLICIES}
    assert len(by_policy) == len(POLICIES)


def test_bad_arguments_are_rejected_before_running():
    spec = attngen.Spec(head_dim=64, gqa_group=2, aligned=True)
    q, k, v = inputs(spec, 1, 1, 128, 128)
    with pytest.raises(ValueError, match="policy"):
        emulate(spec, q, k, v, policy="fastest")
    with pytest.raises(ValueError, match="head_dim"):
        emulate(attngen.Spec(head_dim=128), q, k, v)
    with pytest.raises(InputError, match="gqa group"):  # the runtime's checks (attngen/run/inputs.py)
        emulate(spec, q[:, :, :1], k, v)
    with pytest.raises(InputError, match="multiple of block_n"):
        emulate(spec, q, k[:, :100], v[:, :100])


# -- barrier semantics --------------------------------------------------------------------------
def test_mbarrier_phases_and_parity_waits():
    bar = MBarrier("b", 32)
    assert not bar.blocks(1), "a fresh barrier has completed no phase of parity 1... yet waiting on parity 1 returns"
    assert bar.blocks(0), "waiting on parity 0 of a fresh barrier blocks until phase 0 completes"
    assert bar.arrive(31) == 0 and bar.blocks(0)
    assert bar.arrive(1) == 1 and bar.phase == 1
    assert not bar.blocks(0) and bar.blocks(1)
    assert bar.arrive(128) == 4 and bar.phase == 5  # arrivals beyond the count start the next phases
    assert bar.arrive(20) == 0 and "20 of 32" in bar.state()


def test_named_barrier_counts_across_agents_and_resets():
    nb = NamedBarrier(1)
    nb.arrive(128, 256)
    assert nb.generation == 0 and "128 of 256" in nb.state()
    nb.arrive(128, 256)
    assert nb.generation == 1 and nb.arrived == 0
    nb.arrive(128, 256)  # a dangling arrive (the ping-pong ring leaves one) is allowed
    with pytest.raises(KernelError, match="thread counts"):
        nb.arrive(128, 384)


MINI = '''\
import tilelang
import tilelang.language as T

ARRIVALS = {arrivals}


def build_kernel():
    @T.prim_func
    def mini(Q: T.Tensor([1, 64, 1, 64], "float16"), K: T.Tensor([1, 64, 1, 64], "float16"),
             V: T.Tensor([1, 64, 1, 64], "float16"), O: T.Tensor([1, 64, 1, 64], "float16"),
             softmax_scale: T.float32):  # the forward ABI's last parameter (unused here)
        with T.Kernel(1, 1, 1, threads=256) as (bx, by, bz):
            S = T.alloc_shared([64, 64], "float16")
            bar = T.alloc_barrier([ARRIVALS])
            tx = T.get_thread_binding()
            if tx >= 128 and tx < 160:  # one warp of the producer
                T.tma_copy(K[0, 0:64, 0, :], S, barrier=bar)
                T.mbarrier_arrive(bar)
            if tx >= 200:  # 56 producer threads
                T.mbarrier_arrive(bar)
            with T.ws(0):
                if not tx < 8:  # 120 consumer threads
                    T.mbarrier_arrive(bar)
                T.mbarrier_wait_parity(bar, {parity})
                {after_wait}

    return mini
'''


def run_mini(arrivals, parity=0, policy="producer-first", after_wait="T.copy(S, O[0, 0:64, 0, :])"):
    spec = attngen.Spec(head_dim=64)
    q, k, v = inputs(spec, 1, 1, 64, 64)
    source = MINI.format(arrivals=arrivals, parity=parity, after_wait=after_wait)
    return emulate(spec, q, k, v, source=source, policy=policy), k


def test_arrivals_count_the_threads_that_take_each_branch():
    out, k = run_mini(32 + 56 + 120)
    np.testing.assert_array_equal(out, k)  # the TMA landed when the phase completed
    with pytest.raises(DeadlockError) as e:
        run_mini(32 + 56 + 120 + 1)
    assert "208 of 209 arrivals" in e.value.report


def test_tma_data_is_not_visible_before_its_phase_completes():
    # Wrong parity: a wait on parity 1 of a fresh barrier returns at once, before the load lands.
    with pytest.raises(HazardError) as e:
        run_mini(32 + 56 + 120 + 1, parity=1)
    report = e.value.report
    assert "in-flight TMA load of producer" in report and "not landed first" in report and "has not completed yet" in report
    assert f"line {line_of(MINI, '{after_wait}')}" in report and f"line {line_of(MINI, 'T.tma_copy')}" in report


def test_block_exit_with_a_tma_load_in_flight_is_reported():
    with pytest.raises(HazardError, match="TMA loads still in flight") as e:
        run_mini(32 + 56 + 120 + 1, parity=1, after_wait="pass")  # the phase never completes; nobody reads S
    assert f"TMA load of producer on S, line {line_of(MINI, 'T.tma_copy')}" in e.value.report


def test_tma_bounds_zero_fill_loads_and_drop_stores():
    g = Buffer("G", (5, 4), "float16", "global", data=np.arange(20, dtype=np.float32).reshape(5, 4))
    r = Region.of(g, (slice(3, 7), slice(None)))
    got = r.load_zero_filled()
    np.testing.assert_array_equal(got[:2], g.data[3:5])
    assert got.shape == (4, 4) and np.all(got[2:] == 0)
    r.store_clipped(np.full((4, 4), -1.0))
    assert np.all(g.data[3:] == -1) and np.all(g.data[:3] >= 0)


# -- errors name the construct and the line -----------------------------------------------------
def mutate(spec, old, new):
    src = attngen.render_source(spec)
    assert old in src
    out = src.replace(old, new, 1)
    assert out != src
    return out


def test_unsupported_construct_names_it_and_its_line():
    spec = attngen.Spec(causal=True)
    src = mutate(spec, "T.reduce_sum(acc_s, row_sum, dim=1)", "T.reduce_absmax(acc_s, row_sum, dim=1)")
    q, k, v = inputs(spec, 1, 1, 64, 64)
    with pytest.raises(UnsupportedConstruct) as e:
        emulate(spec, q, k, v, source=src)
    assert "T.reduce_absmax" in e.value.report
    assert f"line {line_of(src, 'T.reduce_absmax')}:" in e.value.report


def test_if_on_element_values_is_unsupported():
    spec = attngen.Spec()
    src = mutate(spec, "            acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])"
                       "  # a row that sees no key gives 0\n",
                 "            if row_sum[i] > 0:\n                acc_o[i, j] /= row_sum[i]\n")
    q, k, v = inputs(spec, 1, 1, 64, 64)
    with pytest.raises(UnsupportedConstruct, match="T.if_then_else") as e:
        emulate(spec, q, k, v, source=src)
    assert f"line {line_of(src, 'if row_sum[i] > 0')}" in e.value.report


def test_out_of_bounds_shared_index_is_a_located_kernel_error():
    spec = attngen.Spec()
    src = mutate(spec, "K_shared[0, :, :], acc_s", "K_shared[K_STAGES, :, :], acc_s")
    q, k, v = inputs(spec, 1, 1, 64, 64)
    with pytest.raises(KernelError, match="out of bounds") as e:
        emulate(spec, q, k, v, source=src)
    assert f"line {line_of(src, 'K_shared[K_STAGES')}" in e.value.report


def test_static_shape_source_checks_its_tensor_shapes():
    spec = attngen.Spec(causal=True)
    src = attngen.render_source(spec, attngen.Shape(1, 1, 1, 100, 100))
    q, k, v = inputs(spec, 1, 1, 100, 100)
    assert check_close(emulate(spec, q, k, v, source=src), q, k, v, True, dtype="float16").ok
    q, k, v = inputs(spec, 1, 1, 100, 120)
    with pytest.raises(KernelError, match="declared"):
        emulate(spec, q, k, v, source=src)


def test_wgmma_never_waited_is_reported():
    spec = attngen.Spec(consumers=1)
    src = attngen.render_source(spec)
    epilogue = src[src.index("# Epilogue"):]
    old = "T.wait_wgmma(0)\n        T.mbarrier_arrive(v_empty[v_stage_last])"
    assert old in epilogue
    src = src.replace(old, "T.mbarrier_arrive(v_empty[v_stage_last])")
    q, k, v = inputs(spec, 1, 1, 64, 64)
    with pytest.raises(HazardError, match="acc_o|in flight"):
        emulate(spec, q, k, v, source=src)


# -- reports ---------------------------------------------------------------------------------------
def test_deadlock_report_lists_every_agent_with_line_and_wait():
    spec = attngen.Spec(causal=True)
    src = mutate(spec, "T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # prime the ring", "pass  # (primer removed)")
    q, k, v = inputs(spec, 1, 1, 128, 256)
    with pytest.raises(DeadlockError) as e:
        emulate(spec, q, k, v, source=src, policy="consumers-first")
    report = e.value.report
    sync_line = line_of(src, "T.sync_threads(wait_bar, PINGPONG_THREADS)")
    for agent in ("consumer 0", "consumer 1", "producer"):
        assert re.search(rf"^  {agent}: (blocked at line \d+|finished)", report, re.M), report
    assert f"consumer 0: blocked at line {sync_line}" in report
    assert "named barrier 1 to release (128 of 256 threads arrived)" in report


def test_hazard_report_names_buffer_lines_and_both_agents():
    spec = attngen.Spec(causal=True)
    early = "            T.mbarrier_arrive(v_empty[v_stage_prev])\n"
    src = attngen.render_source(spec)
    wait = "            T.wait_wgmma(0)  # PV(k-1) done: p_reg and V stage may be reused\n"
    assert wait + early in src
    src = src.replace(wait + early, early + wait)
    q, k, v = inputs(spec, 1, 1, 256, 700)
    with pytest.raises(HazardError) as e:
        emulate(spec, q, k, v, source=src, policy="producer-first")
    report = e.value.report
    assert "producer (TMA load) writes V_shared[" in report
    assert re.search(r"in-flight wgmma of consumer \d reads it", report)
    assert f"line {line_of(src, 'T.tma_copy(V[')}" in report
    assert f"line {line_of(src, 'T.wgmma_gemm(p_reg, V_shared')}" in report


# -- the command line ---------------------------------------------------------------------------
def namespace(spec_path, **kw):
    args = dict(spec=str(spec_path), batch=1, heads=None, kv_heads=2, q_len=100, kv_len=150, seed=0, policy="random", source=None)
    args.update(kw)
    return argparse.Namespace(**args)


def test_command_reports_error_and_bound(tmp_path, capsys):
    from attngen.cli.emulate import command

    spec_path = tmp_path / "spec.toml"
    spec_path.write_text("head_dim = 64\ncausal = true\ngqa_group = 2\n")
    assert command(namespace(spec_path)) == 0
    out = capsys.readouterr().out
    assert "H=4 HKV=2 Sq=100 Skv=150" in out and "PASS" in out and "bound" in out

    spec = attngen.load_spec(spec_path)
    mutant = tmp_path / "mutant.py"
    mutant.write_text(mutate(spec, "T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # prime", "pass  #"))
    assert command(namespace(spec_path, source=str(mutant))) == 1
    assert "DEADLOCK" in capsys.readouterr().out

    assert command(namespace(spec_path, policy="nope")) == 2


def test_cli_entry_point(tmp_path, capsys):
    from attngen.cli import main

    spec_path = tmp_path / "spec.toml"
    spec_path.write_text("head_dim = 64\nconsumers = 1\n")
    assert main(["emulate", str(spec_path), "--q-len", "70", "--kv-len", "33", "--policy", "producer-first"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["emulate", str(spec_path), "--heads", "3", "--kv-heads", "2"]) == 2  # SpecError: H != HKV * group


def test_emulation_error_is_the_common_base():
    assert all(issubclass(c, EmulationError) for c in (HazardError, DeadlockError, UnsupportedConstruct, KernelError))


# -- proxy fences (on by default) --------------------------------------------------------------------------
def epilogue_variants(source, between):
    """The source with exactly `between` (lines) between the O_shared write and its TMA store."""
    lines = source.splitlines(keepends=True)
    w = next(i for i, t in enumerate(lines) if "T.copy(acc_o, O_shared[g, :, :])" in t)
    s = next(i for i, t in enumerate(lines) if "T.copy(O_shared[g, :, :], O[" in t)
    indent = lines[w][: len(lines[w]) - len(lines[w].lstrip())]
    return "".join(lines[: w + 1] + [indent + b + "\n" for b in between] + lines[s:])


FENCE = "T.fence_proxy_async()  # every writer's generic stores -> async proxy"
WG_BARRIER = "T.sync_threads(8 + g, 128)  # all 128 writers before the elected thread's TMA store"


@pytest.mark.parametrize("between, ok", [
    ([FENCE, WG_BARRIER], True),
    ([], False),  # the seed kernel's form: no fence, no barrier
    ([FENCE], False),  # the elected thread's fence does not order the other 127 threads' writes
    ([WG_BARRIER], False),  # ordered, but the generic-proxy writes are not fenced for the async proxy
])
def test_tma_store_needs_fence_and_barrier_after_ordinary_smem_writes(between, ok):
    spec = attngen.Spec(causal=True)
    src = epilogue_variants(attngen.render_source(spec), between)
    q, k, v = inputs(spec, 1, 1, 200, 300)
    if ok:
        out = emulate(spec, q, k, v, source=src, proxy_fences=True)
        assert check_close(out, q, k, v, True, dtype="float16").ok
        return
    with pytest.raises(HazardError) as e:
        emulate(spec, q, k, v, source=src, proxy_fences=True)
    report = e.value.report
    assert "(TMA store) reads O_shared[" in report and "async proxy" in report
    assert f"line {line_of(src, 'T.copy(acc_o, O_shared')}" in report
    assert emulate(spec, q, k, v, source=src, proxy_fences=False).shape == q.shape  # the rule can be switched off


def test_an_endless_loop_is_reported_not_hung(monkeypatch):
    from attngen.emulator import agents

    monkeypatch.setattr(agents, "STALL_SECONDS", 1)
    spec = attngen.Spec(consumers=1)
    src = mutate(spec, "        T.fill(acc_o, 0)\n", "        T.fill(acc_o, 0)\n        while True:\n            pass\n")
    q, k, v = inputs(spec, 1, 1, 64, 64)
    with pytest.raises(KernelError, match="no synchronization point reached"):
        emulate(spec, q, k, v, source=src)


# -- happens-before race detection --------------------------------------------------------------
def test_mbarrier_phase_waits_for_transaction_bytes_and_records_its_clock():
    bar = MBarrier("b", 1, comp=2)
    bar.expect_tx(32768)  # a TMA load's box
    assert bar.arrive(1, [5, 0, 0]) == 0 and bar.phase == 0, "arrivals are in but the bytes are not"
    assert "32768 transaction bytes outstanding" in bar.state()
    assert bar.complete_tx(32768) == 1 and bar.phase == 1
    assert bar.done_vc == [5, 0, 1]  # the arrival's clock, and one completed phase of this barrier
    with pytest.raises(KernelError, match="only 0 expected"):
        bar.complete_tx(1)
    bar.expect_tx(8)
    bar.arrive(1)
    with pytest.raises(KernelError, match="still waits for 8 transaction bytes"):
        bar.arrive(1)


def test_named_barrier_generation_joins_every_arrival_clock():
    nb = NamedBarrier(1)
    nb.arrive(128, 256, "a", [3, 0])
    nb.arrive(128, 256, "b", [0, 7])
    assert nb.generation == 1 and nb.released_vc[1] == [3, 7] and nb.vc == []


SYNC_MINI = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def mini(Q: T.Tensor([1, 64, 1, 64], "float16"), K: T.Tensor([1, 64, 1, 64], "float16"),
             V: T.Tensor([1, 64, 1, 64], "float16"), O: T.Tensor([1, 64, 1, 64], "float16"),
             softmax_scale: T.float32):  # the forward ABI's last parameter (unused here)
        with T.Kernel(1, 1, 1, threads={threads}) as (bx, by, bz):
            S = T.alloc_shared([64, 64], "float16")
            bar = T.alloc_barrier([128])
            F = T.alloc_fragment([64, 64], "float")
            with T.ws(0):
                T.copy(Q[0, 0:64, 0, :], F)
                T.copy(F, S)  # ordinary stores to shared memory
                {first}
            with T.ws(1):
                {middle}
            with T.ws({last}):
                {reader}
                T.copy(S, F)  # ordinary loads
                T.copy(F, O[0, 0:64, 0, :])

    return mini
'''


def run_sync_mini(first, reader, middle="pass", three=False, policy="random", seed=0):
    spec = attngen.Spec(head_dim=64)
    q, k, v = inputs(spec, 1, 1, 64, 64)
    src = SYNC_MINI.format(threads=384 if three else 256, first=first, middle=middle, reader=reader, last=2 if three else 1)
    return emulate(spec, q, k, v, source=src, policy=policy, seed=seed), q


@pytest.mark.parametrize("first, reader", [
    ("T.named_barrier_arrive(1, 256)", "T.sync_threads(1, 256)"),  # bar.arrive releases to the syncer
    ("T.sync_threads(1, 256)", "T.sync_threads(1, 256)"),
    ("T.mbarrier_arrive(bar)", "T.mbarrier_wait_parity(bar, 0)"),  # phase 0 completes with the 128 arrivals
])
def test_synchronized_shared_memory_handoff_is_not_a_race(first, reader):
    for policy in POLICIES:
        out, q = run_sync_mini(first, reader, policy=policy)
        np.testing.assert_array_equal(out, q)


@pytest.mark.parametrize("first, reader", [
    ("pass", "pass"),  # no synchronization at all
    ("T.sync_threads(1, 256)", "T.named_barrier_arrive(1, 256)"),  # bar.arrive does not acquire
    ("pass", "T.mbarrier_wait_parity(bar, 1)"),  # parity 1 of a fresh barrier returns at once, acquiring nothing
])
def test_unsynchronized_shared_memory_handoff_is_a_race_in_every_schedule(first, reader):
    store = line_of(SYNC_MINI, "T.copy(F, S)")
    load = line_of(SYNC_MINI, "T.copy(S, F)")
    for policy in POLICIES:
        for seed in range(3):
            with pytest.raises(HazardError) as e:
                run_sync_mini(first, reader, policy=policy, seed=seed)
            report = e.value.report
            # whichever ran first, both accesses and both agents are named
            assert re.search(r"HAZARD: (producer \(ordinary code\) reads S while consumer 0 \(ordinary code\) writes it"
                             r"|consumer 0 \(ordinary code\) writes S while producer \(ordinary code\) reads it)", report), report
            assert f"line {store}:" in report and f"line {load}:" in report
            assert "a race in every schedule" in report


RING_MINI = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def mini(Q: T.Tensor([1, 64, 1, 64], "float16"), K: T.Tensor([1, 64, 1, 64], "float16"),
             V: T.Tensor([1, 64, 1, 64], "float16"), O: T.Tensor([1, 64, 1, 64], "float16"),
             softmax_scale: T.float32):  # the forward ABI's last parameter (unused here)
        with T.Kernel(1, 1, 1, threads=256) as (bx, by, bz):
            S = T.alloc_shared([64, 64], "float16")
            full = T.alloc_barrier([128])
            F = T.alloc_fragment([64, 64], "float")
            tx = T.get_thread_binding()
            with T.ws(1):
                T.copy(Q[0, 0:64, 0, :], F)
                T.copy(F, S)  # phase 0's tile
                T.mbarrier_arrive(full)  # 128 arrivals: phase 0 completes
                T.copy(K[0, 0:64, 0, :], F)
                {refill}
                if tx < 160:
                    T.mbarrier_arrive(full)  # one warp arrives for phase 1, which stays open
            with T.ws(0):
                T.mbarrier_wait_parity(full, 0)
                T.copy(S, F)  # phase 0's tile, read
                T.copy(F, O[0, 0:64, 0, :])

    return mini
'''


def test_a_wait_acquires_the_completed_phase_not_arrivals_for_the_next_one():
    """The producer overwrites S for phase 1 without waiting for the consumer, then arrives for phase 1
    (which stays open). The consumer's phase-0 wait orders it after phase 0's arrivals only: the
    overwrite races with its read in every schedule, including those where the phase-1 arrival came
    before the consumer resumed (a model that joined the barrier's current clock would miss it there)."""
    spec = attngen.Spec(head_dim=64)
    q, k, v = inputs(spec, 1, 1, 64, 64)
    refill = "T.copy(F, S)  # phase 1's tile, over phase 0's"
    out = emulate(spec, q, k, v, source=RING_MINI.format(refill="pass"), policy="producer-first")
    np.testing.assert_array_equal(out, q)  # without the refill, the hand-off is synchronized
    source = RING_MINI.format(refill=refill)
    store, load = line_of(source, "phase 1's tile"), line_of(source, "phase 0's tile, read")
    for policy in POLICIES:
        for seed in range(3):
            with pytest.raises(HazardError) as e:
                emulate(spec, q, k, v, source=source, policy=policy, seed=seed)
            report = e.value.report
            assert re.search(r"HAZARD: (producer \(ordinary code\) writes S while consumer 0 \(ordinary code\) reads it"
                             r"|consumer 0 \(ordinary code\) reads S while producer \(ordinary code\) writes it)", report), report
            assert f"line {store}:" in report and f"line {load}:" in report, report


def test_happens_before_is_transitive_through_a_third_warpgroup():
    relay = "T.sync_threads(1, 256)\n                T.named_barrier_arrive(2, 256)"
    out, q = run_sync_mini("T.named_barrier_arrive(1, 256)", "T.sync_threads(2, 256)", middle=relay, three=True)
    np.testing.assert_array_equal(out, q)
    # The relay signals without having waited for the writer: no chain, a race.
    broken = "T.named_barrier_arrive(2, 256)\n                T.sync_threads(1, 256)"
    with pytest.raises(HazardError, match=r"reads S while consumer 0 \(ordinary code\) writes it"):
        run_sync_mini("T.named_barrier_arrive(1, 256)", "T.sync_threads(2, 256)", middle=broken, three=True,
                      policy="consumers-first")


def test_arrive_before_a_tma_load_completes_the_phase_without_it():
    """The TMA engine is modeled completing its bytes at once: an arrive placed between two loads
    on one barrier completes the phase, and the second load lands with the next phase."""
    spec = attngen.Spec(causal=True)
    src = attngen.render_source(spec)
    second_q = "                T.tma_copy(Q[batch_idx, q0 + 64:q0 + 128, head, :], Q_shared[1, :, :], barrier=q_full)\n"
    arrive = "                T.mbarrier_arrive(q_full)\n"
    assert second_q + arrive in src
    src = src.replace(second_q + arrive, arrive + second_q)
    q, k, v = inputs(spec, 1, 1, 128, 200)
    for policy in POLICIES:
        with pytest.raises(HazardError) as e:
            emulate(spec, q, k, v, source=src, policy=policy)
        report = e.value.report
        assert "consumer 1 (wgmma) reads Q_shared[1] while the in-flight TMA load of producer writes it" in report
        assert "lands with phase 1 of q_full" in report


def test_access_history_is_pruned_once_every_agent_has_seen_it(monkeypatch):
    from attngen.emulator.hazards import Tracker

    longest = {}
    record = Tracker._record

    def spy(self, buf, rec):
        record(self, buf, rec)
        longest[buf.name] = max(longest.get(buf.name, 0), len(self.hist.get(buf, ())))

    monkeypatch.setattr(Tracker, "_record", spy)
    spec = attngen.Spec()
    q, k, v = inputs(spec, 1, 1, 128, 128 * 24)  # 24 K/V tiles through 2 stages each
    emulate(spec, q, k, v)
    assert 0 < longest["K_shared"] <= 20 and longest["V_shared"] <= 20, longest
    # Without pruning the history grows with the tiles (3 records per tile: a load, two wgmma reads).
    longest.clear()
    monkeypatch.setattr(Tracker, "_prune", lambda self, buf, hist: None)
    emulate(spec, q, k, v)
    assert longest["K_shared"] >= 3 * 24, longest


STORE_MINI = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def mini(Q: T.Tensor([1, 64, 1, 64], "float16"), K: T.Tensor([1, 64, 1, 64], "float16"),
             V: T.Tensor([1, 64, 1, 64], "float16"), O: T.Tensor([1, 64, 1, 64], "float16"),
             softmax_scale: T.float32):  # the forward ABI's last parameter (unused here)
        with T.Kernel(1, 1, 1, threads=256) as (bx, by, bz):
            S = T.alloc_shared([64, 64], "float16")
            F = T.alloc_fragment([64, 64], "float")
            with T.ws(0):
                T.copy(Q[0, 0:64, 0, :], F)
                T.copy(F, S)
                T.fence_proxy_async()
                T.sync_threads(1, 128)
                T.tma_copy(S, O[0, 0:64, 0, :])  # asynchronous: reads S until T.tma_store_wait
                {after}

    return mini
'''


@pytest.mark.parametrize("after, problem", [
    ("T.tma_store_wait(0)\n                T.fill(S, 0)", None),
    ("T.fill(S, 0)\n                T.tma_store_wait(0)", "writes S while the in-flight TMA store of consumer 0 reads it"),
    ("pass", "finished with 1 TMA store(s) in flight"),
])
def test_asynchronous_tma_store_reads_shared_memory_until_waited(after, problem):
    spec = attngen.Spec(head_dim=64)
    q, k, v = inputs(spec, 1, 1, 64, 64)
    src = STORE_MINI.format(after=after)
    if problem is None:
        np.testing.assert_array_equal(emulate(spec, q, k, v, source=src), q)
        return
    with pytest.raises(HazardError, match=re.escape(problem)):
        emulate(spec, q, k, v, source=src)


def test_fence_then_bar_arrive_does_not_order_the_warpgroups_own_writes():
    """bar.arrive releases but does not acquire: the elected thread's TMA store is still not
    ordered after the other 127 threads' stores (the fence-and-sync rule, clock form)."""
    spec = attngen.Spec(causal=True)
    src = epilogue_variants(attngen.render_source(spec), [FENCE, "T.named_barrier_arrive(8 + g, 128)"])
    q, k, v = inputs(spec, 1, 1, 200, 300)
    with pytest.raises(HazardError, match="a named barrier after its fence"):
        emulate(spec, q, k, v, source=src)
