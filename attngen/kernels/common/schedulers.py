"""How a block gets its tile, and the one place that turns a visit into a pipeline stage and a parity.

A kernel's blocks walk a ring of shared-memory stages, each guarded by a "full" barrier (the
producer's TMA landed) and an "empty" one (the consumers released it). Visit v of a ring of S
stages uses stage v % S, and waits for the barrier's phase (v // S) % 2: each barrier flips once
per lap. The templates ask the scheduler for these texts (`schedule.stage("k", "K_STAGES")`,
`schedule.parity("k", "K_STAGES")`), never spell them.

SingleTile, today's scheduler: the grid has one block per tile (grid / block_vars /
tile_start), and every block starts its visit count at 0, so a barrier that completes once per
tile (Q's in the forward, K/V's in the backward) is waited at parity 0.

Persistent (issue 30; FA3's tile_scheduler.hpp): one block per SM (`num_sms`, a run-time
argument) loops over the tiles an atomic counter hands out, in persistent_tile's order. It
overrides grid and block_vars (the SMs) and stage / parity / tile_parity, which add the visits
of the block's earlier tiles (`visit_base`, carried from tile to tile) and count the block's
tiles (`tile_iter`), so the mainloop's text stays as it is and every barrier keeps its phase
across tiles.
"""

from __future__ import annotations

from attngen import tiles
from attngen.hw import DTYPES, L2_KV_BYTES


# A persistent kernel's tile counters: call e takes tiles from slot e % COUNTER_SLOTS, and the block
# that takes the last end mark puts it back to 0 (a replayed CUDA graph keeps its epoch); block 0
# zeroes the other two, so a slot a call died on is clean again before the rotation reaches it.
COUNTER_SLOTS = 3


def _operand(visit: str) -> str:
    """`visit` as an operand of % or //: parenthesised when it is a sum."""
    return f"({visit})" if " " in visit else visit


class SingleTile:
    """One tile per block; visit counts start at 0 in every block."""

    persistent = False

    def grid(self, rows: str, block: str, heads: str, batch: str = "") -> str:
        """The T.Kernel extents: blocks of `block` rows of `rows`, per head, per batch entry (if any)."""
        return ", ".join([f"T.ceildiv({rows}, {block})", heads] + ([batch] if batch else []))

    def block_vars(self, *names: str) -> str:
        """The T.Kernel's block variables, one per grid axis ("" names none)."""
        return ", ".join(n for n in names if n)

    def tile_start(self, start: str, tile: str, size: str) -> str:
        """The statement binding the block's tile's first row (or key) `start`."""
        return f"{start} = {tile} * {size}"

    def stage(self, visit: str, stages: str) -> str:
        """The ring stage of visit `visit` (a kernel expression) in a ring of `stages`."""
        return "0" if visit == "0" else f"{_operand(visit)} % {stages}"

    def parity(self, visit: str, stages: str) -> str:
        """The phase a consumer waits for on the "full" barrier of visit `visit`'s stage."""
        return "0" if visit == "0" else f"({_operand(visit)} // {stages}) % 2"

    def free_parity(self, visit: str, stages: str) -> str:
        """The phase the producer waits for on the "empty" barrier of visit `visit`'s stage: the
        lap before (its first lap passes at once: a fresh barrier counts as released)."""
        return f"({self.parity(visit, stages)}) ^ 1"

    def tile_parity(self) -> str:
        """The phase of a barrier that completes once per tile (the block's only tile: 0)."""
        return "0"


class Persistent(SingleTile):
    """A block per SM looping over tiles: visit v of the block's current tile is the block's visit
    visit_base + v, and its tile_iter-th tile waits the once-per-tile barriers at tile_iter % 2."""

    persistent = True
    VISIT_BASE = "visit_base"  # the block's K/V visits before its current tile (a T.alloc_var)
    TILE_ITER = "tile_iter"  # the block's tiles before its current one (a T.alloc_var)

    def grid(self, rows: str, block: str, heads: str, batch: str = "") -> str:
        return "num_sms"

    def block_vars(self, *names: str) -> str:
        return "sm"

    def _visit(self, visit: str) -> str:
        return self.VISIT_BASE if visit == "0" else f"{self.VISIT_BASE} + {visit}"

    def stage(self, visit: str, stages: str) -> str:
        return f"{_operand(self._visit(visit))} % {stages}"

    def parity(self, visit: str, stages: str) -> str:
        return f"({_operand(self._visit(visit))} // {stages}) % 2"

    def tile_parity(self) -> str:
        return f"{self.TILE_ITER} % 2"

    def free_tile_parity(self) -> str:
        """The phase the taker of the next tile waits for on tile_empty: the last tile's (a fresh
        barrier passes the first tile at once)."""
        return f"({self.tile_parity()}) ^ 1"


