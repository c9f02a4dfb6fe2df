"""The CPU model's atomics, TMA reduce-adds and cross-CTA race detection in global memory.

Small hand-written TileLang kernels run through the CPU model (emulator.driver.Runtime), as the
backward kernels' dQ / dK / dV accumulation would: many warpgroups and many CTAs adding into one
float32 buffer. Values are small integers, so every float32 sum is exact in any order and a
result can be compared exactly whatever the schedule.
"""

import re

import numpy as np
import pytest

from attngen.emulator import POLICIES, HazardError, KernelError, UnsupportedConstruct
from attngen.emulator.driver import Runtime, Stats
from attngen.emulator.hazards import Launch

SEEDS = range(4)
NB = 3  # CTAs


def line_of(source, text):
    for n, line in enumerate(source.splitlines(), 1):
        if text in line:
            return n
    raise AssertionError(f"{text!r} not in source")


def run(src, inputs, *, seed=0, policy="random", proxy_fences=True):
    """Run the module's build_kernel() on `inputs` (one per parameter, None: an output starting NaN)."""
    rt = Runtime(src, "<atomics test>", {})
    stats = Stats()
    rt.run(list(inputs), seed=seed, policy=policy, stats=stats, proxy_fences=proxy_fences)
    return rt.tensors, stats


def tiles(seed=0, nb=NB):
    return np.random.default_rng(seed).integers(-8, 9, size=(nb, 2, 64, 32)).astype(np.float32)


def every_schedule():
    return [(p, s) for p in POLICIES for s in SEEDS]


# -- register atomics: many warpgroups and CTAs into one buffer ----------------------------------------
SUM = '''\
import tilelang
import tilelang.language as T

NB = {nb}


def build_kernel():
    @T.prim_func
    def acc(X: T.Tensor([NB, 2, 64, 32], "float32"), Acc: T.Tensor([64, 32], "float32")):
        with T.Kernel(NB, threads=256) as bx:
            F = T.alloc_fragment([64, 32], "float")
            with T.ws(0):
                T.copy(X[bx, 0, :, :], F)
                {wg0}
            with T.ws(1):
                T.copy(X[bx, 1, :, :], F)
                for i, j in T.Parallel(64, 32):
                    {wg1}

    return acc
'''
TILE_ATOMIC = "T.atomic_add(Acc, F)  # tile form"
ELEMENT_ATOMIC = "T.atomic_add(Acc[i, j], F[i, j])  # element form"


def test_many_ctas_and_warpgroups_adding_atomically_give_the_exact_sum_in_every_schedule():
    src = SUM.format(nb=NB, wg0=TILE_ATOMIC, wg1=ELEMENT_ATOMIC)
    x = tiles()
    for policy, seed in every_schedule():
        got, stats = run(src, [x, np.zeros((64, 32), np.float32)], seed=seed, policy=policy)
        np.testing.assert_array_equal(got["Acc"], x.sum(axis=(0, 1)))
        assert stats.atomics == 2 * NB and stats.reduce_adds == 0


def test_an_atomic_adds_to_what_the_buffer_held():
    src = SUM.format(nb=NB, wg0=TILE_ATOMIC, wg1=ELEMENT_ATOMIC)
    x, start = tiles(), np.full((64, 32), 100.0, np.float32)
    got, _ = run(src, [x, start])
    np.testing.assert_array_equal(got["Acc"], 100 + x.sum(axis=(0, 1)))
    # The check can fail: a model whose "atomic" overwrote would leave one tile.
    assert not np.array_equal(got["Acc"], x[-1, 1])


@pytest.mark.parametrize("wg0, wg1, plain", [
    ("T.copy(F, Acc)  # plain store", ELEMENT_ATOMIC, "plain store"),
    (TILE_ATOMIC, "Acc[i, j] = F[i, j]  # plain store", "plain store"),
])
def test_a_plain_store_beside_atomics_is_a_race_in_every_schedule(wg0, wg1, plain):
    """Within a CTA (the two warpgroups) and across CTAs: reported in every policy and seed, naming both lines."""
    src = SUM.format(nb=NB, wg0=wg0, wg1=wg1)
    store, atomic = line_of(src, plain), line_of(src, "T.atomic_add")
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run(src, [tiles(), np.zeros((64, 32), np.float32)], seed=seed, policy=policy)
        report = e.value.report
        assert "Acc" in report and f"line {store}:" in report and f"line {atomic}:" in report, report
        assert "atomic add" in report


