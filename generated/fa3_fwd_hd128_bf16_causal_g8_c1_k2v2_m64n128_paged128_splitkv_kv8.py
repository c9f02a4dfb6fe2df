# ==============================================================================
# attngen auto-generated kernel: do not edit; regenerate with `attngen generate`.
# kernel:    fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8
# spec hash: c1b768246332
# generator: attngen 0.1.0, template fa3_fwd.py.j2
# shape:     dynamic: batch, q_len, kv_heads, num_pages, max_pages, num_splits are runtime values
# schedule:  1 TMA producer warpgroup + 1 consumer warpgroup(s), 256 threads, setmaxnreg 56/240
# smem:      180224 bytes dynamic (Q 16384, K 65536, V 65536, K8 16384, V8 16384)
# tensors:   k_descale [num_pages, kv_heads], v_descale [num_pages, kv_heads] (float32, passed by name at call time)
# spec:
#   head_dim = 128
#   dtype = "bfloat16"
#   causal = true
#   gqa_group = 8
#   consumers = 1
#   k_stages = 2
#   v_stages = 2
#   block_m = 64
#   block_n = 128
#   pingpong = false
#   aligned = false
#   paged_kv = true
#   page_size = 128
#   splits = "auto"
#   kv_dtype = "float8_e4m3fn"
# ==============================================================================
import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

KERNEL_NAME = "fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8"
SPEC_HASH = "c1b768246332"

HEAD_DIM = 128
DTYPE = "bfloat16"
ACCUM = "float"
GQA_GROUP = 8  # query heads per KV head
BLOCK_M = 64  # query rows per block: 1 consumer warpgroup(s) x 64
BLOCK_N = 128  # keys per K/V tile
WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile)
K_STAGES = 2
V_STAGES = 2
LOG2E = 1.44269504  # the softmax runs in base 2; the scale is the run-time argument softmax_scale
LN2 = 0.6931471805599453  # the LSE is returned in natural log
PAGE_SIZE = 128  # keys per page of the K/V cache
TILES_PER_PAGE = 1  # a K/V tile is one TMA box inside one page
THREADS = 256
CONSUMER_THREADS = 128  # threads [0, 128) are consumers, the rest the producer
TMA_THREAD_END = 160  # one producer warp issues all TMA copies
PRODUCER_REGS = 56  # setmaxnreg: the producer gives registers away...
CONSUMER_REGS = 240  # ...and each consumer takes them
TMA_ARRIVALS = 32  # arrivals that complete a "full" barrier (the TMA warp)
RELEASE_ARRIVALS = CONSUMER_THREADS  # arrivals that complete an "empty" barrier (every consumer thread)
WARPGROUP_THREADS = 128
EPILOGUE_BAR = 1  # named barrier of consumer g's epilogue: EPILOGUE_BAR + g (after the ping-pong ids)
KV_DTYPE = "float8_e4m3fn"  # the cache's K and V; the producer warpgroup dequantizes each tile into DTYPE
DEQUANT_ARRIVALS = WARPGROUP_THREADS  # arrivals that complete a K/V "full" barrier: every producer thread converts
DEQUANT_BAR = 2  # named barrier: the producer warpgroup has read the e4m3 staging tiles
POLICY = T.GemmWarpPolicy.FullRow

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # barriers are explicit below
    # TileLang 0.1.15 gave the producer-only staging tiles the consumers' Q_shared (live in both
    # roles at once): no reuse, every buffer its own bytes
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
}
COMPILE_FLAGS = [  # nvcc flags for the lowered CUDA (attngen build and the GPU runtime use these)
    "-O3",
    "--use_fast_math",
    "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-DNDEBUG",
]


