"""Facts about the target (sm_90a, Hopper) and the element types: the bottom of the flow.

Every module above reads its hardware numbers here, so each fact has one home. Nothing
in this module imports the rest of attngen.
"""

from __future__ import annotations

import dataclasses

# -- the chip ------------------------------------------------------------------------
CAPABILITY = (9, 0)  # sm_90a code (wgmma, setmaxnreg) runs on compute capability 9.0 only
WARPGROUP_THREADS = 128  # four warps issue one wgmma together
WGMMA_M = 64  # rows of one wgmma M tile: the query rows one consumer warpgroup owns
WARP_THREADS = 32  # one producer warp issues every TMA copy and arrives on the "full" barriers
SMEM_PER_BLOCK = 227 * 1024  # max dynamic shared memory per block (232448 bytes)
REGS_PER_SM = 65536
SM_COUNT = 132  # streaming multiprocessors of an H100 SXM / H200: what a grid's waves are counted in
# L2 a persistent schedule keeps for the K and V of the heads it runs together (FA3's
# tile_scheduler.hpp: 32 MB of the 50 MB L2, so a head section's K/V stays resident)
L2_KV_BYTES = 32 * 2**20
MAX_REGS_PER_THREAD = 255
GRID_YZ_MAX = 65535  # grid dimensions y and z (heads and batch)
GRID_X_MAX = 2**31 - 1
INT32_MAX = 2**31 - 1  # TileLang's host stub passes shapes and strides as int32
TMA_ALIGN = 16  # bytes: TMA wants a 16-byte aligned base and 16-byte multiple strides
LOG2E = 1.44269504  # exp(x) = exp2(x * log2(e)); the constant the seed kernel uses

# Register budgets, measured with ptxas on the emitted kernels: the measurements (dates, specs,
# spill bytes) are in docs/hw-measurements.md, one section per constant below.
# setmaxnreg split per consumer count, FlashAttention-3's: (producer, consumer). The producer
# only issues TMA, so it gives its registers to the consumers.
REG_SPLIT = {1: (24, 240), 2: (24, 240), 3: (32, 160)}
# A producer that looks up pages or split ranges per tile spills at 24 registers.
SERVING_PRODUCER_REGS = {1: 56, 2: 40}
# fp8's producer warpgroup under the persistent scheduler transposes V and takes tiles: at 40 registers
# (two consumers) causal hd64/128/256 spilled 20/4/20 B; at 56 none did.
FP8_PERSISTENT_PRODUCER_REGS = 56
# a per-sequence (varlen or paged) producer under the persistent scheduler decodes each tile from a
# call-time list and reads its sequence's bounds (a paged one also looks up pages): at 40 registers (two
# consumers) hd64 GQA 4 with a window spilled 4 B (varlen), hd64 GQA 4 causal with lse 8 B (paged); at 56 none
PER_SEQUENCE_PERSISTENT_PRODUCER_REGS = 56
# Registers a consumer thread needs beyond its accumulators (row statistics, addresses, loop state).
CONSUMER_REG_OVERHEAD = {1: 48, 2: 48, 3: 32}
# ...and beyond that when tiles are masked along a diagonal (causal or a window): the mask's row
# and column index of each element is live beside the accumulators.
DIAGONAL_MASK_REG_OVERHEAD = {1: 0, 2: 0, 3: 4}
# ...and more when the mask is a band (a left window edge beside a right one): both edges'
# indices are live; an upper bound, as their share grows with block_n.
BAND_MASK_REG_OVERHEAD = {1: 0, 2: 0, 3: 28}
# ...and with packed sequences (layout "varlen"): the sequence's start and length stay live to
# the row-by-row epilogue.
PER_SEQUENCE_REG_OVERHEAD = 4
ACCUM_BYTES = 4  # wgmma accumulates in float32
# ...and for the variants' element-wise score work (softcap, ALiBi, score_mod, mask_mod:
# temporaries of the transform and the mask, tensor addresses); lse and sinks need none.
VARIANT_REG_OVERHEAD = 28
# A block mask's consumer keeps its two list cursors, the lists' row and the visit's tile live.
BLOCK_MASK_REG_OVERHEAD = 12


# -- element types ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # the spec's and torch's name
    tag: str  # in kernel names
    bytes: int
    eps: float  # the tolerance rule's floor (reference.py): about one ulp at 1.0


