"""The backward family's plan: every number its kernels (preprocess, main, dq or postprocess,
dsinks, postprocess of dK/dV) need, derived once from the forward's resolved Spec.

`plan_backward` takes FlashAttention-3's tile for the head dim, brings it to this formulation and
shrinks it until the register and shared-memory budgets hold; a violated budget raises
`SpecError` naming the field to change. docs/backward.md describes the kernels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from attngen import hw
from attngen.spec import Spec, SpecError, ruled_out
from attngen.kernels.common.plan import (COMPILE_FLAGS, TILE_SLOT_SMEM, Shape, WarpSpecialized, elementwise_variant, head_dim_v,
                                         serving_tags, variant_tags)
from attngen.kernels.fwd.plan import Plan, make_plan, walking_split



# -- the backward pass (docs/backward.md): a second family of kernels from the same Spec ------------
# FlashAttention-3's sm90 backward tiles, (Q tile rows kBlockM, KV tile keys kBlockN, MMA warpgroups)
# per head dim (flash_bwd_launch_template.h; hd128 takes 80 rows without a mask, 64 with one).
FA3_BWD_TILES = {64: (128, 128, 2), 96: (64, 128, 2), 128: (80, 128, 2), 192: (64, 96, 3), 256: (64, 80, 2)}
FA3_BWD_TILES_MASKED = {128: (64, 128, 2)}
BWD_Q_STAGES = 2  # Q, dO, LSE2 and dPsum of this many Q tiles in flight
# Registers a backward consumer thread needs beyond its tiles (indices, loop state, addresses).
# Calibrated on the SASS of `bench/plan_sweep.py --backward` (docs/backward.md, "Registers"): at
# the 240 edge the estimate is 2-11 over the highest register used (hd128 64x128: 232-238 used,
# hd256 by columns: 232-238); the tiles it refuses next to the chosen ones spill (hd64 128x128:
# 264 B, hd96 128x128: 3228 B, hd192/dv64 by keys: 1928 B).
BWD_REG_OVERHEAD = 32
# ...and with packed sequences and an element-wise variant together (softcap, ALiBi, score_mod,
# mask_mod): the sequence's bounds stay live beside the variant's temporaries. Either alone fits
# at the edge (hd128 64x128 softcap 238 used, varlen 232), both spilled at an estimate of 240:
# softcap + varlen 28 B (hd128 64x128), a score_mod + varlen 336 B (hd256 by columns).
BWD_VARLEN_VARIANT_REGS = 8
# ...and with learnable tensors, split by keys: the scatter's loop (P recomputed from the raw S^T beside
# dP^T, the entry's index) spilled 8 B at the edge: hd128 bf16 causal, `score + bias[b, h, q_idx, kv_idx]`
# learnable, 64 x 128 by keys (estimate 240); the same spec without it: 0 B. By columns it fit at the
# edge: hd256 (estimate 240) 0 B, so the term is the key split's.
BWD_LEARNABLE_REGS = 8
# Refused: packed sequences, a variant that may read the head (ALiBi, score_mod, mask_mod) and
# deterministic GQA together (the CTA loops over the group's heads) spilled at every head dim
# measured, whatever the tile: causal, window [511, -1], ALiBi, varlen, deterministic, GQA 8 by
# columns: hd64 113 B (estimate 216), hd96 270 B (232), hd128 416 B + 152 B of stack (184); hd128
# by keys 84 B (240). Not a register share: the tiles are small there. Softcap in its place fits
# (hd64 196 used); ALiBi without the band 230 (docs/backward.md, "Registers").
VARLEN_GROUPED_VARIANT_SPILLS = "hd64 113 B, hd96 270 B, hd128 by keys 84 B and by columns 416 B"
# the persistent main kernel holds each tile's sequence bounds too; ALiBi or softcap alone built clean
VARLEN_PERSISTENT_ALIBI_SOFTCAP_SPILLS = "hd64 causal 36 B, hd128 causal 40 B, hd64 causal deterministic 24 B"


@dataclasses.dataclass(frozen=True)
class BackwardPlan(WarpSpecialized):
    """Every number the three backward kernels need (templates/bwd/fa3_bwd.py.j2).

    The main kernel's CTA owns one KV tile of BLOCK_N keys; consumer warpgroup g owns keys
    [g WG_KEYS, (g + 1) WG_KEYS) of it (one wgmma M tile: S^T = K_g Q^T, dP^T = V_g dO^T are SS
    wgmmas, P^T and dS^T the register A operands of dV += P^T dO and dK += dS^T Q, and dQ_g = dS_g K_g
    reads dS^T from shared memory), and loops over the Q tiles of BLOCK_M rows that see the tile.
    """

    forward: Plan  # the forward kernel with lse = true: O and the LSE the backward reads
    spec: Spec  # the forward's resolved spec (variants, dtype, head dims)
    shape: Shape | None
    name: str
    hash: str
    block_m: int  # Q tile rows (the dQ wgmma's M: a multiple of 64)
    block_n: int  # KV tile keys: consumers x WG_KEYS
    wg_keys: int
    consumers: int
    q_stages: int
    threads: int
    consumer_threads: int
    warpgroup_threads: int
    tma_threads: int
    producer_regs: int
    consumer_regs: int
    consumer_regs_needed: int
    smem: dict
    ds_bar: int  # named barrier of consumer g's dS staging: ds_bar + g
    dq_bar: int  # ... and of its dQ staging: dq_bar + g
    kv_accum: bool  # GQA/MQA: dK and dV summed into float32 accumulators per KV head (a postprocess converts them)
    fa3_tile: tuple  # FlashAttention-3's (kBlockM, kBlockN, warpgroups) for this head dim, for the record
    columns: bool = False  # MMA warpgroups split the head dims of dK, dV, dQ (each all WG_KEYS keys), not the keys
    deterministic: bool = False  # dQ by the dq kernel (KV tiles in order, no atomics); GQA's heads looped in the CTA
    dq_block_m: int = 0  # the dq kernel's Q tile rows (consumers x 64) ...
    dq_block_n: int = 0  # ... its KV tile keys ...
    dq_kv_stages: int = 0  # ... and K/V stages
    dq_smem: dict = dataclasses.field(default_factory=dict)
    dq_regs_needed: int = 0  # the dq kernel's registers per MMA-warpgroup thread (bwd_dq_regs_needed)
    compile_flags: tuple = COMPILE_FLAGS


def bwd_kernel_name(spec: Spec, block_m: int, block_n: int, consumers: int, q_stages: int, columns: bool = False) -> str:
    parts = [f"fa3_bwd_hd{spec.head_dim}", hw.DTYPES[spec.dtype].tag, "causal" if spec.causal else "full",
             f"g{spec.gqa_group}", f"c{consumers}", f"q{q_stages}", f"m{block_m}n{block_n}"] + (["cols"] if columns else [])
    tail = ["det"] if spec.deterministic else []
    if spec.learnable:  # the tensors whose gradients the main kernel scatters
        tail.append("dt" + hashlib.sha256(",".join(spec.learnable).encode()).hexdigest()[:6])
    if spec.scheduler != "single":
        tail.append(spec.scheduler)
    return "_".join(parts + [t for t in variant_tags(spec) if t != "lse"] + serving_tags(spec) + tail)


def bwd_regs_needed(spec: Spec, block_m: int, columns: int = 1) -> int:
    """Per consumer thread: dK and dV accumulators (WG_KEYS x head dims / columns, float32), then the
    larger of the S^T and dP^T tiles with P^T (WG_KEYS x block_m) and the dQ tile with dS^T
    (block_m x head_dim / columns). `columns`: the warpgroups that split the head dims (1: they split keys)."""
    r = hw.regs_per_thread
    acc = r(hw.WGMMA_M * spec.head_dim // columns, 4) + r(hw.WGMMA_M * head_dim_v(spec) // columns, 4)
    scores = 2 * r(hw.WGMMA_M * block_m, 4) + r(hw.WGMMA_M * block_m, 2)
    dq = r(block_m * spec.head_dim // columns, 4) + r(hw.WGMMA_M * block_m, 2)
    packed = elementwise_variant(spec) and spec.layout == "varlen"
    return (acc + max(scores, dq) + BWD_REG_OVERHEAD + (BWD_VARLEN_VARIANT_REGS if packed else 0)
            + (BWD_LEARNABLE_REGS if spec.learnable and columns == 1 else 0))


def bwd_dq_regs_needed(spec: Spec) -> int:
    """The deterministic dq kernel's MMA-warpgroup thread: its dQ accumulator (64 rows x head_dim,
    float32), S and dP (64 x DQ_BLOCK_N, float32) and dS (the dtype)."""
    r = hw.regs_per_thread
    tile = hw.WGMMA_M * DQ_BLOCK_N
    return r(hw.WGMMA_M * spec.head_dim, 4) + 2 * r(tile, 4) + r(tile, 2) + BWD_REG_OVERHEAD


def varlen_variant_note(spec: Spec) -> str:
    """The refusal's account of BWD_VARLEN_VARIANT_REGS, where it applies."""
    if bwd_regs_needed(spec, hw.WGMMA_M, 2) == bwd_regs_needed(dataclasses.replace(spec, layout="bshd"), hw.WGMMA_M, 2):
        return ""
    return f" ({BWD_VARLEN_VARIANT_REGS} of them for layout 'varlen' beside an element-wise variant: that pair spilled at the edge)"


