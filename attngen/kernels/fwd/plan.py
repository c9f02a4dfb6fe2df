"""Every number the kernel needs, derived once from a Spec (and optionally a static shape).

`make_plan` resolves what the user left open (tile sizes, ping-pong), checks every budget
and returns a `Plan`: the resolved spec, the kernel's name and hash, thread ranges, the
setmaxnreg split, shared-memory bytes, barrier ids and arrival counts and the build flags
(the softmax scale is not here: the kernel takes it at call time). Each entry point (the CLI, attngen.emulate, attngen.attention, ...)
makes the plan once and passes it down; a violated budget raises `SpecError` naming the
field to change, before anything is rendered.
"""

from __future__ import annotations

import dataclasses

from attngen import expr, hw, tiles
from attngen.spec import FIELDS, Spec, SpecError, out_dtype_of, ruled_out
from attngen.kernels.fwd.kv_cache import descale_tensors, kv_fp8, staging_bytes
from attngen.kernels.common.plan import (BLOCK_MASK_TENSORS, COMPILE_FLAGS, DEFAULT_PAGE_SIZE, TILE_SLOT_SMEM, ConsumerBarriers,
                                         ExtraTensor, Shape, WarpSpecialized, check_shape, elementwise_variant, head_dim_v,
                                         serving_tags, spec_hash, transforms_scores, variant_tags)

BLOCK_N_CANDIDATES = (128, 112, 96, 80, 64, 48, 32, 16)
# fp8: FlashAttention-3's fp8 tile (tile_size.h, 1-byte elements) per head dim is the first tried;
# the PV GEMM contracts over the keys, so every candidate is a multiple of hw.FP8_K_STEP.
FA3_FP8_BLOCK_N = {64: 160, 96: 128, 128: 224, 192: 160, 256: 128}
FP8_BLOCK_N_CANDIDATES = (224, 192, 160, 128, 96, 64, 32)
# The fp8 kernels' call-time descales (FA3's): float32 [batch, kv_heads], query head h uses its KV head's.
DESCALE_TENSORS = (("q_descale", "Q_descale"), ("k_descale", "K_descale"), ("v_descale", "V_descale"))


@dataclasses.dataclass(frozen=True)
class Plan(WarpSpecialized):
    spec: Spec  # resolved: block_m, block_n and pingpong filled in
    shape: Shape | None
    name: str  # canonical kernel name: every axis of the resolved spec
    hash: str  # 12 hex digits of the resolved spec
    threads: int
    consumer_threads: int  # threads [0, consumer_threads) are consumers; the rest the producer
    wg_rows: int  # query rows per consumer warpgroup (one wgmma M tile)
    warpgroup_threads: int
    tma_threads: int  # the producer warp that issues TMA and arrives on "full" barriers
    launch_regs: int  # register cap per thread at launch (__launch_bounds__(threads, 1))
    producer_regs: int
    consumer_regs: int
    consumer_regs_needed: int
    smem: dict  # buffer -> bytes (dynamic shared memory)
    consumer_barriers: tuple  # ConsumerBarriers per consumer
    pingpong_threads: int  # threads that meet at one ping-pong barrier
    primer: int | None  # the consumer that arrives once at the start so that warpgroup 0 issues first
    epilogue_bar: int  # first named barrier of the epilogues (consumer g uses epilogue_bar + g)
    compile_flags: tuple
    # Variants (docs/variants.md); at the spec defaults they change nothing in the kernel.
    head_dim_v: int = 0
    window_left: int | None = None  # keys before row + offset - left are masked (None: unbounded)
    window_right: int | None = None  # keys after row + offset + right are masked; causal makes it <= 0
    score_expr: expr.Expr | None = None  # the parsed score_mod
    mask_expr: expr.Expr | None = None  # the parsed mask_mod
    extra: tuple = ()  # ExtraTensor per prim_func parameter after O, in order
    prescaled: bool = False  # a score transform runs: acc_s holds the final score in base-2 units
    guard_empty_rows: bool = False  # some query rows may see no key: a block still visits one tile, such a row's LSE is -inf
    # Serving (docs/serving.md): packed sequences, a paged KV cache, split-KV.
    varlen: bool = False  # q, k, v packed (total, heads, D); per-sequence lengths from cu_seqlens / seqused_k
    page_size: int = 0  # keys per page of the paged K/V cache; 0: K and V are dense
    split_kv: bool = False  # each block also takes a split of the K tiles; a combine kernel merges the splits
    pack_gqa: bool = False  # the query heads of one KV head are rows of one tile (decode: 1 query still fills M)
    block_mask: bool = False  # the kernel visits the KV tiles of a call-time block mask (BLOCK_MASK_TENSORS)
    fp8: bool = False  # e4m3 Q, K, V (docs/fp8.md): P and V^T in shared memory, descales, O in out_dtype