def schedule_of(plan) -> SingleTile:
    """The plan's scheduler: spec.scheduler's."""
    return Persistent() if plan.spec.scheduler == "persistent" else SingleTile()


# -- the persistent order: which (batch*head, row tile) the counter's i-th tile is ------------
def section_heads(kv_len: int, kv_head_bytes_per_key: int, group: int) -> int:
    """Query heads a persistent schedule runs together so that their K/V fits hw.L2_KV_BYTES
    (FA3's "swizzle"): the KV heads that fit, rounded down to a power of two (at least one),
    times the query heads sharing each (`group`, 1 when GQA is packed into the rows).
    `kv_head_bytes_per_key`: one key's K and V bytes, (head_dim + head_dim_v) * element bytes."""
    one_kv_head = kv_len * kv_head_bytes_per_key
    fit = L2_KV_BYTES // one_kv_head if one_kv_head <= L2_KV_BYTES else 1
    return (1 << (fit.bit_length() - 1)) * group


def section_of(spec, kv_len: int) -> int:
    """section_heads for a resolved spec's kernel at `kv_len` keys: what its launcher passes as `section`."""
    per_key = (spec.head_dim + (spec.head_dim_v or spec.head_dim)) * DTYPES[spec.dtype].bytes
    return section_heads(kv_len, per_key, spec.gqa_group)


def persistent_steps(tile, m_blocks, heads_total, section, longest_first: bool, name=lambda step, value: value,
                     tile_name: str = "q_block"):
    """persistent_tile's rule step by step: each step's value goes through `name(step, value)`, which
    returns what later steps use (the value itself, or the kernel's name for it: render's
    tile_lines binds each step to a name, so the kernel's text reads step by step). `m_blocks` counts
    the tiles along the kernel's tile axis (the forward's row tiles, the backward's KV tiles), and
    `tile_name` names the last step, the tile along it; `longest_first` walks that axis backwards."""
    per_section = tiles.mul(section, m_blocks)
    sec = name("sec", tiles.floordiv(tile, per_section))
    within = name("within", tiles.sub(tile, tiles.mul(sec, per_section)))
    width = name("width", tiles.min_(section, tiles.sub(heads_total, tiles.mul(sec, section))))  # the last section may be narrower
    block = name("row_step", tiles.floordiv(within, width))
    bh = name("bh", tiles.add(tiles.mul(sec, section), tiles.sub(within, tiles.mul(block, width))))
    m_block = name(tile_name, tiles.sub(tiles.sub(m_blocks, 1), block) if longest_first else block)
    return bh, m_block


def persistent_tile_lines(blocks: str, longest_first: bool, tile_name: str = "q_block") -> list[str]:
    """persistent_steps' rule as kernel text: a `step = value` line per step, from the index `tile`
    over `blocks` tiles per head (a kernel name), heads_total and section."""
    lines = []

    def name(step, value):
        lines.append(f"{step} = {tiles.text(value)}")
        return tiles.Sym(step, 0)

    persistent_steps(tiles.Sym("tile", 0), tiles.Sym(blocks, 1), tiles.Sym("heads_total", 1), tiles.Sym("section", 1),
                     longest_first, name, tile_name)
    return lines


# What a persistent kernel's launcher passes after softmax_scale (run/persistent.py, emulator/persistent.py)
COUNTER_PARAMS = ['tile_counter: T.Tensor([COUNTER_SLOTS], "int32"),  # the tile counters: call `epoch` takes from slot '
                  'epoch % COUNTER_SLOTS and zeroes the others',
                  "epoch: T.int32,  # this call's number (the launcher counts its calls)"]
BLOCK_PARAMS = ["num_sms: T.int32,  # blocks: one per SM",
                "section: T.int32,  # heads whose tiles go out together (schedulers.section_heads: their K/V fits L2)"]
