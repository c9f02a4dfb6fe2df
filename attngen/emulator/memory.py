"""Buffers (global, shared, fragment), regions of them, and TMA's out-of-bounds rules.

Every float buffer stores float32; 16-bit buffers round on each write (`reference.round_to`),
so numpy matmuls stay fast while values stay exactly what the GPU holds. int32 buffers
(cu_seqlens, block tables) store int32, and reading one element gives a Python int, usable
as an index or a slice bound. A region is a box [lo, hi) per axis plus the axes that an
integer index removed; boxes are what hazard checks intersect, so `K_shared[1, :, :]` and
`K_shared[0, :, :]` never conflict.

Element accesses inside a per-element `if` of `T.Parallel` (tlang's element branches) see
the branch's mask (`predicated`): a store writes only the selected elements, and only the
selected elements (of a store or a load) must be in bounds. A global tensor may carry an
ownership rule (`Owned`): every store to it must stay inside what the running CTA owns.
"""

from __future__ import annotations

import threading

import numpy as np

from attngen.emulator.errors import KernelError, UnsupportedConstruct
from attngen.hw import DTYPES as KERNEL_DTYPES, E4M3
from attngen.reference.forward import round_to

# TileLang's buffer dtype spellings -> how the emulator stores and rounds them
DTYPES = {**{name: name for name in KERNEL_DTYPES}, "float": "float32", "float32": "float32", "int32": "int32",
          E4M3: E4M3}  # an fp8 KV cache's tiles (rounded as cvt.rn.satfinite does)
INT_POISON = np.iinfo(np.int32).min  # what an unwritten int32 element holds (NaN for floats)

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


# The element mask of the per-element `if` being executed, per agent (each agent is a thread).
_PRED = threading.local()


def element_mask():
    """The mask of the enclosing per-element `if` bodies (None outside any)."""
    return getattr(_PRED, "mask", None)


class predicated:
    """`with predicated(mask):` runs element accesses under `mask` (already ANDed with the outer one)."""

    __slots__ = ("mask", "saved")

    def __init__(self, mask):
        self.mask = mask

    def __enter__(self):
        self.saved = element_mask()
        _PRED.mask = self.mask

    def __exit__(self, *exc):
        _PRED.mask = self.saved
        return False


def _needed(mask, shape):
    """Which elements of an access of index shape `shape` some iteration selected by `mask` touches:
    the mask, reduced (any) over the loop axes the index does not vary along."""
    mask = np.asarray(mask, bool)
    nd = max(mask.ndim, len(shape))
    m = mask.reshape((1,) * (nd - mask.ndim) + mask.shape)
    s = (1,) * (nd - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(nd) if s[a] == 1 and m.shape[a] != 1)
    if axes:
        m = m.any(axis=axes, keepdims=True)
    return m.reshape(m.shape[nd - len(shape):])


class Owned:
    """The elements of one global tensor that the running CTA may write, computed on first use.

    `compute()` returns a boolean mask broadcastable to the tensor's shape, or None (no rule);
    `who` names the CTA in reports."""

    __slots__ = ("compute", "who", "_mask", "_done")

    def __init__(self, compute, who: str):
        self.compute, self.who, self._mask, self._done = compute, who, None, False

    def mask(self, buf):
        if not self._done:
            got = self.compute()
            if got is not None:
                try:
                    got = np.broadcast_to(np.asarray(got, bool), buf.shape)
                except ValueError:
                    raise KernelError(f"the ownership rule for {buf.name}{list(buf.shape)} gave a mask of shape "
                                      f"{np.shape(got)}") from None
            self._mask, self._done = got, True
        return self._mask


def _owned_text(buf, mask) -> str:
    """What a CTA owns of buf, as the box around it (and the count when it is not the whole box)."""
    where = np.argwhere(mask)
    if not len(where):
        return f"it owns no element of {buf.name}"
    lo, hi = where.min(axis=0), where.max(axis=0) + 1
    parts = [str(a) if b - a == 1 else (":" if (a, b) == (0, n) else f"{a}:{b}") for a, b, n in zip(lo, hi, buf.shape)]
    box = f"{buf.name}[{', '.join(parts)}]"
    if len(where) == int(np.prod(hi - lo)):
        return f"it owns {box}"
    return f"it owns {len(where)} elements within {box}"


