"""The emulator mechanics that serving kernels need (issue 11, notes: serving ABI).

Hand-written kernels in the emitted style exercise each mechanism: int32 tensors and a
T.int32 scalar as indices, varlen and paged TMA loads, predicated element stores and loads
inside T.Parallel, element-wise global loads into shared memory, the per-CTA ownership rule,
and a second entry (a split-KV combine) fed by the first kernel's outputs. Each checker is
also shown catching a deliberately broken kernel.
"""

import re

import numpy as np
import pytest

from attngen.emulator import HazardError, KernelError, UnsupportedConstruct
from attngen.emulator.driver import Runtime, ServingLayout, Stats, combine_ownership, ownership
from attngen.reference.forward import round_to

HEADER = '''\
import tilelang
import tilelang.language as T

'''


def run(source, dims, inputs, *, entry="build_kernel", owner=None, policy="random", seed=0, proxy_fences=True,
        runtime=None):
    rt = runtime or Runtime(HEADER + source, "<serving test>", dims)
    out = rt.run(inputs, seed=seed, policy=policy, stats=Stats(), proxy_fences=proxy_fences, entry=entry, owner=owner)
    return out, rt


def line_of(source, text):
    lines = (HEADER + source).splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def f16(rng, *shape):
    return round_to(rng.standard_normal(shape), "float16")


# -- varlen: int32 cu_seqlens, a T.int32 scalar, predicated stores, ownership ----------------------
VARLEN = '''\
BLOCK_M = 64
HEAD_DIM = 16


def build_kernel():
    total_q = T.dynamic("total_q")
    batch = T.dynamic("batch")
    heads = T.dynamic("heads")

    @T.prim_func
    def varlen_copy(
        Q: T.Tensor([total_q, heads, HEAD_DIM], "float16"),
        O: T.Tensor([total_q, heads, HEAD_DIM], "float16"),
        LSE: T.Tensor([heads, total_q], "float32"),
        cu_seqlens_q: T.Tensor([batch + 1], "int32"),
        max_seqlen_q: T.int32,
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q, BLOCK_M), heads, batch, threads=256) as (q_block, head, batch_idx):
            Q_shared = T.alloc_shared([BLOCK_M, HEAD_DIM], "float16")
            q_full = T.alloc_barrier([32])
            acc = T.alloc_fragment([BLOCK_M, HEAD_DIM], "float")
            rows = T.alloc_fragment([BLOCK_M], "float")
            q_start = cu_seqlens_q[batch_idx]
            q_len = cu_seqlens_q[batch_idx + 1] - q_start
            q0 = q_block * BLOCK_M
            tx = T.get_thread_binding()
            if tx >= 128 and tx < 160:
                T.tma_copy(Q[q_start + q0:q_start + q0 + BLOCK_M, head, :], Q_shared, barrier=q_full)
                T.mbarrier_arrive(q_full)
            with T.ws(0):
                T.mbarrier_wait_parity(q_full, 0)
                for i, j in T.Parallel(BLOCK_M, HEAD_DIM):
                    acc[i, j] = Q_shared[i, j]
                for i in T.Parallel(BLOCK_M):
                    rows[i] = T.Cast("float32", q_start + q0 + i)
                {store}

    return varlen_copy
'''
STORE_ROWS = '''for i, j in T.Parallel(BLOCK_M, HEAD_DIM):
                    if q0 + i < q_len:
                        O[q_start + q0 + i, head, j] = acc[i, j]
                for i in T.Parallel(BLOCK_M):
                    if q0 + i < q_len:
                        LSE[head, q_start + q0 + i] = rows[i]'''
CU = np.array([0, 10, 75, 90], np.int32)  # sequences of 10, 65 and 15 rows; rows 90..95 belong to none
VARLEN_DIMS = {"total_q": 96, "batch": 3, "heads": 2}
VARLEN_FACTS = ServingLayout(layout="varlen", block_m=64)


def run_varlen(store=STORE_ROWS, owner=True, cu=CU, **kw):
    q = f16(np.random.default_rng(0), 96, 2, 16)
    rule = ownership(VARLEN_FACTS, VARLEN_DIMS, {"cu_seqlens_q": cu}) if owner else None
    max_seqlen = int(np.diff(cu).max())
    (o, lse), rt = run(VARLEN.replace("{store}", store), VARLEN_DIMS, [q, None, None, cu, max_seqlen], owner=rule, **kw)
    return q, o, lse, rt