def kernel_name(spec: Spec) -> str:
    """Canonical readable name of a resolved spec; every axis is in it."""
    parts = [
        f"fa3_fwd_hd{spec.head_dim}",
        hw.DTYPES[spec.dtype].tag + (f"_o{hw.DTYPES[out_dtype_of(spec)].tag}" if is_fp8(spec) else ""),
        "causal" if spec.causal else "full",
        f"g{spec.gqa_group}",
        f"c{spec.consumers}",
        f"k{spec.k_stages}v{spec.v_stages}",
        f"m{spec.block_m}n{spec.block_n}",
    ]
    if spec.consumers >= 2 and not spec.pingpong:
        parts.append("nopp")
    if spec.aligned:
        parts.append("aligned")
    if spec.steady_loop != "one":
        parts.append("splitloop")
    parts += variant_tags(spec) + serving_tags(spec)
    if spec.scheduler != "single":
        parts.append(spec.scheduler)
    if spec.v_layout != "keys":
        parts.append("vtransposed")
    return "_".join(parts)


def is_fp8(spec: Spec) -> bool:
    return spec.dtype == hw.E4M3


def smem_layout(spec: Spec, block_n: int) -> dict:
    elem = hw.DTYPES[spec.dtype].bytes
    rows_q = hw.WGMMA_M * spec.consumers
    dv = head_dim_v(spec)
    smem = {
        "Q": rows_q * spec.head_dim * elem,
        "K": spec.k_stages * block_n * spec.head_dim * elem,
        "V": spec.v_stages * block_n * dv * elem,
        "O": rows_q * dv * hw.DTYPES[out_dtype_of(spec)].bytes,  # output staged in shared memory, then one TMA store
    }
    if is_fp8(spec):  # fp8 wgmma reads both operands K-major from shared memory: V transposed, P stored
        smem["Vt"] = spec.v_stages * dv * block_n * elem
        smem["P"] = rows_q * block_n * elem
        if spec.v_layout == "transposed":  # the TMA lands V^T itself: no V_shared to transpose from
            del smem["V"]
    if spec.splits != 1:
        del smem["O"]  # float32 partial outputs go straight from registers to global memory
    if spec.scheduler == "persistent":
        smem["tile"] = TILE_SLOT_SMEM
    return smem | staging_bytes(spec, block_n, dv)


def variant_regs(spec: Spec) -> int:
    """Extra registers per consumer thread for the element-wise score variants (0 without them)."""
    return hw.VARIANT_REG_OVERHEAD if elementwise_variant(spec) else 0


def mask_regs(spec: Spec) -> int:
    """Extra registers per consumer thread for a diagonal mask (causal or a window). The element-wise
    variants' overhead was measured on a causal windowed kernel, so it already covers the mask."""
    if variant_regs(spec):
        return 0
    left, right = spec.window
    if left >= 0 and (spec.causal or right >= 0):  # a band: both edges' indices live
        return hw.BAND_MASK_REG_OVERHEAD[spec.consumers]
    diagonal = spec.causal or spec.window != (-1, -1)
    return hw.DIAGONAL_MASK_REG_OVERHEAD[spec.consumers] if diagonal else 0


