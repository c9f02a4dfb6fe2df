"""The mask and tile-range algebra, stated once: which KV tiles a Q tile sees, which Q tiles a KV
tile sees, and which of them are full (no mask needed) or partial (the mask runs).

Visibility (bottom-right alignment, offset = kv_len - q_len): query row i sees key j when

    0 <= j < kv_len,   j >= i + offset - left  (a window's left edge),   j <= i + offset + right

`Edges` holds (left, right); None is unbounded, and causal is the right edge at the diagonal
(right = 0, or min(right, 0) with a window). A mask_mod is not part of this algebra: a kernel with
one masks every tile it visits.

Rows are whatever range the caller names (`Rows(start, last)`): the forward passes a block's or a
warpgroup's rows, past q_len too (those rows are computed, never stored). The transposed direction
tiles rows [0, ceildiv(q_len, block_m) * block_m) the same way. Because left, right >= 0, the keys
a run of rows sees form one interval (each row's interval is the previous one moved right by one),
so every range below is a contiguous run of tiles: [first, stop) visible, [full_first, full_stop)
inside it full, the rest partial.

Every function is written once over a tiny integer expression builder (`add`, `min_`, `max_`,
`floordiv`, `ceildiv`): called with Python ints it returns ints (the reference, the tests, block
masks, the backward's loop bounds); called with `Sym`s it returns an expression whose `text()` is
TileLang (render.py prints it); called with torch integer tensors (a Frame of tensor lengths) it
computes elementwise (the varlen persistent order's visit counts, on the device, no host read).
The builder folds constants (`x + 0`, adjacent constants), drops a max/min that a known lower
bound decides, and nothing else, so the text stays the reader's.
This module imports nothing from attngen: render and reference both sit above it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Union

import numpy as np


# -- the expression builder ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sym:
    """A kernel name (q0, kv_len, BLOCK_N, ...) and a lower bound of its value, if known."""
    name: str
    lo: int | None = None


@dataclasses.dataclass(frozen=True)
class Sum:
    terms: tuple  # ((sign, term), ...): term an int (sign +1, the value signed) or a non-Sum node


@dataclasses.dataclass(frozen=True)
class Call:
    fn: str  # "min", "max", "floordiv", "ceildiv": printed T.fn(a, b)
    args: tuple


@dataclasses.dataclass(frozen=True)
class Op:
    op: str  # "//" (floor division, the packed-GQA row) or "*"
    a: object
    b: object


Expr = Union[int, Sym, Sum, Call, Op]


def _value(x) -> bool:
    """An int, or a torch integer tensor (the array-valued form: every function below then computes
    elementwise, e.g. the varlen persistent order's visit counts, schedulers.varlen_tile_list)."""
    return isinstance(x, int) or type(x).__name__ == "Tensor"


def _values(*xs) -> bool:
    return all(_value(x) for x in xs)


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    if isinstance(a, int):
        a, b = b, a
    return a.clamp(max=b) if isinstance(b, int) else a.minimum(b)


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if isinstance(a, int):
        a, b = b, a
    return a.clamp(min=b) if isinstance(b, int) else a.maximum(b)


def _terms(x, sign=1):
    if isinstance(x, int):
        return [(1, sign * x)]
    if isinstance(x, Sum):
        return [(1, s * sign * t) if isinstance(t, int) else (s * sign, t) for s, t in x.terms]
    return [(sign, x)]


def add(*xs) -> Expr:
    """x0 + x1 + ...: flattened; adjacent constants merged and zeros dropped, order kept."""
    if _values(*xs):
        return sum(xs)
    out = []
    for s, t in (st for x in xs for st in _terms(x)):
        if isinstance(t, int) and out and isinstance(out[-1][1], int):
            out[-1] = (1, out[-1][1] + t)
        else:
            out.append((s, t))
    out = [(s, t) for s, t in out if t != 0 or not isinstance(t, int)]
    if not out:
        return 0
    if len(out) == 1 and out[0][0] == 1:
        return out[0][1]
    return Sum(tuple(out))


def neg(x) -> Expr:
    return -x if _value(x) else Sum(tuple(_terms(x, -1)))


def sub(a, b) -> Expr:
    return add(a, neg(b))


def mul(a, b) -> Expr:
    if _values(a, b):
        return a * b
    if 0 in (a, b):
        return 0
    if 1 in (a, b):
        return b if a == 1 else a
    return Op("*", a, b)


def lower_bound(x) -> int | None:
    """A proven lower bound of x's value (None: unknown). Divisors are positive (tile sizes)."""
    if isinstance(x, int):
        return x
    if isinstance(x, Sym):
        return x.lo
    if isinstance(x, Sum):
        total = 0
        for s, t in x.terms:
            lo = lower_bound(t) if s == 1 else (-t if isinstance(t, int) else None)
            if lo is None:
                return None
            total += lo
        return total
    if isinstance(x, Call):
        lows = [lower_bound(a) for a in x.args]
        if x.fn == "min":
            return None if None in lows else min(lows)
        if x.fn == "max":
            known = [lo for lo in lows if lo is not None]
            return max(known) if known else None
        lo = lows[0]
        if lo is None or lo < 0:
            return None
        return (1 if lo >= 1 else 0) if x.fn == "ceildiv" else 0
    return None


def _at_least(x, c: int) -> bool:
    lo = lower_bound(x)
    return lo is not None and lo >= c


def max_(a, b) -> Expr:
    """max(a, b), simplified by identities that hold for every value (n >= 1):
    max(x, c) = x when x >= c is proven; max(min(A, B), c) = min(A, max(B, c)) when A >= c, and
    there max(ceildiv(x, n), 1) = ceildiv(max(x, 1), n) (the bound on the row, where a reader looks)."""
    if _values(a, b):
        return _max(a, b)
    if isinstance(a, int):
        a, b = b, a
    if a == b:
        return a
    if isinstance(b, int):
        if _at_least(a, b):
            return a
        if isinstance(a, Call) and a.fn == "min":
            x, y = a.args
            if _at_least(x, b):  # (the first operand only: the bound's place in the text stays put)
                y = max_(y, b)
                if isinstance(y, Call) and y.fn == "max" and isinstance(y.args[0], Call) and y.args[0].fn == "ceildiv" and b == 1:
                    y = ceildiv(max_(y.args[0].args[0], 1), y.args[0].args[1])
                return min_(x, y)
    return Call("max", (a, b))


def min_(a, b) -> Expr:
    if _values(a, b):
        return _min(a, b)
    if a == b:
        return a
    return Call("min", (a, b))


def floordiv(a, n) -> Expr:
    if _values(a, n):
        return a // n
    return 0 if a == 0 else Call("floordiv", (a, n))


def ceildiv(a, n) -> Expr:
    if _values(a, n):
        return -(-a // n)
    return 0 if a == 0 else Call("ceildiv", (a, n))


def rowdiv(a, n) -> Expr:
    """a // n printed with the operator (the packed-GQA row position)."""
    if isinstance(a, int) and isinstance(n, int):
        return a // n
    return Op("//", a, n)


def text(x) -> str:
    """TileLang source of an expression."""
    if isinstance(x, int):
        return str(x)
    if isinstance(x, Sym):
        return x.name
    if isinstance(x, Call):
        return f"T.{x.fn}({', '.join(text(a) for a in x.args)})"
    if isinstance(x, Op):
        def side(y):
            return f"({text(y)})" if isinstance(y, Sum) or (isinstance(y, int) and y < 0) else text(y)
        return f"{side(x.a)} {x.op} {side(x.b)}"
    out = ""
    for n, (s, t) in enumerate(x.terms):
        negative = s < 0 or (isinstance(t, int) and t < 0)
        body = str(abs(t)) if isinstance(t, int) else text(t)
        out += ("-" + body if negative else body) if n == 0 else (f" - {body}" if negative else f" + {body}")
    return out


def evaluate(x, env: dict) -> int:
    """The value of an expression with each Sym's name bound in env (floor and ceiling division)."""
    if isinstance(x, int):
        return x
    if isinstance(x, Sym):
        return env[x.name]
    if isinstance(x, Sum):
        return sum(s * evaluate(t, env) for s, t in x.terms)
    a, b = (evaluate(y, env) for y in ((x.a, x.b) if isinstance(x, Op) else x.args))
    fn = x.op if isinstance(x, Op) else x.fn
    return {"min": min, "max": max, "*": lambda p, q: p * q,
            "floordiv": lambda p, q: p // q, "//": lambda p, q: p // q, "ceildiv": lambda p, q: -(-p // q)}[fn](a, b)


# -- the algebra ----------------------------------------------------------------------------
class Edges(NamedTuple):
    left: int | None  # keys before row + offset - left are masked; None: unbounded
    right: int | None  # keys after row + offset + right are masked; causal: 0


def edges(causal: bool, window=(-1, -1)) -> Edges:
    """A spec's causal flag and window [left, right] (-1 unbounded) as Edges, causal folded in."""
    left, right = (None if x < 0 else x for x in window)
    if causal:  # causal is the window's right edge at the diagonal
        right = 0 if right is None else min(right, 0)
    return Edges(left, right)


def visible(i, j, q_len: int, kv_len: int, e: Edges):
    """Does row i see key j (numpy arrays broadcast)? Rows past q_len follow the same formula."""
    off = kv_len - q_len
    i, j = np.asarray(i), np.asarray(j)
    vis = np.broadcast_to((j >= 0) & (j < kv_len), np.broadcast_shapes(i.shape, j.shape))
    if e.left is not None:
        vis = vis & (j >= i + off - e.left)
    if e.right is not None:
        vis = vis & (j <= i + off + e.right)
    return vis


class Rows(NamedTuple):
    """Rows start..last (inclusive) of one block, one warpgroup, or one Q tile."""
    start: Expr
    last: Expr

    @property
    def stop(self) -> Expr:
        return add(self.last, 1)


class Span(NamedTuple):
    """Exact tile ranges (ints): tiles [first, stop) hold a visible entry, [full_first, full_stop)
    are wholly visible; both empty (first == stop) when nothing is visible."""
    first: int
    stop: int
    full_first: int
    full_stop: int

    @property
    def tiles(self) -> range:
        return range(self.first, self.stop)

    @property
    def full(self) -> range:
        return range(self.full_first, self.full_stop)

    @property
    def partial(self) -> list:
        return [t for t in self.tiles if t not in self.full]


@dataclasses.dataclass(frozen=True)
class Frame:
    """One attention problem's lengths, edges and tile sizes: ints, or Syms for the kernel's text."""
    q_len: Expr
    kv_len: Expr
    offset: Expr  # kv_len - q_len (a Sym in the kernel: causal_offset)
    edges: Edges
    block_m: Expr  # Q tile rows (the transposed direction's tiles)
    block_n: Expr  # KV tile keys

    @classmethod
    def of(cls, q_len: int, kv_len: int, e: Edges, block_m: int, block_n: int) -> "Frame":
        return cls(q_len, kv_len, kv_len - q_len, e, block_m, block_n)

    # -- a run of query rows -> KV tiles (the forward's loop; the backward's dQ) ----------
    def key_first(self, row):
        """First key row `row` may see (unclamped), or 0 without a left edge."""
        return 0 if self.edges.left is None else add(row, self.offset, -self.edges.left)

    def kv_first(self, rows: Rows):
        """The first KV tile holding a key the rows see (exact when they see any)."""
        if self.edges.left is None:
            return 0
        return floordiv(max_(self.key_first(rows.start), 0), self.block_n)

    def kv_stop(self, rows: Rows):
        """One past the last KV tile holding a key the rows see (exact when they see any; <= kv_first
        or <= 0 when they see none because of the right edge)."""
        end = ceildiv(self.kv_len, self.block_n)
        if self.edges.right is None:
            return end
        return min_(end, ceildiv(add(rows.stop, self.offset, self.edges.right), self.block_n))

    def kv_full_first(self, rows: Rows):
        """The first KV tile no row's left edge cuts: every row sees its first key."""
        if self.edges.left is None:
            return 0
        return ceildiv(max_(self.key_first(rows.last), 0), self.block_n)

    def kv_full_stop(self, rows: Rows, first_row_real: bool = False):
        """One past the last KV tile wholly visible on the right: inside kv_len and left of the first
        row's right edge (may be < 1: none). `first_row_real`: rows.start < q_len, so with right = 0
        its edge start + offset + 1 <= kv_len and the min with kv_len is dropped (the kernel's text)."""
        whole = floordiv(self.kv_len, self.block_n)
        if self.edges.right is None:
            return whole
        edge = add(rows.start, self.offset, self.edges.right, 1)
        if first_row_real and self.edges.right == 0:
            return floordiv(edge, self.block_n)
        return floordiv(min_(edge, self.kv_len), self.block_n)

    def rows_see_any(self, rows: Rows):
        """Do rows start..last see any key? (ints: a bool; tensors: elementwise)"""
        e = self.edges
        see = (self.kv_len > 0) & (rows.start <= rows.last)
        if e.right is not None:
            see = see & (rows.last + self.offset + e.right >= 0)
        if e.left is not None:
            see = see & (rows.start + self.offset - e.left <= self.kv_len - 1)
        return bool(see) if isinstance(see, (bool, int)) else see

    def kv_visits(self, rows: Rows):
        """len(kv_span(rows).tiles): the KV tiles the rows visit (ints, or tensors elementwise)."""
        count = _max(sub(self.kv_stop(rows), self.kv_first(rows)), 0)
        see = self.rows_see_any(rows)
        return (count if see else 0) if isinstance(see, bool) else count.where(see, 0)

    def row_tile_visits(self, t):
        """KV tiles row tile t visits (its rows clipped to q_len); ints, or tensors elementwise."""
        rows = Rows(mul(t, self.block_m), sub(min_(self.q_len, mul(add(t, 1), self.block_m)), 1))
        return self.kv_visits(rows)

    def kv_span(self, rows: Rows) -> Span:
        """The exact KV tile ranges of rows (ints)."""
        if not self.rows_see_any(rows):
            return Span(0, 0, 0, 0)
        first, stop = self.kv_first(rows), self.kv_stop(rows)
        lo = min(max(self.kv_full_first(rows), first), stop)
        hi = max(min(self.kv_full_stop(rows), stop), lo)
        return Span(first, stop, lo, hi)

    # -- a KV tile -> the Q tiles that see it (the backward's loop over Q tiles) ------------
    def q_tiles(self):
        return ceildiv(self.q_len, self.block_m)

    def q_first(self, kv_tile):
        """The first Q tile with a row that sees a key of KV tile `kv_tile` (exact when any does)."""
        if self.edges.right is None:
            return 0
        c0 = mul(kv_tile, self.block_n)
        return floordiv(max_(sub(c0, add(self.offset, self.edges.right)), 0), self.block_m)

    def q_stop(self, kv_tile):
        """One past the last such Q tile: the tile's last key (inside kv_len) with the left edge."""
        if self.edges.left is None:
            return self.q_tiles()
        keys_stop = min_(mul(add(kv_tile, 1), self.block_n), self.kv_len)
        return min_(self.q_tiles(), ceildiv(add(sub(keys_stop, self.offset), self.edges.left), self.block_m))

    def q_full_first(self, kv_tile):
        """The first Q tile whose first row sees the KV tile's last key (right edge)."""
        if self.edges.right is None:
            return 0
        last_key = add(mul(kv_tile, self.block_n), self.block_n, -1)
        return ceildiv(max_(sub(last_key, add(self.offset, self.edges.right)), 0), self.block_m)

    def q_full_stop(self, kv_tile):
        """One past the last Q tile whose last row sees the KV tile's first key (left edge); no Q tile
        is full for a KV tile that passes kv_len."""
        stop = self.q_tiles() if self.edges.left is None else min_(
            self.q_tiles(), floordiv(add(sub(mul(kv_tile, self.block_n), self.offset), self.edges.left, 1), self.block_m))
        return stop

    def kv_tile_seen(self, kv_tile):
        """Does any row of the Q tiles see a key of KV tile `kv_tile`? (ints: a bool; tensors: elementwise)"""
        e = self.edges
        c0 = mul(kv_tile, self.block_n)
        c_last = sub(min_(add(c0, self.block_n), self.kv_len), 1)
        rows_last = sub(mul(self.q_tiles(), self.block_m), 1)
        see = (c0 < self.kv_len) & (self.q_len > 0)
        if e.right is not None:
            see = see & (c0 - self.offset - e.right <= rows_last)
        if e.left is not None:
            see = see & (c_last - self.offset + e.left >= 0)
        return bool(see) if isinstance(see, (bool, int)) else see

    def q_visits(self, kv_tile):
        """len(q_span(kv_tile).tiles): the Q tiles that visit KV tile `kv_tile` (ints, or tensors elementwise)."""
        count = _max(sub(self.q_stop(kv_tile), self.q_first(kv_tile)), 0)
        see = self.kv_tile_seen(kv_tile)
        return (count if see else 0) if isinstance(see, bool) else count.where(see, 0)

    def q_span(self, kv_tile: int) -> Span:
        """The exact Q tile ranges of KV tile `kv_tile` (ints)."""
        if not self.kv_tile_seen(kv_tile):
            return Span(0, 0, 0, 0)
        first, stop = self.q_first(kv_tile), self.q_stop(kv_tile)
        if (kv_tile + 1) * self.block_n > self.kv_len:  # keys past kv_len: never wholly visible
            return Span(first, stop, first, first)
        lo = min(max(self.q_full_first(kv_tile), first), stop)
        hi = max(min(self.q_full_stop(kv_tile), stop), lo)
        return Span(first, stop, lo, hi)


# -- split-KV: each split takes an equal share of a block's KV tiles ----------------------------
def split_tiles_per(n_tiles, splits):
    return ceildiv(n_tiles, splits)


def split_first(split_idx, tiles_per):
    """Split split_idx's first visit (an offset from the block's first tile)."""
    return mul(split_idx, tiles_per)


def split_count(n_tiles, first, tiles_per):
    """Visits of the split starting at `first` (< 1: the split is empty)."""
    return min_(sub(n_tiles, first), tiles_per)


def at_least_one(x):
    """The kernel's rule: a block (or split) that sees no key still runs one fully masked visit."""
    return max_(x, 1)


# -- block masks (FlexAttention's BlockMask): a mask's tiles, empty / partial / full ------------------
EMPTY, PARTIAL, FULL = 0, 1, 2


def tile_states(visible: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Each (block_m x block_n) tile of a boolean mask [..., q_len, kv_len] as EMPTY (no entry
    visible), PARTIAL or FULL (every entry visible): an int8 array [..., ceildiv(q_len, block_m),
    ceildiv(kv_len, block_n)]. Entries past q_len or kv_len count as masked, as FlexAttention's
    create_block_mask counts them, so a tile that runs past either length is never FULL."""
    *lead, q_len, kv_len = visible.shape
    nq, nk = ceildiv(q_len, block_m), ceildiv(kv_len, block_n)
    pad = [(0, 0)] * len(lead) + [(0, nq * block_m - q_len), (0, nk * block_n - kv_len)]
    vis = np.pad(visible.astype(bool), pad, constant_values=False).reshape(*lead, nq, block_m, nk, block_n)
    seen = vis.sum(axis=(-3, -1))
    return np.where(seen == 0, EMPTY, np.where(seen == block_m * block_n, FULL, PARTIAL)).astype(np.int8)


def mask_states(visible_rows, q_len: int, block_m: int, block_n: int) -> np.ndarray:
    """tile_states of a mask given one row of tiles at a time (memory: one row of tiles):
    visible_rows(q0, q1) is the boolean mask of query rows q0..q1-1, [..., q1 - q0, kv_len]."""
    return np.concatenate([tile_states(visible_rows(q0, min(q0 + block_m, q_len)), block_m, block_n)
                           for q0 in range(0, q_len, block_m)], axis=-2)


def tile_lists(selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of tiles [..., rows, cols] of booleans: (counts [..., rows], indices [..., rows, cols]),
    each row's selected columns ascending, then padded with the remaining columns ascending (as
    Flex pads kv_indices: only the first count entries of a row are meaningful)."""
    counts = selected.sum(axis=-1).astype(np.int32)
    order = np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)
    return counts, order


def retile_states(states: np.ndarray, block: tuple, kernel: tuple, lengths: tuple) -> np.ndarray:
    """Tile states [..., nq, nk] of a block mask's (bq, bk) tiles as states of (block_m, block_n)
    tiles, any sizes: a tile is EMPTY when every block it overlaps is (a block past the grid counts
    EMPTY: it runs past a length), FULL when every one is, else PARTIAL. A tile inside one block
    takes its state, except that a FULL block's piece past a length is PARTIAL; a PARTIAL block's
    pieces stay PARTIAL (some may be empty or full: masked anyway, so exact, only less is
    skipped). Coarsening by whole multiples loses nothing. (EMPTY < PARTIAL < FULL: all EMPTY is a
    max of EMPTY, all FULL a min of FULL.)"""
    st = states
    for axis, (b, t, n) in enumerate(zip(block, kernel, lengths)):
        ax = st.ndim - 2 + axis
        stops = [ceildiv((i + 1) * t, b) for i in range(ceildiv(n, t))]  # one past the last block tile i overlaps
        pad = [(0, 0)] * st.ndim
        pad[ax] = (0, max(0, stops[-1] - st.shape[ax]))
        grid = np.pad(st, pad, constant_values=EMPTY)
        pieces = [np.take(grid, np.arange(i * t // b, stop), axis=ax) for i, stop in enumerate(stops)]
        st = np.stack([np.where(p.max(axis=ax) == EMPTY, EMPTY, np.where(p.min(axis=ax) == FULL, FULL, PARTIAL))
                       for p in pieces], axis=ax).astype(np.int8)
    kq, kk = kernel
    q_len, kv_len = lengths
    if q_len % kq:  # a tile past a length is never FULL
        st[..., -1, :] = np.where(st[..., -1, :] == FULL, PARTIAL, st[..., -1, :])
    if kv_len % kk:
        st[..., :, -1] = np.where(st[..., :, -1] == FULL, PARTIAL, st[..., :, -1])
    return st


def list_states(counts, indices, full_counts, full_indices, n_cols: int) -> np.ndarray:
    """The tile states [..., rows, n_cols] that two lists name (kv_num_blocks/kv_indices and the
    full_kv_* pair, or the q_* pair): the inverse of tile_lists. Only the first count entries of a
    row are read (the padding after them may be anything)."""
    st = np.zeros(np.shape(counts) + (n_cols,), np.int8)
    for state, c, idx in ((PARTIAL, counts, indices), (FULL, full_counts, full_indices)):
        c, idx = np.asarray(c), np.asarray(idx)
        idx = np.where(np.arange(idx.shape[-1]) < c[..., None], idx, n_cols)  # unread entries: a spare column
        mark = np.zeros(np.shape(c) + (n_cols + 1,), bool)
        np.put_along_axis(mark, idx.astype(np.int64), True, axis=-1)
        st[mark[..., :n_cols]] = state
    return st


def mask_lists(states: np.ndarray) -> dict:
    """FlexAttention's eight BlockMask lists of tile states [..., nq, nk] (int32): per Q tile the
    partial (kv_num_blocks, kv_indices) and full (full_kv_*) KV tiles, and per KV tile the
    transposed q_num_blocks, q_indices, full_q_num_blocks, full_q_indices."""
    out = {}
    for direction, sel in (("kv", lambda x: x), ("q", lambda x: np.swapaxes(x, -1, -2))):
        for prefix, state in (("", PARTIAL), ("full_", FULL)):
            out[f"{prefix}{direction}_num_blocks"], out[f"{prefix}{direction}_indices"] = tile_lists(sel(states == state))
    return out


def backward_lists(lists: dict, block: tuple, lengths: tuple, main_tile: tuple, dq_tile: tuple | None = None) -> dict:
    """The backward's block-mask lists from the forward's (kv_num_blocks, kv_indices, full_kv_*,
    over `block` tiles): the main kernel's transposed q_* lists over its (block_m, block_n)
    tiles, and with `dq_tile` the deterministic dq kernel's kv_* lists over its tiles, named
    dq_kv_num_blocks ... (retile_states: exact at any sizes, skipping less where they differ)."""
    st = list_states(lists["kv_num_blocks"], lists["kv_indices"], lists["full_kv_num_blocks"], lists["full_kv_indices"],
                     ceildiv(lengths[1], block[1]))
    main = mask_lists(retile_states(st, block, main_tile, lengths))
    out = {n: main[n] for n in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")}
    if dq_tile is not None:
        dq = mask_lists(retile_states(st, block, dq_tile, lengths))
        out.update({f"dq_{n}": dq[n] for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")})
    return out


def retiles(block: int, kernel: int) -> bool:
    """Can a block mask's block be seen as kernel tiles (one a whole multiple of the other)?"""
    return kernel % block == 0 or block % kernel == 0