def test_plain_stores_from_every_cta_into_one_buffer_race_across_ctas_in_every_schedule():
    """dQ written with a plain store instead of an atomic: one warpgroup per CTA, so only the
    cross-CTA rule can see it."""
    src = SUM.format(nb=NB, wg0="T.copy(F, Acc)  # plain store", wg1="pass")
    store = line_of(src, "plain store")
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run(src, [tiles(), np.zeros((64, 32), np.float32)], seed=seed, policy=policy)
        report = e.value.report
        assert re.search(r"HAZARD: block \(x=\d, y=0, z=0\), consumer 0 \(store\) writes Acc\[0, 0\], which "
                         r"block \(x=\d, y=0, z=0\), consumer 0 \(store\) wrote", report), report
        assert report.count(f"line {store}:") == 2 and "a race whatever order the blocks run in" in report
    # One CTA alone is fine: the check is about other blocks.
    one = SUM.format(nb=1, wg0="T.copy(F, Acc)  # plain store", wg1="pass")
    got, _ = run(one, [tiles(nb=1), np.zeros((64, 32), np.float32)])
    np.testing.assert_array_equal(got["Acc"], tiles(nb=1)[0, 0])


# -- an atomic against a plain read, in another CTA or unordered in the same one ---------------------------
MIXED = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def mixed(X: T.Tensor([2, 64, 32], "float32"), Acc: T.Tensor([64, 32], "float32"),
              Out: T.Tensor([2, 64, 32], "float32")):
        with T.Kernel(2, threads=256) as bx:
            F = T.alloc_fragment([64, 32], "float")
            with T.ws(0):
                if bx == {adder}:
                    T.copy(X[bx, :, :], F)
                    T.atomic_add(Acc, F)  # the atomic
                {sync0}
            with T.ws(1):
                {sync1}
                if bx == {reader}:
                    T.copy(Acc, F)  # the plain read
                    T.copy(F, Out[bx, :, :])

    return mixed
'''


@pytest.mark.parametrize("adder, reader", [(0, 1), (1, 0)])
def test_an_atomic_and_a_plain_read_in_other_ctas_race_whichever_block_runs_first(adder, reader):
    src = MIXED.format(adder=adder, reader=reader, sync0="pass", sync1="pass")
    atomic, read = line_of(src, "the atomic"), line_of(src, "the plain read")
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run(src, [tiles(nb=1)[0], np.zeros((64, 32), np.float32), None], seed=seed, policy=policy)
        report = e.value.report
        assert f"block (x={max(adder, reader)}, y=0, z=0)" in report.splitlines()[0], report  # found by the later block
        assert f"line {atomic}:" in report and f"line {read}:" in report
        assert "atomics commute only with atomics" in report


def test_an_atomic_and_a_plain_read_in_one_cta_race_unless_a_barrier_orders_them():
    # Both in block 0 (block 1 does neither): only happens-before decides.
    bare = MIXED.format(adder=0, reader=0, sync0="pass", sync1="pass")
    synced = MIXED.format(adder=0, reader=0, sync0="T.sync_threads(1, 256)", sync1="T.sync_threads(1, 256)")
    x = tiles(nb=1)[0]
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run(bare, [x, np.zeros((64, 32), np.float32), None], seed=seed, policy=policy)
        assert re.search(r"consumer 0 \(atomic add\) writes Acc|producer \(load\) reads Acc", e.value.report), e.value.report
        got, _ = run(synced, [x, np.zeros((64, 32), np.float32), None], seed=seed, policy=policy)
        np.testing.assert_array_equal(got["Out"][0], x[0])


def test_reads_of_inputs_by_every_cta_and_disjoint_stores_are_not_races():
    src = SUM.format(nb=NB, wg0="T.copy(F, Acc)  # plain store", wg1="pass").replace(
        "T.copy(F, Acc)  # plain store", "T.copy(X[0, 0, :, :], F)  # every block reads the same tile")
    run(src, [tiles(), np.zeros((64, 32), np.float32)])


# -- atomics on shared memory ----------------------------------------------------------------------------
SHARED = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def shared(X: T.Tensor([2, 64, 32], "float32"), Out: T.Tensor([64, 32], "float32")):
        with T.Kernel(1, threads=256) as bx:
            S = T.alloc_shared([64, 32], "float32")
            F = T.alloc_fragment([64, 32], "float")
            with T.ws(0):
                T.fill(S, 0)
            T.sync_threads(1, 256)
            with T.ws(0):
                T.copy(X[0, :, :], F)
                T.atomic_add(S, F)
            with T.ws(1):
                T.copy(X[1, :, :], F)
                {second}
            {sync}
            with T.ws(1):
                T.copy(S, F)
                T.copy(F, Out)

    return shared
'''


