"""Where a kernel's tensors live: one layout object per plan, shared by both passes and the combine kernel.

A layout answers, as kernel text, every question whose answer depends on how Q, K, V, O and the
row statistics (LSE, dPsum) are stored (docs/serving.md): their shapes, the kernel's extents,
the serving parameters, the index and TMA-box text of a row or a tile, the lines that give a
block its sequence, and the guards that keep a block inside it. The renderers ask; they never
test the layout themselves.

    Dense         bshd: q [batch, q_len, heads, D], k/v [batch, kv_len, kv_heads, D]
    Varlen        packed sequences: q [total_q, heads, D], k/v [total_k, kv_heads, D], cu_seqlens
    Paged         a paged K/V cache [num_pages, PAGE_SIZE, kv_heads, D] with a block_table and
                  seqused_k, and dense queries; PagedVarlen: the same with packed queries

Two options ride on any layout (fields): split_kv (each block takes a share of the K tiles and
writes a float32 partial O and LSE per split, merged by the combine kernel) and pack_gqa (the
query heads of one KV head are rows of one tile). `layout_of(plan)` is the one place that chooses,
from the plan's serving fields; a small frozen record, so each caller asks it rather than carry it.

Text conventions: `r`, `a`, `b` are row expressions relative to the block's sequence (a row of
a packed tensor adds the sequence's start); an "index" is the text inside T[...] up to the last
axis; a "box" (or "slice") indexes rows a:b.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen import tiles
from attngen.kernels.common.emit import tensor_param

STATIC_DIMS = ("batch", "q_len", "kv_len", "kv_heads")  # a static shape's extents, as the kernel names them


def _seq_slice(rows: str, start: str) -> str:
    """Rows a:b of a sequence as rows of the packed tensor whose sequence begins at `start`."""
    lo, hi = rows.split(":")
    return f"{start} + {lo}:{start} + {hi}"


@dataclass(frozen=True)
class Dense:
    """bshd: every sequence has the kernel's q_len queries and kv_len keys; a block's rows are
    indexed by its batch_idx."""

    split_kv: bool = False  # a block takes one split of the K tiles (grid axis batch * num_splits)
    pack_gqa: bool = False  # a tile's rows are the query heads of one KV head (grid axis kv_heads)
    page_size: int = 0  # keys per page of a paged cache (Paged only)

    per_sequence = False  # lengths differ by sequence: each block reads its own
    q_packed = False  # q rows of all sequences in one axis (stores clip to the sequence's rows)
    kv_packed = False
    q_total = "q_len"  # the extent of q's row axis
    q_extent = "q_len"  # rows of the longest sequence: sizes the grids over rows
    kv_extent = "kv_len"

    # -- shapes and extents ---------------------------------------------------------------
    def q_shape(self, dim: str = "HEAD_DIM") -> list:
        """Q, O, dO, dQ (head dim `dim`)."""
        return ["batch", "q_len", "heads", dim]

    def kv_shape(self, dim: str) -> list:
        """K, V, dK, dV (head dim `dim`)."""
        return ["batch", "kv_len", "kv_heads", dim]

    def lse_shape(self) -> list:
        """The row statistics: LSE, LSE2, dPsum, dLSE."""
        return ["batch", "heads", "q_len"]

    def dims(self) -> list:
        """The main kernel's T.dynamic extents (a dynamic shape), in parameter order."""
        return ["batch", self.q_total, *self._kv_dims(), "kv_heads", *self._cache_dims()] + (
            ["num_splits"] if self.split_kv else [])

    def _kv_dims(self) -> list:
        return ["kv_len"]

    def _cache_dims(self) -> list:
        return []

    def kernel_dims(self, shape) -> dict:
        """name -> extent: a static shape's STATIC_DIMS as ints, else every dim as None (T.dynamic)."""
        if shape is not None:
            return {d: getattr(shape, d) for d in STATIC_DIMS}
        return {d: None for d in self.dims()}

    @property
    def may_see_no_key(self) -> bool:
        """A block's sequence or split may have no key (kv_len >= 0; a bshd kernel's is >= 1)."""
        return self.per_sequence or self.split_kv

    def query_row(self, row: str) -> str:
        """The query position of a tile's row `row` (kernel text): a packed row's is row // GQA_GROUP."""
        return f"({row}) // GQA_GROUP" if self.pack_gqa else row

    def query_head(self) -> str:
        """The query head of a consumer's row i: the block's, or a packed row's place in the group."""
        return "(head + (q0 + row0 + i) % GQA_GROUP)" if self.pack_gqa else "head"

    def query_position(self, row: tiles.Expr) -> tiles.Expr:
        """The query position of a tile's row (tile-range algebra): a packed row's is row // GQA_GROUP."""
        return tiles.rowdiv(row, tiles.Sym("GQA_GROUP", 1)) if self.pack_gqa else row

    # -- index text -------------------------------------------------------------------------
    def q_row(self, r: str) -> str:
        """Row r of the block's sequence as a row of q."""
        return r

    def q_index(self, row: str, head: str = "head") -> str:
        """Q-like tensors at q row `row` (already a row of q), head `head` (the head-dim axis follows)."""
        return f"batch_idx, {row}, {head}"

    def stat_index(self, row: str, head: str = "head") -> str:
        """Row statistics at q row `row` (already a row of q), head `head`."""
        return f"batch_idx, {head}, {row}"

    def q_last(self) -> str:
        """The last row of q a clamped load may read."""
        return "q_len - 1"

    def q_at(self, r: str, head: str = "head") -> str:
        """Q-like tensors at the sequence's row r."""
        return self.q_index(self.q_row(r), head)

    def q_slice(self, rows: str, head: str = "head") -> str:
        """Q-like tensors at the sequence's rows `rows` ("a:b"): a TMA box."""
        return self.q_index(self._rows(rows), head)

    def q_box(self, a: str, b: str, head: str = "head") -> str:
        return self.q_slice(f"{a}:{b}", head)

    def row_at(self, r: str) -> str:
        """Row statistics at the sequence's row r."""
        return self.stat_index(self.q_row(r))

    def row_box(self, a: str, b: str) -> str:
        return self.stat_index(self._rows(f"{a}:{b}"))

    def _rows(self, rows: str) -> str:
        """The sequence's rows "a:b" as rows of q."""
        return rows

    def q_clamped(self, r: str) -> str:
        """The sequence's row r as a row of q, clamped into the tensor (a load past the rows, never stored)."""
        return f"T.min({self.q_row(r)}, {self.q_last()})"

    def q_clamped_at(self, r: str) -> str:
        """Q-like tensors at row r, clamped: the backward's preprocess reads rows past the sequence (counted 0)."""
        return self.q_index(self.q_clamped(r))

    def row_clamped_at(self, r: str) -> str:
        """Row statistics at row r, clamped."""
        return self.stat_index(self.q_clamped(r))

    def k_row(self, r: str) -> str:
        """Key r of the block's sequence as a row of k."""
        return r

    def k_index(self, row: str, head: str) -> str:
        return f"batch_idx, {row}, {head}"

    def k_at(self, r: str, head: str = "kv_head") -> str:
        """K-like tensors (K, V, dK, dV) at the sequence's key r."""
        return self.k_index(self.k_row(r), head)

    def k_box(self, a: str, b: str, head: str = "kv_head") -> str:
        """K-like tensors at the sequence's keys a:b: a TMA box."""
        return self.k_index(f"{self.k_row(a)}:{self.k_row(b)}", head)

    # -- the forward's tiles and epilogue ----------------------------------------------------
    def kv_tile_setup(self, tile: str) -> list:
        """Lines that locate K tile `tile` (its index text) before its loads: none outside a paged cache."""
        return []

    def kv_box(self, tile: str) -> str:
        """The TMA box of K tile `tile`'s rows (K or V)."""
        return f"{self.k_box(f'{tile} * BLOCK_N', f'({tile} + 1) * BLOCK_N')}, :"

    def q_pack_index(self) -> str:
        """Packed GQA: Q at packed row r of consumer row0, column d (clamped: rows past the sequence
        are computed, never stored)."""
        return f"{self.q_index(self.q_clamped('(q0 + row0 + r) // GQA_GROUP'), 'head + (q0 + row0 + r) % GQA_GROUP')}, d"

    def _split(self, index: str) -> str:
        return f"split_idx, {index}" if self.split_kv else index

    def out_index(self, rows: str, head: str) -> str:
        """O (or this split's O_partial) at the sequence's row `rows`, head `head`, column j."""
        return self._split(f"{self.q_at(rows, head)}, j")

    def lse_index(self, rows: str, head: str) -> str:
        """The LSE (or this split's LSE_partial) at the sequence's row `rows`, head `head`."""
        return self._split(self.stat_index(self.q_row(rows), head))

    @property
    def lse_param(self) -> str:
        """The tensor the forward writes its LSE to."""
        return "LSE_partial" if self.split_kv else "LSE"

    @property
    def clips_rows(self) -> bool:
        """The epilogue stores row by row under row_valid (a tile's box would pass the sequence's
        rows, or a split stores float32 straight from registers)."""
        return self.q_packed or self.split_kv

    @property
    def epilogue_store(self) -> str:
        """What the forward's epilogue does with O, for its comment."""
        if self.split_kv:
            return "store this split's float32 O and LSE (this block's rows only)"
        if self.q_packed:
            return "stage in shared memory, store this sequence's rows only"
        return "stage in shared memory, one TMA store"

    # -- the forward's grid and block --------------------------------------------------------
    @property
    def grid_rows(self) -> str:
        """The extent the grid's first axis tiles by BLOCK_M."""
        return f"{self.q_extent} * GQA_GROUP" if self.pack_gqa else self.q_extent

    @property
    def grid_heads(self) -> str:
        return "kv_heads" if self.pack_gqa else "heads"

    @property
    def grid_batch(self) -> str:
        return "batch * num_splits" if self.split_kv else "batch"

    @property
    def head_var(self) -> str:
        """The block's head variable: a packed tile's is its KV head."""
        return "kv_head" if self.pack_gqa else "head"

    @property
    def batch_var(self) -> str:
        return "batch_split" if self.split_kv else "batch_idx"

    def block_setup(self, offset: bool) -> list:
        """Lines that give a forward block its head, split, sequence and lengths (before q0);
        `offset`: the kernel reads causal_offset (bound here when lengths are per sequence)."""
        if self.pack_gqa:
            lines = ["head = kv_head * GQA_GROUP  # packed GQA: row r is query r // GQA_GROUP of head head + r % GQA_GROUP"]
        else:
            lines = ["kv_head = head // GQA_GROUP"]
        if self.split_kv:
            lines += ["batch_idx = T.truncdiv(batch_split, num_splits)  # truncdiv: both >= 0, no floor fix-up code",
                      "split_idx = T.truncmod(batch_split, num_splits)  # which share of the K tiles this block visits"]
        return lines + self.sequence_setup(offset)

    def sequence_setup(self, offset: bool, q_note: str = "this sequence's first row of q and out", k_note: str = "") -> list:
        """Lines that bind the block's sequence: its start rows and lengths and, with `offset`, its
        causal_offset; none where the lengths are the kernel's. The notes are each pass's comments."""
        lines = self._q_sequence(q_note) + self._kv_sequence(k_note)
        if self.per_sequence and offset:
            lines.append("causal_offset = kv_len - q_len  # bottom-right alignment, per sequence")
        return lines

    def _q_sequence(self, note: str) -> list:
        return []

    def _kv_sequence(self, note: str) -> list:
        return []

    def sequence_tensors(self) -> list:
        """The call-time tensors sequence_setup reads (a persistent consumer reads each tile's bounds itself)."""
        return self._q_tensors() + self._kv_tensors()

    def _q_tensors(self) -> list:
        return []

    def _kv_tensors(self) -> list:
        return []

    def row_valid(self, row: str) -> str:
        """A forward epilogue's guard: is the row's query position `row` one of the sequence's?"""
        return f"{row} < q_len"

    def guard_count(self, count: str, start: str, length: str) -> str:
        """A count of tiles for a block whose first row or key `start` may lie past its sequence's
        `length` (the grid covers the longest sequence): 0 there. Bshd grids cover each sequence exactly."""
        return count

    # -- parameters and arguments ------------------------------------------------------------
    def io_params(self, dv: str, kv_dtype: str = "DTYPE", out: str = "DTYPE") -> list:
        """The forward's Q, K, V and output parameter lines (each split's partial O and LSE);
        `kv_dtype` names K's and V's element type (an fp8 cache's KV_DTYPE), `out` O's."""
        lines = [tensor_param("Q", self.q_shape(), "DTYPE"), tensor_param("K", self.kv_shape("HEAD_DIM"), kv_dtype),
                 tensor_param("V", self.kv_shape(dv), kv_dtype)]
        if not self.split_kv:
            return lines + [tensor_param("O", self.q_shape(dv), out)]
        return lines + [tensor_param("O_partial", ["num_splits"] + self.q_shape(dv), '"float32"',
                                     "output: each split's normalised partial O (the combine kernel merges them)"),
                        tensor_param("LSE_partial", ["num_splits"] + self.lse_shape(), '"float32"',
                                     "output: each split's log-sum-exp per row, natural log (-inf: no key)")]

    @property
    def kernel_writes_lse(self) -> bool:
        """The forward kernel writes the LSE output itself (a split's is the combine kernel's)."""
        return not self.split_kv

    def serving_params(self) -> list:
        """The forward's parameter lines that locate each sequence (docs/serving.md's ABI order)."""
        return self._q_params() + self._kv_params() + self._grid_params()

    def _q_params(self) -> list:
        return []

    def _kv_params(self) -> list:
        return []

    def _grid_params(self) -> list:
        return []

    def backward_params(self) -> list:
        """The backward kernels' parameter lines that locate each sequence."""
        return []

    def consumer_outputs(self) -> list:
        """The forward consumer's output arguments: staging and O, or the split's O_partial."""
        return ["O_partial"] if self.split_kv else ["O_shared", "O"]

    def q_barrier_args(self) -> list:
        """The consumer waits on q_full for the TMA's Q; a packed tile's warpgroup loads its own."""
        return [] if self.pack_gqa else ["q_full"]

    def extra_output_args(self, lse: bool) -> list:
        """A split writes LSE_partial even where the spec returns no LSE (the combine weighs by it)."""
        return ["LSE_partial"] if self.split_kv and not lse else []

    def q_load_args(self) -> list:
        return ["Q"] if self.pack_gqa else []

    def sequence_args(self, offset: bool) -> list:
        """The block's per-sequence values a forward consumer reads (lengths, offset, q's start)."""
        return []

    def _q_start_args(self) -> list:
        return []

    def split_args(self) -> list:
        return ["split_idx"] if self.split_kv else []

    def key_start_args(self) -> list:
        """The backward's macros also read the keys' start."""
        return []

    def constants(self) -> list:
        """Module constants of the layout (a paged cache's PAGE_SIZE)."""
        return []

    # -- the combine kernel: a flat walk over q's rows ------------------------------------------
    @property
    def flat_batch(self) -> str:
        """The batch axis of a grid over q's rows ("": packed rows have none)."""
        return "batch"

    @property
    def flat_batch_var(self) -> str:
        return "batch_idx" if self.flat_batch else ""

    def flat_rows(self) -> str:
        """The rows a flat walk writes."""
        return self.q_total

    def flat_setup(self) -> list:
        return []

    def flat_params(self) -> list:
        return []


