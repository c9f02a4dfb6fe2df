"""CPU implementations of the `T.*` subset the templates emit, under Hopper's asynchronous rules.

`TLang` is what the name `T` (and `tilelang.language`) means while an emitted module runs.
Anything else under `T.` raises UnsupportedConstruct naming it (the driver adds the line).

What each construct means here:
- T.Kernel yields the block indices of the CTA being run; T.get_thread_binding the thread
  indices of the running warpgroup (a per-thread array; see rewrite.py for `if` on it).
- Allocation: shared buffers and barriers belong to the CTA (every warpgroup executing the
  same allocation gets the same object); fragments belong to the warpgroup that allocates.
- T.tma_copy global->shared adds its box's bytes to the mbarrier's transaction count and
  completes them at once (the earliest the TMA engine could), so it belongs to the phase
  current at its issue; its data lands when that phase completes (zeros beyond the
  tensor). Shared->global stores drop what lies beyond the tensor.
- T.wgmma_gemm records its operands; a later T.wait_wgmma(n) retires all but the n newest
  of the warpgroup's outstanding wgmmas, and only then are operands read and the
  accumulator written.
- T.atomic_add adds at issue, in the destination's dtype: the element form (inside
  T.Parallel, predicated like a store), the tile-region form (a fragment/shared/global source
  or a value) and `use_tma=True`, a TMA reduce-add from shared memory that one elected thread
  issues and waits for (its read) inside the statement, as TileLang 0.1.15 lowers it.
- Every synchronization also moves vector clocks, and every access is checked for a race
  against the accesses no synchronization orders it with (hazards.py); atomics commute.
- T.Parallel yields broadcast index arrays once, so each element-wise statement runs as one
  numpy expression in float32. An `if` whose test varies with the indices runs its body once
  under the mask of the elements that take it (memory.predicated); an `if` on per-element
  float values stays unsupported (the templates use T.if_then_else for those).
- Parameters are T.Tensor buffers (float or int32), `T.int32` scalars (a Python int) and
  `T.float32` scalars (a numpy float32, so arithmetic on it stays float32 as on the GPU).
"""

from __future__ import annotations

import builtins
import sys
import threading

import numpy as np

from attngen.emulator.agents import WARPGROUP, MBarrier, NamedBarrier
from attngen.emulator.errors import KernelError, UnsupportedConstruct
from attngen.emulator.hazards import ATOMIC, REDUCE_ADD, Op
from attngen.emulator.memory import (
    Buffer, ElementRef, Lanes, Region, Target, as_region, element_mask, parallel_indices, predicated, same_shape,
)
from attngen.hw import E4M3, FP8_K_STEP
from attngen.reference.forward import round_to

def _check_fp8_wgmma(A, B, transpose_A: bool, transpose_B: bool, k: int) -> None:
    """Hopper's fp8 wgmma (QGMMA): e4m3 x e4m3, and both operands K-major, A as [M, K] (not
    transposed), B as [N, K] (transpose_B): the hardware has no transposing fp8 load, and TileLang
    turns any other form into mma.sync (through fp16), not wgmma. K a multiple of 32."""
    if A.buf.dtype != B.buf.dtype:
        raise KernelError(f"T.wgmma_gemm: fp8 wgmma multiplies e4m3 by e4m3 only, got A {A.buf.dtype} and B {B.buf.dtype}")
    if transpose_A or not transpose_B:
        bad = f"A {A} transposed" if transpose_A else f"B {B} not transposed (K-major B is [N, K], passed with transpose_B=True)"
        raise KernelError(f"T.wgmma_gemm: an fp8 wgmma reads both operands K-major, but {bad}: Hopper has no fp8 "
                          f"transposing wgmma (transpose V in shared memory first)")
    if k % FP8_K_STEP:
        raise KernelError(f"T.wgmma_gemm: an fp8 wgmma contracts {FP8_K_STEP} elements at a time; K = {k}")


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, E4M3: 1}  # bytes per element, for TMA transaction counts
MEMORY_ORDERS = ("relaxed", "consume", "acquire", "release", "acq_rel", "seq_cst")  # TileLang's names
ATOMIC_DTYPES = ("float32", "float16", "bfloat16", "int32")  # atomicAdd's types among the model's buffers
REDUCE_ADD_DTYPES = ("float16", "bfloat16", "float32", "int32")  # cp.reduce.async.bulk .add (src/cuda/op/atomic_add.cc)


class GridProbe(BaseException):
    """Raised by T.Kernel while the driver only asks for the launch grid."""

    def __init__(self, grid, threads):
        super().__init__()
        self.grid, self.threads = grid, threads


class TensorType:
    """`T.Tensor(shape, dtype)` as a parameter annotation."""

    def __init__(self, shape, dtype="float32"):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype


class ScalarType(str):
    """`T.int32` and friends: a dtype name (usable wherever a dtype string is), the annotation of a
    scalar prim_func parameter, and a cast (`T.int32(x)`)."""

    def __call__(self, value=0):
        if self == "int32":
            return value.astype(np.int64) if isinstance(value, np.ndarray) else int(value)  # truncates, like a C cast
        return np.float32(value) if self == "float32" else round_to(value, str(self))


