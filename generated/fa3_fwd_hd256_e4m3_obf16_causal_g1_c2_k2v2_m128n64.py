# ==============================================================================
# attngen auto-generated kernel: do not edit; regenerate with `attngen generate`.
# kernel:    fa3_fwd_hd256_e4m3_obf16_causal_g1_c2_k2v2_m128n64
# spec hash: 4268190646bb
# generator: attngen 0.1.0, template fa3_fwd.py.j2
# shape:     dynamic: batch, q_len, kv_len, kv_heads are runtime values
# schedule:  1 TMA producer warpgroup + 2 consumer warpgroup(s), ping-pong, 384 threads, setmaxnreg 40/232
# smem:      204800 bytes dynamic (Q 32768, K 32768, V 32768, O 65536, Vt 32768, P 8192)
# tensors:   q_descale [batch, kv_heads], k_descale [batch, kv_heads], v_descale [batch, kv_heads] (float32, passed by name at call time)
# spec:
#   head_dim = 256
#   dtype = "float8_e4m3fn"
#   out_dtype = "bfloat16"
#   causal = true
#   gqa_group = 1
#   consumers = 2
#   k_stages = 2
#   v_stages = 2
#   block_m = 128
#   block_n = 64
#   pingpong = true
#   aligned = false
# ==============================================================================
import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

KERNEL_NAME = "fa3_fwd_hd256_e4m3_obf16_causal_g1_c2_k2v2_m128n64"
SPEC_HASH = "4268190646bb"

