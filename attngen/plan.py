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
import hashlib
import json

from attngen import expr, hw, tiles
from attngen.spec import FIELDS, HEAD_DIMS, MAX_PAGE_SIZE, PAGE_SIZE_STEP, Spec, SpecError, ruled_out

BLOCK_N_CANDIDATES = (128, 112, 96, 80, 64, 48, 32, 16)
SHAPE_FIELDS = ("batch", "heads", "kv_heads", "q_len", "kv_len")

# nvcc flags for the lowered CUDA: fast math (exp2 -> ex2.approx) and the half/bfloat16
# operators TileLang's headers need. The emitted file carries them for users of the file.
COMPILE_FLAGS = (
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
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A static problem shape: batch, query heads, KV heads, query length, KV length."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            values = [int(p) for p in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 5:
            raise SpecError("shape", text, "expected five integers B,H,HKV,SQ,SKV (for example 1,8,8,1024,1024)")
        return cls(*values)

    def __str__(self):
        return ",".join(str(getattr(self, f)) for f in SHAPE_FIELDS)


# A page of 128 keys holds one K tile of every head dim's default block_n but hd256's (80: it
# then takes 64); vLLM and FlashInfer default to 16, which here would force 16-key tiles.
DEFAULT_PAGE_SIZE = 128

# A block mask's call-time tensors (FlexAttention's BlockMask fields), int32, in parameter order.
# Axes "bm_batch" and "bm_heads" are 1 (broadcast) or the call's batch and heads; "bm_q_tiles" is
# ceildiv(q_len, block_m) and "bm_kv_tiles" ceildiv(kv_len, block_n) (attngen/inputs.py checks them).
BLOCK_MASK_TENSORS = (
    ("kv_num_blocks", "KV_num_blocks", ("bm_batch", "bm_heads", "bm_q_tiles")),
    ("kv_indices", "KV_indices", ("bm_batch", "bm_heads", "bm_q_tiles", "bm_kv_tiles")),
    ("full_kv_num_blocks", "Full_kv_num_blocks", ("bm_batch", "bm_heads", "bm_q_tiles")),
    ("full_kv_indices", "Full_kv_indices", ("bm_batch", "bm_heads", "bm_q_tiles", "bm_kv_tiles")),
)
BLOCK_MASK_AXES = ("bm_batch", "bm_heads", "bm_q_tiles", "bm_kv_tiles")
# The backward's: the main kernel's transposed lists per KV tile (FlexAttention's q_* names and
# layout), over its own tiles; the deterministic dq kernel's kv_* lists over its tiles (dq_*:
# other extents than the forward's). tiles.backward_lists derives both from the forward's lists.
BWD_BLOCK_MASK_TENSORS = (
    ("q_num_blocks", "Q_num_blocks", ("bm_batch", "bm_heads", "bm_kv_tiles")),
    ("q_indices", "Q_indices", ("bm_batch", "bm_heads", "bm_kv_tiles", "bm_q_tiles")),
    ("full_q_num_blocks", "Full_q_num_blocks", ("bm_batch", "bm_heads", "bm_kv_tiles")),
    ("full_q_indices", "Full_q_indices", ("bm_batch", "bm_heads", "bm_kv_tiles", "bm_q_tiles")),
)
DQ_BLOCK_MASK_TENSORS = tuple((f"dq_{n}", p, tuple({"bm_q_tiles": "bm_dq_q_tiles", "bm_kv_tiles": "bm_dq_kv_tiles"}.get(a, a)
                                                   for a in axes)) for n, p, axes in BLOCK_MASK_TENSORS)

SEED_SHAPE = Shape(1, 8, 8, 1024, 1024)  # the hand-written seed kernel's static shape (docs/seed-parity.md)


@dataclasses.dataclass(frozen=True)
class ConsumerBarriers:
    """Named barriers of one consumer warpgroup (0 and 0 when ping-pong is off)."""

    wait_bar: int  # this warpgroup syncs here before issuing its GEMMs
    signal_bar: int  # then arrives here to let the next warpgroup issue


@dataclasses.dataclass(frozen=True)
class ExtraTensor:
    """A kernel parameter beyond Q, K, V, O: the LSE output or a float32 call-time input."""

    name: str  # the call-time keyword (alibi_slopes, sinks, a score_mod/mask_mod tensor) or "lse"
    param: str  # the prim_func parameter
    shape: tuple  # per axis: "batch", "heads", "q_len", "kv_len", a block mask's "bm_*", or None (any extent >= 1)
    output: bool = False
    dtype: str = "float32"  # int32: a block mask's counts and indices

    def dim(self, axis: int) -> str:
        """The kernel's name for an axis extent (a T.dynamic for a free axis)."""
        return self.shape[axis] or f"{self.param}_dim{axis}"


class _WarpSpecialized:
    """What a warp-specialised kernel's plan derives from its fields (Plan, BackwardPlan): shared
    memory in all, and the end of the producer's TMA thread range."""

    @property
    def smem_bytes(self) -> int:
        return sum(self.smem.values())

    @property
    def tma_thread_end(self) -> int:
        return self.consumer_threads + self.tma_threads


@dataclasses.dataclass(frozen=True)
class Plan(_WarpSpecialized):
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


def kernel_name(spec: Spec) -> str:
    """Canonical readable name of a resolved spec; every axis is in it."""
    parts = [
        f"fa3_fwd_hd{spec.head_dim}",
        hw.DTYPES[spec.dtype].tag,
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
    return "_".join(parts)


def serving_tags(spec: Spec) -> list:
    """Name parts of the serving fields (none for a bshd, dense, unsplit kernel)."""
    tags = []
    if spec.layout != "bshd":
        tags.append(spec.layout)
    if spec.paged_kv:
        tags.append(f"paged{spec.page_size}")
    if spec.splits != 1:
        tags.append("splitkv")
    return tags


def float_token(x: float) -> str:
    """A float as part of an identifier, distinct for distinct floats: its 6-digit form where that
    reads back as x (30.0: 30, 0.5: 0p5, 1e+20: 1e20, the names kernels always had), else its shortest
    exact form (2.0000001: 2p0000001); '-' (an exponent's sign) becomes m (1e-05: 1em05)."""
    text = f"{x:g}" if float(f"{x:g}") == x else repr(x)
    return text.replace(".", "p").replace("+", "").replace("-", "m")


def variant_tags(spec: Spec) -> list:
    """Name parts of the variant fields that differ from their defaults (none for a plain kernel)."""
    tags = []
    if spec.head_dim_v is not None and spec.head_dim_v != spec.head_dim:
        tags.append(f"dv{spec.head_dim_v}")
    if spec.window != (-1, -1):
        tags.append("w" + "_".join("inf" if x < 0 else str(x) for x in spec.window))
    if spec.softcap:
        tags.append("sc" + float_token(spec.softcap))
    if spec.alibi:
        tags.append("alibi")
    if spec.sinks:
        tags.append("sinks")
    for field, tag in (("score_mod", "smod"), ("mask_mod", "mmod")):
        text = getattr(spec, field)
        if text.strip():
            tags.append(tag + hashlib.sha256(text.strip().encode()).hexdigest()[:6])
    if spec.lse:
        tags.append("lse")
    if spec.block_mask:
        tags.append("bmask")
    return tags


def spec_hash(spec: Spec) -> str:
    """Content hash of a resolved spec (12 hex digits): equal for a default written out or left implicit."""
    blob = json.dumps(spec.canonical_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def head_dim_v(spec: Spec) -> int:
    return spec.head_dim if spec.head_dim_v is None else spec.head_dim_v


def smem_layout(spec: Spec, block_n: int) -> dict:
    elem = hw.DTYPES[spec.dtype].bytes
    rows_q = hw.WGMMA_M * spec.consumers
    dv = head_dim_v(spec)
    smem = {
        "Q": rows_q * spec.head_dim * elem,
        "K": spec.k_stages * block_n * spec.head_dim * elem,
        "V": spec.v_stages * block_n * dv * elem,
        "O": rows_q * dv * elem,  # output staged in shared memory, then one TMA store
    }
    if spec.splits != 1:
        del smem["O"]  # float32 partial outputs go straight from registers to global memory
    return smem


def variant_regs(spec: Spec) -> int:
    """Extra registers per consumer thread for the element-wise score variants (0 without them)."""
    elementwise = spec.softcap or spec.alibi or spec.score_mod.strip() or spec.mask_mod.strip()
    return hw.VARIANT_REG_OVERHEAD if elementwise else 0


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
    if spec.paged_kv or spec.splits != 1 or spec.block_mask:  # a block mask's producer walks its lists per tile
        return walking_split(spec.consumers)
    return hw.REG_SPLIT[spec.consumers]


def walking_split(n: int) -> tuple:
    """The split of n consumers whose producer looks up each tile (pages, splits, a block mask's lists)."""
    producer, consumer = hw.REG_SPLIT[n]
    producer = hw.SERVING_PRODUCER_REGS.get(n, producer)
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


def default_block_n(spec: Spec) -> int:
    """The largest candidate within both budgets (the smallest if none fits: make_plan then says why).
    A paged cache also needs the tile to divide the page (one TMA box per tile, inside one page)."""
    _, consumer_regs = reg_split(spec)
    limit = block_n_limit(spec) or BLOCK_N_CANDIDATES[0]
    fits_page = [bn for bn in BLOCK_N_CANDIDATES if (not spec.paged_kv or spec.page_size % bn == 0) and bn <= limit]
    for bn in fits_page:
        if regs_needed(spec, bn) <= consumer_regs and sum(smem_layout(spec, bn).values()) <= hw.SMEM_PER_BLOCK:
            return bn
    return fits_page[-1]


def canonical(spec: Spec) -> Spec:
    """One spec per kernel, so that equal kernels get equal names, hashes and emitted text.

    Under causal a window's right bound says nothing (the diagonal bounds every row already;
    plan_variant folds it to 0), so it is dropped; score_mod and mask_mod are written as they
    parse (expr.Expr.canonical: no comments, spacing or redundant parentheses, identifiers
    NFKC-normalised as Python reads them). The presets' expressions are canonical as written.
    """
    fields = {}
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

    needed = regs_needed(spec, spec.block_n)
    if check_registers and needed > consumer_regs:
        _register_budget_error(spec, needed, consumer_regs)
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

    # Rows that may see no key: then the row max stays -inf (guarded) and the row sum 0.
    if mask_expr is not None or left is not None or per_sequence or spec.splits != 1:
        guard = True  # also: a sequence may have fewer keys than rows, or none; a split may be empty  # any row may be masked whole (mask_mod), or its first visited tiles (window)
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
        "prescaled": bool(spec.softcap or spec.alibi or score_expr is not None),
        "guard_empty_rows": guard,
        "varlen": spec.layout == "varlen",
        "page_size": spec.page_size if spec.paged_kv else 0,
        "split_kv": spec.splits != 1,
        # Packing is for decode, where one warpgroup's 64 rows hold the group's heads. With more
        # consumers TileLang 0.1.15's codegen fails on the paged varlen form ("Let cannot bind
        # the same var to two different values"), and more rows only add empty ones.
        "pack_gqa": spec.splits != 1 and spec.gqa_group > 1 and spec.consumers == 1,
        "block_mask": spec.block_mask,
    }


def _register_budget_error(spec: Spec, needed: int, consumer_regs: int):
    n = spec.consumers
    fits = [bn for bn in BLOCK_N_CANDIDATES if regs_needed(spec, bn) <= consumer_regs]
    if not fits:
        def fits_with(c: int) -> bool:  # the same estimate and split as this spec's, at c consumers
            other = dataclasses.replace(spec, consumers=c, block_m=hw.WGMMA_M * c, pingpong=None)
            return regs_needed(other, BLOCK_N_CANDIDATES[-1]) <= reg_split(other)[1]

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


def check_shape(spec: Spec, shape: Shape) -> None:
    """A static shape must fit the resolved spec (plan.spec) and the launch: positive sizes,
    H = HKV * gqa_group, grid and int32 limits, tile multiples when aligned."""
    for field in SHAPE_FIELDS:
        value = getattr(shape, field)
        if type(value) is not int or value < 1:
            raise SpecError(f"shape.{field}", value, "expected a positive integer")
    if shape.heads != shape.kv_heads * spec.gqa_group:
        raise SpecError("shape.heads", shape.heads, f"expected kv_heads * gqa_group = {shape.kv_heads} * {spec.gqa_group}")
    for field in ("batch", "heads"):  # grid z and y
        if getattr(shape, field) > hw.GRID_YZ_MAX:
            raise SpecError(f"shape.{field}", getattr(shape, field), f"expected at most {hw.GRID_YZ_MAX} (a CUDA grid dimension)")
    largest = max(shape.batch * shape.q_len * shape.heads, shape.batch * shape.kv_len * shape.kv_heads) * spec.head_dim
    if largest > hw.INT32_MAX:
        raise SpecError("shape", str(shape), f"a tensor of {largest} elements; at most {hw.INT32_MAX} (the kernel indexes with int32)")
    if spec.aligned:
        if shape.q_len % spec.block_m:
            raise SpecError("shape.q_len", shape.q_len, f"expected a multiple of block_m = {spec.block_m} (aligned spec)")
        if shape.kv_len % spec.block_n:
            raise SpecError("shape.kv_len", shape.kv_len, f"expected a multiple of block_n = {spec.block_n} (aligned spec)")


def tflops(shape: Shape, head_dim: int, causal: bool, seconds: float) -> float:
    """Forward FLOP/s in TFLOP/s: 4*B*H*Sq*Skv*D, halved for causal."""
    flops = 4 * shape.batch * shape.heads * shape.q_len * shape.kv_len * head_dim
    return flops / (2 if causal else 1) / seconds / 1e12


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
# Refused: packed sequences, a variant that may read the head (ALiBi, score_mod, mask_mod) and
# deterministic GQA together (the CTA loops over the group's heads) spilled at every head dim
# measured, whatever the tile: causal, window [511, -1], ALiBi, varlen, deterministic, GQA 8 by
# columns: hd64 113 B (estimate 216), hd96 270 B (232), hd128 416 B + 152 B of stack (184); hd128
# by keys 84 B (240). Not a register share: the tiles are small there. Softcap in its place fits
# (hd64 196 used); ALiBi without the band 230 (docs/backward.md, "Registers").
VARLEN_GROUPED_VARIANT_SPILLS = "hd64 113 B, hd96 270 B, hd128 by keys 84 B and by columns 416 B"


@dataclasses.dataclass(frozen=True)
class BackwardPlan(_WarpSpecialized):
    """Every number the three backward kernels need (templates/fa3_bwd.py.j2).

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
    return "_".join(parts + [t for t in variant_tags(spec) if t != "lse"] + serving_tags(spec) + tail)


def bwd_regs_needed(spec: Spec, block_m: int, columns: int = 1) -> int:
    """Per consumer thread: dK and dV accumulators (WG_KEYS x head dims / columns, float32), then the
    larger of the S^T and dP^T tiles with P^T (WG_KEYS x block_m) and the dQ tile with dS^T
    (block_m x head_dim / columns). `columns`: the warpgroups that split the head dims (1: they split keys)."""
    r = hw.regs_per_thread
    acc = r(hw.WGMMA_M * spec.head_dim // columns, 4) + r(hw.WGMMA_M * head_dim_v(spec) // columns, 4)
    scores = 2 * r(hw.WGMMA_M * block_m, 4) + r(hw.WGMMA_M * block_m, 2)
    dq = r(block_m * spec.head_dim // columns, 4) + r(hw.WGMMA_M * block_m, 2)
    elementwise = spec.softcap or spec.alibi or spec.score_mod.strip() or spec.mask_mod.strip()
    packed = bool(elementwise) and spec.layout == "varlen"
    return acc + max(scores, dq) + BWD_REG_OVERHEAD + (BWD_VARLEN_VARIANT_REGS if packed else 0)


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
    backward reads (ops.fwd_arguments asks for it; runtime.precompile_training builds it)."""
    return dataclasses.replace(spec, lse=True)


FORWARD_ONLY_FIELDS = {"consumers": 2, "k_stages": 2, "v_stages": 2, "block_m": None, "block_n": None,
                       "pingpong": None, "aligned": False, "steady_loop": "one"}


def plan_backward(spec: Spec, shape: Shape | None = None, *, check_registers: bool = True,
                  block_m: int | None = None, columns: bool | None = None) -> BackwardPlan:
    """The backward kernels' plan: FlashAttention-3's tile for the head dim, brought to this
    formulation (Q tile rows a multiple of the wgmma M of the dQ GEMM; one 64-key slice of the KV
    tile per consumer) and shrunk until the register and shared-memory budgets hold.
    `block_m` / `columns` fix the tile instead (the register sweep builds refused neighbours with
    them and check_registers=False, bench/plan_sweep.py --backward)."""
    if not isinstance(spec, Spec):
        raise SpecError("<spec>", type(spec).__name__, "expected an attngen.Spec")
    if spec.paged_kv:
        raise SpecError("paged_kv", True, "a paged KV cache is an inference layout: the backward takes dense k and v")
    if spec.splits != 1:
        raise SpecError("splits", spec.splits, "split-KV is an inference layout: the backward runs with splits = 1")
    if spec.block_mask and spec.deterministic and spec.gqa_group > 1:
        raise ruled_out("deterministic", True, "false", f"block_mask = true and gqa_group = {spec.gqa_group}", "the "
                        "deterministic backward loops over a KV head's query heads in one CTA, whose block-mask lists differ per head")
    # A block mask's backward visits its listed tiles (BWD_BLOCK_MASK_TENSORS, docs/backward.md)
    forward = make_plan(dataclasses.replace(spec, lse=True, deterministic=False), shape)
    forward_spec = forward.spec
    # The backward's identity (name, hash, header): the fields its kernels read; the forward's own tiling,
    # stages, ping-pong, alignment and loop form at their defaults, so specs that differ only there
    # share one backward module (default and seed_parity did, under one name with two headers)
    rspec = dataclasses.replace(forward_spec, deterministic=spec.deterministic, **FORWARD_ONLY_FIELDS)
    masked = rspec.causal or rspec.window != (-1, -1) or bool(rspec.mask_mod.strip()) or rspec.softcap
    per_head = rspec.alibi or rspec.score_mod.strip() or rspec.mask_mod.strip()  # may read the visit's head
    if check_registers and per_head and rspec.layout == "varlen" and rspec.deterministic and rspec.gqa_group > 1:
        raise SpecError("deterministic", True, "with layout 'varlen', alibi, a score_mod or a mask_mod, and gqa_group "
                        f"{rspec.gqa_group} the deterministic backward spills at every head dim "
                        f"(measured: {VARLEN_GROUPED_VARIANT_SPILLS}); use deterministic = false or gqa_group = 1")
    fa3 = (FA3_BWD_TILES_MASKED if masked else {}).get(rspec.head_dim, FA3_BWD_TILES[rspec.head_dim])
    fa3_m, fa3_n, _ = fa3
    consumers = 2
    # a block mask's producer walks its lists per Q tile: the forward's walking share (24 registers spilled)
    producer_regs, consumer_regs = walking_split(consumers) if spec.block_mask else hw.REG_SPLIT[consumers]
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


# -- the KV-cache append (flash_attn_with_kvcache's k=, v=; docs/interfaces.md) -------------------
APPEND_ROWS = 8  # appended rows of one KV head per append block: 8 x 128 columns is one 16-byte store per thread
APPEND_THREADS = 128


@dataclasses.dataclass(frozen=True)
class AppendPlan:
    """The append companion kernel's numbers: it copies the new keys and values k, v
    [batch, seqlen_new, kv_heads, D(v)] into a paged cache [num_pages, page_size, kv_heads, D(v)]
    at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, through the block table
    (a dense cache is appended through its page view, as the forward reads it). No Spec: the
    kernel depends only on these fields, so one build serves every forward spec of the cache."""

    dtype: str
    head_dim: int
    head_dim_v: int
    page_size: int
    rows: int = APPEND_ROWS
    threads: int = APPEND_THREADS
    compile_flags: tuple = COMPILE_FLAGS
    shape: None = None  # always dynamic (the runtime's cache entries read plan.shape)

    @property
    def name(self) -> str:
        dv = f"_dv{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        return f"fa3_kvappend_hd{self.head_dim}{dv}_{hw.DTYPES[self.dtype].tag}_page{self.page_size}"


def append_plan(dtype: str, head_dim: int, head_dim_v: int, page_size: int) -> AppendPlan:
    """The append kernel of a cache: its dtype, head dims (the spec's HEAD_DIMS) and page size
    (the spec's page rule). SpecError naming the value otherwise; callers validate tensors first."""
    if dtype not in hw.DTYPES:
        raise SpecError("dtype", dtype, f"expected one of {', '.join(hw.DTYPES)}")
    for field, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if type(value) is not int or value not in HEAD_DIMS:
            raise SpecError(field, value, f"expected one of {', '.join(map(str, HEAD_DIMS))}")
    if type(page_size) is not int or not (PAGE_SIZE_STEP <= page_size <= MAX_PAGE_SIZE and page_size % PAGE_SIZE_STEP == 0):
        raise SpecError("page_size", page_size, f"expected a multiple of {PAGE_SIZE_STEP} from {PAGE_SIZE_STEP} to {MAX_PAGE_SIZE}")
    return AppendPlan(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size)