def sequence_regs(spec: Spec) -> int:
    """Extra registers per consumer thread for packed sequences (their offsets and lengths)."""
    return hw.PER_SEQUENCE_REG_OVERHEAD if spec.layout == "varlen" else 0


def regs_needed(spec: Spec, block_n: int) -> int:
    # O's accumulator is head_dim_v wide; S and P are block_n wide whatever the head dims
    return (hw.consumer_regs_needed(head_dim_v(spec), block_n, spec.consumers, hw.DTYPES[spec.dtype].bytes)
            + variant_regs(spec) + mask_regs(spec) + sequence_regs(spec)
            + (hw.BLOCK_MASK_REG_OVERHEAD if spec.block_mask else 0))


def reg_split(spec: Spec) -> tuple:
    """setmaxnreg (producer, consumer) registers: FA3's split, or a serving producer's larger share
    (page and split lookups per tile), the consumers keeping what the pool leaves them."""
    # a block mask's producer walks its lists per tile; an fp8 cache's producer dequantizes each tile;
    # fp8's producer warpgroup transposes V
    if is_fp8(spec) and spec.scheduler == "persistent":
        return walking_split(spec.consumers, hw.FP8_PERSISTENT_PRODUCER_REGS)
    if (spec.paged_kv or spec.layout == "varlen") and spec.scheduler == "persistent":  # it reads a tile list
        return walking_split(spec.consumers, hw.PER_SEQUENCE_PERSISTENT_PRODUCER_REGS)
    if spec.paged_kv or spec.splits != 1 or spec.block_mask or kv_fp8(spec) or is_fp8(spec):
        return walking_split(spec.consumers)
    if spec.scheduler == "persistent":  # the producer takes and decodes each tile: at 24 registers it spilled 8 B
        return walking_split(spec.consumers)
    return hw.REG_SPLIT[spec.consumers]


