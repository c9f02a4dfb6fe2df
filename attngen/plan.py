"""Every number the kernel needs, derived from a Spec (and optionally a static shape).

The template only prints what this module computes: thread ranges, the
setmaxnreg split, shared-memory bytes, barrier ids and arrival counts, the
softmax scale. Budgets are checked here, before anything is rendered, and a
violated budget raises `SpecError` naming the field to change.
"""

from __future__ import annotations

import dataclasses

from attngen.spec import Spec, SpecError

WARPGROUP = 128  # threads per warpgroup
WG_ROWS = 64  # query rows per consumer warpgroup: one wgmma M tile
TMA_THREADS = 32  # one producer warp issues TMA and arrives on the "full" barriers
SMEM_LIMIT = 227 * 1024  # sm_90: max dynamic shared memory per block (232448 bytes)
REGS_PER_SM = 65536
# setmaxnreg split per consumer count, as FlashAttention-3 uses it: (producer, consumer).
# The producer only issues TMA, so it gives its registers to the consumers.
REG_SPLIT = {1: (24, 240), 2: (24, 240), 3: (32, 160)}
# Registers a consumer thread needs beyond its accumulators (row statistics,
# addresses, loop state), per consumer count. Calibrated with bench/register_budget.py
# against ptxas spill reports: docs/spec-reference.md, "Register budget".
CONSUMER_REG_OVERHEAD = {1: 48, 2: 48, 3: 32}
BLOCK_N_CANDIDATES = (128, 112, 96, 80, 64, 48, 32, 16)
LOG2E = 1.44269504  # exp(x) = exp2(x * log2(e)); the constant the seed kernel uses


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
        parts = text.split(",")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 5:
            raise SpecError("shape", text, "expected five integers B,H,HKV,SQ,SKV (for example 1,8,8,1024,1024)")
        return cls(*values)

    def __str__(self):
        return f"{self.batch},{self.heads},{self.kv_heads},{self.q_len},{self.kv_len}"


@dataclasses.dataclass(frozen=True)
class PingPong:
    """Named barriers of one consumer warpgroup in the ping-pong ring."""

    wait_bar: int  # this warpgroup syncs here before issuing its GEMMs
    signal_bar: int  # then arrives here to let the next warpgroup issue


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: Spec
    shape: Shape | None
    threads: int
    consumer_threads: int  # threads [0, consumer_threads) are consumers; the rest the producer
    launch_regs: int  # register cap per thread at launch (__launch_bounds__(threads, 1))
    producer_regs: int
    consumer_regs: int
    consumer_regs_needed: int
    smem: dict  # buffer -> bytes (dynamic shared memory)
    pingpong: tuple  # PingPong per consumer, empty when ping-pong is off
    pingpong_threads: int  # threads that meet at one ping-pong barrier
    guard_empty_rows: bool  # some query rows may see no key: guard -inf maxima and 0 sums
    scale_log2: float

    @property
    def smem_bytes(self) -> int:
        return sum(self.smem.values())

    @property
    def tma_thread_end(self) -> int:
        return self.consumer_threads + TMA_THREADS

    @property
    def epilogue_bar(self) -> int:
        """First named barrier of the epilogues (consumer g uses epilogue_bar + g); 0 is __syncthreads."""
        return 1 + len(self.pingpong)

    @property
    def primer(self) -> int | None:
        """The consumer that arrives once at the start so that warpgroup 0 issues first."""
        return len(self.pingpong) - 1 if self.pingpong else None


def consumer_regs_needed(head_dim: int, block_n: int, consumers: int) -> int:
    """Registers per consumer thread: O and S accumulators (fp32), register-P (16-bit pairs), overhead."""
    per_thread = lambda elems, bytes_per: elems * bytes_per // (4 * WARPGROUP)  # noqa: E731
    acc_o = per_thread(WG_ROWS * head_dim, 4)
    acc_s = per_thread(WG_ROWS * block_n, 4)
    p_reg = per_thread(WG_ROWS * block_n, 2)
    return acc_o + acc_s + p_reg + CONSUMER_REG_OVERHEAD[consumers]


def smem_layout(spec: Spec, block_n: int) -> dict:
    elem = 2  # float16 and bfloat16
    rows_q = WG_ROWS * spec.consumers
    return {
        "Q": rows_q * spec.head_dim * elem,
        "K": spec.k_stages * block_n * spec.head_dim * elem,
        "V": spec.v_stages * block_n * spec.head_dim * elem,
        "O": rows_q * spec.head_dim * elem,  # output staged in shared memory, then one TMA store
    }