@pytest.mark.parametrize("second, sync, race", [
    ("T.atomic_add(S, F)", "T.sync_threads(2, 256)", False),  # atomics commute; the barrier orders the read
    ("T.atomic_add(S, F)", "pass", True),  # warpgroup 1 reads S while warpgroup 0's atomic is unordered
    ("T.copy(F, S)", "T.sync_threads(2, 256)", True),  # a plain store beside warpgroup 0's atomic
])
def test_shared_memory_atomics_commute_but_race_with_plain_accesses(second, sync, race):
    src = SHARED.format(second=second, sync=sync)
    x = tiles(nb=1)[0]
    for policy, seed in every_schedule():
        if race:
            with pytest.raises(HazardError, match=r"S \(shared\)"):
                run(src, [x, None], seed=seed, policy=policy)
        else:
            got, _ = run(src, [x, None], seed=seed, policy=policy)
            np.testing.assert_array_equal(got["Out"], x.sum(axis=0))


# -- element form: predication, bounds, repeated elements, 16-bit rounding -----------------------------------
ELEMENTS = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def elems(X: T.Tensor([64, 32], "float32"), Acc: T.Tensor([{rows}, 32], "{dtype}")):
        with T.Kernel(1, threads=128) as bx:
            F = T.alloc_fragment([64, 32], "float")
            T.copy(X, F)
            for i, j in T.Parallel(64, 32):
                {body}

    return elems
'''


def test_element_atomics_are_predicated_like_stores():
    x = tiles(nb=1)[0, 0]
    masked = ELEMENTS.format(rows=40, dtype="float32",
                             body="if i < 40:\n                    T.atomic_add(Acc[i, j], F[i, j])")
    got, _ = run(masked, [x, np.zeros((40, 32), np.float32)])
    np.testing.assert_array_equal(got["Acc"], x[:40])  # rows 40..63 are out of range, but not selected
    unmasked = ELEMENTS.format(rows=40, dtype="float32", body="T.atomic_add(Acc[i, j], F[i, j])")
    with pytest.raises(KernelError, match="index out of bounds: Acc axis 0 has extent 40"):
        run(unmasked, [x, np.zeros((40, 32), np.float32)])


def test_element_atomics_into_one_element_each_add():
    x = tiles(nb=1)[0, 0]
    src = ELEMENTS.format(rows=1, dtype="float32", body="T.atomic_add(Acc[0, j], F[i, j])")
    got, _ = run(src, [x, np.zeros((1, 32), np.float32)])
    np.testing.assert_array_equal(got["Acc"][0], x.sum(axis=0))


def test_a_16_bit_destination_rounds_after_every_add():
    """2048 + 1 rounds back to 2048 in float16 (ties to even), so 64 adds of 1 leave 2048; adding
    the sum first (one rounding) would give 2112."""
    src = ELEMENTS.format(rows=1, dtype="float16", body="T.atomic_add(Acc[0, j], F[i, j])")
    got, _ = run(src, [np.ones((64, 32), np.float32), np.full((1, 32), 2048.0, np.float32)])
    np.testing.assert_array_equal(got["Acc"], np.full((1, 32), 2048.0))
    got, _ = run(src, [np.full((64, 32), 2.0, np.float32), np.full((1, 32), 2048.0, np.float32)])
    np.testing.assert_array_equal(got["Acc"], np.full((1, 32), 2048.0 + 128))  # 2 is representable at every step


# -- TMA reduce-add --------------------------------------------------------------------------------------
REDUCE = '''\
import tilelang
import tilelang.language as T

NB = {nb}


def build_kernel():
    @T.prim_func
    def reduce(X: T.Tensor([NB, 2, 64, 32], "float32"), Acc: T.Tensor([64, 32], "float32")):
        with T.Kernel(NB, threads=256) as bx:
            S = T.alloc_shared([64, 32], "float32")
            F = T.alloc_fragment([64, 32], "float")
            with T.ws(0):
                for it in T.serial({iters}):
                    T.copy(X[bx, it, :, :], F)
                    T.copy(F, S)  # the source, written
                    {fence}
                    T.sync_threads(1, 128)
                    T.atomic_add(Acc, S, use_tma=True)  # the reduce-add
                    {after}
            with T.ws(1):
                {other}

    return reduce