def test_varlen_rows_are_written_by_their_own_blocks_and_the_rest_stays_poisoned():
    q, o, lse, rt = run_varlen()
    np.testing.assert_array_equal(o[:90], q[:90])  # int32 reads as TMA coordinates and store indices
    np.testing.assert_array_equal(lse[:, :90], np.broadcast_to(np.arange(90, dtype=np.float32), (2, 90)))
    assert np.isnan(o[90:]).all() and np.isnan(lse[:, 90:]).all()  # rows of no sequence: untouched
    assert set(rt.tensors) == {"Q", "O", "LSE", "cu_seqlens_q"} and rt.tensors["O"] is o
    assert rt.tensors["cu_seqlens_q"].dtype == np.int32


def test_a_dropped_predicate_writes_the_next_sequence_and_the_ownership_rule_reports_it():
    dropped = STORE_ROWS.replace("if q0 + i < q_len:", "if True:")
    with pytest.raises(KernelError) as e:
        run_varlen(dropped)
    report = e.value.report
    assert "block (x=0, y=0, z=0) writes O[10, 0, 0], which it does not own" in report
    assert "it owns O[0:10, 0, :]" in report
    assert f"line {line_of(VARLEN.replace('{store}', dropped), 'O[q_start + q0 + i, head, j] = acc')}" in report


@pytest.mark.parametrize("store, buffer", [
    ("T.copy(Q_shared, O[q_start + q0:q_start + q0 + BLOCK_M, head, :])", "O"),  # a TMA store T.copy waits for
    ("T.tma_copy(Q_shared, O[q_start + q0:q_start + q0 + BLOCK_M, head, :])\n                T.tma_store_wait(0)", "O"),
    ("T.copy(rows, LSE[head, q_start + q0:q_start + q0 + BLOCK_M])", "LSE"),  # fragment -> global
])
def test_a_whole_tile_store_of_a_short_sequence_is_reported(store, buffer):
    """64 rows stored where only 10 belong to the block (sequence 0)."""
    with pytest.raises(KernelError) as e:
        run_varlen(store)
    report = e.value.report
    element = "O[10, 0, 0]" if buffer == "O" else "LSE[0, 10]"
    assert f"block (x=0, y=0, z=0) writes {element}, which it does not own" in report, report
    assert f"{864 if buffer == 'O' else 54} such element(s)" in report
    assert ("it owns O[0:10, 0, :]" if buffer == "O" else "it owns LSE[0, 0:10]") in report
    assert f"line {line_of(VARLEN.replace('{store}', store), store.splitlines()[0])}" in report


def test_the_tile_store_is_fine_when_every_row_of_the_tile_is_the_blocks():
    cu = np.array([0, 64, 128], np.int32)
    q = f16(np.random.default_rng(1), 128, 2, 16)
    dims = {"total_q": 128, "batch": 2, "heads": 2}
    rule = ownership(VARLEN_FACTS, dims, {"cu_seqlens_q": cu})
    src = VARLEN.replace("{store}", "T.copy(Q_shared, O[q_start + q0:q_start + q0 + BLOCK_M, head, :])")
    (o, lse), _ = run(src, dims, [q, None, None, cu, 64], owner=rule)
    np.testing.assert_array_equal(o, q)
    assert np.isnan(lse).all()


def test_scalar_and_int32_parameters_are_checked():
    q = f16(np.random.default_rng(0), 96, 2, 16)
    src = VARLEN.replace("{store}", STORE_ROWS)
    with pytest.raises(KernelError, match=r"scalar max_seqlen_q \(int32\) needs an int, got float"):
        run(src, VARLEN_DIMS, [q, None, None, CU, 65.0])
    with pytest.raises(KernelError, match="cu_seqlens_q is an int32 tensor: it needs integers"):
        run(src, VARLEN_DIMS, [q, None, None, CU.astype(np.float32), 65])
    with pytest.raises(KernelError, match="declared"):
        run(src, VARLEN_DIMS, [q, None, None, CU[:3], 65])