def walking_split(n: int, producer: int | None = None) -> tuple:
    """The split of n consumers whose producer looks up each tile (pages, splits, a block mask's lists,
    a persistent schedule's next tile), or holds `producer` registers where that is given."""
    fa3_producer, consumer = hw.REG_SPLIT[n]
    producer = producer or hw.SERVING_PRODUCER_REGS.get(n, fa3_producer)
    pool = (n + 1) * hw.launch_regs(hw.WARPGROUP_THREADS * (n + 1))
    return producer, min(consumer, (pool - producer) // n // 8 * 8)  # setmaxnreg counts are multiples of 8


# ALiBi with split-KV and 3 consumers: from block_n 80 nvcc keeps the S tile in local memory
# (160 B stack, causal or not; the per-element distance inlines the split's first tile, a division
# by the runtime num_splits), at 64 it stays in registers (bench/plan_sweep.py; not a register
# overflow, so not in the estimate). Measured with bshd; the varlen form fitted at 80.
ALIBI_SPLIT_MAX_BLOCK_N = 64


def block_n_limit(spec: Spec) -> int | None:
    """The largest block_n the emitted kernel keeps in registers whatever the estimate, or None."""
    if spec.alibi and spec.splits != 1 and spec.consumers == 3:
        return ALIBI_SPLIT_MAX_BLOCK_N
    return None


def fp8_producer_spills(spec: Spec, block_n: int) -> bool:
    """An fp8 tile whose V-transposing producer spilled where its neighbours did not (hw.FP8_PRODUCER_SPILL_TILES)."""
    if not is_fp8(spec) or spec.v_layout == "transposed":  # measured on the transposing producer only
        return False
    block_ns, causal_only = hw.FP8_PRODUCER_SPILL_TILES.get((head_dim_v(spec), spec.consumers), ((), False))
    return block_n in block_ns and (spec.causal or not causal_only)


def tile_fits(spec: Spec, block_n: int, consumer_regs: int) -> bool:
    """block_n within the register estimate and shared memory, and not a tile measured to spill."""
    return (regs_needed(spec, block_n) <= consumer_regs and sum(smem_layout(spec, block_n).values()) <= hw.SMEM_PER_BLOCK
            and not fp8_producer_spills(spec, block_n))


def default_block_n(spec: Spec) -> int:
    """The largest candidate within both budgets (the smallest if none fits: make_plan then says why).
    A paged cache also needs the tile to divide the page (one TMA box per tile, inside one page)."""
    _, consumer_regs = reg_split(spec)
    candidates = block_n_candidates(spec)
    limit = block_n_limit(spec) or candidates[0]
    fits_page = [bn for bn in candidates if (not spec.paged_kv or spec.page_size % bn == 0) and bn <= limit]
    for bn in fits_page:
        if tile_fits(spec, bn, consumer_regs):
            return bn
    return fits_page[-1]


def block_n_candidates(spec: Spec) -> tuple:
    """The block_n values default_block_n tries, largest first (fp8: from FlashAttention-3's tile down)."""
    if is_fp8(spec):
        return tuple(bn for bn in FP8_BLOCK_N_CANDIDATES if bn <= FA3_FP8_BLOCK_N[spec.head_dim])
    return BLOCK_N_CANDIDATES


def canonical(spec: Spec) -> Spec:
    """One spec per kernel, so that equal kernels get equal names, hashes and emitted text.

    Under causal a window's right bound says nothing (the diagonal bounds every row already;
    plan_variant folds it to 0), so it is dropped; score_mod and mask_mod are written as they
    parse (expr.Expr.canonical: no comments, spacing or redundant parentheses, identifiers
    NFKC-normalised as Python reads them). The presets' expressions are canonical as written.
    """
    fields = {}
    if spec.kv_dtype == spec.dtype:
        fields["kv_dtype"] = None  # a cache of the queries' own dtype is the plain kernel
    if spec.causal and spec.window[1] >= 0:
        fields["window"] = (spec.window[0], -1)
    for field in ("score_mod", "mask_mod"):
        text = getattr(spec, field)
        canon = expr.parse(text, field).canonical if text.strip() else ""
        if canon != text:
            fields[field] = canon
    return dataclasses.replace(spec, **fields) if fields else spec


def masks_some_tile(spec: Spec) -> bool:
    """Some K tile may need a mask: causal, a window, a mask_mod, or lengths not tile multiples."""
    return spec.causal or not spec.aligned or spec.window != (-1, -1) or bool(spec.mask_mod.strip())


def splits_steady_loop(spec: Spec) -> bool:
    """steady_loop = "split" makes a different kernel: some visits are masked and some are not
    (a mask_mod masks every visit; without a mask there is nothing to set apart)."""
    return masks_some_tile(spec) and not spec.mask_mod.strip()


def resolve(spec: Spec) -> Spec:
    """The spec with every "choose for me" field filled in (and canonical)."""
    spec = canonical(spec)
    if spec.paged_kv and spec.page_size is None:
        spec = dataclasses.replace(spec, page_size=DEFAULT_PAGE_SIZE)
    if not splits_steady_loop(spec):  # both forms are one loop: one name and hash for one kernel
        spec = dataclasses.replace(spec, steady_loop="one")
    if is_fp8(spec):  # written out: the output's type is an axis of every fp8 kernel's name
        spec = dataclasses.replace(spec, out_dtype=out_dtype_of(spec))
    return dataclasses.replace(
        spec,
        head_dim_v=head_dim_v(spec),
        block_m=spec.block_m if spec.block_m is not None else hw.WGMMA_M * spec.consumers,
        block_n=spec.block_n if spec.block_n is not None else default_block_n(spec),
        pingpong=spec.pingpong if spec.pingpong is not None else spec.consumers >= 2,
    )


def make_plan(spec: Spec, shape: Shape | None = None, *, check_registers: bool = True) -> Plan:
    """Resolve `spec`, check its budgets (and `shape`), derive every number the kernel needs.

    `check_registers=False` skips the register estimate (bench/register_budget.py lets ptxas judge).
    """
    if not isinstance(spec, Spec):
        raise SpecError("<spec>", type(spec).__name__, "expected an attngen.Spec")
    spec = resolve(spec)
    n = spec.consumers
    threads = hw.WARPGROUP_THREADS * (n + 1)
    launch_regs = hw.launch_regs(threads)
    producer_regs, consumer_regs = reg_split(spec)
    if producer_regs + n * consumer_regs > (n + 1) * launch_regs:
        raise SpecError("consumers", n, f"setmaxnreg split {producer_regs}+{n}x{consumer_regs} exceeds the {threads}-thread pool")

    if check_registers and spec.scheduler == "persistent" and n > 2:
        raise ruled_out("consumers", n, "1 or 2", 'scheduler = "persistent"', "with 3 consumers (32 producer and "
                        "160 consumer registers) the persistent kernel's per-tile state spilled, producer and consumers: "
                        "36 to 120 B measured (hd64 block_n 96 and 112, hd128 block_n 80)")
    needed = regs_needed(spec, spec.block_n)
    if check_registers and needed > consumer_regs:
        _register_budget_error(spec, needed, consumer_regs)
    if check_registers and is_fp8(spec) and spec.layout == "varlen" and n == 3:
        raise SpecError("consumers", n, "an fp8 varlen kernel with 3 consumers spills (hd128 causal: 44 bytes, its 32-register "
                        "producer and its consumers; bench/plan_sweep.py --fp8): use 1 or 2 consumers")
    if check_registers and fp8_producer_spills(spec, spec.block_n):
        fits = [bn for bn in block_n_candidates(spec) if tile_fits(spec, bn, consumer_regs)]
        raise SpecError("block_n", spec.block_n, f"this fp8 tile (head_dim_v {head_dim_v(spec)}, {n} consumers"
                        + (", causal" if spec.causal else "") + f") spilled in its {producer_regs}-register producer, "
                        f"the V transpose (bench/plan_sweep.py --fp8); block_n in {sorted(fits)} fits")
    limit = block_n_limit(spec)
    if check_registers and limit and spec.block_n > limit:
        raise SpecError("block_n", spec.block_n, f"with alibi, split-KV and 3 consumers the S tile of a block_n above {limit} "
                        f"goes to local memory (nvcc); block_n <= {limit} fits, or use 2 consumers")

    smem = smem_layout(spec, spec.block_n)
    total = sum(smem.values())
    if total > hw.SMEM_PER_BLOCK:
        detail = ", ".join(f"{k} {v}" for k, v in smem.items())
        raise SpecError(
            "k_stages/v_stages", (spec.k_stages, spec.v_stages),
            f"the plan needs {total} bytes of shared memory ({detail}) but sm_90 allows {hw.SMEM_PER_BLOCK} (227 KiB) "
            f"per block; use fewer stages or a smaller block_n",
        )

    if spec.paged_kv and spec.page_size % spec.block_n:
        raise SpecError("page_size", spec.page_size, f"expected a multiple of block_n = {spec.block_n}: each K/V tile is "
                        f"one TMA box inside one page (TileLang cannot land a smaller box in the swizzled tile)")
    if shape is not None:
        if spec.layout != "bshd" or spec.paged_kv:
            raise SpecError("shape", str(shape), "a varlen or paged kernel reads its lengths at call time; it has no static shape")
        check_shape(spec, shape)
    variant = plan_variant(spec, shape)

    if spec.pingpong:
        # Named barrier 0 is __syncthreads; the ring uses 1..n: warpgroup g waits on g+1, signals g+2 (mod n).
        barriers = tuple(ConsumerBarriers(wait_bar=g + 1, signal_bar=(g + 1) % n + 1) for g in range(n))
        ring = n
    else:
        barriers = tuple(ConsumerBarriers(0, 0) for _ in range(n))
        ring = 0

    return Plan(
        spec=spec,
        shape=shape,
        name=kernel_name(spec),
        hash=spec_hash(spec),
        threads=threads,
        consumer_threads=hw.WARPGROUP_THREADS * n,
        wg_rows=hw.WGMMA_M,
        warpgroup_threads=hw.WARPGROUP_THREADS,
        tma_threads=hw.WARP_THREADS,
        launch_regs=launch_regs,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        consumer_regs_needed=needed,
        smem=smem,
        consumer_barriers=barriers,
        pingpong_threads=2 * hw.WARPGROUP_THREADS,
        primer=n - 1 if spec.pingpong else None,
        epilogue_bar=1 + ring,
        compile_flags=COMPILE_FLAGS,
        **variant,
    )


def plan_variant(spec: Spec, shape: Shape | None) -> dict:
    """The variant fields' derived numbers: window bounds (causal folded in), parsed mods,
    the extra kernel parameters, whether rows can see no key."""
    left, right = tiles.edges(spec.causal, spec.window)  # causal is the window's right edge at the diagonal
    score_expr = expr.parse(spec.score_mod, "score_mod") if spec.score_mod.strip() else None
    mask_expr = expr.parse(spec.mask_mod, "mask_mod") if spec.mask_mod.strip() else None

    extra = []
    per_sequence = spec.layout == "varlen" or spec.paged_kv  # lengths differ by sequence: read at run time
    if spec.lse:
        lse_axes = ("heads", "total_q") if spec.layout == "varlen" else ("batch", "heads", "q_len")
        extra.append(ExtraTensor("lse", "LSE", lse_axes, output=True))
    if spec.alibi:
        extra.append(ExtraTensor("alibi_slopes", "Alibi", ("heads",)))
    if spec.sinks:
        extra.append(ExtraTensor("sinks", "Sinks", ("heads",)))
    extra += descale_tensors(spec)
    used = {}
    for field, e in (("score_mod", score_expr), ("mask_mod", mask_expr)):
        for name, axes in (e.tensors if e else ()):
            if name in used and len(used[name][1]) != len(axes):
                raise SpecError(field, getattr(spec, field),
                                f"tensor `{name}` has {len(used[name][1])} indices in {used[name][0]} but {len(axes)} here")
            if name in used:
                axes = tuple(a if a == b else None for a, b in zip(axes, used[name][1]))
            used[name] = (used.get(name, (field,))[0], axes)

    for name, (field, _) in used.items():
        if name in FIELDS:  # attngen.attention takes spec fields and tensors as keywords
            raise SpecError(field, getattr(spec, field), f"tensor `{name}` has the name of a spec field; rename it")
    if per_sequence:  # no kernel-wide q_len/kv_len to size a mod's tensor by: those axes are free
        used = {name: (field, tuple(None if a in ("q_len", "kv_len") else a for a in axes)) for name, (field, axes) in used.items()}
    ints = set().union(*(e.int_tensors for e in (score_expr, mask_expr) if e))
    for name in ints:  # one tensor, one kernel parameter type
        if any(e and name in dict(e.tensors) and name not in e.int_tensors for e in (score_expr, mask_expr)):
            raise SpecError("score_mod", spec.score_mod, f"tensor `{name}` is float32 ({name}[...]) in one mod "
                                                         f"and int32 ({name}.int32[...]) in the other")
    extra += [ExtraTensor(name, f"X_{name}", axes, dtype="int32" if name in ints else "float32")
              for name, (_, axes) in used.items()]
    if spec.block_mask:
        extra += [ExtraTensor(name, param, axes, dtype="int32") for name, param, axes in BLOCK_MASK_TENSORS]
    if is_fp8(spec):
        extra += [ExtraTensor(name, param, ("batch", "kv_heads")) for name, param in DESCALE_TENSORS]

    # Rows that may see no key: then the row max stays -inf (guarded) and the row sum 0.
    if mask_expr is not None or left is not None or per_sequence or spec.splits != 1:
        # any row may be masked whole (mask_mod), or its first visited tiles (window); also: a sequence
        # may have fewer keys than rows, or none; a split may be empty
        guard = True
    elif right is not None:
        guard = shape is None or shape.q_len > shape.kv_len + right
    else:
        guard = False
    return {
        "head_dim_v": spec.head_dim_v,
        "window_left": left,
        "window_right": right,
        "score_expr": score_expr,
        "mask_expr": mask_expr,
        "extra": tuple(extra),
        "prescaled": transforms_scores(spec),
        "guard_empty_rows": guard,
        "varlen": spec.layout == "varlen",
        "page_size": spec.page_size if spec.paged_kv else 0,
        "split_kv": spec.splits != 1,
        # Packing is for decode, where one warpgroup's 64 rows hold the group's heads. With more
        # consumers TileLang 0.1.15's codegen fails on the paged varlen form ("Let cannot bind
        # the same var to two different values"), and more rows only add empty ones.
        "pack_gqa": spec.splits != 1 and spec.gqa_group > 1 and spec.consumers == 1,
        "block_mask": spec.block_mask,
        "fp8": is_fp8(spec),
    }


def _register_budget_error(spec: Spec, needed: int, consumer_regs: int):
    n = spec.consumers
    fits = [bn for bn in block_n_candidates(spec) if regs_needed(spec, bn) <= consumer_regs]
    if not fits:
        def fits_with(c: int) -> bool:  # the same estimate and split as this spec's, at c consumers
            other = dataclasses.replace(spec, consumers=c, block_m=hw.WGMMA_M * c, pingpong=None)
            return regs_needed(other, block_n_candidates(spec)[-1]) <= reg_split(other)[1]

        ok = [c for c in hw.REG_SPLIT if fits_with(c)]
        # O's accumulator, the term that does not shrink with block_n, is head_dim_v wide
        dv = head_dim_v(spec)
        what = f"head_dim {dv}" if dv == spec.head_dim else f"head_dim_v {dv} (the width of O's accumulator)"
        raise SpecError(
            "consumers", n,
            f"with {n} consumers setmaxnreg gives each consumer thread {consumer_regs} registers, fewer than "
            f"{what} needs at any block_n; use consumers in {ok}",
        )
    raise SpecError(
        "block_n", spec.block_n,
        f"a consumer thread would need about {needed} registers (O {head_dim_v(spec) // 2}, S {spec.block_n // 2}, "
        f"P {spec.block_n // 4}, overhead {hw.CONSUMER_REG_OVERHEAD[n]}"
        + (f", variants {variant_regs(spec)}" if variant_regs(spec) else "")
        + (f", diagonal mask {mask_regs(spec)}" if mask_regs(spec) else "")
        + (f", varlen {sequence_regs(spec)}" if sequence_regs(spec) else "")
        + f") but setmaxnreg gives it {consumer_regs} "
        f"with {n} consumer(s); block_n <= {max(fits)} fits",
    )


def as_plan(spec_or_plan, shape: Shape | None = None) -> Plan:
    """What an entry point does once: a Plan passes through, a Spec is planned (with `shape`)."""
    if isinstance(spec_or_plan, Plan):
        if shape is not None and shape != spec_or_plan.shape:
            raise SpecError("shape", str(shape), f"the plan was made for shape {spec_or_plan.shape or 'dynamic'}")
        return spec_or_plan
    return make_plan(spec_or_plan, shape)