'''
FENCE = "T.fence_proxy_async()"
REUSE_OK = "T.sync_threads(2, 128)  # all 128 threads after the elected thread's wait"


def reduce_source(after=REUSE_OK, other="pass", fence=FENCE, nb=NB, iters=2):
    return REDUCE.format(nb=nb, after=after, other=other, fence=fence, iters=iters)


def run_reduce(after=REUSE_OK, other="pass", fence=FENCE, nb=NB, iters=2, **kw):
    src = reduce_source(after, other, fence, nb, iters)
    x = tiles(nb=nb)
    got, stats = run(src, [x, np.zeros((64, 32), np.float32)], **kw)
    return src, x, got, stats


def test_reduce_add_then_a_warpgroup_barrier_then_reuse_is_clean_and_exact():
    for policy, seed in every_schedule():
        _, x, got, stats = run_reduce(policy=policy, seed=seed)
        np.testing.assert_array_equal(got["Acc"], x.sum(axis=(0, 1)))
        assert stats.reduce_adds == 2 * NB and stats.atomics == 0


@pytest.mark.parametrize("after", ["pass", "T.tma_store_wait(0)"])
def test_reduce_add_source_reused_before_the_warpgroup_is_ordered_after_the_read_is_a_race(after):
    """TileLang 0.1.15 waits for the read inside T.atomic_add(use_tma=True), in the elected thread
    only: the next iteration's stores by the other 127 threads race with the TMA engine's read
    unless a barrier of the warpgroup follows. A T.tma_store_wait does not order them."""
    src = reduce_source(after=after)
    write, reduce = line_of(src, "the source, written"), line_of(src, "the reduce-add")
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run_reduce(after=after, policy=policy, seed=seed)
        report = e.value.report
        assert "consumer 0 (ordinary code) writes S while consumer 0 (TMA reduce-add) reads it" in report, report
        assert f"line {write}:" in report and f"line {reduce}:" in report
        assert "one elected thread of consumer 0" in report


def test_reduce_add_source_overwritten_by_another_warpgroup_is_a_race():
    """The producer is ordered after the source's stores (a bar.arrive before the reduce-add) but
    not after the reduce-add's read."""
    fence = "T.fence_proxy_async()\n                    T.named_barrier_arrive(3, 256)"
    other = "T.sync_threads(3, 256)\n                T.fill(S, 0)  # another warpgroup, after the stores only"
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run_reduce(fence=fence, other=other, iters=1, policy=policy, seed=seed)
        report = e.value.report
        assert re.search(r"producer \(ordinary code\) writes S while consumer 0 \(TMA reduce-add\) reads it"
                         r"|consumer 0 \(TMA reduce-add\) reads S while producer \(ordinary code\) writes it", report), report
    run_reduce(fence=fence, other=other.replace("T.fill(S, 0)", "pass"), iters=1)  # without the fill: clean


def test_reduce_add_reads_shared_memory_through_the_async_proxy():
    with pytest.raises(HazardError, match="async proxy") as e:
        run_reduce(fence="pass")
    assert "(TMA reduce-add) reads S through the async proxy" in e.value.report
    run_reduce(fence="pass", proxy_fences=False)  # the rule can be switched off


def test_reduce_add_beside_a_plain_read_or_store_is_a_race():
    read = "T.copy(Acc, F)  # a plain read of the accumulator"
    src = reduce_source(other=read)
    for policy, seed in every_schedule():
        with pytest.raises(HazardError) as e:
            run_reduce(other=read, policy=policy, seed=seed)
        report = e.value.report
        assert "TMA reduce-add" in report and "Acc (global)" in report, report
        assert f"line {line_of(src, 'a plain read')}:" in report and f"line {line_of(src, 'the reduce-add')}:" in report
    # A TMA store in place of the reduce-add: every block stores the same rows.
    store = reduce_source(iters=1).replace("T.atomic_add(Acc, S, use_tma=True)  # the reduce-add", "T.copy(S, Acc)  # a TMA store")
    with pytest.raises(HazardError, match=r"consumer 0 \(TMA store\) writes Acc\[0, 0\], which block \(x=0"):
        run(store, [tiles(), np.zeros((64, 32), np.float32)])
    got, _ = run(store.replace("NB = 3", "NB = 1"), [tiles(nb=1), np.zeros((64, 32), np.float32)])  # one block alone
    np.testing.assert_array_equal(got["Acc"], tiles(nb=1)[0, 0])


def test_a_plain_read_after_a_reduce_add_needs_a_non_read_wait():
    """The reduce-add's global writes complete at an unknown time: `.read` waits only for the source."""
    src = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    @T.prim_func
    def k(X: T.Tensor([64, 32], "float32"), Acc: T.Tensor([64, 32], "float32"), Out: T.Tensor([64, 32], "float32")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_shared([64, 32], "float32")
            F = T.alloc_fragment([64, 32], "float")
            T.copy(X, F)
            T.copy(F, S)
            T.fence_proxy_async()
            T.sync_threads(1, 128)
            T.atomic_add(Acc, S, use_tma=True)
            {wait}
            T.sync_threads(2, 128)
            T.copy(Acc, F)  # reads the sum back
            T.copy(F, Out)

    return k
'''
    x = tiles(nb=1)[0, 0]
    with pytest.raises(HazardError, match="only a T.tma_store_wait\\(n, read=False\\)"):
        run(src.format(wait="T.tma_store_wait(0)"), [x, np.ones((64, 32), np.float32), None])
    got, _ = run(src.format(wait="T.tma_store_wait(0, read=False)"), [x, np.ones((64, 32), np.float32), None])
    np.testing.assert_array_equal(got["Out"], x + 1)