# -- predicates: bounds, nesting, else, what stays unsupported -------------------------------------
MASKED = '''\
def build_kernel():
    n_rows = T.dynamic("n_rows")

    @T.prim_func
    def masked(X: T.Tensor([n_rows, 8], "float32"), O: T.Tensor([n_rows, 8], "float32"), limit: T.int32):
        with T.Kernel(1, threads=128) as bx:
            {body}

    return masked
'''


def run_masked(body, limit, n_rows=20):
    x = np.arange(n_rows * 8, dtype=np.float32).reshape(n_rows, 8)
    out, _ = run(MASKED.replace("{body}", body), {"n_rows": n_rows}, [x, None, limit])
    return x, out


GUARDED = '''for i, j in T.Parallel(32, 8):
                if i < limit:
                    O[i, j] = X[i, j] * 2'''


def test_an_index_out_of_range_is_an_error_only_where_the_predicate_holds():
    x, out = run_masked(GUARDED, limit=20)  # rows 20..31 are out of range, and not selected
    np.testing.assert_array_equal(out, 2 * x)
    x, out = run_masked(GUARDED, limit=5)
    np.testing.assert_array_equal(out[:5], 2 * x[:5])
    assert np.isnan(out[5:]).all()
    with pytest.raises(KernelError, match=re.escape("X axis 0 has extent 20, accessed [0, 21) where the `if` holds")) as e:
        run_masked(GUARDED, limit=21)
    assert f"line {line_of(MASKED.replace('{body}', GUARDED), 'O[i, j] = X[i, j] * 2')}" in e.value.report
    store_only = GUARDED.replace("X[i, j] * 2", "1.0")
    with pytest.raises(KernelError, match=re.escape("O axis 0 has extent 20, accessed [0, 21) where the `if` holds")):
        run_masked(store_only, limit=21)
    # Outside any `if`, every element must be in bounds, as before.
    with pytest.raises(KernelError, match=re.escape("X axis 0 has extent 20, accessed [0, 32)")):
        run_masked("for i, j in T.Parallel(32, 8):\n                O[T.min(i, 19), j] = X[i, j]", limit=0)


def test_nested_ifs_and_their_masks_and_else_takes_the_complement():
    # The outer branch's other side runs first, so an inner side that escaped its mask would overwrite it.
    body = '''for i, j in T.Parallel(8, 8):
                if i >= limit:
                    O[i, j] = X[i, j] * 0 + 3.0
                else:
                    if j >= 6 or i == 0:
                        O[i, j] = 1.0
                    else:
                        O[i, j] = 2.0'''
    _, out = run_masked(body, limit=4, n_rows=8)
    want = np.full((8, 8), 3.0, np.float32)
    want[:4] = 2.0
    want[:4, 6:] = 1.0
    want[0] = 1.0
    np.testing.assert_array_equal(out, want)


HALVES = '''\
def build_kernel():
    @T.prim_func
    def halves(X: T.Tensor([64, 8], "float32"), O: T.Tensor([64, 8], "float32"), limit: T.int32):
        with T.Kernel(1, threads=256) as bx:
            S = T.alloc_shared([64, 8], "float32")
            with T.ws(0):
                for i, j in T.Parallel(64, 8):
                    if i < limit:
                        S[i, j] = X[i, j]
            with T.ws(1):
                for i, j in T.Parallel(64, 8):
                    if i >= {start}:
                        S[i, j] = X[i, j] + 1
            T.sync_threads(1, 256)
            with T.ws(0):
                for i, j in T.Parallel(64, 8):
                    O[i, j] = S[i, j]

    return halves
'''


@pytest.mark.parametrize("policy", ["producer-first", "consumers-first"])
def test_predicated_shared_stores_race_only_on_the_elements_they_write(policy):
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    (out, _) = run(HALVES.replace("{start}", "limit"), {}, [x, None, 40], policy=policy)  # rows [0, 40) and [40, 64)
    np.testing.assert_array_equal(out, x + (np.arange(64) >= 40)[:, None])
    with pytest.raises(HazardError, match=r"writes S\[39, :\]|writes S\[39:64\]|writes S\[0:40\]"):
        run(HALVES.replace("{start}", "limit - 1"), {}, [x, None, 40], policy=policy)  # both write row 39