@dataclass(frozen=True)
class Varlen(Dense):
    """Packed sequences: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of
    q (its keys likewise of k, by cu_seqlens_k); grids cover the longest sequence (max_seqlen_*)."""

    per_sequence = True
    q_packed = True
    kv_packed = True
    q_total = "total_q"
    q_extent = "max_seqlen_q"
    kv_extent = "max_seqlen_k"

    def q_shape(self, dim: str = "HEAD_DIM") -> list:
        return ["total_q", "heads", dim]

    def kv_shape(self, dim: str) -> list:
        return ["total_k", "kv_heads", dim]

    def lse_shape(self) -> list:
        return ["heads", "total_q"]

    def _kv_dims(self) -> list:
        return ["total_k"]

    def q_row(self, r: str) -> str:
        return f"q_start + {r}"

    def q_index(self, row: str, head: str = "head") -> str:
        return f"{row}, {head}"

    def stat_index(self, row: str, head: str = "head") -> str:
        return f"{head}, {row}"

    def q_last(self) -> str:
        return "total_q - 1"

    def _rows(self, rows: str) -> str:
        return _seq_slice(rows, "q_start")

    def k_row(self, r: str) -> str:
        return f"k_start + {r}"

    def k_index(self, row: str, head: str) -> str:
        return f"{row}, {head}"

    def _q_sequence(self, note: str) -> list:
        return [f"q_start = cu_seqlens_q[batch_idx]  # {note}", "q_len = cu_seqlens_q[batch_idx + 1] - q_start"]

    def _q_tensors(self) -> list:
        return ["cu_seqlens_q"]

    def _kv_tensors(self) -> list:
        return ["cu_seqlens_k"]

    def _kv_sequence(self, note: str) -> list:
        return ["k_start = cu_seqlens_k[batch_idx]" + (f"  # {note}" if note else ""),
                "kv_len = cu_seqlens_k[batch_idx + 1] - k_start"]

    def guard_count(self, count: str, start: str, length: str) -> str:
        return f"T.if_then_else({start} < {length}, {count}, 0)"

    def _q_params(self) -> list:
        return [tensor_param("cu_seqlens_q", ["batch + 1"], '"int32"',
                             "sequence b's rows of q and out: [cu_seqlens_q[b], cu_seqlens_q[b + 1])")]

    def _kv_params(self) -> list:
        return [tensor_param("cu_seqlens_k", ["batch + 1"], '"int32"', "sequence b's rows of k and v")]

    def _grid_params(self) -> list:
        return ["max_seqlen_q: T.int32,  # the longest sequence's rows: sizes the grid"]

    def backward_params(self) -> list:
        return [tensor_param("cu_seqlens_q", ["batch + 1"], '"int32"',
                             "sequence b's rows of q, dO, dQ: [cu_seqlens_q[b], cu_seqlens_q[b + 1])"),
                tensor_param("cu_seqlens_k", ["batch + 1"], '"int32"', "sequence b's rows of k, v, dK, dV"),
                "max_seqlen_q: T.int32,  # the longest sequence's rows: sizes the grids over rows",
                "max_seqlen_k: T.int32,  # the longest sequence's keys: sizes the main kernel's grid"]

    def sequence_args(self, offset: bool) -> list:
        return ["q_len", "kv_len"] + (["causal_offset"] if offset else []) + self._q_start_args()

    def _q_start_args(self) -> list:
        return ["q_start"]

    def key_start_args(self) -> list:
        return ["k_start"]

    @property
    def flat_batch(self) -> str:
        return ""

    def flat_rows(self) -> str:
        return "used_rows"

    def flat_setup(self) -> list:
        return ["used_rows = cu_seqlens_q[batch]  # the packed rows the sequences own; the rest is padding"]

    def flat_params(self) -> list:
        return [tensor_param("cu_seqlens_q", ["batch + 1"], '"int32"', "rows past cu_seqlens_q[batch] are padding: not written")]


