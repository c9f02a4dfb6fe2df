"""What every kernel family's plan shares: the static Shape, the call-time tensor ABI
(ExtraTensor, the block-mask lists), named-barrier records, the names and hashes made from a
Spec, and the nvcc flags. Each family's own plan (kernels/<family>/plan.py) builds on these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from attngen import hw
from attngen.spec import Spec, SpecError

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
# ceildiv(q_len, block_m) and "bm_kv_tiles" ceildiv(kv_len, block_n) (attngen/run/inputs.py checks them).
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


# A persistent kernel's int32 tile slot (tile_shared, the plan's smem "tile"): TileLang places it in the
# dynamic shared memory at 16-byte alignment, and the next buffer's swizzle alignment may round that up
# to 1 KiB. Measured: hd128 causal forward 197632 B built against 196608 single-tile (1 KiB), the
# hd128 column-split backward 149504 against 148480 (1 KiB); hd64 causal varlen forward 98320 against
# 98304, the hd64 GQA 2 deterministic backward 66576 against 66560 (16 B). The plan counts the most.
TILE_SLOT_SMEM = 1024
TILE_SLOT_MIN_SMEM = 16


class WarpSpecialized:
    """What a warp-specialised kernel's plan derives from its fields (Plan, BackwardPlan): shared
    memory in all, and the end of the producer's TMA thread range."""

    @property
    def smem_bytes(self) -> int:
        return sum(self.smem.values())

    @property
    def smem_slack(self) -> int:
        """Bytes of smem_bytes a build may leave unused: the tile slot's placement (TILE_SLOT_SMEM)."""
        return TILE_SLOT_SMEM - TILE_SLOT_MIN_SMEM if "tile" in self.smem else 0

    @property
    def tma_thread_end(self) -> int:
        return self.consumer_threads + self.tma_threads


def serving_tags(spec: Spec) -> list:
    """Name parts of the serving fields (none for a bshd, dense, unsplit kernel)."""
    tags = []
    if spec.layout != "bshd":
        tags.append(spec.layout)
    if spec.paged_kv:
        tags.append(f"paged{spec.page_size}")
    if spec.splits != 1:
        tags.append("splitkv")
    if spec.kv_dtype is not None:
        tags.append("kv8")  # K and V in an e4m3 cache
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


def transforms_scores(spec: Spec) -> bool:
    """The score is transformed before the softmax (softcap, ALiBi, a score_mod): the kernel turns
    q . k into the final base-2 score itself (Plan.prescaled), and the backward differentiates it."""
    return bool(spec.softcap or spec.alibi or spec.score_mod.strip())


def elementwise_variant(spec: Spec) -> bool:
    """A variant computed per score element (a transform, or a mask_mod): its temporaries cost
    registers in both passes (hw.VARIANT_REG_OVERHEAD, the backward's BWD_VARLEN_VARIANT_REGS)."""
    return transforms_scores(spec) or bool(spec.mask_mod.strip())


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelNumbers:
    """The numbers every warp-specialized family's template prints (its `kernel`): the resolved
    spec, thread ranges and register split. Each family's plan adds its own (fwd.render.ForwardNumbers,
    bwd.render.BackwardNumbers)."""

    header: list[str]
    """the file's comment lines: name, hash, full spec, shape, schedule"""
    name: str
    """the kernel's name (its prim_func's and its file's)"""
    spec_hash: str
    """the spec's hash"""
    head_dim: int
    """Q and K head dim"""
    dtype: str
    """Q/K/V/O element type"""
    gqa_group: int
    """query heads per KV head"""
    consumers: int
    """consumer (MMA) warpgroups"""
    block_m: int
    """query rows per block (the backward: per Q tile)"""
    block_n: int
    """keys per K/V tile"""
    log2e: float
    """log2(e): the softmax runs in base 2"""
    threads: int
    """threads per block"""
    consumer_threads: int
    """the consumers' threads (the producer follows)"""
    tma_thread_end: int
    """end of the producer's TMA-issuing threads"""
    tma_threads: int
    """threads that issue TMA copies"""
    producer_regs: int
    """setmaxnreg of the producer"""
    consumer_regs: int
    """setmaxnreg of each consumer"""
    warpgroup_threads: int
    """threads per warpgroup"""
    compile_flags: tuple
    """nvcc flags carried in the emitted file"""
    consumer_args: str
    """the consumer macro's arguments"""
