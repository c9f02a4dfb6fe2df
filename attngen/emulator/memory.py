"""Buffers (global, shared, fragment), regions of them, and TMA's out-of-bounds rules.

Every buffer stores float32; 16-bit buffers round on each write (`reference.round_to`), so
numpy matmuls stay fast while values stay exactly what the GPU holds. A region is a box
[lo, hi) per axis plus the axes that an integer index removed; boxes are what hazard
checks intersect, so `K_shared[1, :, :]` and `K_shared[0, :, :]` never conflict.
"""

from __future__ import annotations

import numpy as np

from attngen.emulator.errors import KernelError, UnsupportedConstruct
from attngen.hw import DTYPES as KERNEL_DTYPES
from attngen.reference import round_to

# TileLang's buffer dtype spellings -> how the emulator stores and rounds them
DTYPES = {**{name: name for name in KERNEL_DTYPES}, "float": "float32", "float32": "float32"}

# T.Parallel hands out cached broadcast aranges; this maps id(array) -> (position, extent),
# so an element access with them becomes a plain slice (the common case, and fast).
PARALLEL_INDEX: dict[int, tuple[int, int]] = {}
_PARALLEL_CACHE: dict[tuple, tuple] = {}


def parallel_indices(extents: tuple[int, ...]) -> tuple:
    got = _PARALLEL_CACHE.get(extents)
    if got is None:
        nd = len(extents)
        arrays = []
        for pos, n in enumerate(extents):
            shape = [1] * nd
            shape[pos] = n
            a = np.arange(n).reshape(shape)
            a.flags.writeable = False
            PARALLEL_INDEX[id(a)] = (pos, n)
            arrays.append(a)
        got = _PARALLEL_CACHE[extents] = tuple(arrays)
    return got


class Lanes(np.ndarray):
    """Per-thread values of one warpgroup (the thread index and tests on it).

    Python cannot branch on them; the ast rewrite turns `if` on lanes into "how many of this
    agent's threads take the branch", so truth-testing them anywhere else is an error.
    """

    def __bool__(self):
        raise UnsupportedConstruct("a thread-index condition is used where it cannot be split per thread "
                                   "(only `if` statements and T.ws may test the thread index)")


class Buffer:
    """A global tensor, a CTA's shared buffer or one warpgroup's fragment."""

    __slots__ = ("name", "shape", "dtype", "scope", "data", "owner", "tracker", "__weakref__")

    def __init__(self, name, shape, dtype, scope, *, data=None, owner=None, tracker=None):
        if dtype not in DTYPES:
            raise UnsupportedConstruct(f"buffer dtype {dtype!r} (supported: {', '.join(DTYPES)})")
        self.name, self.dtype, self.scope, self.owner, self.tracker = name, DTYPES[dtype], scope, owner, tracker
        self.shape = tuple(int(s) for s in shape)
        # Shared memory and registers start as garbage on the GPU: NaN here, so a read before
        # any write (a missed load, a wait that passed too early) shows up in the output.
        self.data = np.full(self.shape, np.nan, np.float32) if data is None else data

    def __repr__(self):
        return f"{self.name}{list(self.shape)}"

    @property
    def label(self):
        return f"{self.name} ({self.scope}" + (f" of {self.owner.name})" if self.owner is not None else ")")

    # -- element access (inside T.Parallel) ----------------------------------
    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(x, slice) for x in idx):
            return Region.of(self, idx)
        np_idx, shape, box = self._elements(idx)
        if self.tracker is not None:
            self.tracker.check(self, box, write=False)
        got = self.data[np_idx]
        # A value, not a view: `x = buf[i, j]` must not change when buf is written later.
        return got.reshape(shape).copy() if shape is not None else got

    def __setitem__(self, idx, value):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(x, slice) for x in idx):
            Region.of(self, idx).write(value)
            return
        np_idx, shape, box = self._elements(idx)
        if self.tracker is not None:
            self.tracker.check(self, box, write=True)
        value = self.convert(value)
        try:
            if shape is not None:
                self.data[np_idx].reshape(shape, copy=False)[...] = value  # a view: full slices
            else:
                self.data[np_idx] = value
        except ValueError as e:
            raise KernelError(f"cannot store a value of shape {np.shape(value)} into {self.name}[...]: {e} "
                              f"(several parallel iterations would write the same element)") from None

    def convert(self, value):
        if self.dtype == "float32":
            return np.asarray(value, np.float32)
        return round_to(value, self.dtype)

    def _elements(self, idx):
        """numpy index, result shape (None: use numpy's), and the [lo, hi) box touched."""
        if len(idx) != len(self.shape):
            raise KernelError(f"{self.name} has {len(self.shape)} dimensions, indexed with {len(idx)}")
        fast = True
        last = -1
        out_shape = None
        lo, hi = [], []
        for axis, x in enumerate(idx):
            info = PARALLEL_INDEX.get(id(x))
            if info is not None and info[1] == self.shape[axis] and info[0] > last:
                last = info[0]
                if out_shape is None:
                    out_shape = [1] * x.ndim
                out_shape[info[0]] = info[1]
                lo.append(0)
                hi.append(info[1])
                continue
            fast = False
            if isinstance(x, Lanes):
                raise UnsupportedConstruct(f"indexing {self.name} by the thread index (per-thread code)")
            if isinstance(x, np.ndarray):
                if x.dtype.kind not in "iu":
                    raise KernelError(f"{self.name} indexed with a non-integer array")
                a, b = (int(x.min()), int(x.max()) + 1) if x.size else (0, 0)
            else:
                try:
                    a = int(x)
                except TypeError:
                    raise KernelError(f"{self.name} indexed with {type(x).__name__}") from None
                b = a + 1
            if a < 0 or b > self.shape[axis]:
                raise KernelError(f"index out of bounds: {self.name} axis {axis} has extent {self.shape[axis]}, "
                                  f"accessed [{a}, {b})")
            lo.append(a)
            hi.append(b)
        box = (tuple(lo), tuple(hi))
        if fast:
            return tuple(slice(None) for _ in idx), tuple(out_shape) if out_shape is not None else (), box
        return tuple(int(x) if not isinstance(x, np.ndarray) else x for x in idx), None, box