def bwd_smem_layout(spec: Spec, block_m: int, block_n: int, consumers: int, q_stages: int, columns: bool = False) -> dict:
    e = hw.DTYPES[spec.dtype].bytes
    d, dv = spec.head_dim, head_dim_v(spec)
    smem = {"K": block_n * d * e, "V": block_n * dv * e, "Q": q_stages * block_m * d * e, "dO": q_stages * block_m * dv * e,
            "LSE2": q_stages * block_m * 4, "dPsum": q_stages * block_m * 4}
    if not spec.deterministic:  # dQ is the dq kernel's there
        dq_cols = d // consumers if columns else d
        smem.update({"dS": consumers * hw.WGMMA_M * block_m * e, "dQ": consumers * block_m * dq_cols * 4})
    if spec.scheduler == "persistent":  # the main kernel's tile index, handed from the producer to the consumers
        smem["tile"] = TILE_SLOT_SMEM
    return smem


DQ_BLOCK_N = 64  # the deterministic dq kernel's KV tile (its S, dP and dQ tiles stay in registers beside each other)
DQ_KV_STAGES = 2


def dq_smem_layout(spec: Spec, block_m: int, block_n: int, stages: int) -> dict:
    e = hw.DTYPES[spec.dtype].bytes
    d, dv = spec.head_dim, head_dim_v(spec)
    return {"Q": block_m * d * e, "dO": block_m * dv * e, "LSE2": block_m * 4, "dPsum": block_m * 4,
            "K": stages * block_n * d * e, "V": stages * block_n * dv * e}