COUNTER_CONSTANT = (f"COUNTER_SLOTS = {COUNTER_SLOTS}  # tile counters, used in turn "
                    "by successive calls (schedulers.COUNTER_SLOTS)")
SLOT_LINE = "slot = T.truncmod(epoch, COUNTER_SLOTS)  # this call's counter: the two calls before it zeroed it"


def persistent_tile(tile, m_blocks, heads_total, section, longest_first: bool):
    """The `tile`-th tile a persistent schedule hands out, as (bh, m_block): bh = batch * heads +
    head, m_block the row tile. Written over tiles.py's builder: ints give ints (the bench, the
    tests, the CPU model's checks), Syms give the kernel's TileLang text, so both read one rule.

    Tiles go out section by section (`section` heads of bh order, the last section the rest):
    within one, row tile by row tile, each across the section's heads, so the heads whose K/V
    share L2 run together. `longest_first` reverses the row tiles (FA3's LPT for causal and
    local attention: with bottom-right alignment the last row tile sees the most keys)."""
    return persistent_steps(tile, m_blocks, heads_total, section, longest_first)


SAMPLE_TILES = 8  # a sample problem's length in tiles (of the larger side): enough for the ranges' ends to differ


def sample_frame(plan, block_m: int, block_n: int) -> tiles.Frame:
    """tiles.Frame of a square sample problem under the forward plan's mask edges: where the persistent
    orders read which tiles see more (each axis's visits are monotone, so its ends decide)."""
    length = SAMPLE_TILES * max(block_m, block_n)
    return tiles.Frame.of(length, length, tiles.Edges(plan.window_left, plan.window_right), block_m, block_n)


def walks_backwards(visits, n_tiles: int, first: str = "longest") -> bool:
    """Whether a persistent order walks its tile axis backwards so that the `first` ("longest" or
    "shortest") tiles go out first. `visits(t)`: tile t's visits as ints (tiles.Frame's ranges at a
    sample shape), t in [0, n_tiles); the visit count is monotone along the axis under causal
    attention, so its two ends decide. A tie (no mask) keeps the natural order."""
    head, tail = visits(0), visits(n_tiles - 1)
    return tail > head if first == "longest" else tail < head


# -- the varlen persistent order: a call-time tile list (issue 30) --------------------------
def varlen_tile_param(name: str = "tile_list", rows: str = "tile_rows", tile: str = "row tile",
                      order: str = "longest first", builder: str = "schedulers.varlen_tile_list") -> str:
    """A per-sequence persistent kernel's tile-list parameter line (tile_pairs' tensor, made by `builder`)."""
    return (f'{name}: T.Tensor([{rows}, 2], "int32"),  # (sequence, {tile}) pairs {order}, then padding; row {rows} - 1 '
            f'holds the real pair count: {builder}')


def varlen_tile_lines(tile: str = "q_block", name: str = "tile_list", heads: str = "heads", head: str = "head") -> list:
    """What a varlen persistent block binds from its tile index `tile`: pair tile // heads of the list,
    head tile % heads (a pair's heads go out together, innermost)."""
    return [f"pair = T.truncdiv(tile, {heads})  # the counter's tile t is pair t // {heads}, head t % {heads}",
            f"batch_idx = {name}[pair, 0]", f"{head} = T.truncmod(tile, {heads})", f"{tile} = {name}[pair, 1]"]


def varlen_total_line(name: str = "tile_list", rows: str = "tile_rows", heads: str = "heads") -> str:
    return f"total_tiles = {name}[{rows} - 1, 0] * {heads}  # the real pairs' tiles: the padding is never handed out"


VARLEN_TILE_PARAM = varlen_tile_param()
VARLEN_TILE_LINES = varlen_tile_lines()
VARLEN_TOTAL_LINE = varlen_total_line()


def varlen_pairs_bound(total: int, batch: int, block: int) -> int:
    """The most (sequence, tile) pairs a varlen call can have, from shapes alone: the sum over
    sequences of ceildiv(length, block) is at most total // block + batch (total: the packed rows)."""
    return total // block + batch


def varlen_tile_list(plan, named: dict, q_shape):
    """A per-sequence persistent forward's tile list (varlen queries or a paged cache) from its call's
    tensors by name and q's shape, on their device (call_lengths, tile_pairs)."""
    q_lens, kv_lens, total_q = call_lengths(plan, named, q_shape)
    return tile_pairs(q_lens, kv_lens, total_q, tiles.Edges(plan.window_left, plan.window_right), plan.spec.block_m,
                      plan.spec.block_n)