class Region:
    """buffer[lo:hi] per axis; `squeeze` marks axes given as integers (dropped from the shape)."""

    __slots__ = ("buf", "lo", "hi", "squeeze")

    def __init__(self, buf, lo, hi, squeeze):
        self.buf, self.lo, self.hi, self.squeeze = buf, lo, hi, squeeze

    @classmethod
    def of(cls, buf: Buffer, idx) -> "Region":
        if len(idx) != len(buf.shape):
            raise KernelError(f"{buf.name} has {len(buf.shape)} dimensions, indexed with {len(idx)}")
        lo, hi, squeeze = [], [], []
        for axis, x in enumerate(idx):
            n = buf.shape[axis]
            if isinstance(x, slice):
                if x.step not in (None, 1):
                    raise UnsupportedConstruct(f"strided slice of {buf.name}")
                a = 0 if x.start is None else _as_int(x.start, buf)
                b = n if x.stop is None else _as_int(x.stop, buf)
                squeeze.append(False)
            else:
                a = _as_int(x, buf)
                b = a + 1
                squeeze.append(True)
            lo.append(a)
            hi.append(b)
        return cls(buf, tuple(lo), tuple(hi), tuple(squeeze))

    @classmethod
    def whole(cls, buf: Buffer) -> "Region":
        return cls(buf, (0,) * len(buf.shape), buf.shape, (False,) * len(buf.shape))

    @property
    def shape(self):
        return tuple(b - a for a, b, s in zip(self.lo, self.hi, self.squeeze) if not s)

    @property
    def box(self):
        return self.lo, self.hi

    def __str__(self):
        b = self.buf
        if self.lo == (0,) * len(b.shape) and self.hi == b.shape:
            return b.name
        parts = []
        for a, c, s, n in zip(self.lo, self.hi, self.squeeze, b.shape):
            parts.append(str(a) if s else (":" if (a, c) == (0, n) else f"{a}:{c}"))
        while len(parts) > 1 and parts[-1] == ":":  # K_shared[1, :, :] reads as K_shared[1]
            parts.pop()
        return f"{b.name}[{', '.join(parts)}]"

    def _slices(self):
        for a, c, n in zip(self.lo, self.hi, self.buf.shape):
            if a < 0 or c > n or a > c:
                raise KernelError(f"region {self} is out of bounds of {self.buf.name}{list(self.buf.shape)}")
        return tuple(slice(a, c) for a, c in zip(self.lo, self.hi))

    def check_bounds(self):
        if self.buf.scope != "global":
            self._slices()

    def read(self, check=True) -> np.ndarray:
        """The region's values as a view (callers use them at once)."""
        sl = self._slices()
        if check and self.buf.tracker is not None:
            self.buf.tracker.check(self.buf, self.box, write=False)
        return self.buf.data[sl].reshape(self.shape)

    def write(self, value, check=True):
        sl = self._slices()
        if check and self.buf.tracker is not None:
            self.buf.tracker.check(self.buf, self.box, write=True)
        full = tuple(c - a for a, c in zip(self.lo, self.hi))
        value = self.buf.convert(value)
        try:
            self.buf.data[sl] = np.broadcast_to(value, self.shape).reshape(full)
        except ValueError:
            raise KernelError(f"cannot copy a value of shape {np.shape(value)} into {self} of shape {self.shape}") from None

    # -- global memory: TMA bounds rules -------------------------------------
    def _clipped(self):
        """(slices into the tensor, slices into the box) for the in-bounds part; None if empty."""
        src, dst = [], []
        for a, c, n in zip(self.lo, self.hi, self.buf.shape):
            a2, c2 = max(a, 0), min(c, n)
            if a2 >= c2:
                return None
            src.append(slice(a2, c2))
            dst.append(slice(a2 - a, c2 - a))
        return tuple(src), tuple(dst)

    def load_zero_filled(self) -> np.ndarray:
        """TMA load: elements outside the tensor read as zero."""
        full = tuple(c - a for a, c in zip(self.lo, self.hi))
        out = np.zeros(full, np.float32)
        cl = self._clipped()
        if cl is not None:
            out[cl[1]] = self.buf.data[cl[0]]
        return out.reshape(self.shape)

    def store_clipped(self, value):
        """TMA store: elements outside the tensor are dropped."""
        full = tuple(c - a for a, c in zip(self.lo, self.hi))
        value = np.broadcast_to(self.buf.convert(value), self.shape).reshape(full)
        cl = self._clipped()
        if cl is not None:
            self.buf.data[cl[0]] = value[cl[1]]


def _as_int(x, buf):
    if isinstance(x, (np.ndarray, Lanes)) and np.ndim(x):
        raise UnsupportedConstruct(f"array-valued slice bound into {buf.name}")
    try:
        return int(x)
    except TypeError:
        raise KernelError(f"{buf.name} sliced with {type(x).__name__}") from None


def as_region(x) -> Region:
    if isinstance(x, Region):
        return x
    if isinstance(x, Buffer):
        return Region.whole(x)
    raise KernelError(f"expected a buffer or a buffer region, got {type(x).__name__}")


def same_shape(a: tuple, b: tuple) -> bool:
    """Copy shapes agree once unit axes are ignored (TileLang legalizes those)."""
    return tuple(d for d in a if d != 1) == tuple(d for d in b if d != 1)