# -- what the model refuses ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, text", [
    ("T.atomic_add(Acc, F, memory_order='release')", UnsupportedConstruct, "memory_order='release'"),
    ("T.atomic_add(Acc, F, memory_order='sideways')", KernelError, "expected one of relaxed"),
    ("T.atomic_add(Acc, F, return_prev=True)", UnsupportedConstruct, "return_prev=True"),
    ("T.atomic_add(Acc, F, annotations={'coalesced_width': 4})", UnsupportedConstruct, "coalesced_width"),
    ("T.atomic_add(Acc, F, use_tma=True)", KernelError, "shared source region"),
    ("T.atomic_add(Acc[0:32, :], F)", KernelError, "has shape (64, 32)"),
    ("T.atomic_add(F, Acc)", UnsupportedConstruct, "into the fragment F"),
])
def test_what_the_model_cannot_honour_is_named(call, error, text):
    src = SUM.format(nb=1, wg0=call, wg1="pass")
    with pytest.raises(error) as e:
        run(src, [tiles(nb=1), np.zeros((64, 32), np.float32)])
    assert text in e.value.report and f"line {line_of(src, call)}" in e.value.report


def test_relaxed_is_the_default_order():
    src = SUM.format(nb=NB, wg0="T.atomic_add(Acc, F, memory_order='relaxed')", wg1=ELEMENT_ATOMIC)
    got, _ = run(src, [tiles(), np.zeros((64, 32), np.float32)])
    np.testing.assert_array_equal(got["Acc"], tiles().sum(axis=(0, 1)))


# -- the cross-CTA record itself -------------------------------------------------------------------------------
class _Agent:
    name = "consumer 0"


class _Tracker:
    context = "test"

    @staticmethod
    def describe_line(line):
        return f"line {line}"


def test_the_cross_cta_verdict_does_not_depend_on_the_order_of_the_blocks():
    from attngen.emulator.memory import Buffer

    kinds = {"read": (False, False), "write": (True, False), "atomic": (True, True)}
    races = {("read", "write"), ("read", "atomic"), ("write", "write"), ("write", "atomic")}
    for a in kinds:
        for b in kinds:
            for first, second in ((a, b), (b, a)):
                buf = Buffer("G", (8, 8), "float32", "global", data=np.zeros((8, 8), np.float32))
                launch = Launch()
                found = False
                try:
                    for n, (kind, rows) in enumerate(((first, slice(0, 4)), (second, slice(3, 8)))):
                        launch.begin(f"block {n}")
                        launch.access(_Tracker, buf, (rows, slice(None)), *kinds[kind], _Agent, kind, n)
                        launch.end()
                except HazardError:
                    found = True
                assert found == ((a, b) in races or (b, a) in races), (first, second)
    # Disjoint elements never race.
    launch = Launch()
    for n, rows in enumerate((slice(0, 3), slice(3, 8))):
        launch.begin(f"block {n}")
        launch.access(_Tracker, buf, (rows, slice(None)), True, False, _Agent, "write", n)
        launch.end()


# -- the order of the blocks ------------------------------------------------------------------------------------
ORDER = SUM.replace("                {wg1}", "                pass")  # one warpgroup per block adds its tile