def check_owned(buf, index):
    """A store to buf[index] (a numpy index, in bounds) must touch only elements the running CTA owns."""
    owned = buf.owned
    if owned is None:
        return
    mask = owned.mask(buf)
    if mask is None:
        return
    ok = mask[index]
    if ok.all():
        return
    bad = np.zeros(buf.shape, bool)
    bad[index] = ~ok
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise KernelError(f"{owned.who} writes {buf.name}[{', '.join(map(str, first))}], which it does not own "
                      f"({int(bad.sum())} such element(s) in this store); {_owned_text(buf, mask)}")


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

    __slots__ = ("name", "shape", "dtype", "scope", "data", "owner", "tracker", "owned", "__weakref__")

    def __init__(self, name, shape, dtype, scope, *, data=None, owner=None, tracker=None):
        if dtype not in DTYPES:
            raise UnsupportedConstruct(f"buffer dtype {dtype!r} (supported: {', '.join(DTYPES)})")
        self.name, self.dtype, self.scope, self.owner, self.tracker = name, DTYPES[dtype], scope, owner, tracker
        self.shape = tuple(int(s) for s in shape)
        self.owned = None  # global tensors: an Owned rule for the running CTA's stores (None: unchecked)
        # Shared memory and registers start as garbage on the GPU: NaN here (int32: INT_POISON), so
        # a read before any write (a missed load, a wait that passed too early) shows up in the output.
        if data is None:
            int32 = self.dtype == "int32"
            data = np.full(self.shape, INT_POISON if int32 else np.nan, np.int32 if int32 else np.float32)
        self.data = data

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
        mask = element_mask()
        if mask is not None:
            return self._load_masked(idx, mask)
        np_idx, shape, box = self._elements(idx)
        if self.tracker is not None:
            self.tracker.check(self, box, write=False, index=np_idx)
        got = self.data[np_idx]
        if shape is None and got.ndim == 0 and self.dtype == "int32":
            return int(got)  # an index or a bound (cu_seqlens_q[b]), not a numpy int32 that could overflow
        # A value, not a view: `x = buf[i, j]` must not change when buf is written later.
        return got.reshape(shape).copy() if shape is not None else got

    def __setitem__(self, idx, value):
        idx = idx if isinstance(idx, tuple) else (idx,)
        mask = element_mask()
        if any(isinstance(x, slice) for x in idx):
            if mask is not None:
                raise UnsupportedConstruct(f"a sliced store into {self.name} inside a per-element `if`")
            Region.of(self, idx).write(value)
            return
        if mask is not None:
            self._store_masked(idx, value, mask)
            return
        np_idx, shape, box = self._elements(idx)
        if self.owned is not None:  # first: a store outside the block's rows is the more precise report
            check_owned(self, np_idx)
        if self.tracker is not None:
            self.tracker.check(self, box, write=True, index=np_idx)
        value = self.convert(value)
        try:
            if shape is not None:
                self.data[np_idx].reshape(shape, copy=False)[...] = value  # a view: full slices
            else:
                self.data[np_idx] = value
        except ValueError as e:
            raise KernelError(f"cannot store a value of shape {np.shape(value)} into {self.name}[...]: {e} "
                              f"{_SAME_ELEMENT}") from None

    def convert(self, value):
        if self.dtype == "float32":
            return np.asarray(value, np.float32)
        if self.dtype == "int32":
            return np.asarray(value).astype(np.int32)
        return round_to(value, self.dtype)

    # -- element access under a per-element `if` -------------------------------
    def _index_arrays(self, idx):
        """Each index as an int or an integer array, unchecked (the predicate decides what must be in bounds)."""
        if len(idx) != len(self.shape):
            raise KernelError(f"{self.name} has {len(self.shape)} dimensions, indexed with {len(idx)}")
        out = []
        for x in idx:
            if isinstance(x, Lanes):
                raise UnsupportedConstruct(f"indexing {self.name} by the thread index (per-thread code)")
            if isinstance(x, np.ndarray) and x.ndim:
                if x.dtype.kind not in "iu":
                    raise KernelError(f"{self.name} indexed with a non-integer array")
                out.append(x)
                continue
            try:
                out.append(int(x))
            except TypeError:
                raise KernelError(f"{self.name} indexed with {type(x).__name__}") from None
        return out, np.broadcast_shapes(*(np.shape(a) for a in out))

    def _selected(self, arrays, shape, sel):
        """The selected elements' coordinates (1-d arrays), bounds-checked, and their bounding box (None: none)."""
        where = [np.broadcast_to(a, shape)[sel] for a in arrays]
        if not where[0].size:
            return where, None
        lo, hi = [], []
        for axis, w in enumerate(where):
            a, b = int(w.min()), int(w.max()) + 1
            self._check_span(axis, a, b, " where the `if` holds")
            lo.append(a)
            hi.append(b)
        return where, (tuple(lo), tuple(hi))

    def _load_masked(self, idx, mask):
        arrays, shape = self._index_arrays(idx)
        try:
            need = np.broadcast_to(_needed(mask, shape), shape)
        except ValueError:
            raise KernelError(f"a load of {self.name} indexed with shape {shape} under an `if` of shape "
                              f"{np.shape(mask)}") from None
        where, box = self._selected(arrays, shape, need)
        if box is not None and self.tracker is not None:
            self.tracker.check(self, box, write=False, index=tuple(where))
        got = np.zeros(shape, self.data.dtype)  # elements no selected iteration reads: never used
        got[need] = self.data[tuple(where)]
        if got.ndim == 0 and self.dtype == "int32":
            return int(got)
        return got

    def _store_masked(self, idx, value, mask):
        arrays, shape = self._index_arrays(idx)
        try:
            sel = np.broadcast_to(mask, shape)
            value = np.broadcast_to(self.convert(value), shape)
        except ValueError:
            raise KernelError(f"cannot store a value of shape {np.shape(value)} under an `if` of shape "
                              f"{np.shape(mask)} into {self.name}[...] indexed with shape {shape} {_SAME_ELEMENT}") from None
        where, box = self._selected(arrays, shape, sel)
        if box is None:
            return
        index = tuple(where)
        if self.owned is not None:
            check_owned(self, index)
        if self.tracker is not None:
            self.tracker.check(self, box, write=True, index=index)
        self.data[index] = value[sel]

    # -- atomics ---------------------------------------------------------------
    def add_elements(self, idx, value, by: str) -> int:
        """`T.atomic_add(buf[i, j], value)`: every iteration of the enclosing T.Parallel that the
        element mask selects adds its value to its element (several iterations may name one
        element: each adds). Only selected elements must be in bounds. Returns the adds made."""
        mask = element_mask()
        arrays, shape = self._index_arrays(idx)
        try:
            it = np.broadcast_shapes(shape, np.shape(value), () if mask is None else np.shape(mask))
            sel = np.ones(it, bool) if mask is None else np.broadcast_to(mask, it)
            vals = np.broadcast_to(self.convert(value), it)
        except ValueError:
            raise KernelError(f"T.atomic_add into {self.name}[...] indexed with shape {shape}: a value of shape "
                              f"{np.shape(value)} under an `if` of shape {np.shape(mask)} does not broadcast") from None
        where, box = self._selected(arrays, it, sel)
        if box is None:
            return 0
        index = tuple(where)
        if self.owned is not None:
            check_owned(self, index)
        if self.tracker is not None:
            self.tracker.check(self, box, write=True, by=by, index=index, atomic=True)
        self.add_at(index, vals[sel], unique=False)
        return len(where[0])

    def add_at(self, index, vals, unique: bool):
        """data[index] += vals, in the buffer's dtype: float32 adds in float32, int32 wraps, a 16-bit
        element rounds after each add. `unique`: index names each element at most once."""
        if self.dtype in ("float32", "int32"):
            if unique:
                self.data[index] += vals
            else:
                np.add.at(self.data, index, vals)
            return
        if not unique:  # a 16-bit element named twice rounds twice: add the repeats one round at a time
            flat = np.ravel_multi_index(index, self.shape)
            order = np.argsort(flat, kind="stable")
            flat = flat[order]
            first = np.r_[True, flat[1:] != flat[:-1]]
            rank = np.arange(len(flat)) - np.maximum.accumulate(np.where(first, np.arange(len(flat)), 0))
            for r in range(int(rank.max()) + 1 if len(rank) else 0):
                pick = order[rank == r]
                sub = tuple(a[pick] for a in index)
                self.data[sub] = round_to(self.data[sub] + vals[pick], self.dtype)
            return
        self.data[index] = round_to(self.data[index] + vals, self.dtype)

    def _check_span(self, axis, a, b, where=""):
        if a < 0 or b > self.shape[axis]:
            raise KernelError(f"index out of bounds: {self.name} axis {axis} has extent {self.shape[axis]}, "
                              f"accessed [{a}, {b}){where}")

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
            self._check_span(axis, a, b)
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
        if self.buf.owned is not None:
            check_owned(self.buf, sl)
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

    def clipped_box(self):
        """The box of the part inside the tensor, or None if empty."""
        cl = self._clipped()
        if cl is None:
            return None
        return tuple(x.start for x in cl[0]), tuple(x.stop for x in cl[0])

    def add(self, value):
        """An atomic add of value (broadcast to the region) into it, element by element; a global
        region drops what lies beyond the tensor (TileLang predicates those elements off, TMA clips
        them). The caller checks ownership and races first. Returns the box added to (None: nothing)."""
        full = tuple(c - a for a, c in zip(self.lo, self.hi))
        try:
            value = np.broadcast_to(self.buf.convert(value), self.shape).reshape(full)
        except ValueError:
            raise KernelError(f"T.atomic_add: a value of shape {np.shape(value)} into {self} of shape {self.shape}") from None
        if self.buf.scope == "global":
            cl = self._clipped()
            if cl is None:
                return None
            target, value = cl[0], value[cl[1]]
        else:
            target = self._slices()
        self.buf.add_at(target, value, unique=True)
        return tuple(x.start for x in target), tuple(x.stop for x in target)

    def check_owned(self):
        """A store to this region: its part inside the tensor must be the running CTA's own."""
        cl = self._clipped()
        if cl is not None and self.buf.owned is not None:
            check_owned(self.buf, cl[0])

    def store_clipped(self, value):
        """TMA store: elements outside the tensor are dropped."""
        full = tuple(c - a for a, c in zip(self.lo, self.hi))
        value = np.broadcast_to(self.buf.convert(value), self.shape).reshape(full)
        self.check_owned()
        cl = self._clipped()
        if cl is not None:
            self.buf.data[cl[0]] = value[cl[1]]