def call_lengths(plan, named: dict, q_shape) -> tuple:
    """(q_lens, kv_lens, total_q) of a per-sequence call: int64 tensors by torch ops on its tensors'
    device (no host read) and q's packed rows (a shape). Packed queries count from cu_seqlens_q, else
    each sequence has q_shape[1] rows; a paged cache's keys are seqused_k, else from cu_seqlens_k."""
    import torch

    if plan.varlen:
        q_lens, total_q = _lengths(named["cu_seqlens_q"]), int(q_shape[0])
    else:
        batch, q_len = int(q_shape[0]), int(q_shape[1])
        q_lens, total_q = torch.full((batch,), q_len, dtype=torch.int64, device=named["seqused_k"].device), batch * q_len
    kv_lens = torch.as_tensor(named["seqused_k"]).to(torch.int64) if plan.page_size else _lengths(named["cu_seqlens_k"])
    return q_lens, kv_lens, total_q


def _lengths(cu):
    """Each sequence's length from its prefix sums (int64, on their device)."""
    import torch

    return torch.as_tensor(cu).to(torch.int64).diff()


def varlen_pairs(cu_seqlens_q, cu_seqlens_k, total: int, edges: tiles.Edges, block_m: int, block_n: int, *,
                 kv_tiles: bool = False, first: str = "longest"):
    """tile_pairs over the lengths of cu_seqlens_q / cu_seqlens_k (prefix sums)."""
    return tile_pairs(_lengths(cu_seqlens_q), _lengths(cu_seqlens_k), total, edges, block_m, block_n, kv_tiles=kv_tiles, first=first)


def tile_pairs(q_lens, kv_lens, total: int, edges: tiles.Edges, block_m: int, block_n: int, *,
               kv_tiles: bool = False, first: str = "longest"):
    """A per-sequence persistent kernel's tile list: an int32 [pairs_bound + 1, 2] tensor on the
    lengths' device (int64 tensors, one per sequence), built by torch ops that read no value on the
    host (no device-to-host copy, no sync). Rows [0, pairs): the (sequence, row tile) pairs, or with
    `kv_tiles` the (sequence, KV tile) pairs of the backward's main kernel (total: then k's packed
    rows), by visits (tiles.Frame's ranges, each sequence bottom-right aligned), the `first`
    ("longest" or "shortest") first, ties in (sequence, tile) order; the kernel hands out each
    pair's heads together, innermost, so a GQA group's heads read their shared K/V tiles at once.
    Then padding (the last sequence's tiles past its end) up to the bound; the last row holds
    (pairs, 0): the kernel's total_tiles is pairs * heads, so no padding pair is handed out."""
    import torch

    device = q_lens.device
    batch = q_lens.shape[0]
    lens, block = (kv_lens, block_n) if kv_tiles else (q_lens, block_m)
    bound = varlen_pairs_bound(int(total), batch, block)
    counts = tiles.ceildiv(lens.clamp(min=0), block)
    # the padding as one more "sequence" (index batch), so the repeats sum to the bound exactly
    repeats = torch.cat([counts, (bound - counts.sum()).reshape(1)])
    seq = torch.repeat_interleave(torch.arange(batch + 1, device=device), repeats, output_size=bound)
    firsts = repeats.cumsum(0) - repeats
    tile = torch.arange(bound, device=device) - firsts[seq]
    padding = seq == batch
    real_seq = seq.clamp(max=batch - 1)
    frame = tiles.Frame(q_lens[real_seq], kv_lens[real_seq], kv_lens[real_seq] - q_lens[real_seq],
                        edges, block_m, block_n)
    visits = frame.q_visits(tile) if kv_tiles else frame.row_tile_visits(tile)
    key = -visits if first == "longest" else visits
    order = torch.sort(key.where(~padding, torch.iinfo(torch.int64).max), stable=True).indices  # padding sorts last
    tile = tile + padding * counts[-1:]  # padding: the last sequence's tiles past its end
    pairs = torch.stack([real_seq[order], tile[order]], 1)
    count = torch.stack([counts.sum(), torch.zeros((), dtype=torch.int64, device=device)]).reshape(1, 2)
    return torch.cat([pairs, count]).to(torch.int32)