def test_a_predicate_that_varies_where_the_store_does_not_is_several_writes_to_one_element():
    body = '''for i, j in T.Parallel(8, 8):
                if i < limit:
                    O[0, j] = X[i, j]'''
    with pytest.raises(KernelError, match="several parallel iterations would write the same element"):
        run_masked(body, limit=3, n_rows=8)


def test_if_on_element_values_stays_unsupported_but_on_int32_values_is_modeled():
    with pytest.raises(UnsupportedConstruct, match="T.if_then_else"):
        run_masked("for i, j in T.Parallel(8, 8):\n                if X[i, j] > 3:\n                    O[i, j] = 1.0",
                   limit=0, n_rows=8)
    with pytest.raises(UnsupportedConstruct, match="tile operation inside a per-element `if`"):
        run_masked("for i, j in T.Parallel(8, 8):\n                if i < limit:\n                    T.fill(O, 0)",
                   limit=3, n_rows=8)


# -- paged K/V: a page index read from block_table is a TMA coordinate ----------------------------
PAGED = '''\
PAGE = 16
D = 16


def build_kernel():
    num_pages = T.dynamic("num_pages")
    batch = T.dynamic("batch")
    max_pages = T.dynamic("max_pages")

    @T.prim_func
    def paged(
        K: T.Tensor([num_pages, PAGE, 1, D], "float16"),
        O: T.Tensor([batch, max_pages * PAGE, 1, D], "float16"),
        block_table: T.Tensor([batch, max_pages], "int32"),
        seqused_k: T.Tensor([batch], "int32"),
    ):
        with T.Kernel(1, 1, batch, threads=256) as (bx, kv_head, batch_idx):
            K_shared = T.alloc_shared([2, PAGE, D], "float16")
            k_full = T.alloc_barrier([32] * 2)
            k_empty = T.alloc_barrier([128] * 2)
            kv_len = seqused_k[batch_idx]
            n_tiles = T.ceildiv(kv_len, PAGE)
            last_page = T.max(n_tiles - 1, 0)
            tx = T.get_thread_binding()
            if tx >= 128 and tx < 160:
                for k in T.serial(n_tiles):
                    s = k % 2
                    {acquire}
                    T.tma_copy(K[block_table[batch_idx, T.min(k, last_page)], 0:PAGE, kv_head, :], K_shared[s, :, :], barrier=k_full[s])
                    T.mbarrier_arrive(k_full[s])
            with T.ws(0):
                for k in T.serial(n_tiles):
                    s = k % 2
                    T.mbarrier_wait_parity(k_full[s], (k // 2) % 2)
                    for i, j in T.Parallel(PAGE, D):
                        if k * PAGE + i < kv_len:
                            O[batch_idx, k * PAGE + i, kv_head, j] = K_shared[s, i, j]
                    T.mbarrier_arrive(k_empty[s])

    return paged
'''


def run_paged(acquire="T.mbarrier_wait_parity(k_empty[s], ((k // 2) % 2) ^ 1)", policy="random"):
    rng = np.random.default_rng(2)
    k = f16(rng, 9, 16, 1, 16)
    table = np.array([[7, 2, 5, 0], [1, 8, 3, 3]], np.int32)  # batch 1 uses 2 pages; its tail entries are unused
    seqused = np.array([61, 20], np.int32)
    dims = {"num_pages": 9, "batch": 2, "max_pages": 4}
    out, _ = run(PAGED.replace("{acquire}", acquire), dims, [k, None, table, seqused], policy=policy)
    return k, table, seqused, out