_SAME_ELEMENT = "(several parallel iterations would write the same element)"


def stored(x, dtype: str, name: str) -> np.ndarray:
    """A caller's array as a global tensor of `dtype` holds it: a fresh float32 array of that dtype's
    values, or int32 for an int32 tensor (integer input only, within int32)."""
    if DTYPES.get(dtype) != "int32":
        return np.array(round_to(x, dtype))
    x = np.asarray(x)
    if x.dtype.kind not in "iub" or (x.size and (x.min() < np.iinfo(np.int32).min or x.max() > np.iinfo(np.int32).max)):
        raise KernelError(f"{name} is an int32 tensor: it needs integers within int32, got {x.dtype} values")
    return x.astype(np.int32)


class ElementRef:
    """`buf[i, j]` as T.atomic_add's destination: the element(s) named, not their values (the ast
    rewrite passes the subscript this way, so that naming them is not a load)."""

    __slots__ = ("buf", "idx")

    def __init__(self, buf, idx):
        self.buf, self.idx = buf, idx if isinstance(idx, tuple) else (idx,)

    def __str__(self):
        return f"{self.buf.name}[...]"


class Target:
    """`__rt__.target(buf)[idx]`: a region for a sliced subscript, else an ElementRef."""

    __slots__ = ("buf",)

    def __init__(self, buf):
        self.buf = buf

    def __getitem__(self, idx):
        buf = self.buf
        if not isinstance(buf, Buffer):
            return buf[idx]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(x, slice) for x in idx):
            return Region.of(buf, idx)
        return ElementRef(buf, idx)


def _as_int(x, buf):
    if isinstance(x, (np.ndarray, Lanes)) and np.ndim(x):
        raise UnsupportedConstruct(f"array-valued slice bound into {buf.name}")
    try:
        return int(x)
    except TypeError:
        raise KernelError(f"{buf.name} sliced with {type(x).__name__}") from None


def as_region(x) -> Region:
    """The operand of a tile operation (T.copy, T.fill, ...): whole regions, never under an element mask."""
    if element_mask() is not None:
        raise UnsupportedConstruct("a tile operation inside a per-element `if` of T.Parallel")
    if isinstance(x, Region):
        return x
    if isinstance(x, Buffer):
        return Region.whole(x)
    raise KernelError(f"expected a buffer or a buffer region, got {type(x).__name__}")


def same_shape(a: tuple, b: tuple) -> bool:
    """Copy shapes agree once unit axes are ignored (TileLang legalizes those)."""
    return tuple(d for d in a if d != 1) == tuple(d for d in b if d != 1)
