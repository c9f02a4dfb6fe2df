# ==============================================================================
# attngen auto-generated backward kernels: do not edit; regenerate with attngen.
# kernel:    fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks
# spec hash: 5adc4aea6a0e
# generator: attngen 0.1.0, template fa3_bwd.py.j2
# shape:     dynamic: batch, q_len, kv_len, kv_heads are runtime values
# schedule:  1 TMA producer warpgroup + 2 MMA warpgroup(s) of 64 keys, 384 threads, setmaxnreg 24/240; FA3's tile 64x128 (2 WGs)
# smem:      214016 bytes dynamic (K 32768, V 32768, Q 32768, dO 32768, LSE2 512, dPsum 512, dS 16384, dQ 65536)
# entries:   build_preprocess_kernel, build_kernel, build_postprocess_kernel, build_postprocess_kv_kernel
# spec:
#   head_dim = 128
#   dtype = "bfloat16"
#   causal = true
#   gqa_group = 8
#   consumers = 2
#   k_stages = 2
#   v_stages = 2
#   aligned = false
#   lse = true
#   sinks = true
# ==============================================================================
import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

KERNEL_NAME = "fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks"
SPEC_HASH = "5adc4aea6a0e"

HEAD_DIM = 128
DTYPE = "bfloat16"
ACCUM = "float"
GQA_GROUP = 8  # query heads per KV head
BLOCK_M = 64  # query rows per Q tile (the M of the dQ wgmma)
BLOCK_N = 128  # keys per KV tile: 2 MMA warpgroup(s) x 64
WG_KEYS = 64  # keys per MMA warpgroup (one wgmma M tile of S^T, dP^T, dK, dV)
Q_STAGES = 2  # Q, dO, LSE2, dPsum tiles in flight
LOG2E = 1.44269504
THREADS = 384
CONSUMER_THREADS = 256  # threads [0, 256) are MMA warpgroups, the rest the producer
TMA_THREAD_END = 288  # one producer warp issues all TMA copies
PRODUCER_REGS = 24
CONSUMER_REGS = 240
TMA_ARRIVALS = 32
RELEASE_ARRIVALS = CONSUMER_THREADS
WARPGROUP_THREADS = 128
DS_BAR = 1  # named barrier of consumer g's dS^T staging: DS_BAR + g
DQ_BAR = 3  # ... and of its dQ staging: DQ_BAR + g
PRE_ROWS = 64  # rows of one head per preprocess / postprocess block
PRE_THREADS = 128
POLICY = T.GemmWarpPolicy.FullRow

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # barriers are explicit below
}
COMPILE_FLAGS = [
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


def build_preprocess_kernel():
    """dPsum = rowsum(dO * O) - dLSE, LSE2 = LSE * log2(e) (0 for -inf), dQ_accum zeroed, dSinks."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_len = T.dynamic("kv_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * GQA_GROUP

    @T.prim_func
    def fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_preprocess(
        O: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),  # the forward's output
        dO: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        LSE: T.Tensor([batch, heads, q_len], "float32"),  # the forward's log-sum-exp, natural log (-inf: a row with no key)
        dLSE: T.Tensor([batch, heads, q_len], "float32"),  # the LSE output's gradient (zeros when the loss reads no LSE)
        dPsum: T.Tensor([batch, heads, q_len], "float32"),  # output: rowsum(dO * O) - dLSE
        LSE2: T.Tensor([batch, heads, q_len], "float32"),  # output: LSE * log2(e), 0 where LSE is -inf
        dQ_accum: T.Tensor([batch, q_len, heads, HEAD_DIM], "float32"),  # output: zeroed (the main kernel reduce-adds into it)
        Sinks: T.Tensor([heads], "float32"),  # call time: sinks
        dSinks: T.Tensor([heads], "float32"),  # in/out: zeroed by the caller; -= sum_rows exp(sink - LSE) dPsum
    ):
        with T.Kernel(T.ceildiv(q_len, PRE_ROWS), heads, batch, threads=PRE_THREADS) as (row_block, head, batch_idx):
            r0 = row_block * PRE_ROWS
            prod = T.alloc_fragment([PRE_ROWS, HEAD_DIM], ACCUM)
            dpsum = T.alloc_fragment([PRE_ROWS], ACCUM)
            for i, j in T.Parallel(PRE_ROWS, HEAD_DIM):  # rows past q_len read row q_len - 1 and count 0
                prod[i, j] = T.if_then_else(r0 + i < q_len, T.Cast(ACCUM, O[batch_idx, T.min(r0 + i, q_len - 1), head, j]) * T.Cast(ACCUM, dO[batch_idx, T.min(r0 + i, q_len - 1), head, j]), 0)
            T.reduce_sum(prod, dpsum, dim=1)
            for i in T.Parallel(PRE_ROWS):  # the LSE output's gradient folds into the row term: dS = P (dP - (D - dLSE))
                dpsum[i] = dpsum[i] - dLSE[batch_idx, head, T.min(r0 + i, q_len - 1)]
            for i in T.Parallel(PRE_ROWS):
                if r0 + i < q_len:
                    dPsum[batch_idx, head, r0 + i] = dpsum[i]
                    LSE2[batch_idx, head, r0 + i] = T.if_then_else(LSE[batch_idx, head, r0 + i] == -T.infinity(ACCUM), 0, LSE[batch_idx, head, r0 + i] * LOG2E)
            for i, d in T.Parallel(PRE_ROWS, HEAD_DIM):
                if r0 + i < q_len:
                    dQ_accum[batch_idx, r0 + i, head, d] = 0
            sink_term = T.alloc_fragment([PRE_ROWS], ACCUM)
            dsink = T.alloc_fragment([1], ACCUM)
            for i in T.Parallel(PRE_ROWS):  # d lse / d sink = exp(sink - lse): dsink = -sum_rows exp(sink - lse) (D - dLSE)
                sink_term[i] = T.if_then_else(r0 + i < q_len, -T.exp(Sinks[head] - LSE[batch_idx, head, T.min(r0 + i, q_len - 1)]) * dpsum[i], 0)
            T.reduce_sum(sink_term, dsink, dim=0)
            T.atomic_add(dSinks[head:head + 1], dsink)  # every row block of every batch adds its share

    return fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_preprocess


def build_kernel():
    """The main kernel: one KV tile per block, its K and V resident, a loop over the Q tiles that see it."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_len = T.dynamic("kv_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * GQA_GROUP
    causal_offset = kv_len - q_len  # bottom-right alignment: row i's diagonal is key i + causal_offset

    @T.macro
    def consumer(g, K_shared, V_shared, Q_shared, dO_shared, LSE_shared, dPsum_shared, dS_shared, dQ_shared, kv_full, q_full, q_empty, do_full, do_empty, dQ_accum, dK_accum, dV_accum, kv_block, head, kv_head, batch_idx, q_first, n_q, full_first, full_stop, kv_partial, softmax_scale):
        """MMA warpgroup g: keys [key0, key0 + WG_KEYS) of the KV tile, every head-dim column; element (i, j) of a tile is key key0 + i, query row m0 + j."""
        T.set_max_nreg(CONSUMER_REGS, 1)
        key0 = kv_block * BLOCK_N + g * WG_KEYS
        acc_s = T.alloc_fragment([WG_KEYS, BLOCK_M], ACCUM)  # S^T = K_g Q^T, then P^T
        acc_dp = T.alloc_fragment([WG_KEYS, BLOCK_M], ACCUM)  # dP^T = V_g dO^T, then dS^T
        p_reg = T.alloc_fragment([WG_KEYS, BLOCK_M], DTYPE)  # P^T: the A operand of dV += P^T dO
        ds_reg = T.alloc_fragment([WG_KEYS, BLOCK_M], DTYPE)  # dS^T: the A operand of dK += dS^T Q
        acc_dk = T.alloc_fragment([WG_KEYS, HEAD_DIM], ACCUM)
        acc_dv = T.alloc_fragment([WG_KEYS, HEAD_DIM], ACCUM)
        acc_dq = T.alloc_fragment([BLOCK_M, HEAD_DIM], ACCUM)  # dS_g K_g: this warpgroup's keys' share of dQ
        scale_log2 = softmax_scale * LOG2E  # P = exp2(k . q * scale_log2 - LSE2)
        T.fill(acc_dk, 0)
        T.fill(acc_dv, 0)
        T.mbarrier_wait_parity(kv_full, 0)
        for m in T.serial(n_q):
            stage = m % Q_STAGES
            phase = (m // Q_STAGES) % 2
            q_tile = q_first + m
            m0 = q_tile * BLOCK_M
            T.mbarrier_wait_parity(q_full[stage], phase)
            T.wgmma_gemm(K_shared[g, :, :], Q_shared[stage, 0, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
            T.mbarrier_wait_parity(do_full[stage], phase)
            T.wgmma_gemm(V_shared[g, :, :], dO_shared[stage, 0, :, :], acc_dp, transpose_B=True, policy=POLICY, clear_accum=True)
            T.wait_wgmma(1)  # S^T done; dP^T may still run
            for i, j in T.Parallel(WG_KEYS, BLOCK_M):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - LSE_shared[stage, j])  # P^T, as the forward weighed it
            if q_tile < full_first or q_tile >= full_stop or m0 + BLOCK_M > q_len or kv_partial:  # a diagonal, edge or partial tile: masked
                diag = m0 + causal_offset - key0  # row m0 + j's diagonal key is key0 + j + diag
                for i, j in T.Parallel(WG_KEYS, BLOCK_M):
                    acc_s[i, j] = T.if_then_else(j + diag >= i and m0 + j < q_len, acc_s[i, j], 0)
            T.copy(acc_s, p_reg)
            T.wgmma_gemm(p_reg, dO_shared[stage, 0, :, :], acc_dv, policy=POLICY, clear_accum=False)  # dV += P^T dO
            T.wait_wgmma(1)  # dP^T done; dV may still run
            for i, j in T.Parallel(WG_KEYS, BLOCK_M):  # dS^T = P^T (dP^T - dPsum) (0 where P is)
                acc_dp[i, j] = acc_s[i, j] * (acc_dp[i, j] - dPsum_shared[stage, j])
            T.copy(acc_dp, ds_reg)
            T.wgmma_gemm(ds_reg, Q_shared[stage, 0, :, :], acc_dk, policy=POLICY, clear_accum=False)  # dK += dS^T Q
            T.copy(ds_reg, dS_shared[g, :, :])
            T.fence_proxy_async()  # the dS^T stores must be visible to the wgmma's async-proxy reads...
            T.sync_threads(DS_BAR + g, WARPGROUP_THREADS)  # ...and every thread's written
            T.wgmma_gemm(dS_shared[g, :, :], K_shared[g, :, :], acc_dq, transpose_A=True, policy=POLICY, clear_accum=True)  # dQ_g = dS_g K_g
            T.wait_wgmma(0)
            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)
            T.mbarrier_arrive(do_empty[stage])  # dO, dPsum read (dP^T, dV, dS)
            T.copy(acc_dq, dQ_shared[g, :, :])
            T.fence_proxy_async()
            T.sync_threads(DQ_BAR + g, WARPGROUP_THREADS)  # every row staged before the TMA engine reads them
            T.atomic_add(dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :], dQ_shared[g, :, :], use_tma=True)  # TMA reduce-add; rows past q_len dropped
        for i, j in T.Parallel(WG_KEYS, HEAD_DIM):
            acc_dk[i, j] *= softmax_scale  # dK = scale * dS^T Q
        T.atomic_add(dK_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :], acc_dk)  # the group's query heads sum here
        T.atomic_add(dV_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :], acc_dv)

    @T.prim_func
    def fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks(
        Q: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        K: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        V: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        dO: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        LSE2: T.Tensor([batch, heads, q_len], "float32"),
        dPsum: T.Tensor([batch, heads, q_len], "float32"),
        dQ_accum: T.Tensor([batch, q_len, heads, HEAD_DIM], "float32"),  # in/out: dS K reduce-added, unscaled
        dK_accum: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], "float32"),  # in/out: zeroed by the caller; dK of the group's query heads atomically added, scaled
        dV_accum: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], "float32"),  # in/out: zeroed by the caller; dV of the group's query heads atomically added
        softmax_scale: T.float32,  # call time: score = q . k * softmax_scale
    ):
        with T.Kernel(T.ceildiv(kv_len, BLOCK_N), heads, batch, threads=THREADS) as (kv_block, head, batch_idx):
            K_shared = T.alloc_shared([2, WG_KEYS, HEAD_DIM], DTYPE)  # one slice of keys per MMA warpgroup
            V_shared = T.alloc_shared([2, WG_KEYS, HEAD_DIM], DTYPE)
            Q_shared = T.alloc_shared([Q_STAGES, 1, BLOCK_M, HEAD_DIM], DTYPE)
            dO_shared = T.alloc_shared([Q_STAGES, 1, BLOCK_M, HEAD_DIM], DTYPE)
            LSE_shared = T.alloc_shared([Q_STAGES, BLOCK_M], ACCUM)
            dPsum_shared = T.alloc_shared([Q_STAGES, BLOCK_M], ACCUM)
            dS_shared = T.alloc_shared([2, WG_KEYS, BLOCK_M], DTYPE)  # dS^T: the A operand of dQ (transposed)
            dQ_shared = T.alloc_shared([2, BLOCK_M, HEAD_DIM], ACCUM)  # the source of the TMA reduce-add
            T.annotate_layout({K_shared: make_swizzled_layout(K_shared), V_shared: make_swizzled_layout(V_shared), Q_shared: make_swizzled_layout(Q_shared), dO_shared: make_swizzled_layout(dO_shared), dS_shared: make_swizzled_layout(dS_shared)})

            kv_full = T.alloc_barrier([TMA_ARRIVALS])
            q_full = T.alloc_barrier([TMA_ARRIVALS] * Q_STAGES)
            q_empty = T.alloc_barrier([RELEASE_ARRIVALS] * Q_STAGES)
            do_full = T.alloc_barrier([TMA_ARRIVALS] * Q_STAGES)
            do_empty = T.alloc_barrier([RELEASE_ARRIVALS] * Q_STAGES)

            kv_head = head // GQA_GROUP
            kv0 = kv_block * BLOCK_N
            kv_partial = kv0 + BLOCK_N > kv_len  # keys past kv_len: every visit masked
            q_first = T.floordiv(T.max(kv_block * BLOCK_N - causal_offset, 0), BLOCK_M)  # the first Q tile with a row that sees this KV tile
            n_q = T.max(T.ceildiv(q_len, BLOCK_M) - q_first, 0)  # Q tiles [q_first, q_first + n_q) see it (0: none; dK = dV = 0)
            full_first = T.ceildiv(T.max(kv_block * BLOCK_N + BLOCK_N - 1 - causal_offset, 0), BLOCK_M)  # Q tiles [full_first, full_stop) see every key of it
            full_stop = T.ceildiv(q_len, BLOCK_M)
            tx = T.get_thread_binding()

            # Producer warpgroup: K and V once, then Q with LSE2 and dO with dPsum per Q tile.
            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(PRODUCER_REGS, 0)
            if tx >= CONSUMER_THREADS and tx < TMA_THREAD_END:
                T.tma_copy(K[batch_idx, kv0:kv0 + 64, kv_head, :], K_shared[0, :, :], barrier=kv_full)
                T.tma_copy(V[batch_idx, kv0:kv0 + 64, kv_head, :], V_shared[0, :, :], barrier=kv_full)
                T.tma_copy(K[batch_idx, kv0 + 64:kv0 + 128, kv_head, :], K_shared[1, :, :], barrier=kv_full)
                T.tma_copy(V[batch_idx, kv0 + 64:kv0 + 128, kv_head, :], V_shared[1, :, :], barrier=kv_full)
                T.mbarrier_arrive(kv_full)
                for m in T.serial(n_q):
                    stage = m % Q_STAGES
                    m0 = (q_first + m) * BLOCK_M
                    T.mbarrier_wait_parity(q_empty[stage], ((m // Q_STAGES) % 2) ^ 1)
                    T.tma_copy(Q[batch_idx, m0:m0 + BLOCK_M, head, :], Q_shared[stage, 0, :, :], barrier=q_full[stage])
                    T.tma_copy(LSE2[batch_idx, head, m0:m0 + BLOCK_M], LSE_shared[stage, :], barrier=q_full[stage])
                    T.mbarrier_arrive(q_full[stage])
                    T.mbarrier_wait_parity(do_empty[stage], ((m // Q_STAGES) % 2) ^ 1)
                    T.tma_copy(dO[batch_idx, m0:m0 + BLOCK_M, head, :], dO_shared[stage, 0, :, :], barrier=do_full[stage])
                    T.tma_copy(dPsum[batch_idx, head, m0:m0 + BLOCK_M], dPsum_shared[stage, :], barrier=do_full[stage])
                    T.mbarrier_arrive(do_full[stage])

            # MMA warpgroups: one body, instantiated per warpgroup.
            with T.ws(0):
                consumer(0, K_shared, V_shared, Q_shared, dO_shared, LSE_shared, dPsum_shared, dS_shared, dQ_shared, kv_full, q_full, q_empty, do_full, do_empty, dQ_accum, dK_accum, dV_accum, kv_block, head, kv_head, batch_idx, q_first, n_q, full_first, full_stop, kv_partial, softmax_scale)
            with T.ws(1):
                consumer(1, K_shared, V_shared, Q_shared, dO_shared, LSE_shared, dPsum_shared, dS_shared, dQ_shared, kv_full, q_full, q_empty, do_full, do_empty, dQ_accum, dK_accum, dV_accum, kv_block, head, kv_head, batch_idx, q_first, n_q, full_first, full_stop, kv_partial, softmax_scale)

    return fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks


def build_postprocess_kernel():
    """dQ = dQ_accum * softmax_scale in the input dtype."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_len = T.dynamic("kv_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * GQA_GROUP

    @T.prim_func
    def fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_postprocess(
        dQ_accum: T.Tensor([batch, q_len, heads, HEAD_DIM], "float32"),
        dQ: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),  # output
        softmax_scale: T.float32,  # call time: score = q . k * softmax_scale
    ):
        with T.Kernel(T.ceildiv(q_len, PRE_ROWS), heads, batch, threads=PRE_THREADS) as (row_block, head, batch_idx):
            r0 = row_block * PRE_ROWS
            for i, d in T.Parallel(PRE_ROWS, HEAD_DIM):
                if r0 + i < q_len:
                    dQ[batch_idx, r0 + i, head, d] = dQ_accum[batch_idx, r0 + i, head, d] * softmax_scale

    return fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_postprocess


def build_postprocess_kv_kernel():
    """GQA/MQA: dK and dV from their float32 accumulators (already scaled) in the input dtype."""
    batch = T.dynamic("batch")
    q_len = T.dynamic("q_len")
    kv_len = T.dynamic("kv_len")
    kv_heads = T.dynamic("kv_heads")
    heads = kv_heads * GQA_GROUP

    @T.prim_func
    def fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_postprocess_kv(
        dK_accum: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], "float32"),
        dV_accum: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], "float32"),
        dK: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),  # output
        dV: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),  # output
    ):
        with T.Kernel(T.ceildiv(kv_len, PRE_ROWS), kv_heads, batch, threads=PRE_THREADS) as (row_block, kv_head, batch_idx):
            r0 = row_block * PRE_ROWS
            for i, d in T.Parallel(PRE_ROWS, HEAD_DIM):
                if r0 + i < kv_len:
                    dK[batch_idx, r0 + i, kv_head, d] = dK_accum[batch_idx, r0 + i, kv_head, d]
            for i, d in T.Parallel(PRE_ROWS, HEAD_DIM):
                if r0 + i < kv_len:
                    dV[batch_idx, r0 + i, kv_head, d] = dV_accum[batch_idx, r0 + i, kv_head, d]

    return fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks_postprocess_kv