@pytest.mark.parametrize("policy", ["producer-first", "consumers-first"])
def test_paged_loads_follow_the_block_table(policy):
    k, table, seqused, out = run_paged(policy=policy)
    for b in range(2):
        t = np.arange(seqused[b])
        np.testing.assert_array_equal(out[b, t], k[table[b, t // 16], t % 16])
        assert np.isnan(out[b, seqused[b]:]).all()


@pytest.mark.parametrize("policy", ["producer-first", "consumers-first"])
def test_paged_stage_reuse_without_the_empty_wait_is_a_race(policy):
    with pytest.raises(HazardError, match=r"producer \(TMA load\) writes K_shared\[0\]"):
        run_paged(acquire="pass  # no k_empty wait", policy=policy)


# -- pack-GQA: element-wise global loads into shared, fancy-index predicated stores ---------------
PACKED = '''\
G = 2
BLOCK_M = 64
D = 16


def build_kernel():
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * G

    @T.prim_func
    def packed(Q: T.Tensor([batch, q_len, heads, D], "float16"), O: T.Tensor([batch, q_len, heads, D], "float16")):
        with T.Kernel(T.ceildiv(q_len * G, BLOCK_M), kv_heads, batch, threads=256) as (q_block, kv_head, batch_idx):
            Q_shared = T.alloc_shared([BLOCK_M, D], "float16")
            head = kv_head * G
            q0 = q_block * BLOCK_M
            with T.ws(0):
                for r, d in T.Parallel(BLOCK_M, D):
                    Q_shared[r, d] = Q[batch_idx, T.min((q0 + r) // G, q_len - 1), head + (q0 + r) % G, d]
                {signal}
            with T.ws(1):
                {wait}
                for r, d in T.Parallel(BLOCK_M, D):
                    if (q0 + r) // G < q_len:
                        O[batch_idx, (q0 + r) // G, {head}, d] = Q_shared[r, d]

    return packed
'''
PACKED_FACTS = ServingLayout(pack_gqa=True, gqa_group=2, block_m=64)


def run_packed(signal="T.named_barrier_arrive(1, 256)", wait="T.sync_threads(1, 256)", head="head + (q0 + r) % G",
               policy="random", seed=0):
    q = f16(np.random.default_rng(3), 2, 40, 4, 16)
    dims = {"batch": 2, "q_len": 40, "kv_heads": 2, "heads": 4}
    src = PACKED.replace("{signal}", signal).replace("{wait}", wait).replace("{head}", head)
    out, _ = run(src, dims, [q, None], owner=ownership(PACKED_FACTS, dims, {}), policy=policy, seed=seed)
    return q, out


def test_pack_gqa_loads_and_stores_every_row_of_every_head():
    q, out = run_packed()
    np.testing.assert_array_equal(out, q)


def test_pack_gqa_with_the_wrong_head_is_reported_by_the_ownership_rule():
    with pytest.raises(KernelError) as e:
        run_packed(head="(q0 + r) % G")  # the kv head's offset dropped: block y=1 writes heads 0 and 1
    report = e.value.report
    assert "block (x=0, y=1, z=0) writes O[0, 0, 0, 0], which it does not own" in report
    assert "it owns O[0, 0:32, 2:4, :]" in report


@pytest.mark.parametrize("policy", ["producer-first", "consumers-first", "random"])
def test_element_wise_shared_writes_are_race_checked(policy):
    with pytest.raises(HazardError, match=r"reads Q_shared|writes Q_shared"):
        run_packed(signal="pass", wait="pass", policy=policy)


GATHER = '''\
D = 16


def build_kernel():
    q_len = T.dynamic("q_len")

    @T.prim_func
    def gather(Q: T.Tensor([1, q_len, 1, D], "float16"), O: T.Tensor([1, q_len, 1, D], "float16")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_shared([64, D], "float16")
            for r, d in T.Parallel(64, D):
                S[r, d] = Q[0, T.min(r, q_len - 1), 0, d]
            {between}
            T.copy(S, O[0, 0:64, 0, :])

    return gather
'''


@pytest.mark.parametrize("between, ok", [
    ("T.fence_proxy_async()\n            T.sync_threads(1, 128)", True),
    ("T.sync_threads(1, 128)", False),
    ("pass", False),
])
def test_element_wise_global_loads_into_shared_need_the_proxy_fence(between, ok):
    q = f16(np.random.default_rng(4), 1, 64, 1, 16)
    src = GATHER.replace("{between}", between)
    if ok:
        np.testing.assert_array_equal(run(src, {"q_len": 64}, [q, None])[0], q)
        return
    with pytest.raises(HazardError, match=r"\(TMA store\) reads S through the async proxy"):
        run(src, {"q_len": 64}, [q, None])
    np.testing.assert_array_equal(run(src, {"q_len": 64}, [q, None], proxy_fences=False)[0], q)


# -- split-KV: two entries of one module, the second fed by the first ------------------------------
SPLIT = '''\
BLOCK_M = 64
ROWS = 32
D = 16


def build_kernel():
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    heads = T.dynamic("heads")
    num_splits = T.dynamic("num_splits")

    @T.prim_func
    def split_kernel(
        X: T.Tensor([batch, q_len, heads, D], "float16"),
        O_partial: T.Tensor([num_splits, batch, q_len, heads, D], "float32"),
        LSE_partial: T.Tensor([num_splits, batch, heads, q_len], "float32"),
    ):
        with T.Kernel(T.ceildiv(q_len, BLOCK_M), heads, batch * num_splits, threads=128) as (q_block, head, bz):
            batch_idx = bz // num_splits
            split = bz % num_splits
            q0 = q_block * BLOCK_M
            acc_o = T.alloc_fragment([BLOCK_M, D], "float")
            lse = T.alloc_fragment([BLOCK_M], "float")
            for i, j in T.Parallel(BLOCK_M, D):
                acc_o[i, j] = X[batch_idx, T.min(q0 + i, q_len - 1), head, j] * (split + 1)
            for i in T.Parallel(BLOCK_M):
                lse[i] = T.Cast("float32", (q0 + i) % 7) * 0.25 - split
            for i, j in T.Parallel(BLOCK_M, D):
                if q0 + i < q_len:
                    O_partial[{split}, batch_idx, q0 + i, head, j] = acc_o[i, j]
            for i in T.Parallel(BLOCK_M):
                if q0 + i < q_len:
                    LSE_partial[split, batch_idx, head, q0 + i] = lse[i]

    return split_kernel


def build_combine_kernel():
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    heads = T.dynamic("heads")
    num_splits = T.dynamic("num_splits")

    @T.prim_func
    def combine(
        O_partial: T.Tensor([num_splits, batch, q_len, heads, D], "float32"),
        LSE_partial: T.Tensor([num_splits, batch, heads, q_len], "float32"),
        O: T.Tensor([batch, q_len, heads, D], "float16"),
        LSE: T.Tensor([batch, heads, q_len], "float32"),
    ):
        with T.Kernel(T.ceildiv(q_len, ROWS), heads, batch, threads=128) as (r_block, head, batch_idx):
            r0 = r_block * ROWS
            m = T.alloc_fragment([ROWS], "float")
            total = T.alloc_fragment([ROWS], "float")
            acc = T.alloc_fragment([ROWS, D], "float")
            T.fill(m, -T.infinity("float"))
            T.fill(total, 0)
            T.fill(acc, 0)
            for s in T.serial(num_splits):
                for i in T.Parallel(ROWS):
                    if r0 + i < q_len:
                        m[i] = T.max(m[i], LSE_partial[s, batch_idx, head, r0 + i])
            for s in T.serial(num_splits):
                for i, j in T.Parallel(ROWS, D):
                    if r0 + i < q_len:
                        acc[i, j] += T.exp(LSE_partial[s, batch_idx, head, r0 + i] - m[i]) * O_partial[s, batch_idx, r0 + i, head, j]
                for i in T.Parallel(ROWS):
                    if r0 + i < q_len:
                        total[i] += T.exp(LSE_partial[s, batch_idx, head, r0 + i] - m[i])
            for i, j in T.Parallel(ROWS, D):
                if r0 + i < q_len:
                    O[batch_idx, r0 + i, head, j] = acc[i, j] / total[i]
            for i in T.Parallel(ROWS):
                if r0 + i < q_len:
                    LSE[batch_idx, head, r0 + i] = m[i] + T.log(total[i])

    return combine
'''
SPLIT_DIMS = {"batch": 2, "q_len": 100, "heads": 2, "num_splits": 3}


def split_rules():
    return (ownership(ServingLayout(block_m=64, splits=True), SPLIT_DIMS, {}),
            combine_ownership(ServingLayout(), SPLIT_DIMS, 32))


def test_the_combine_kernel_consumes_the_split_kernels_outputs():
    x = f16(np.random.default_rng(5), 2, 100, 2, 16)
    rt = Runtime(HEADER + SPLIT.replace("{split}", "split"), "<split>", SPLIT_DIMS)
    split_rule, combine_rule = split_rules()
    parts, _ = run(None, None, [x, None, None], owner=split_rule, runtime=rt)
    o_part, lse_part = parts
    assert o_part.shape == (3, 2, 100, 2, 16) and np.isfinite(o_part).all() and np.isfinite(lse_part).all()
    (o, lse), _ = run(None, None, [o_part, lse_part, None, None], entry="build_combine_kernel", owner=combine_rule,
                      runtime=rt)
    # What the split kernel wrote, and the combine of it, computed here.
    s = np.arange(3, dtype=np.float64)
    want_lse = np.broadcast_to((np.arange(100) % 7 * 0.25)[None, None, None, :] - s[:, None, None, None], (3, 2, 2, 100))
    np.testing.assert_allclose(lse_part, want_lse, rtol=0, atol=1e-6)  # [split, b, h, row]
    w = np.exp(want_lse - want_lse.max(axis=0))  # [split, b, h, row]
    ref = np.einsum("sbhr,sbrhd->brhd", w, (s[:, None, None, None, None] + 1) * x[None]) / w.sum(axis=0).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(o, round_to(ref, "float16"), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, want_lse.max(axis=0) + np.log(w.sum(axis=0)), rtol=0, atol=1e-5)
    assert set(rt.tensors) == {"O_partial", "LSE_partial", "O", "LSE"} and rt.tensors["O"] is o


def test_a_split_writing_another_splits_partials_is_reported():
    x = f16(np.random.default_rng(5), 2, 100, 2, 16)
    split_rule, _ = split_rules()
    with pytest.raises(KernelError) as e:
        run(SPLIT.replace("{split}", "0"), SPLIT_DIMS, [x, None, None], owner=split_rule)
    report = e.value.report
    assert "block (x=0, y=0, z=1) writes O_partial[0, 0, 0, 0, 0], which it does not own" in report
    assert "it owns O_partial[1, 0, 0:64, 0, :]" in report


def test_an_unknown_entry_is_named():
    with pytest.raises(KernelError, match=r"defines no build_split\(\)"):
        run(SPLIT.replace("{split}", "split"), SPLIT_DIMS, [], entry="build_split")


# -- the ownership rule itself, against the ABI's row mapping written out as loops -----------------
@pytest.mark.parametrize("layout, pack_gqa, splits", [
    ("bshd", False, False), ("bshd", True, True), ("varlen", False, True), ("varlen", True, False),
])
def test_ownership_follows_the_row_mapping(layout, pack_gqa, splits):
    g, bm, heads, n_splits = 2, 8, 4, 2
    cu = np.array([0, 5, 19, 20])
    q_lens = np.diff(cu) if layout == "varlen" else np.array([13, 13, 13])
    starts = cu[:-1] if layout == "varlen" else np.zeros(3, int)
    dims = {"batch": 3, "q_len": 13, "total_q": 20, "heads": heads, "num_splits": n_splits}
    facts = ServingLayout(layout=layout, pack_gqa=pack_gqa, gqa_group=g, block_m=bm, splits=splits)
    rule = ownership(facts, dims, {"cu_seqlens_q": cu})
    o_name, lse_name = ("O_partial", "LSE_partial") if splits else ("O", "LSE")
    rows = int(q_lens.max()) * (g if pack_gqa else 1)
    o_shape = (n_splits,) * splits + ((20, heads, 16) if layout == "varlen" else (3, 13, heads, 16))
    for b in range(3):
        for split in range(n_splits if splits else 1):
            for x in range(-(-rows // bm)):
                for y in range(heads // g if pack_gqa else heads):
                    z = b * n_splits + split if splits else b
                    o = np.broadcast_to(rule((x, y, z), o_name), o_shape)
                    lse = np.asarray(rule((x, y, z), lse_name))
                    want_o, want_lse = set(), set()
                    for r in range(bm):
                        p = x * bm + r
                        qpos, head = (p // g, y * g + p % g) if pack_gqa else (p, y)
                        if qpos >= q_lens[b]:
                            continue
                        pre = (split,) if splits else ()
                        if layout == "varlen":
                            want_o.add(pre + (starts[b] + qpos, head))
                            want_lse.add(pre + (head, starts[b] + qpos))
                        else:
                            want_o.add(pre + (b, qpos, head))
                            want_lse.add(pre + (b, head, qpos))
                    assert {tuple(i[:-1]) for i in np.argwhere(o)} == want_o
                    assert (o.any(axis=-1) == o.all(axis=-1)).all()  # whole rows of the head dim
                    assert {tuple(i) for i in np.argwhere(lse)} == want_lse
    assert not np.asarray(rule((0, 0, 0), "Q")).any()  # an input: nothing to write
