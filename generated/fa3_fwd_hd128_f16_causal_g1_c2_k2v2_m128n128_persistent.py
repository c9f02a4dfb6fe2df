# ==============================================================================
# attngen auto-generated kernel: do not edit; regenerate with `attngen generate`.
# kernel:    fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128_persistent
# spec hash: fc7053f2ddf3
# generator: attngen 0.1.0, template fa3_fwd.py.j2
# shape:     dynamic: batch, q_len, kv_len, kv_heads are runtime values
# schedule:  1 TMA producer warpgroup + 2 consumer warpgroup(s), ping-pong, 384 threads, setmaxnreg 40/232
# smem:      197632 bytes dynamic (Q 32768, K 65536, V 65536, O 32768, tile 1024)
# spec:
#   head_dim = 128
#   dtype = "float16"
#   causal = true
#   gqa_group = 1
#   consumers = 2
#   k_stages = 2
#   v_stages = 2
#   block_m = 128
#   block_n = 128
#   pingpong = true
#   aligned = false
#   scheduler = "persistent"
# ==============================================================================
import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

KERNEL_NAME = "fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128_persistent"
SPEC_HASH = "fc7053f2ddf3"

HEAD_DIM = 128
DTYPE = "float16"
ACCUM = "float"
GQA_GROUP = 1  # query heads per KV head
BLOCK_M = 128  # query rows per block: 2 consumer warpgroup(s) x 64
BLOCK_N = 128  # keys per K/V tile
WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile)
K_STAGES = 2
V_STAGES = 2
LOG2E = 1.44269504  # the softmax runs in base 2; the scale is the run-time argument softmax_scale
COUNTER_SLOTS = 3  # tile counters, used in turn by successive calls (schedulers.COUNTER_SLOTS)
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
    def consumer(g, wait_bar, signal_bar, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, tile_shared, tile_full, tile_empty, m_blocks, heads_total, total_tiles, section, softmax_scale):
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
        if g == 1:
            T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)  # prime the ring once: it runs on from tile to tile
        tile_iter = T.alloc_var("int32", 0)  # the block's tiles so far: a once-per-tile barrier's phase
        visit_base = T.alloc_var("int32", 0)  # the block's K/V visits so far: stages and phases carry from tile to tile
        tile = T.alloc_var("int32", 0)
        T.mbarrier_wait_parity(tile_full, tile_iter % 2)  # the producer took the block's first tile
        tile = tile_shared[0]
        while tile < total_tiles:  # an index past the last tile ends the block
            sec = T.floordiv(tile, section * m_blocks)
            within = tile - sec * section * m_blocks
            width = T.min(section, heads_total - sec * section)
            row_step = T.floordiv(within, width)
            bh = sec * section + within - row_step * width
            q_block = m_blocks - 1 - row_step  # longest first: the last row tile sees the most keys
            batch_idx = T.truncdiv(bh, heads)  # truncdiv: both >= 0, no floor fix-up code
            head = T.truncmod(bh, heads)
            kv_head = head // GQA_GROUP
            q0 = q_block * BLOCK_M
            n_tiles = T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))  # >= 1: a block of rows that see no key still runs (fully masked) tile 0

            T.fill(acc_o, 0)
            T.fill(alpha, 1.0)  # the first carried rescale is a no-op
            T.fill(m_cur, T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0))  # a finite floor, not -inf: a row of -inf scores gets exp2(-inf - m) = 0, not NaN
            T.mbarrier_wait_parity(q_full, tile_iter % 2)

            # Prologue, tile 0: QK and softmax only; its PV is issued in the next iteration.
            T.sync_threads(wait_bar, PINGPONG_THREADS)
            T.mbarrier_wait_parity(k_full[visit_base % K_STAGES], (visit_base // K_STAGES) % 2)
            T.wgmma_gemm(Q_shared[g, :, :], K_shared[visit_base % K_STAGES, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
            T.named_barrier_arrive(signal_bar, PINGPONG_THREADS)
            T.wait_wgmma(0)
            T.mbarrier_arrive(k_empty[visit_base % K_STAGES])
            full_tiles = T.floordiv(q0 + row0 + causal_offset + 1, BLOCK_N)  # leading K tiles that need no mask for these rows
            if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile
                diag0 = q0 + row0 + causal_offset  # row i of tile 0 sees keys j <= i + diag0
                for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                    acc_s[i, j] = T.if_then_else(i + diag0 >= j, acc_s[i, j], -T.infinity(ACCUM))
            T.reduce_max(acc_s, m_cur, dim=1, clear=False)  # the first tile's max, never below the floor
            for i, j in T.Parallel(WG_ROWS, BLOCK_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
            T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's
            T.copy(acc_s, p_reg)

            # Steady state, tile k: QK(k), rescale, PV(k-1), softmax(k).
            for k in T.serial(1, n_tiles):
                k_stage = (visit_base + k) % K_STAGES
                v_stage_prev = (visit_base + k - 1) % V_STAGES
                T.sync_threads(wait_bar, PINGPONG_THREADS)  # ping-pong: my turn on the tensor cores
                T.mbarrier_wait_parity(k_full[k_stage], ((visit_base + k) // K_STAGES) % 2)
                T.wgmma_gemm(Q_shared[g, :, :], K_shared[k_stage, :, :], acc_s, transpose_B=True, policy=POLICY, clear_accum=True)
                for i, j in T.Parallel(WG_ROWS, HEAD_DIM):  # rescale by the carried alpha while QK runs
                    acc_o[i, j] *= alpha[i]
                T.mbarrier_wait_parity(v_full[v_stage_prev], ((visit_base + k - 1) // V_STAGES) % 2)
                T.wgmma_gemm(p_reg, V_shared[v_stage_prev, :, :], acc_o, policy=POLICY, clear_accum=False)  # delayed PV of tile k-1
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
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
                T.reduce_sum(acc_s, row_sum_tile, dim=1)
                T.wait_wgmma(0)  # PV(k-1) done: p_reg and V stage may be reused
                T.mbarrier_arrive(v_empty[v_stage_prev])
                for i in T.Parallel(WG_ROWS):
                    row_sum[i] = row_sum[i] * alpha[i] + row_sum_tile[i]
                T.copy(acc_s, p_reg)
            # The tile's last QK retired: Q_shared and the tile index are free, so the producer takes the next
            # tile and loads its Q and first K/V stages under this epilogue (the stages the last PV frees last).
            T.mbarrier_arrive(tile_empty)

            # Epilogue: the last PV, normalise, stage in shared memory, one TMA store.
            v_stage_last = (visit_base + n_tiles - 1) % V_STAGES
            for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
                acc_o[i, j] *= alpha[i]
            T.mbarrier_wait_parity(v_full[v_stage_last], ((visit_base + n_tiles - 1) // V_STAGES) % 2)
            T.wgmma_gemm(p_reg, V_shared[v_stage_last, :, :], acc_o, policy=POLICY, clear_accum=False)
            T.wait_wgmma(0)
            T.mbarrier_arrive(v_empty[v_stage_last])
            for i, j in T.Parallel(WG_ROWS, HEAD_DIM):
                acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0
            T.copy(acc_o, O_shared[g, :, :])
            T.fence_proxy_async()  # each thread's O_shared stores must be visible to the TMA engine...
            T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and all 128 done before one thread issues the store
            T.copy(O_shared[g, :, :], O[batch_idx, q0 + row0:q0 + row0 + WG_ROWS, head, :])
            T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # the store's one thread has read O_shared: the next tile's epilogue may write it
            visit_base = visit_base + n_tiles
            tile_iter = tile_iter + 1
            T.mbarrier_wait_parity(tile_full, tile_iter % 2)  # the producer took the block's next tile
            tile = tile_shared[0]

    @T.prim_func
    def fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128_persistent(
        Q: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        K: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        V: T.Tensor([batch, kv_len, kv_heads, HEAD_DIM], DTYPE),
        O: T.Tensor([batch, q_len, heads, HEAD_DIM], DTYPE),
        softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))
        tile_counter: T.Tensor([COUNTER_SLOTS], "int32"),  # the tile counters: call `epoch` takes from slot epoch % COUNTER_SLOTS and zeroes the others
        epoch: T.int32,  # this call's number (the launcher counts its calls)
        num_sms: T.int32,  # blocks: one per SM
        section: T.int32,  # heads whose tiles go out together (schedulers.section_heads: their K/V fits L2)
    ):
        with T.Kernel(num_sms, threads=THREADS) as (sm):
            Q_shared = T.alloc_shared([2, WG_ROWS, HEAD_DIM], DTYPE)  # one slice per consumer: wgmma A must start at offset 0
            K_shared = T.alloc_shared([K_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            V_shared = T.alloc_shared([V_STAGES, BLOCK_N, HEAD_DIM], DTYPE)
            O_shared = T.alloc_shared([2, WG_ROWS, HEAD_DIM], DTYPE)
            T.annotate_layout({Q_shared: make_swizzled_layout(Q_shared), K_shared: make_swizzled_layout(K_shared), V_shared: make_swizzled_layout(V_shared)})

            q_full = T.alloc_barrier([TMA_ARRIVALS])
            k_full = T.alloc_barrier([TMA_ARRIVALS] * K_STAGES)
            k_empty = T.alloc_barrier([RELEASE_ARRIVALS] * K_STAGES)
            v_full = T.alloc_barrier([TMA_ARRIVALS] * V_STAGES)
            v_empty = T.alloc_barrier([RELEASE_ARRIVALS] * V_STAGES)
            tile_shared = T.alloc_shared([1], "int32")  # the block's next tile index, from the producer to every warp
            tile_full = T.alloc_barrier([1])  # the taking thread wrote tile_shared
            tile_empty = T.alloc_barrier([RELEASE_ARRIVALS + TMA_ARRIVALS])  # every reader read it (the consumers: and are done with Q_shared)

            m_blocks = T.ceildiv(q_len, BLOCK_M)  # row tiles per head
            heads_total = batch * heads  # tile t's (batch, head) pair is bh = batch_idx * heads + head
            total_tiles = m_blocks * heads_total  # the counter hands out [0, total_tiles), then an end mark per block
            slot = T.truncmod(epoch, COUNTER_SLOTS)  # this call's counter: the two calls before it zeroed it
            tx = T.get_thread_binding()

            # Producer warpgroup: gives its registers away; one warp loads Q once, then K and V per tile.
            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(PRODUCER_REGS, 0)
            if tx >= CONSUMER_THREADS and tx < TMA_THREAD_END:
                if sm == 0:  # zero the next two calls' counters (this call's was zeroed by the two calls before it)
                    tile_counter[T.truncmod(epoch + 1, COUNTER_SLOTS)] = 0
                    tile_counter[T.truncmod(epoch + 2, COUNTER_SLOTS)] = 0
                tile_iter = T.alloc_var("int32", 0)
                visit_base = T.alloc_var("int32", 0)
                tile = T.alloc_var("int32", 0)
                if tx == CONSUMER_THREADS:  # one thread takes the block's next tile from the counter
                    T.mbarrier_wait_parity(tile_empty, (tile_iter % 2) ^ 1)  # every reader is done with the last index, and the consumers with Q_shared
                    tile_shared[0] = T.atomic_add(tile_counter[slot], 1, return_prev=True)
                    T.mbarrier_arrive(tile_full)
                T.mbarrier_wait_parity(tile_full, tile_iter % 2)
                tile = tile_shared[0]
                T.mbarrier_arrive(tile_empty)  # this warp has read it
                while tile < total_tiles:
                    sec = T.floordiv(tile, section * m_blocks)
                    within = tile - sec * section * m_blocks
                    width = T.min(section, heads_total - sec * section)
                    row_step = T.floordiv(within, width)
                    bh = sec * section + within - row_step * width
                    q_block = m_blocks - 1 - row_step  # longest first: the last row tile sees the most keys
                    batch_idx = T.truncdiv(bh, heads)  # truncdiv: both >= 0, no floor fix-up code
                    head = T.truncmod(bh, heads)
                    kv_head = head // GQA_GROUP
                    q0 = q_block * BLOCK_M
                    n_tiles = T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))  # >= 1: a block of rows that see no key still runs (fully masked) tile 0
                    T.tma_copy(Q[batch_idx, q0:q0 + 64, head, :], Q_shared[0, :, :], barrier=q_full)
                    T.tma_copy(Q[batch_idx, q0 + 64:q0 + 128, head, :], Q_shared[1, :, :], barrier=q_full)
                    T.mbarrier_arrive(q_full)
                    for k in T.serial(n_tiles):
                        k_stage = (visit_base + k) % K_STAGES
                        T.mbarrier_wait_parity(k_empty[k_stage], (((visit_base + k) // K_STAGES) % 2) ^ 1)
                        T.tma_copy(K[batch_idx, k * BLOCK_N:(k + 1) * BLOCK_N, kv_head, :], K_shared[k_stage, :, :], barrier=k_full[k_stage])
                        T.mbarrier_arrive(k_full[k_stage])
                        v_stage = (visit_base + k) % V_STAGES
                        T.mbarrier_wait_parity(v_empty[v_stage], (((visit_base + k) // V_STAGES) % 2) ^ 1)
                        T.tma_copy(V[batch_idx, k * BLOCK_N:(k + 1) * BLOCK_N, kv_head, :], V_shared[v_stage, :, :], barrier=v_full[v_stage])
                        T.mbarrier_arrive(v_full[v_stage])
                    visit_base = visit_base + n_tiles
                    tile_iter = tile_iter + 1
                    if tx == CONSUMER_THREADS:  # one thread takes the block's next tile from the counter
                        T.mbarrier_wait_parity(tile_empty, (tile_iter % 2) ^ 1)  # every reader is done with the last index, and the consumers with Q_shared
                        tile_shared[0] = T.atomic_add(tile_counter[slot], 1, return_prev=True)
                        T.mbarrier_arrive(tile_full)
                    T.mbarrier_wait_parity(tile_full, tile_iter % 2)
                    tile = tile_shared[0]
                    T.mbarrier_arrive(tile_empty)  # this warp has read it

            # Consumer warpgroups: one body, instantiated per warpgroup.
            with T.ws(0):
                consumer(0, 1, 2, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, tile_shared, tile_full, tile_empty, m_blocks, heads_total, total_tiles, section, softmax_scale)
            with T.ws(1):
                consumer(1, 2, 1, Q_shared, K_shared, V_shared, O_shared, O, q_full, k_full, k_empty, v_full, v_empty, tile_shared, tile_full, tile_empty, m_blocks, heads_total, total_tiles, section, softmax_scale)

    return fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128_persistent