def autograd_spec(spec: Spec) -> Spec:
    """The forward attngen.attention runs when a gradient is wanted: the spec with its LSE, which the
    backward reads (ops.fwd_arguments asks for it; backward.precompile_training builds it)."""
    return dataclasses.replace(spec, lse=True)


FORWARD_ONLY_FIELDS = {"consumers": 2, "k_stages": 2, "v_stages": 2, "block_m": None, "block_n": None,
                       "pingpong": None, "aligned": False, "steady_loop": "one"}


def single_tile_twin(spec: Spec) -> BackwardPlan:
    """The single-tile backward plan with the persistent one's tiles (its producer's larger register
    share may move a head dim to the column split): what a persistent backward's bits are held to,
    since another tile sums in another order."""
    tiles = plan_backward(dataclasses.replace(spec, scheduler="persistent"))
    return plan_backward(dataclasses.replace(spec, scheduler="single"), block_m=tiles.block_m, columns=tiles.columns)


def plan_backward(spec: Spec, shape: Shape | None = None, *, check_registers: bool = True,
                  block_m: int | None = None, columns: bool | None = None) -> BackwardPlan:
    """The backward kernels' plan: FlashAttention-3's tile for the head dim, brought to this
    formulation (Q tile rows a multiple of the wgmma M of the dQ GEMM; one 64-key slice of the KV
    tile per consumer) and shrunk until the register and shared-memory budgets hold.
    `block_m` / `columns` fix the tile instead (the register sweep builds refused neighbours with
    them and check_registers=False, bench/plan_sweep.py --backward)."""
    if not isinstance(spec, Spec):
        raise SpecError("<spec>", type(spec).__name__, "expected an attngen.Spec")
    if spec.dtype == hw.E4M3:
        raise SpecError("dtype", spec.dtype, "fp8 has no backward: train in 16 bits (float16 or bfloat16), as FlashAttention-3")
    if spec.paged_kv:
        raise SpecError("paged_kv", True, "a paged KV cache is an inference layout: the backward takes dense k and v")
    if spec.splits != 1:
        raise SpecError("splits", spec.splits, "split-KV is an inference layout: the backward runs with splits = 1")
    if spec.kv_dtype is not None and spec.kv_dtype != spec.dtype:
        raise SpecError("kv_dtype", spec.kv_dtype, "an fp8 KV cache is for inference: the backward takes k and v of dtype")
    if spec.block_mask and spec.deterministic and spec.gqa_group > 1:
        raise ruled_out("deterministic", True, "false", f"block_mask = true and gqa_group = {spec.gqa_group}", "the "
                        "deterministic backward loops over a KV head's query heads in one CTA, whose block-mask lists differ per head")
    # A block mask's backward visits its listed tiles (BWD_BLOCK_MASK_TENSORS, docs/backward.md)
    if spec.learnable and spec.deterministic and spec.layout != "bshd":
        raise ruled_out("deterministic", True, "false", f"learnable = {list(spec.learnable)} and layout "
                        f"{spec.layout!r}", "the fixed-order walk over the learnable tensors' terms is laid out for "
                        "bshd (a [batch, heads, q_len, kv_len] buffer)")
    forward = make_plan(dataclasses.replace(spec, lse=True, deterministic=False, learnable=()), shape)
    forward_spec = forward.spec
    # The backward's identity (name, hash, header): the fields its kernels read; the forward's own tiling,
    # stages, ping-pong, alignment and loop form at their defaults, so specs that differ only there
    # share one backward module (default and seed_parity did, under one name with two headers)
    rspec = dataclasses.replace(forward_spec, deterministic=spec.deterministic, learnable=spec.learnable,
                                **FORWARD_ONLY_FIELDS)
    masked = rspec.causal or rspec.window != (-1, -1) or bool(rspec.mask_mod.strip()) or rspec.softcap
    per_head = rspec.alibi or rspec.score_mod.strip() or rspec.mask_mod.strip()  # may read the visit's head
    if check_registers and per_head and rspec.layout == "varlen" and rspec.deterministic and rspec.gqa_group > 1:
        raise SpecError("deterministic", True, "with layout 'varlen', alibi, a score_mod or a mask_mod, and gqa_group "
                        f"{rspec.gqa_group} the deterministic backward spills at every head dim "
                        f"(measured: {VARLEN_GROUPED_VARIANT_SPILLS}); use deterministic = false or gqa_group = 1")
    if check_registers and spec.scheduler == "persistent" and rspec.layout == "varlen" and rspec.alibi and rspec.softcap:
        raise SpecError("scheduler", "persistent", "with layout 'varlen', alibi and softcap the persistent backward's "
                        f"main kernel spills (measured: {VARLEN_PERSISTENT_ALIBI_SOFTCAP_SPILLS}); use scheduler = "
                        '"single", or alibi or softcap alone')
    fa3 = (FA3_BWD_TILES_MASKED if masked else {}).get(rspec.head_dim, FA3_BWD_TILES[rspec.head_dim])
    fa3_m, fa3_n, _ = fa3
    consumers = 2
    # a block mask's producer walks its lists per Q tile: the forward's walking share (24 registers spilled)
    # a block mask's producer walks its lists per tile; a persistent one takes and decodes each tile: at
    # 24 registers it spilled (hd128 causal: 52 B, deterministic 76 B, its dq kernel 36 B; attngen build)
    walking = spec.block_mask or spec.scheduler == "persistent"
    producer_regs, consumer_regs = walking_split(consumers) if walking else hw.REG_SPLIT[consumers]
    if block_m is not None and (type(block_m) is not int or block_m < hw.WGMMA_M or block_m % hw.WGMMA_M):
        raise SpecError("block_m", block_m, f"expected a multiple of {hw.WGMMA_M} (the dQ wgmma's M)")
    fixed = block_m is not None
    block_m = block_m if fixed else max(hw.WGMMA_M, fa3_m // hw.WGMMA_M * hw.WGMMA_M)
    while check_registers and not fixed and block_m > hw.WGMMA_M and bwd_regs_needed(rspec, block_m) > consumer_regs:
        block_m -= hw.WGMMA_M
    # the warpgroups split the tile's keys; where dK and dV of 64 keys do not fit, its head-dim columns
    if columns is None:
        columns = bwd_regs_needed(rspec, block_m) > consumer_regs
    needed = bwd_regs_needed(rspec, block_m, consumers if columns else 1)
    if check_registers and needed > consumer_regs and spec.scheduler == "persistent":
        raise ruled_out("scheduler", spec.scheduler, '"single"', f"head_dim = {rspec.head_dim}", "the persistent "
                        f"backward's producer takes {producer_regs} registers, leaving {consumer_regs} per consumer thread; "
                        f"dK and dV split by columns need about {needed}")
    if check_registers and needed > consumer_regs:
        raise SpecError("head_dim", rspec.head_dim,
                        f"the generated backward keeps dK and dV of 64 keys in registers, split over {consumers} "
                        f"warpgroups by head-dim columns: about {needed} registers per thread at head_dim "
                        f"{rspec.head_dim} / head_dim_v {head_dim_v(rspec)}{varlen_variant_note(rspec)}, more than the "
                        f"{consumer_regs} setmaxnreg gives")
    block_n = hw.WGMMA_M if columns else hw.WGMMA_M * consumers
    q_stages = BWD_Q_STAGES
    smem = bwd_smem_layout(rspec, block_m, block_n, consumers, q_stages, columns)
    while sum(smem.values()) > hw.SMEM_PER_BLOCK and q_stages > 1:
        q_stages -= 1
        smem = bwd_smem_layout(rspec, block_m, block_n, consumers, q_stages, columns)
    if sum(smem.values()) > hw.SMEM_PER_BLOCK:
        raise SpecError("head_dim", rspec.head_dim, f"the backward needs {sum(smem.values())} bytes of shared memory; "
                        f"sm_90 allows {hw.SMEM_PER_BLOCK}")
    name = bwd_kernel_name(rspec, block_m, block_n, consumers, q_stages, columns)
    blob = json.dumps({"pass": "backward", "spec": rspec.canonical_dict(), "tile": [block_m, block_n, consumers, q_stages, columns]},
                      sort_keys=True).encode()
    threads = hw.WARPGROUP_THREADS * (consumers + 1)
    return BackwardPlan(
        forward=forward, spec=rspec, shape=shape, name=name, hash=hashlib.sha256(blob).hexdigest()[:12],
        block_m=block_m, block_n=block_n, wg_keys=hw.WGMMA_M, consumers=consumers, q_stages=q_stages,
        threads=threads, consumer_threads=hw.WARPGROUP_THREADS * consumers, warpgroup_threads=hw.WARPGROUP_THREADS,
        tma_threads=hw.WARP_THREADS, producer_regs=producer_regs, consumer_regs=consumer_regs,
        consumer_regs_needed=needed, smem=smem, ds_bar=1, dq_bar=1 + consumers,
        kv_accum=rspec.gqa_group > 1 and not rspec.deterministic, fa3_tile=fa3, columns=columns,
        deterministic=rspec.deterministic,
        dq_block_m=hw.WGMMA_M * consumers, dq_block_n=DQ_BLOCK_N, dq_kv_stages=DQ_KV_STAGES,
        dq_smem=dq_smem_layout(rspec, hw.WGMMA_M * consumers, DQ_BLOCK_N, DQ_KV_STAGES) if rspec.deterministic else {},
        dq_regs_needed=bwd_dq_regs_needed(rspec) if rspec.deterministic else 0)