def build_kernel():
    """Return the TileLang prim_func. Shapes not fixed below are runtime values."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_heads = T.dynamic("kv_heads")
    num_pages = T.dynamic("num_pages")
    max_pages = T.dynamic("max_pages")
    num_splits = T.dynamic("num_splits")
    heads = kv_heads * GQA_GROUP

    @T.macro
    def consumer(g, wait_bar, signal_bar, Q_shared, K_shared, V_shared, O_partial, k_full, k_empty, v_full, v_empty, q0, n_tiles, head, batch_idx, K_descale, V_descale, LSE_partial, first_tile, Q, q_len, kv_len, causal_offset, split_idx, softmax_scale):
        """One consumer warpgroup: rows [q0 + 64 g, q0 + 64 g + 64) of one head."""
        T.set_max_nreg(CONSUMER_REGS, 1)
        row0 = g * WG_ROWS
        acc_s = T.alloc_fragment([WG_ROWS, BLOCK_N], ACCUM)  # scores S = Q K^T, then P = exp2(...)
        p_reg = T.alloc_fragment([WG_ROWS, BLOCK_N], DTYPE)  # P in registers: the A operand of PV
        acc_o = T.alloc_fragment([WG_ROWS, HEAD_DIM], ACCUM)
        m_cur = T.alloc_fragment([WG_ROWS], ACCUM)  # running row max
        m_prev = T.alloc_fragment([WG_ROWS], ACCUM)
        alpha = T.alloc_fragment([WG_ROWS], ACCUM)  # exp2(m_prev - m_cur): rescales acc_o and row_sum
        row_sum_tile = T.alloc_fragment([WG_ROWS], ACCUM)
        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)
        scale_log2 = softmax_scale * LOG2E  # the softmax runs in base 2: exp2(s * scale_log2) = exp(s * softmax_scale)

        T.fill(acc_o, 0)
        T.fill(alpha, 1.0)  # the first carried rescale is a no-op
        T.fill(m_cur, T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0))  # a finite floor, not -inf: a row of -inf scores gets exp2(-inf - m) = 0, not NaN
        for r, d in T.Parallel(WG_ROWS, HEAD_DIM):  # packed GQA: no TMA box holds these rows, so the warpgroup loads them
            Q_shared[g, r, d] = Q[batch_idx, T.min((q0 + row0 + r) // GQA_GROUP, q_len - 1), head + (q0 + row0 + r) % GQA_GROUP, d]
        T.fence_proxy_async()  # these stores must be visible to the wgmma's async-proxy reads...
        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and every thread's rows written

        # Prologue, the first visited tile: QK and softmax only; its PV is issued in the next iteration.
        T.mbarrier_wait_parity(k_full[0], 0)
        T.wgmma_gemm(Q_shared[g, :, :], K_shared[0, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
        T.wait_wgmma(0)
        T.mbarrier_arrive(k_empty[0])
        full_tiles = T.floordiv((q0 + row0) // GQA_GROUP + causal_offset + 1, BLOCK_N) - first_tile  # leading K tiles that need no mask for these rows
        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile
            for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                acc_s[i, j] = T.if_then_else((q0 + row0 + i) // GQA_GROUP + causal_offset >= first_tile * BLOCK_N + j, acc_s[i, j], -T.infinity(ACCUM))
        T.reduce_max(acc_s, m_cur, dim=1, clear=False)  # the first tile's max, never below the floor
        for i, j in T.Parallel(WG_ROWS, BLOCK_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's
        T.copy(acc_s, p_reg)

        # Steady state, visit k (K tile first_tile + k): QK(k), rescale, PV(k-1), softmax(k).
        for k in T.serial(1, n_tiles):
            k_stage = k % K_STAGES
            v_stage_prev = (k - 1) % V_STAGES
            T.mbarrier_wait_parity(k_full[k_stage], (k // K_STAGES) % 2)
            T.wgmma_gemm(Q_shared[g, :, :], K_shared[k_stage, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
            for i, j in T.Parallel(WG_ROWS, HEAD_DIM):  # rescale by the carried alpha while QK runs
                acc_o[i, j] *= alpha[i]
            T.mbarrier_wait_parity(v_full[v_stage_prev], ((k - 1) // V_STAGES) % 2)
            T.wgmma_gemm(p_reg, V_shared[v_stage_prev, :, :], acc_o, policy=POLICY, clear_accum=False)  # delayed PV of tile k-1
            T.wait_wgmma(1)  # QK(k) done; PV(k-1) may still run under the softmax below
            T.mbarrier_arrive(k_empty[k_stage])
            if k >= full_tiles:  # a diagonal or partial tile: masked
                for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                    acc_s[i, j] = T.if_then_else((q0 + row0 + i) // GQA_GROUP + causal_offset >= (first_tile + k) * BLOCK_N + j, acc_s[i, j], -T.infinity(ACCUM))
            T.copy(m_cur, m_prev)
            T.reduce_max(acc_s, m_cur, dim=1, clear=False)
            for i in T.Parallel(WG_ROWS):
                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_cur[i] * scale_log2)
            for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
            T.reduce_sum(acc_s, row_sum_tile, dim=1)
            T.wait_wgmma(0)  # PV(k-1) done: p_reg and V stage may be reused
            T.mbarrier_arrive(v_empty[v_stage_prev])
            for i in T.Parallel(WG_ROWS):
                row_sum[i] = row_sum[i] * alpha[i] + row_sum_tile[i]
            T.copy(acc_s, p_reg)

        # Epilogue: the last PV, normalise, store this split's float32 O and LSE (this block's rows only).
        v_stage_last = (n_tiles - 1) % V_STAGES
        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
            acc_o[i, j] *= alpha[i]
        T.mbarrier_wait_parity(v_full[v_stage_last], ((n_tiles - 1) // V_STAGES) % 2)
        T.wgmma_gemm(p_reg, V_shared[v_stage_last, :, :], acc_o, policy=POLICY, clear_accum=False)
        T.wait_wgmma(0)
        T.mbarrier_arrive(v_empty[v_stage_last])
        for i in T.Parallel(WG_ROWS):  # row_sum_tile is free now: it holds the LSE on its way out
            row_sum_tile[i] = T.if_then_else(row_sum[i] == 0, -T.infinity(ACCUM), (m_cur[i] * scale_log2 + T.log2(row_sum[i])) * LN2)
        for i in T.Parallel(WG_ROWS):
            if (q0 + row0 + i) // GQA_GROUP < q_len:  # only this block's rows of this sequence
                LSE_partial[split_idx, batch_idx, (head + (q0 + row0 + i) % GQA_GROUP), (q0 + row0 + i) // GQA_GROUP] = row_sum_tile[i]
        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
            acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0
        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
            if (q0 + row0 + i) // GQA_GROUP < q_len:  # float32, straight from registers: the combine kernel merges the splits
                O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, (head + (q0 + row0 + i) % GQA_GROUP), j] = acc_o[i, j]

    @T.prim_func
    def fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8(
        Q: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        K: T.Tensor([num_pages, PAGE_SIZE, kv_heads, HEAD_DIM], KV_DTYPE),
        V: T.Tensor([num_pages, PAGE_SIZE, kv_heads, HEAD_DIM], KV_DTYPE),
        O_partial: T.Tensor([num_splits, batch, q_len, heads, HEAD_DIM], "float32"),  # output: each split's normalised partial O (the combine kernel merges them)
        LSE_partial: T.Tensor([num_splits, batch, heads, q_len], "float32"),  # output: each split's log-sum-exp per row, natural log (-inf: no key)
        K_descale: T.Tensor([num_pages, kv_heads], "float32"),  # call time: k_descale
        V_descale: T.Tensor([num_pages, kv_heads], "float32"),  # call time: v_descale
        block_table: T.Tensor([batch, max_pages], "int32"),  # sequence b's key t lives in page block_table[b, t // PAGE_SIZE]
        seqused_k: T.Tensor([batch], "int32"),  # keys of sequence b
        softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))
    ):
        with T.Kernel(T.ceildiv(q_len * GQA_GROUP, BLOCK_M), kv_heads, batch * num_splits, threads=THREADS) as (q_block, kv_head, batch_split):
            Q_shared = T.alloc_shared([1, WG_ROWS, HEAD_DIM], DTYPE)  # one slice per consumer: wgmma A must start at offset 0
            K_shared = T.alloc_shared([K_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            V_shared = T.alloc_shared([V_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            K8_shared = T.alloc_shared([BLOCK_N, HEAD_DIM], KV_DTYPE)  # the cache's e4m3 tiles, as TMA lands them
            V8_shared = T.alloc_shared([BLOCK_N, HEAD_DIM], KV_DTYPE)
            T.annotate_layout({Q_shared: make_swizzled_layout(Q_shared), K_shared: make_swizzled_layout(K_shared), V_shared: make_swizzled_layout(V_shared)})

            kv8_full = T.alloc_barrier([TMA_ARRIVALS])  # the e4m3 staging tiles landed
            k_full = T.alloc_barrier([DEQUANT_ARRIVALS] * K_STAGES)
            k_empty = T.alloc_barrier([RELEASE_ARRIVALS] * K_STAGES)
            v_full = T.alloc_barrier([DEQUANT_ARRIVALS] * V_STAGES)
            v_empty = T.alloc_barrier([RELEASE_ARRIVALS] * V_STAGES)

            head = kv_head * GQA_GROUP  # packed GQA: row r is query r // GQA_GROUP of head head + r % GQA_GROUP
            batch_idx = T.truncdiv(batch_split, num_splits)  # truncdiv: both >= 0, no floor fix-up code
            split_idx = T.truncmod(batch_split, num_splits)  # which share of the K tiles this block visits
            kv_len = seqused_k[batch_idx]
            last_page = T.max(T.ceildiv(kv_len, PAGE_SIZE) - 1, 0)  # tiles past the sequence (masked) reread its last page
            causal_offset = kv_len - q_len  # bottom-right alignment, per sequence
            q0 = q_block * BLOCK_M
            n_block_tiles = T.max(T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv((q0 + BLOCK_M - 1) // GQA_GROUP + 1 + causal_offset, BLOCK_N)), 1)  # >= 1: a block of rows that see no key still runs (fully masked) tile 0
            tiles_per_split = T.ceildiv(n_block_tiles, num_splits)
            first_tile = split_idx * tiles_per_split  # this split's first K tile
            n_tiles = T.max(T.min(n_block_tiles - first_tile, tiles_per_split), 1)  # >= 1: an empty split runs one fully masked tile
            tx = T.get_thread_binding()

            # Producer warpgroup: gives its registers away; one warp loads Q once, then K and V per tile.
            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(PRODUCER_REGS, 0)
            if tx >= CONSUMER_THREADS:  # fp8 cache: the TMA warp lands e4m3 tiles, the whole warpgroup dequantizes them
                for k in T.serial(n_tiles):
                    k_stage = k % K_STAGES
                    page = block_table[batch_idx, T.min((first_tile + k) // TILES_PER_PAGE, last_page)]  # the page holding this tile
                    page_row = (first_tile + k) % TILES_PER_PAGE * BLOCK_N
                    if tx < TMA_THREAD_END:  # DEQUANT_BAR of the previous tile: every thread has read the staging
                        T.tma_copy(K[page, page_row:page_row + BLOCK_N, kv_head, :], K8_shared, barrier=kv8_full)
                        T.tma_copy(V[page, page_row:page_row + BLOCK_N, kv_head, :], V8_shared, barrier=kv8_full)
                        T.mbarrier_arrive(kv8_full)
                    k_scale = K_descale[page, kv_head]  # the tile lies in one page: one scale each
                    v_scale = V_descale[page, kv_head]
                    T.mbarrier_wait_parity(kv8_full, (k // 1) % 2)
                    T.mbarrier_wait_parity(k_empty[k_stage], ((k // K_STAGES) % 2) ^ 1)
                    for i, d in T.Parallel(BLOCK_N, HEAD_DIM):  # float32 product, rounded once to DTYPE: the GEMM's input
                        K_shared[k_stage, i, d] = K8_shared[i, d] * k_scale
                    T.fence_proxy_async()  # generic stores, read next by the consumers' wgmma (async proxy)
                    T.mbarrier_arrive(k_full[k_stage])
                    v_stage = k % V_STAGES
                    T.mbarrier_wait_parity(v_empty[v_stage], ((k // V_STAGES) % 2) ^ 1)
                    for i, d in T.Parallel(BLOCK_N, HEAD_DIM):
                        V_shared[v_stage, i, d] = V8_shared[i, d] * v_scale
                    T.fence_proxy_async()
                    T.mbarrier_arrive(v_full[v_stage])
                    T.sync_threads(DEQUANT_BAR, WARPGROUP_THREADS)  # the staging is read: the next tile's TMA may land

            # Consumer warpgroups: one body, instantiated per warpgroup.
            with T.ws(0):
                consumer(0, 0, 0, Q_shared, K_shared, V_shared, O_partial, k_full, k_empty, v_full, v_empty, q0, n_tiles, head, batch_idx, K_descale, V_descale, LSE_partial, first_tile, Q, q_len, kv_len, causal_offset, split_idx, softmax_scale)

    return fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8


COMBINE_ROWS = 64  # rows of one head per combine block
COMBINE_THREADS = 128


def build_combine_kernel():
    """Return the prim_func that merges the splits: O = sum_s w_s O_s / sum_s w_s, w_s = exp(LSE_s - max LSE)."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_heads = T.dynamic("kv_heads")
    num_splits = T.dynamic("num_splits")
    heads = kv_heads * GQA_GROUP

    @T.prim_func
    def fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8_combine(
        O_partial: T.Tensor([num_splits, batch, q_len, heads, HEAD_DIM], "float32"),
        LSE_partial: T.Tensor([num_splits, batch, heads, q_len], "float32"),
        O: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
    ):
        with T.Kernel(T.ceildiv(q_len, COMBINE_ROWS), heads, batch, threads=COMBINE_THREADS) as (row_block, head, batch_idx):
            lse_max = T.alloc_fragment([COMBINE_ROWS], ACCUM)
            weight = T.alloc_fragment([COMBINE_ROWS], ACCUM)
            weight_sum = T.alloc_fragment([COMBINE_ROWS], ACCUM)
            acc_o = T.alloc_fragment([COMBINE_ROWS, HEAD_DIM], ACCUM)
            r0 = row_block * COMBINE_ROWS
            T.fill(lse_max, -T.infinity(ACCUM))
            T.fill(weight_sum, 0)
            T.fill(acc_o, 0)
            for s in T.serial(num_splits):
                for i in T.Parallel(COMBINE_ROWS):
                    lse_max[i] = T.max(lse_max[i], LSE_partial[s, batch_idx, head, T.min(r0 + i, q_len - 1)])
            for s in T.serial(num_splits):
                for i in T.Parallel(COMBINE_ROWS):  # a split that saw no key has LSE -inf: weight 0
                    weight[i] = T.if_then_else(lse_max[i] == -T.infinity(ACCUM), 0.0, T.exp2((LSE_partial[s, batch_idx, head, T.min(r0 + i, q_len - 1)] - lse_max[i]) * LOG2E))
                    weight_sum[i] += weight[i]
                for i, j in T.Parallel(COMBINE_ROWS, HEAD_DIM):
                    acc_o[i, j] += weight[i] * O_partial[s, batch_idx, T.min(r0 + i, q_len - 1), head, j]
            for i, j in T.Parallel(COMBINE_ROWS, HEAD_DIM):
                if r0 + i < q_len:
                    O[batch_idx, r0 + i, head, j] = T.if_then_else(weight_sum[i] == 0, 0, acc_o[i, j] / weight_sum[i])  # a row that sees no key gives 0

    return fa3_fwd_hd128_bf16_causal_g8_c1_k2v2_m64n128_paged128_splitkv_kv8_combine