class PrimFunc:
    """`@T.prim_func`: the function plus its parameters (name, TensorType or ScalarType), in order."""

    def __init__(self, func):
        self.func = func
        self.name = func.__name__
        self.params = []
        for name, ann in func.__annotations__.items():
            if name == "return":
                continue
            if not isinstance(ann, TensorType) and ann not in ("int32", "float32"):
                raise UnsupportedConstruct(f"prim_func parameter {name}: only T.Tensor, T.int32 and T.float32 "
                                           "parameters are modeled")
            self.params.append((name, ann))


class _KernelFrame:
    def __init__(self, index):
        self.index = index

    def __enter__(self):
        return self.index[0] if len(self.index) == 1 else self.index

    def __exit__(self, *exc):
        return False


class GemmWarpPolicy:
    Square, FullRow, FullCol = "Square", "FullRow", "FullCol"


class _Names:
    """tilelang.PassConfigKey and friends: any attribute is just its name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return name


class _Layout:
    @staticmethod
    def make_swizzled_layout(buffer, *args, **kwargs):
        return None  # swizzling changes addresses, not values: nothing to model


class FakeTileLang:
    """What `import tilelang` binds in the emitted module."""

    def __init__(self, language):
        self.language = language
        self.layout = _Layout()
        self.PassConfigKey = _Names()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedConstruct(f"tilelang.{name} is not modeled by the emulator")


class _Branch:
    """A branch whose test depends on the thread index: which threads take it."""

    def __init__(self, agent, then_mask, other_mask):
        self.agent, self.then_mask, self.other_mask = agent, then_mask, other_mask
        self.then, self.other = bool(then_mask.any()), bool(other_mask.any())

    def taken(self):
        return _Active(self.agent, self.then_mask)

    def not_taken(self):
        return _Active(self.agent, self.other_mask)


class _Active:
    def __init__(self, agent, mask):
        self.agent, self.mask = agent, mask

    def __enter__(self):
        self.agent.push_active(self.mask)

    def __exit__(self, *exc):
        self.agent.pop_active()
        return False


class _Elements:
    """A branch whose test varies with the T.Parallel element: each side runs once, its element
    accesses under the mask of the elements that take it (nested ifs AND their masks)."""

    __slots__ = ("then_mask", "other_mask", "then", "other")

    def __init__(self, test):
        test = np.asarray(test, bool)
        outer = element_mask()
        self.then_mask = test if outer is None else outer & test
        self.other_mask = ~test if outer is None else outer & ~test
        self.then, self.other = bool(self.then_mask.any()), bool(self.other_mask.any())

    def taken(self):
        return predicated(self.then_mask)

    def not_taken(self):
        return predicated(self.other_mask)


class _Uniform:
    """A branch every thread takes the same way (a plain Python condition)."""

    __slots__ = ("then", "other")

    def __init__(self, then):
        self.then, self.other = then, not then

    def taken(self):
        return _NULL

    not_taken = taken


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()
_TAKEN, _SKIPPED = _Uniform(True), _Uniform(False)


class Helpers:
    """`__rt__` in the rewritten module: branch splitting and element-wise logic."""

    def __init__(self, rt):
        self.rt = rt
        self.tls = threading.local()  # per agent: did the `if` test being evaluated read per-element floats?

    def value(self, x):
        """A subscript in an `if` test (rewrite.py wraps them): notes a read of per-element float values."""
        if isinstance(x, np.ndarray) and x.size > 1 and x.dtype.kind == "f":
            self.tls.values = True
        return x

    def cond(self, test):
        on_values = getattr(self.tls, "values", False)
        self.tls.values = False
        if isinstance(test, Lanes):
            agent = self.rt.agent
            mask = np.asarray(test).astype(bool)
            if mask.shape != (WARPGROUP,):
                raise UnsupportedConstruct("a thread-index condition that is not one value per thread")
            active = agent.active[-1]
            return _Branch(agent, active & mask, active & ~mask)
        if isinstance(test, np.ndarray) and test.size != 1:
            if on_values:
                raise UnsupportedConstruct("`if` on per-element values inside T.Parallel (use T.if_then_else; "
                                           "an `if` on the loop indices is modeled)")
            return _Elements(test)
        return _TAKEN if test else _SKIPPED

    @staticmethod
    def target(buf):
        """T.atomic_add's destination subscript (rewrite.py): names elements without loading them."""
        return Target(buf)

    @staticmethod
    def and_(a, b):
        if isinstance(a, np.ndarray):
            return np.logical_and(a, b())
        return b() if a else a

    @staticmethod
    def or_(a, b):
        if isinstance(a, np.ndarray):
            return np.logical_or(a, b())
        return a if a else b()

    @staticmethod
    def not_(a):
        if isinstance(a, np.ndarray):
            return np.logical_not(a)
        return not a


def _f32(x):
    return np.asarray(x, np.float32)