def test_a_shuffled_block_order_exposes_float_atomics_that_depend_on_it_and_never_changes_a_verdict():
    """float32 atomics from several blocks are not associative: 1e8 + 1 - 1e8 is 0 or 1 by the order
    of the blocks. The driver's grid order always gives one answer; a shuffled order (drawn from the
    seed) shows the others, as the GPU's scheduler may."""
    src = ORDER.format(nb=NB, wg0=TILE_ATOMIC, wg1="pass")
    x = np.zeros((NB, 2, 64, 32), np.float32)
    x[:, 0, 0, 0] = [1e8, 1.0, -1e8]

    def first(order, seed):
        rt = Runtime(src, "<atomics test>", {})
        rt.run([x, np.zeros((64, 32), np.float32)], seed=seed, policy="random", stats=Stats(), block_order=order)
        return float(rt.tensors["Acc"][0, 0])

    assert {first("grid", s) for s in range(8)} == {0.0}  # (1e8 + 1) - 1e8 in float32
    assert {first("shuffled", s) for s in range(8)} == {0.0, 1.0}
    racy = ORDER.format(nb=NB, wg0="T.copy(F, Acc)  # plain store", wg1="pass")
    for seed in range(8):
        with pytest.raises(HazardError, match="a race whatever order the blocks run in"):
            Runtime(racy, "<atomics test>", {}).run([tiles(), np.zeros((64, 32), np.float32)], seed=seed,
                                                  policy="random", stats=Stats(), block_order="shuffled")


def test_a_forward_kernel_gives_the_same_output_in_any_block_order():
    import attngen
    from attngen.emulator import emulate_stats
    from attngen.reference.forward import random_inputs

    spec = attngen.Spec(causal=True, head_dim=64)
    q, k, v = random_inputs(spec.dtype, 64, 1, 2, 2, 300, 200, 0)
    grid, _ = emulate_stats(spec, q, k, v)
    for seed in range(2):
        shuffled, _ = emulate_stats(spec, q, k, v, seed=seed, block_order="shuffled")
        np.testing.assert_array_equal(shuffled, emulate_stats(spec, q, k, v, seed=seed)[0])
    assert np.isfinite(grid).all()
    with pytest.raises(ValueError, match="block_order"):
        emulate_stats(spec, q, k, v, block_order="backwards")


CLI_KERNEL = '''\
import tilelang
import tilelang.language as T


def build_kernel():
    q_len = T.dynamic("q_len")
    kv_len = T.dynamic("kv_len")

    @T.prim_func
    def one_key(Q: T.Tensor([1, q_len, 1, 128], "float16"), K: T.Tensor([1, kv_len, 1, 128], "float16"),
                V: T.Tensor([1, kv_len, 1, 128], "float16"), O: T.Tensor([1, q_len, 1, 128], "float16"),
                softmax_scale: T.float32):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_shared([32, 128], "float16")
            F = T.alloc_fragment([64, 128], "float")
            G = T.alloc_fragment([32, 128], "float")
            T.fill(F, 0)
            T.copy(F, O[0, 0:64, 0, :])
            for i, d in T.Parallel(32, 128):
                T.atomic_add(O[0, i, 0, d], V[0, 0, 0, d])  # one key: every row's output is v[0]
            for i, d in T.Parallel(32, 128):
                G[i, d] = V[0, 0, 0, d]
            T.copy(G, S)
            T.fence_proxy_async()
            T.sync_threads(1, 128)
            T.atomic_add(O[0, 32:64, 0, :], S, use_tma=True)

    return one_key
'''


def test_the_cli_prints_atomics_and_reduce_adds(tmp_path, capsys):
    import argparse

    from attngen.cli.emulate import command

    spec_path, source = tmp_path / "spec.toml", tmp_path / "one_key.py"
    spec_path.write_text("head_dim = 128\n")
    source.write_text(CLI_KERNEL)
    args = argparse.Namespace(spec=str(spec_path), batch=1, heads=None, kv_heads=1, q_len=64, kv_len=1, seed=0,
                              policy="random", source=str(source))
    assert command(args) == 0
    out = capsys.readouterr().out
    assert "1 atomics, 1 TMA reduce-adds" in out and "PASS" in out, out
    source.write_text(CLI_KERNEL.replace("T.atomic_add(O[0, i, 0, d], V[0, 0, 0, d])", "pass"))
    assert command(args) == 1  # rows 0..31 stay 0: the check sees the atomics' values
    assert "1 TMA reduce-adds" in capsys.readouterr().out