HEAD_DIM = 256
DTYPE = "float8_e4m3fn"
ACCUM = "float"
GQA_GROUP = 1  # query heads per KV head
BLOCK_M = 128  # query rows per block: 2 consumer warpgroup(s) x 64
BLOCK_N = 64  # keys per K/V tile
WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile)
K_STAGES = 2
V_STAGES = 2
LOG2E = 1.44269504  # the softmax runs in base 2; the scale is the run-time argument softmax_scale
OUT_DTYPE = "bfloat16"  # O: an fp8 kernel writes 16 bits
TRANSPOSE_KEYS = 8  # keys of V the producer transposes at a time (its registers: docs/fp8.md)
MAX_OFFSET = 8.0  # P = exp2(s - m + MAX_OFFSET): e4m3's range, not [0, 1] (FA3's Max_offset)
THREADS = 384
CONSUMER_THREADS = 256  # threads [0, 256) are consumers, the rest the producer
TMA_THREAD_END = 288  # one producer warp issues all TMA copies
PRODUCER_REGS = 40  # setmaxnreg: the producer gives registers away...
CONSUMER_REGS = 232  # ...and each consumer takes them
TMA_ARRIVALS = 32  # arrivals that complete a "full" barrier (the TMA warp)
RELEASE_ARRIVALS = CONSUMER_THREADS  # arrivals that complete an "empty" barrier (every consumer thread)
PINGPONG_THREADS = 256  # a ping-pong barrier joins two warpgroups
WARPGROUP_THREADS = 128
EPILOGUE_BAR = 3  # named barrier of consumer g's epilogue: EPILOGUE_BAR + g (after the ping-pong ids)
POLICY = T.GemmWarpPolicy.FullRow

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # barriers are explicit below
    # The producer alone touches V_shared, so TileLang would reuse its bytes for P_shared or O_shared,
    # which the consumers write while the next tiles land there: every buffer keeps its own bytes.
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
    kv_len = T.dynamic("kv_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * GQA_GROUP
    causal_offset = kv_len - q_len  # bottom-right alignment: row i sees keys j <= i + causal_offset

    @T.macro
    def consumer(g, wait_bar, signal_bar, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, q0, n_tiles, head, batch_idx, P_shared, Vt_shared, vt_full, vt_empty, Q_descale, K_descale, V_descale, softmax_scale):
        """One consumer warpgroup: rows [q0 + 64 g, q0 + 64 g + 64) of one head."""
        T.set_max_nreg(CONSUMER_REGS, 1)
        row0 = g * WG_ROWS
        acc_s = T.alloc_fragment([WG_ROWS, BLOCK_N], ACCUM)  # scores S = Q K^T, then P = exp2(...)
        acc_o = T.alloc_fragment([WG_ROWS, HEAD_DIM], ACCUM)
        m_cur = T.alloc_fragment([WG_ROWS], ACCUM)  # running row max
        m_prev = T.alloc_fragment([WG_ROWS], ACCUM)
        alpha = T.alloc_fragment([WG_ROWS], ACCUM)  # exp2(m_prev - m_cur): rescales acc_o and row_sum
        row_sum_tile = T.alloc_fragment([WG_ROWS], ACCUM)
        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)
        kv_head = head // GQA_GROUP  # a query head takes its KV head's descales
        qk_scale = softmax_scale * Q_descale[batch_idx, kv_head] * K_descale[batch_idx, kv_head]  # q, k descales fold into the scale
        v_descale = V_descale[batch_idx, kv_head]  # applied with the row sum's division
        scale_log2 = qk_scale * LOG2E  # the softmax runs in base 2: exp2(s * scale_log2) = exp(s * softmax_scale)

        T.fill(acc_o, 0)
        T.fill(alpha, 1.0)  # the first carried rescale is a no-op
        T.fill(m_cur, T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0))  # a finite floor, not -inf: a row of -inf scores gets exp2(-inf - m) = 0, not NaN
        T.mbarrier_wait_parity(q_full, 0)
        if g == 1:
            T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # prime the ring: warpgroup 0 issues first

        # Prologue, tile 0: QK and softmax only; its PV is issued in the next iteration.
        T.sync_threads(wait_bar, PINGPONG_THREADS)
        T.mbarrier_wait_parity(k_full[0], 0)
        T.wgmma_gemm(Q_shared[g, :, :], K_shared[0, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
        T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)
        T.wait_wgmma(0)
        T.mbarrier_arrive(k_empty[0])
        full_tiles = T.floordiv(q0 + row0 + causal_offset + 1, BLOCK_N)  # leading K tiles that need no mask for these rows
        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile
            diag0 = q0 + row0 + causal_offset  # row i of tile 0 sees keys j <= i + diag0
            for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                acc_s[i, j] = T.if_then_else(i + diag0 >= j, acc_s[i, j], -T.infinity(ACCUM))
        T.reduce_max(acc_s, m_cur, dim=1, clear=False)  # the first tile's max, never below the floor
        for i, j in T.Parallel(WG_ROWS, BLOCK_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2 + MAX_OFFSET)
        T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's
        T.copy(acc_s, P_shared[g, :, :])  # P rounded to e4m3 (its row sum is the unrounded one): PV's A operand
        T.fence_proxy_async()  # these stores must be visible to the next PV's async-proxy reads...
        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and every thread's P written

        # Steady state, tile k: QK(k), rescale, PV(k-1), softmax(k).
        for k in T.serial(1, n_tiles):
            k_stage = k % K_STAGES
            v_stage_prev = (k - 1) % V_STAGES
            T.sync_threads(wait_bar, PINGPONG_THREADS)  # ping-pong: my turn on the tensor cores
            T.mbarrier_wait_parity(k_full[k_stage], (k // K_STAGES) % 2)
            T.wgmma_gemm(Q_shared[g, :, :], K_shared[k_stage, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
            for i, j in T.Parallel(WG_ROWS, HEAD_DIM):  # rescale by the carried alpha while QK runs
                acc_o[i, j] *= alpha[i]
            T.mbarrier_wait_parity(vt_full[v_stage_prev], ((k - 1) // V_STAGES) % 2)  # V^T of that tile is in shared memory
            T.wgmma_gemm(P_shared[g, :, :], Vt_shared[v_stage_prev, :, :], acc_o, transpose_B=True, policy=POLICY, clear_accum=False)  # delayed PV of tile k-1
            T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # next warpgroup may issue
            T.wait_wgmma(1)  # QK(k) done; PV(k-1) may still run under the softmax below
            T.mbarrier_arrive(k_empty[k_stage])
            if k >= full_tiles:  # a diagonal or partial tile: masked
                diag = q0 + row0 + causal_offset - k * BLOCK_N  # row i of tile k sees keys j <= i + diag
                for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                    acc_s[i, j] = T.if_then_else(i + diag >= j, acc_s[i, j], -T.infinity(ACCUM))
            T.copy(m_cur, m_prev)
            T.reduce_max(acc_s, m_cur, dim=1, clear=False)
            for i in T.Parallel(WG_ROWS):
                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_cur[i] * scale_log2)
            for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2 + MAX_OFFSET)
            T.reduce_sum(acc_s, row_sum_tile, dim=1)
            T.wait_wgmma(0)  # PV(k-1) done: P_shared and the V^T stage may be reused
            T.mbarrier_arrive(vt_empty[v_stage_prev])
            for i in T.Parallel(WG_ROWS):
                row_sum[i] = row_sum[i] * alpha[i] + row_sum_tile[i]
            T.copy(acc_s, P_shared[g, :, :])  # P rounded to e4m3 (its row sum is the unrounded one): PV's A operand
            T.fence_proxy_async()  # these stores must be visible to the next PV's async-proxy reads...
            T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and every thread's P written

        # Epilogue: the last PV, normalise, stage in shared memory, one TMA store.
        v_stage_last = (n_tiles - 1) % V_STAGES
        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
            acc_o[i, j] *= alpha[i]
        T.mbarrier_wait_parity(vt_full[v_stage_last], ((n_tiles - 1) // V_STAGES) % 2)  # V^T of that tile is in shared memory
        T.wgmma_gemm(P_shared[g, :, :], Vt_shared[v_stage_last, :, :], acc_o, transpose_B=True, policy=POLICY, clear_accum=False)
        T.wait_wgmma(0)
        T.mbarrier_arrive(vt_empty[v_stage_last])
        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
            acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] * (v_descale / row_sum[i]))  # a row that sees no key gives 0
        T.copy(acc_o, O_shared[g, :, :])
        T.fence_proxy_async()  # each thread's O_shared stores must be visible to the TMA engine...
        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and all 128 done before one thread issues the store
        T.copy(O_shared[g, :, :], O[batch_idx, q0 + row0:q0 + row0 + WG_ROWS, head, :])

    @T.prim_func
    def fa3_fwd_hd256_e4m3_obf16_causal_g1_c2_k2v2_m128n64(
        Q: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        K: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        V: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        O: T.Tensor([batch, q_len, heads, HEAD_DIM], OUT_DTYPE),
        Q_descale: T.Tensor([batch, kv_heads], "float32"),  # call time: q_descale
        K_descale: T.Tensor([batch, kv_heads], "float32"),  # call time: k_descale
        V_descale: T.Tensor([batch, kv_heads], "float32"),  # call time: v_descale
        softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))
    ):
        with T.Kernel(T.ceildiv(q_len, BLOCK_M), heads, batch, threads=THREADS) as (q_block, head, batch_idx):
            Q_shared = T.alloc_shared([2, WG_ROWS, HEAD_DIM], DTYPE)  # one slice per consumer: wgmma A must start at offset 0
            K_shared = T.alloc_shared([K_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            V_shared = T.alloc_shared([V_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            O_shared = T.alloc_shared([2, WG_ROWS, HEAD_DIM], OUT_DTYPE)
            Vt_shared = T.alloc_shared([V_STAGES, HEAD_DIM, BLOCK_N], DTYPE)  # V transposed: fp8 wgmma reads B K-major only
            P_shared = T.alloc_shared([2, WG_ROWS, BLOCK_N], DTYPE)  # P in e4m3: PV's A operand
            T.annotate_layout({Q_shared: make_swizzled_layout(Q_shared), K_shared: make_swizzled_layout(K_shared), V_shared: make_swizzled_layout(V_shared),
                               Vt_shared: make_swizzled_layout(Vt_shared), P_shared: make_swizzled_layout(P_shared)})

            q_full = T.alloc_barrier([TMA_ARRIVALS])
            k_full = T.alloc_barrier([TMA_ARRIVALS] * K_STAGES)
            k_empty = T.alloc_barrier([RELEASE_ARRIVALS] * K_STAGES)
            v_full = T.alloc_barrier([TMA_ARRIVALS] * V_STAGES)
            v_empty = T.alloc_barrier([WARPGROUP_THREADS] * V_STAGES)  # freed by the producer warpgroup once it has transposed the tile
            vt_full = T.alloc_barrier([WARPGROUP_THREADS] * V_STAGES)  # V^T written (the producer warpgroup's four warps)
            vt_empty = T.alloc_barrier([RELEASE_ARRIVALS] * V_STAGES)  # V^T read by every consumer's PV

            kv_head = head // GQA_GROUP
            q0 = q_block * BLOCK_M
            n_tiles = T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))  # >= 1: a block of rows that see no key still runs (fully masked) tile 0
            tx = T.get_thread_binding()

            # Producer warpgroup: gives its registers away; one warp loads Q once, then K and V per tile;
            # all four warps transpose each V tile in shared memory (fp8 wgmma reads B K-major only).
            with T.ws(2):
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < TMA_THREAD_END:
                    T.tma_copy(Q[batch_idx, q0:q0 + 64, head, :], Q_shared[0, :, :], barrier=q_full)
                    T.tma_copy(Q[batch_idx, q0 + 64:q0 + 128, head, :], Q_shared[1, :, :], barrier=q_full)
                    T.mbarrier_arrive(q_full)
                for k in T.serial(n_tiles + 1):  # loads of tile k, then the transpose of tile k - 1 (it lags one tile)
                    if tx < TMA_THREAD_END and k < n_tiles:
                        k_stage = k % K_STAGES
                        T.mbarrier_wait_parity(k_empty[k_stage], ((k // K_STAGES) % 2) ^ 1)
                        T.tma_copy(K[batch_idx, k * BLOCK_N:(k + 1) * BLOCK_N, kv_head, :], K_shared[k_stage, :, :], barrier=k_full[k_stage])
                        T.mbarrier_arrive(k_full[k_stage])
                        v_stage = k % V_STAGES
                        T.mbarrier_wait_parity(v_empty[v_stage], ((k // V_STAGES) % 2) ^ 1)
                        T.tma_copy(V[batch_idx, k * BLOCK_N:(k + 1) * BLOCK_N, kv_head, :], V_shared[v_stage, :, :], barrier=v_full[v_stage])
                        T.mbarrier_arrive(v_full[v_stage])
                    if k > 0:  # after tile k's loads: a consumer's wait on k_full[k] orders nothing of this transpose
                        t_stage = (k - 1) % V_STAGES
                        T.mbarrier_wait_parity(v_full[t_stage], ((k - 1) // V_STAGES) % 2)  # V tile k - 1 landed
                        T.mbarrier_wait_parity(vt_empty[t_stage], (((k - 1) // V_STAGES) % 2) ^ 1)  # its V^T stage is free
                        for c in T.serial(BLOCK_N // TRANSPOSE_KEYS):  # in slices: the producer holds few registers
                            for d, j in T.Parallel(HEAD_DIM, TRANSPOSE_KEYS):
                                Vt_shared[t_stage, d, c * TRANSPOSE_KEYS + j] = V_shared[t_stage, c * TRANSPOSE_KEYS + j, d]
                        T.fence_proxy_async()  # the generic-proxy stores must be visible to the consumers' wgmma reads
                        T.mbarrier_arrive(vt_full[t_stage])
                        T.mbarrier_arrive(v_empty[t_stage])  # the TMA may land tile k - 1 + V_STAGES in V_shared

            # Consumer warpgroups: one body, instantiated per warpgroup.
            with T.ws(0):
                consumer(0, 1, 2, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, q0, n_tiles, head, batch_idx, P_shared, Vt_shared, vt_full, vt_empty, Q_descale, K_descale, V_descale, softmax_scale)
            with T.ws(1):
                consumer(1, 2, 1, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, q0, n_tiles, head, batch_idx, P_shared, Vt_shared, vt_full, vt_empty, Q_descale, K_descale, V_descale, softmax_scale)

    return fa3_fwd_hd256_e4m3_obf16_causal_g1_c2_k2v2_m128n64