E4M3 = "float8_e4m3fn"  # torch's name for Hopper's fp8 wgmma input format (4 exponent bits, no inf)
E4M3_MAX = 448.0  # its largest finite value; conversions saturate here (cvt.rn.satfinite)

DTYPES = {
    "float16": DType("float16", "f16", 2, 1e-3),
    "bfloat16": DType("bfloat16", "bf16", 2, 8e-3),  # 2**-7, one bfloat16 ulp at 1.0
    E4M3: DType(E4M3, "e4m3", 1, 0.125),  # 2**-3: Q, K and V only; the output is 16-bit (Spec.out_dtype)
}
HALF_DTYPES = ("float16", "bfloat16")  # the 16-bit types: a 16-bit kernel's GEMM inputs, what an fp8 cache serves
OUT_DTYPES = ("bfloat16", "float16")  # what an fp8 kernel writes O in (FA3's is bfloat16)
FP8_MAX_OFFSET = 8  # FA3's Max_offset: P = exp2(s - m + 8) spans e4m3's range (<= 256 < 448), not [0, 1]
FP8_K_STEP = 32  # an fp8 wgmma contracts 32 elements per instruction: the PV GEMM's keys are a multiple
# The fp8 producer warpgroup transposes V in slices of at most this many elements a thread, by its
# setmaxnreg registers (the swizzled indexes of both tiles are live): with 40, 32 elements spilled
# 28 bytes (hd192, hd256); with 32 (beside 3 consumers) 16 spilled 64 bytes (hd64), 8 none. Half as
# many below 40. bench/plan_sweep.py --fp8, docs/fp8.md.
FP8_TRANSPOSE_ELEMENTS = 16
FP8_TRANSPOSE_REGS = 40  # the producer registers FP8_TRANSPOSE_ELEMENTS was measured with
# fp8 tiles whose transposing producer spills at its setmaxnreg count (40 beside 2 consumers, 32
# beside 3) although the block_n on both sides builds clean: the LDL/STL sit before the consumers'
# setmaxnreg, so no consumer estimate sees it; measured points, not a term. (head_dim_v, consumers):
# (block_n's, causal only). hd64 c2: 96 (28 B), 128 (36 B), 32/64/160 clean; hd64 c3 causal: 128
# (8 B), 96/160 and non-causal 128 clean; hd128 c3 causal: 64 (4 B), 32/96 and non-causal 64 clean.
# Measured 2026-12-05 (docs/hw-measurements.md).
FP8_PRODUCER_SPILL_TILES = {(64, 2): ((96, 128), False), (64, 3): ((128,), True), (128, 3): ((64,), True)}


def fp8_transpose_keys(head_dim_v: int, producer_regs: int) -> int:
    """Keys of V the fp8 producer transposes at a time: a divisor of every fp8 block_n (a multiple of
    FP8_K_STEP) with at most FP8_TRANSPOSE_ELEMENTS elements a producer thread (half below FP8_TRANSPOSE_REGS)."""
    elements = FP8_TRANSPOSE_ELEMENTS if producer_regs >= FP8_TRANSPOSE_REGS else FP8_TRANSPOSE_ELEMENTS // 2
    keys = FP8_K_STEP
    while keys > 8 and head_dim_v * keys > elements * WARPGROUP_THREADS:
        keys //= 2
    return keys


# -- budget arithmetic -----------------------------------------------------------------
def launch_regs(threads: int) -> int:
    """Registers per thread at launch for one block per SM (__launch_bounds__(threads, 1))."""
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // threads // 8 * 8)


def regs_per_thread(elements: int, bytes_per: int) -> int:
    """32-bit registers each thread of a warpgroup holds for a tile spread over the warpgroup."""
    return elements * bytes_per // (4 * WARPGROUP_THREADS)


def consumer_regs_needed(head_dim: int, block_n: int, consumers: int, elem_bytes: int = 2) -> int:
    """Registers per consumer thread: O and S accumulators (fp32), register-P, overhead."""
    acc_o = regs_per_thread(WGMMA_M * head_dim, ACCUM_BYTES)
    acc_s = regs_per_thread(WGMMA_M * block_n, ACCUM_BYTES)
    p_reg = regs_per_thread(WGMMA_M * block_n, elem_bytes)
    return acc_o + acc_s + p_reg + CONSUMER_REG_OVERHEAD[consumers]