@dataclass(frozen=True)
class Paged(Dense):
    """A paged K/V cache with dense queries: key t of sequence b is row t % PAGE_SIZE of page
    block_table[b, t // PAGE_SIZE]; seqused_k[b] keys. A K tile is one TMA box inside one page."""

    block_n: int = 0  # keys per K tile (TILES_PER_PAGE)

    per_sequence = True
    kv_packed = False

    def kv_shape(self, dim: str) -> list:
        return ["num_pages", "PAGE_SIZE", "kv_heads", dim]

    def _kv_dims(self) -> list:
        return []

    def _cache_dims(self) -> list:
        return ["num_pages", "max_pages"]

    def _kv_sequence(self, note: str) -> list:
        return ["kv_len = seqused_k[batch_idx]",
                "last_page = T.max(T.ceildiv(kv_len, PAGE_SIZE) - 1, 0)  # tiles past the sequence (masked) reread its last page"]

    def _kv_tensors(self) -> list:
        return ["seqused_k"]

    def kv_tile_setup(self, tile: str) -> list:
        return [f"page = block_table[batch_idx, T.min({tile} // TILES_PER_PAGE, last_page)]  # the page holding this tile",
                f"page_row = {tile} % TILES_PER_PAGE * BLOCK_N"]

    def kv_box(self, tile: str) -> str:
        return "page, page_row:page_row + BLOCK_N, kv_head, :"

    def _kv_params(self) -> list:
        return [tensor_param("block_table", ["batch", "max_pages"], '"int32"',
                             "sequence b's key t lives in page block_table[b, t // PAGE_SIZE]"),
                tensor_param("seqused_k", ["batch"], '"int32"', "keys of sequence b")]

    sequence_args = Varlen.sequence_args

    def key_start_args(self) -> list:
        raise NotImplementedError("the backward reads no paged cache")

    def constants(self) -> list:
        return [f"PAGE_SIZE = {self.page_size}  # keys per page of the K/V cache",
                f"TILES_PER_PAGE = {self.page_size // self.block_n}  # a K/V tile is one TMA box inside one page"]


@dataclass(frozen=True)
class PagedVarlen(Paged, Varlen):
    """A paged K/V cache with packed queries (Varlen's rows of q, Paged's keys)."""


def layout_of(plan) -> Dense:
    """The plan's layout (a forward Plan; the backward passes its forward plan)."""
    options = {"split_kv": plan.split_kv, "pack_gqa": plan.pack_gqa}
    if plan.page_size:
        paged = PagedVarlen if plan.varlen else Paged
        return paged(**options, page_size=plan.page_size, block_n=plan.spec.block_n)
    return (Varlen if plan.varlen else Dense)(**options)