class TLang:
    """The `T` namespace, bound to one emulation (`rt`: the driver's Runtime)."""

    GemmWarpPolicy = GemmWarpPolicy
    int32, float32, float16, bfloat16 = (ScalarType(n) for n in ("int32", "float32", "float16", "bfloat16"))
    float8_e4m3fn = ScalarType(E4M3)  # stored as float32 holding e4m3 values, like the 16-bit types

    def __init__(self, rt):
        self._rt = rt

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedConstruct(f"T.{name} is not modeled by the emulator")

    # -- helpers ---------------------------------------------------------------
    def _site(self):
        """Line of the emitted source that called into T (frames above ours)."""
        fn = self._rt.filename
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename != fn:
            f = f.f_back
        return f.f_lineno if f is not None else None

    def _barrier(self, b) -> MBarrier:
        if isinstance(b, MBarrier):
            return b
        if isinstance(b, list) and b and isinstance(b[0], MBarrier):
            if len(b) != 1:
                raise KernelError(f"barrier array {b[0].name.split('[')[0]} has {len(b)} barriers: index it")
            return b[0]
        raise KernelError(f"expected an mbarrier (from T.alloc_barrier), got {type(b).__name__}")

    def _per_cta(self, table, make):
        """The object of this allocation site for the CTA (the n-th execution by a warpgroup -> n-th object)."""
        agent = self._rt.agent
        line = self._site()
        n = agent.alloc_seen.get(line, 0)
        agent.alloc_seen[line] = n + 1
        key = (line, n)
        obj = table.get(key)
        if obj is None:
            obj = table[key] = make(self._rt.alloc_name(line))
        return obj, line

    # -- launch, shapes, threads -------------------------------------------------
    def dynamic(self, name, dtype="int32"):
        dims = self._rt.dims
        if name not in dims:
            raise KernelError(f"T.dynamic({name!r}): the driver knows {', '.join(sorted(dims))}")
        return dims[name]

    def Tensor(self, shape, dtype="float32", data=None, scope=None):
        if data is not None or scope is not None:
            raise UnsupportedConstruct("T.Tensor with data= or scope=")
        return TensorType(shape if isinstance(shape, (list, tuple)) else (shape,), dtype)

    def macro(self, func=None, **kwargs):
        return func if func is not None else (lambda f: f)

    def prim_func(self, func=None, **kwargs):
        return PrimFunc(func) if func is not None else PrimFunc

    def Kernel(self, *blocks, threads=None, prelude=None, cluster_dims=None):
        if prelude is not None or cluster_dims is not None:
            raise UnsupportedConstruct("T.Kernel with prelude= or cluster_dims=")
        if not isinstance(threads, (int, np.integer)):
            raise UnsupportedConstruct(f"T.Kernel(threads={threads!r}): only a 1-d thread block is modeled")
        grid = tuple(int(b) for b in blocks)
        rt = self._rt
        if rt.probe:
            raise GridProbe(grid, int(threads))
        cta = rt.cta
        if grid != cta.grid or int(threads) != cta.threads:
            raise KernelError(f"T.Kernel grid {grid} x {threads} threads differs from the probed {cta.grid} x {cta.threads}")
        return _KernelFrame(cta.index[:len(grid)])

    def get_thread_binding(self, dim=0):
        if dim != 0:
            raise UnsupportedConstruct(f"T.get_thread_binding({dim}): only threadIdx.x is modeled")
        return self._rt.agent.lanes.view(Lanes)

    def ws(self, *warp_group_idx):
        agent = self._rt.agent
        ids = [int(i) for i in warp_group_idx]
        return np.isin(agent.lanes // WARPGROUP, ids).view(Lanes)

    def set_max_nreg(self, reg_count, is_inc):
        return None  # register budgets are the build's concern, not the values'

    def annotate_layout(self, layout_map):
        return None

    # -- allocation ------------------------------------------------------------------
    def alloc_shared(self, shape, dtype, scope="shared.dyn"):
        cta = self._rt.cta
        buf, line = self._per_cta(cta.shared, lambda name: Buffer(name, shape, dtype, "shared", tracker=cta.tracker))
        if buf.shape != tuple(int(s) for s in shape):
            raise KernelError(f"shared buffer {buf.name} allocated with shapes {buf.shape} and {tuple(shape)}")
        return buf

    def alloc_fragment(self, shape, dtype, scope="local.fragment"):
        rt = self._rt
        name = rt.alloc_name(self._site())
        return Buffer(name, shape, dtype, "fragment", owner=rt.agent, tracker=rt.cta.tracker)

    def alloc_var(self, dtype, *args, scope="local.var", init=None):
        """A per-thread scalar variable (a block mask's cursors). TileLang reads the name as its
        value and stores on assignment, so here it is the plain value: each agent runs its code in
        order, and an assignment in a loop carries to the next iteration as on the GPU. Only
        uniform values are modeled (what every thread of the warpgroup holds alike).
        Positional forms as TileLang's: (dtype), (dtype, init), (dtype, scope), (dtype, init, scope)."""
        if len(args) == 1 and not isinstance(args[0], str):
            init = args[0]
        elif len(args) == 2:
            init = args[0]
        value = 0 if init is None else init
        return int(value) if str(dtype).startswith("int") else np.float32(value)

    def alloc_barrier(self, arrive_count):
        counts = list(arrive_count) if isinstance(arrive_count, (list, tuple)) else [arrive_count]
        cta = self._rt.cta

        tracker = cta.tracker

        def make(name):
            names = [name] if len(counts) == 1 else [f"{name}[{i}]" for i in range(len(counts))]
            return [MBarrier(n, int(c), tracker.component(f"phases of {n} completed")) for n, c in zip(names, counts)]

        bars, _ = self._per_cta(cta.barriers, make)
        return bars

    # -- loops -------------------------------------------------------------------------
    def serial(self, start, stop=None, *, annotations=None):
        return range(int(start)) if stop is None else range(int(start), int(stop))

    def Parallel(self, *extents, coalesced_width=None, loop_layout=None, annotations=None):
        idx = parallel_indices(tuple(int(e) for e in extents))
        self._rt.trace and self._rt.trace.event("parallel", self._site(), extents=extents)
        return iter([idx[0] if len(idx) == 1 else idx])

    # -- arithmetic ------------------------------------------------------------------------
    def exp2(self, x):
        return np.exp2(_f32(x))

    def exp(self, x):
        return np.exp(_f32(x))

    def log2(self, x):
        return np.log2(_f32(x))

    def log(self, x):
        return np.log(_f32(x))

    def sqrt(self, x):
        return np.sqrt(_f32(x))

    def tanh(self, x):
        return np.tanh(_f32(x))

    def sin(self, x):
        return np.sin(_f32(x))

    def cos(self, x):
        return np.cos(_f32(x))

    def tan(self, x):
        return np.tan(_f32(x))

    def pow(self, x, y):
        return np.power(_f32(x), _f32(y))

    def bitwise_and(self, a, b):
        return np.bitwise_and(a, b)

    def bitwise_or(self, a, b):
        return np.bitwise_or(a, b)

    def bitwise_xor(self, a, b):
        return np.bitwise_xor(a, b)

    def Cast(self, dtype, x):
        if dtype == "int32":
            return self.int32(x)
        if dtype not in ("float32", "float"):
            raise UnsupportedConstruct(f"T.Cast({dtype!r}, ...): only casts to float32 and int32 are modeled")
        return _f32(x)

    def abs(self, x):
        return np.abs(x)

    def infinity(self, dtype):
        return float("inf")

    def min_value(self, dtype):
        if dtype not in ("float", "float32"):
            raise UnsupportedConstruct(f"T.min_value({dtype!r}): the CPU model knows float32's only")
        return float(np.finfo(np.float32).min)

    def if_then_else(self, cond, t, f):
        r = np.where(cond, t, f)
        return r.astype(np.float32) if r.dtype == np.float64 else r

    def min(self, a, b):
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.minimum(a, b)
        return builtins.min(a, b)

    def max(self, a, b):
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.maximum(a, b)
        return builtins.max(a, b)

    def ceildiv(self, a, b):
        return -(-a // b)

    def floordiv(self, a, b):
        return a // b

    def floormod(self, a, b):
        return a % b

    def truncdiv(self, a, b):  # C's / : the emitted kernels use it only where both are >= 0
        return np.trunc(np.divide(a, b)).astype(np.int64) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) \
            else int(a / b) if abs(a) < 2**52 else a // b

    def truncmod(self, a, b):
        return a - self.truncdiv(a, b) * b

    # -- tile operations -------------------------------------------------------------------
    def fill(self, buffer, value, annotations=None):
        r = as_region(buffer)
        self._rt.trace and self._rt.trace.event("fill", self._site(), dst=r)
        r.write(np.full(r.shape, value, np.float32))

    def copy(self, src, dst, **kwargs):
        src, dst = as_region(src), as_region(dst)
        if not same_shape(src.shape, dst.shape):
            raise KernelError(f"T.copy: {src} has shape {src.shape}, {dst} has shape {dst.shape}")
        self._rt.trace and self._rt.trace.event("copy", self._site(), src=src, dst=dst)
        if src.buf.scope == "global":  # a synchronous TMA load: zeros beyond the tensor
            if dst.buf.tracker is not None:
                dst.check_bounds()
                kind = "TMA load (T.copy)" if dst.buf.scope == "shared" else "load"  # into registers: every thread loads
                dst.buf.tracker.check(dst.buf, dst.box, True, by=kind)
                dst.buf.tracker.global_read(src, self._rt.agent, kind)
            dst.write(src.load_zero_filled().reshape(dst.shape), check=False)
        elif dst.buf.scope == "global":  # a TMA store: elements beyond the tensor are dropped
            self._tma_store(src, dst)
        else:
            dst.write(src.read().reshape(dst.shape))

    def _reduce(self, kind, buffer, out, dim, clear):
        src = as_region(buffer).read()
        dst = as_region(out)
        dim = dim if dim >= 0 else src.ndim + dim
        red = {"max": np.max, "min": np.min, "sum": np.sum}[kind](src, axis=dim)
        self._rt.trace and self._rt.trace.event("reduce", self._site(), op=kind, elems=src.size)
        if not clear:
            prev = dst.read()
            red = {"max": np.maximum, "min": np.minimum, "sum": np.add}[kind](prev, red.reshape(prev.shape))
        dst.write(red.reshape(dst.shape))

    def reduce_max(self, buffer, out, dim=-1, clear=True, batch=1, annotations=None):
        self._reduce("max", buffer, out, dim, clear)

    def reduce_min(self, buffer, out, dim=-1, clear=True, batch=1, annotations=None):
        self._reduce("min", buffer, out, dim, clear)

    def reduce_sum(self, buffer, out, dim=-1, clear=True, batch=1, annotations=None):
        self._reduce("sum", buffer, out, dim, clear)

    # -- TMA -------------------------------------------------------------------------------
    def tma_copy(self, src, dst, *, barrier=None, cluster_mask=None, leader_scope_threads=None, eviction_policy=None, annotations=None):
        if cluster_mask is not None:
            raise UnsupportedConstruct("T.tma_copy(cluster_mask=...): multicast is not modeled")
        rt = self._rt
        src, dst = as_region(src), as_region(dst)
        if not same_shape(src.shape, dst.shape):
            raise KernelError(f"T.tma_copy: {src} has shape {src.shape}, {dst} has shape {dst.shape}")
        if src.buf.scope == "global" and dst.buf.scope == "shared":
            if barrier is None:
                raise KernelError("T.tma_copy global -> shared needs barrier=")
            bar = self._barrier(barrier)
            dst.check_bounds()
            line = self._site()
            agent = rt.agent
            tracker = rt.cta.tracker
            data = src.load_zero_filled().reshape(dst.shape)  # read at issue (a write racing with it is reported)
            # The box counts in full, rows beyond the tensor (zero-filled) included.
            nbytes = int(np.prod([b - a for a, b in zip(dst.lo, dst.hi)])) * ITEMSIZE[dst.buf.dtype]
            bar.expect_tx(nbytes)
            op = Op("TMA load", agent, line, [], [dst], lambda: dst.write(data, check=False))
            op.comp, op.clock, op.bar = bar.comp, bar.phase + 1, bar  # lands with the current phase
            tracker.issue(op, writes=(dst,))
            tracker.global_read(src, agent, "TMA load", op)
            tracker.add(op)
            bar.loads.append((bar.phase, op))
            rt.trace and rt.trace.event("tma_issue", line, bar=bar, dst=dst)
            # The TMA engine completes its bytes as early as it could (at once): a phase whose
            # arrivals are in then completes without waiting for loads issued after it, which
            # is what hardware may do, so an arrive placed before a load is exposed.
            if bar.complete_tx(nbytes):
                self._land(bar)
            rt.cta.stats["tma"] += 1
            if src.buf.name == "K":  # a K tile: what a block mask's skipped tiles save (Stats.k_tiles)
                rt.cta.stats["k_tiles"] += 1
                rt.cta.k_boxes.append(src.lo)  # which (a persistent backward checks each KV tile is loaded once)
            elif src.buf.name == "Q":  # a Q tile (its column slices count each): the backward's analogue
                rt.cta.stats["q_tiles"] += 1
                rt.cta.q_boxes.append(src.lo)  # which tile (a persistent run checks each is loaded once)
            rt.sched.pause(line)
        elif src.buf.scope == "shared" and dst.buf.scope == "global":
            rt.trace and rt.trace.event("copy", self._site(), src=src, dst=dst)
            self._tma_store(src, dst, wait=False)
        else:
            raise KernelError(f"T.tma_copy from {src.buf.scope} {src} to {dst.buf.scope} {dst}: expected global <-> shared")

    def _tma_store(self, src, dst, wait=True):
        """Shared -> global, issued by one elected thread through the async proxy.

        T.copy waits for it (tma_store_wait<0> follows in the lowering): its read of shared
        memory is done before the next statement. T.tma_copy does not: the read is in flight
        until T.tma_store_wait retires it.
        """
        rt = self._rt
        tracker = rt.cta.tracker
        agent = rt.agent
        if wait:
            dst.check_owned()  # first: a store outside the block's rows is the more precise report
        if wait and src.buf.scope != "shared":  # from registers: every thread stores its elements
            tracker.check(src.buf, src.box, False, by="store")
            cl = dst.clipped_box()
            if cl is not None:
                tracker.check(dst.buf, cl, True, by="store")
            dst.store_clipped(src.read(check=False).reshape(dst.shape))
            return
        agent.bulk_issued += 1
        if wait:  # one elected thread issues it and waits for its read (tma_store_wait<0, read>)
            tracker.check(src.buf, src.box, False, by="TMA store", elected=True)
            tracker.check_async_read(src, "TMA store", agent)
            tracker.bulk_write(dst, agent, agent.bulk_issued, "TMA store")
            dst.store_clipped(src.read(check=False).reshape(dst.shape))
            return
        line = self._site()
        dst.check_owned()  # at issue, where the bad store is written
        agent.store_issued += 1
        op = Op("TMA store", agent, line, [src], [], lambda: dst.store_clipped(src.read(check=False).reshape(dst.shape)))
        op.comp, op.clock = agent.store_comp, agent.store_issued
        tracker.issue(op, reads=(src,))
        tracker.check_async_read(src, "TMA store", agent)
        tracker.bulk_write(dst, agent, agent.bulk_issued, "TMA store", op)
        tracker.add(op)
        agent.stores.append(op)

    def tma_store_arrive(self):
        return None  # commits the bulk group; T.tma_copy and T.copy imply it

    def tma_store_wait(self, count=0, read=True):
        rt = self._rt
        agent = rt.agent
        keep = int(count)
        if keep < 0:
            raise KernelError(f"T.tma_store_wait({keep}): expected a count >= 0")
        retired = 0
        while len(agent.stores) > keep:
            op = agent.stores.pop(0)
            rt.cta.tracker.remove(op)
            op.action()
            retired = op.clock
        if retired:
            rt.cta.tracker.retire(agent, agent.store_comp, retired)
        if not read and agent.bulk_issued > keep:  # the writes of all but the `keep` newest bulk groups completed
            rt.cta.tracker.retire(agent, agent.bulk_comp, agent.bulk_issued - keep)

    # -- atomics ----------------------------------------------------------------------------
    def atomic_add(self, dst, value, memory_order=None, return_prev=False, use_tma=False, annotations=None):
        """TileLang 0.1.15's `T.atomic_add` (tilelang/cuda/language/atomic.py over language/atomic.py).

        - `T.atomic_add(dst[i, j], value)`, an element form (inside T.Parallel, or scalar indices):
          each iteration the element mask selects adds its value (atomicAdd, by every thread);
        - `T.atomic_add(dst_region, src)`: src a fragment, shared or global region of dst's shape
          (unit axes aside) or a value broadcast over it; each element adds (a tiled atomicAdd);
          in a global dst, elements beyond the tensor are dropped;
        - `use_tma=True`: src a shared region, dst a global region of the same dtype (float16,
          bfloat16, float32, int32): one elected thread issues a TMA reduce-add (`tl::tma_store_add`)
          and waits for its read of shared memory (`tma_store_arrive`, `tma_store_wait<0, read>`).
        The add happens at issue, in the destination's dtype (float32 adds in float32).
        """
        rt = self._rt
        ann = dict(annotations or {})
        use_tma = bool(ann.pop("use_tma", use_tma))
        if ann:
            raise UnsupportedConstruct(f"T.atomic_add(annotations={sorted(ann)}): only use_tma is modeled")
        if memory_order is not None and memory_order not in MEMORY_ORDERS:
            raise KernelError(f"T.atomic_add(memory_order={memory_order!r}): expected one of {', '.join(MEMORY_ORDERS)}")
        if memory_order not in (None, "relaxed"):
            raise UnsupportedConstruct(f"T.atomic_add(memory_order={memory_order!r}): atomics that order other "
                                       "memory accesses are not modeled (relaxed, the default, is)")
        tracker = rt.cta.tracker
        if return_prev:
            return self._fetch_add(dst, value, use_tma)
        if isinstance(dst, ElementRef):
            if use_tma:
                raise KernelError("T.atomic_add(use_tma=True) needs a shared source region and a global "
                                  "destination region")
            if isinstance(value, (Buffer, Region)):
                raise KernelError(f"T.atomic_add({dst}, ...): an element destination takes a value, not a region")
            self._atomic_target(dst.buf, dst.buf.name)
            if dst.buf.add_elements(dst.idx, value, ATOMIC):
                rt.cta.stats["atomic"] += 1
            return None
        dst = as_region(dst)
        self._atomic_target(dst.buf, str(dst))
        src = as_region(value) if isinstance(value, (Buffer, Region)) else None
        if src is not None and not same_shape(src.shape, dst.shape):
            raise KernelError(f"T.atomic_add: {src} has shape {src.shape}, {dst} has shape {dst.shape}")
        if use_tma:
            self._reduce_add(src, dst)
            return None
        vals = value if src is None else src.read()  # src loads by every thread (a fragment: its own)
        if src is not None:
            vals = vals.reshape(dst.shape)
        if dst.buf.scope == "global":
            dst.check_owned()
            cl = dst.clipped_box()
            if cl is not None:
                tracker.check(dst.buf, cl, True, by=ATOMIC, atomic=True)
        else:
            dst.check_bounds()
            tracker.check(dst.buf, dst.box, True, by=ATOMIC, atomic=True)
        dst.add(vals)
        rt.cta.stats["atomic"] += 1
        return None

    def _fetch_add(self, dst, value, use_tma):
        """`T.atomic_add(buf[i], v, return_prev=True)`: the scalar path (tl.atomic_add_ret_elem_op), which
        returns the value before the add. One thread's is modeled (a guarded `if tx == ...`: a tile
        counter); the statement is a scheduling point before the add, so the blocks of a concurrent
        launch race for the value in every order the scheduler draws."""
        rt = self._rt
        if use_tma or not isinstance(dst, ElementRef) or isinstance(value, (Buffer, Region)):
            raise UnsupportedConstruct("T.atomic_add(return_prev=True) on a region: only the scalar path (one "
                                       "element and a value) returns the previous value (TileLang 0.1.15 refuses the rest)")
        if rt.agent.nthreads != 1:
            raise UnsupportedConstruct(f"T.atomic_add(return_prev=True) by {rt.agent.nthreads} threads: one thread's "
                                       "is modeled (guard it with `if tx == ...`)")
        self._atomic_target(dst.buf, dst.buf.name)
        rt.sched.pause(self._site())
        np_idx = tuple(int(i) for i in dst.idx)
        prev = dst.buf.data[np_idx].item()
        dst.buf.add_elements(np_idx, value, ATOMIC)  # checked as an atomic: it commutes with the other blocks' adds
        rt.cta.stats["atomic"] += 1
        return int(prev) if dst.buf.dtype == "int32" else np.float32(prev)

    @staticmethod
    def _atomic_target(buf, name):
        if buf.scope == "fragment":
            raise UnsupportedConstruct(f"T.atomic_add into the fragment {name} (atomics on shared or global memory "
                                       "are modeled)")
        if buf.dtype not in ATOMIC_DTYPES:
            raise KernelError(f"T.atomic_add into {name} ({buf.dtype}): atomics take {', '.join(ATOMIC_DTYPES)}")

    def _reduce_add(self, src, dst):
        rt = self._rt
        if src is None or src.buf.scope != "shared" or dst.buf.scope != "global":
            raise KernelError(f"T.atomic_add(use_tma=True) reduces a shared source region into a global region; got "
                              f"{'a value' if src is None else f'{src.buf.scope} {src}'} into {dst.buf.scope} {dst}")
        if src.buf.dtype != dst.buf.dtype or dst.buf.dtype not in REDUCE_ADD_DTYPES:
            raise KernelError(f"T.atomic_add(use_tma=True): {src} is {src.buf.dtype} and {dst} is {dst.buf.dtype}; a TMA "
                              f"reduce-add needs one dtype of {', '.join(REDUCE_ADD_DTYPES)}")
        src.check_bounds()
        tracker = rt.cta.tracker
        agent = rt.agent
        line = self._site()
        dst.check_owned()
        agent.bulk_issued += 1
        tracker.check(src.buf, src.box, False, by=REDUCE_ADD, elected=True)
        tracker.check_async_read(src, REDUCE_ADD, agent)
        tracker.bulk_write(dst, agent, agent.bulk_issued, REDUCE_ADD, atomic=True)
        dst.add(src.read(check=False).reshape(dst.shape))
        rt.cta.stats["reduce_add"] += 1
        rt.sched.pause(line)

    # -- mbarriers -----------------------------------------------------------------------
    def _land(self, bar: MBarrier):
        """The barrier completed a phase: TMA loads issued in earlier phases become visible."""
        keep = []
        for phase, op in bar.loads:
            if phase < bar.phase:
                self._rt.trace and self._rt.trace.event("tma_land", op.line, bar=bar, phase=phase, op=op)
                self._rt.cta.tracker.remove(op)
                op.action()
            else:
                keep.append((phase, op))
        bar.loads[:] = keep

    def mbarrier_arrive(self, mbarrier, cta_id=None):
        if cta_id is not None:
            raise UnsupportedConstruct("T.mbarrier_arrive(cta_id=...): cluster barriers are not modeled")
        rt = self._rt
        bar = self._barrier(mbarrier)
        line = self._site()
        agent = rt.agent
        rt.trace and rt.trace.event("mbar_arrive", line, bar=bar, n=agent.nthreads)
        done = bar.arrive(agent.nthreads, agent.vc)  # release
        rt.cta.tracker.released(agent)
        if done:
            self._land(bar)
        rt.sched.pause(line)

    barrier_arrive = mbarrier_arrive

    def mbarrier_wait_parity(self, mbarrier, parity):
        rt = self._rt
        bar = self._barrier(mbarrier)
        parity = int(parity)
        if parity not in (0, 1):
            raise KernelError(f"T.mbarrier_wait_parity({bar.name}, {parity}): parity must be 0 or 1")
        line = self._site()
        rt.sched.block(lambda: not bar.blocks(parity),
                       lambda: f"{bar.name} to complete its phase of parity {parity} ({bar.state()})", line)
        rt.cta.tracker.acquire(rt.agent, bar.done_vc)  # the latest completed phase (none on a fresh barrier)
        rt.trace and rt.trace.event("mbar_wait", line, bar=bar, parity=parity)

    barrier_wait = mbarrier_wait_parity

    # -- named barriers -------------------------------------------------------------------
    def _named(self, barrier_id, count):
        rt = self._rt
        if barrier_id is None:
            barrier_id = 0
        count = rt.cta.threads if count is None else int(count)
        nb = rt.cta.named.get(int(barrier_id))
        if nb is None:
            nb = rt.cta.named[int(barrier_id)] = NamedBarrier(int(barrier_id))
        return nb, count

    def sync_threads(self, barrier_id=None, arrive_count=None):
        """bar.sync: arrive (release), wait for the generation, acquire every arrival of it."""
        rt = self._rt
        nb, count = self._named(barrier_id, arrive_count)
        line = self._site()
        agent = rt.agent
        tracker = rt.cta.tracker
        gen = nb.generation
        rt.trace and rt.trace.event("bar_arrive", line, bar=nb, gen=gen, n=agent.nthreads, count=count, sync=True)
        nb.arrive(agent.nthreads, count, agent, agent.vc)
        tracker.released(agent)
        if nb.generation == gen:
            rt.sched.block(lambda: nb.generation != gen, nb.state, line)
        else:
            rt.sched.pause(line)
        tracker.acquire(agent, nb.released_vc[gen + 1])
        rt.trace and rt.trace.event("bar_wait", line, bar=nb, gen=gen)

    def named_barrier_arrive(self, barrier_id, thread_count):
        """bar.arrive: release only; the syncers of the generation acquire it."""
        rt = self._rt
        nb, count = self._named(barrier_id, thread_count)
        line = self._site()
        agent = rt.agent
        rt.trace and rt.trace.event("bar_arrive", line, bar=nb, gen=nb.generation, n=agent.nthreads, count=count, sync=False)
        nb.arrive(agent.nthreads, count, agent, agent.vc)
        rt.cta.tracker.released(agent)
        rt.sched.pause(line)

    def fence_proxy_async(self):
        self._rt.cta.tracker.fence(self._rt.agent)

    # -- wgmma -------------------------------------------------------------------------------
    def wgmma_gemm(self, A, B, C, transpose_A=False, transpose_B=False, policy=None, clear_accum=False, annotations=None):
        rt = self._rt
        A, B, C = as_region(A), as_region(B), as_region(C)
        a, b, c = A.shape, B.shape, C.shape
        if len(a) != 2 or len(b) != 2 or len(c) != 2:
            raise KernelError(f"T.wgmma_gemm needs 2-d operands: A {a}, B {b}, C {c}")
        m, ka = a[::-1] if transpose_A else a
        kb, n = b[::-1] if transpose_B else b
        if ka != kb or c != (m, n):
            raise KernelError(f"T.wgmma_gemm shapes do not agree: A {a}{' (transposed)' if transpose_A else ''}, "
                              f"B {b}{' (transposed)' if transpose_B else ''}, C {c}")
        if C.buf.scope != "fragment" or C.buf.dtype != "float32":
            raise KernelError(f"T.wgmma_gemm accumulator {C} must be a float32 fragment")
        if E4M3 in (A.buf.dtype, B.buf.dtype):
            _check_fp8_wgmma(A, B, transpose_A, transpose_B, ka)
        for r in (A, B, C):
            r.check_bounds()  # at issue, where the bad index is written
        agent = rt.agent
        line = self._site()
        tracker = rt.cta.tracker
        reads = [A, B] + ([] if clear_accum else [C])

        def action():
            x = A.read(check=False)
            y = B.read(check=False)
            prod = (x.T if transpose_A else x) @ (y.T if transpose_B else y)
            C.write(prod if clear_accum else C.read(check=False) + prod, check=False)

        op = Op("wgmma", agent, line, reads, [C], action)
        agent.wg_issued += 1
        op.comp, op.clock = agent.wg_comp, agent.wg_issued
        # The accumulator is read and written: recording the write covers both.
        tracker.issue(op, reads=(A, B), writes=(C,), acc=C)
        for r in (A, B):
            if r.buf.scope == "shared":
                tracker.check_async_read(r, "wgmma operand", agent)
        tracker.add(op)
        agent.wgmma.append(op)
        rt.trace and rt.trace.event("wgmma", line, a=A, b=B, c=C, m=m, n=n, k=ka)
        rt.cta.stats["wgmma"] += 1
        rt.sched.pause(line)

    def wait_wgmma(self, id):
        rt = self._rt
        agent = rt.agent
        keep = int(id)
        if keep < 0:
            raise KernelError(f"T.wait_wgmma({keep}): expected a count >= 0")
        line = self._site()
        rt.trace and rt.trace.event("wgmma_wait", line, keep=keep)
        tracker = rt.cta.tracker
        retired, bufs = 0, set()
        while len(agent.wgmma) > keep:
            op = agent.wgmma.pop(0)
            tracker.remove(op)
            op.action()
            retired = op.clock
            bufs.update(r.buf for r in op.reads + op.writes)
        if retired:
            tracker.retire(agent, agent.wg_comp, retired, bufs)
        rt.sched.pause(line)