def default_tiles(spec: Spec) -> tuple[int, int]:
    """block_m is 64 per consumer; block_n the largest candidate within both budgets."""
    _, consumer_regs = REG_SPLIT[spec.consumers]
    for bn in BLOCK_N_CANDIDATES:
        fits_regs = consumer_regs_needed(spec.head_dim, bn, spec.consumers) <= consumer_regs
        fits_smem = sum(smem_layout(spec, bn).values()) <= SMEM_LIMIT
        if fits_regs and fits_smem:
            return WG_ROWS * spec.consumers, bn
    # Nothing fits: return the smallest so make_plan reports the real budget.
    return WG_ROWS * spec.consumers, BLOCK_N_CANDIDATES[-1]


def make_plan(spec: Spec, shape: Shape | None = None) -> Plan:
    n = spec.consumers
    threads = WARPGROUP * (n + 1)
    launch_regs = min(255, REGS_PER_SM // threads // 8 * 8)
    producer_regs, consumer_regs = REG_SPLIT[n]
    if producer_regs + n * consumer_regs > (n + 1) * launch_regs:
        raise SpecError("consumers", n, f"setmaxnreg split {producer_regs}+{n}x{consumer_regs} exceeds the {threads}-thread pool")

    needed = consumer_regs_needed(spec.head_dim, spec.block_n, n)
    if needed > consumer_regs:
        fits = [bn for bn in BLOCK_N_CANDIDATES if consumer_regs_needed(spec.head_dim, bn, n) <= consumer_regs]
        if not fits:
            ok = [c for c, (_, regs) in REG_SPLIT.items() if consumer_regs_needed(spec.head_dim, BLOCK_N_CANDIDATES[-1], c) <= regs]
            raise SpecError(
                "consumers", n,
                f"with {n} consumers setmaxnreg gives each consumer thread {consumer_regs} registers, fewer than "
                f"head_dim {spec.head_dim} needs at any block_n; use consumers in {ok}",
            )
        raise SpecError(
            "block_n", spec.block_n,
            f"a consumer thread would need about {needed} registers (O {spec.head_dim // 2}, S {spec.block_n // 2}, "
            f"P {spec.block_n // 4}, overhead {CONSUMER_REG_OVERHEAD[n]}) but setmaxnreg gives it {consumer_regs} "
            f"with {n} consumer(s); block_n <= {max(fits) if fits else 'none'} fits",
        )

    smem = smem_layout(spec, spec.block_n)
    total = sum(smem.values())
    if total > SMEM_LIMIT:
        detail = ", ".join(f"{k} {v}" for k, v in smem.items())
        raise SpecError(
            "k_stages/v_stages", (spec.k_stages, spec.v_stages),
            f"the plan needs {total} bytes of shared memory ({detail}) but sm_90 allows {SMEM_LIMIT} (227 KiB) "
            f"per block; use fewer stages or a smaller block_n",
        )

    if shape is not None:
        check_shape(spec, shape)

    pingpong = ()
    if spec.pingpong:
        # Named barrier 0 is __syncthreads; the ring uses 1..n: warpgroup g waits on g+1, signals g+2 (mod n).
        pingpong = tuple(PingPong(wait_bar=g + 1, signal_bar=(g + 1) % n + 1) for g in range(n))

    return Plan(
        spec=spec,
        shape=shape,
        threads=threads,
        consumer_threads=WARPGROUP * n,
        launch_regs=launch_regs,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        consumer_regs_needed=needed,
        smem=smem,
        pingpong=pingpong,
        pingpong_threads=2 * WARPGROUP,
        guard_empty_rows=spec.causal and (shape is None or shape.q_len > shape.kv_len),
        scale_log2=(1.0 / spec.head_dim) ** 0.5 * LOG2E,
    )


def check_shape(spec: Spec, shape: Shape) -> None:
    """A static shape must fit the spec: positive sizes, H = HKV * gqa_group, tile multiples when aligned."""
    for field in ("batch", "heads", "kv_heads", "q_len", "kv_len"):
        value = getattr(shape, field)
        if type(value) is not int or value < 1:
            raise SpecError(f"shape.{field}", value, "expected a positive integer")
    if shape.heads != shape.kv_heads * spec.gqa_group:
        raise SpecError("shape.heads", shape.heads, f"expected kv_heads * gqa_group = {shape.kv_heads} * {spec.gqa_group}")
    if spec.aligned:
        if shape.q_len % spec.block_m:
            raise SpecError("shape.q_len", shape.q_len, f"aligned spec: expected a multiple of block_m = {spec.block_m}")
        if shape.kv_len % spec.block_n:
            raise SpecError("shape.kv_len", shape.kv_len, f"aligned spec: expected a multiple of block_n = {spec.block_n}")


def tflops(shape: Shape, head_dim: int, causal: bool, seconds: float) -> float:
    """Forward FLOP/s in TFLOP/s: 4*B*H*Sq*Skv*D, halved for causal."""
    flops = 4 * shape.batch * shape.heads * shape.q_len * shape.kv_len * head_dim
    return flops / (2 if causal else 1) / seconds / 1e12

