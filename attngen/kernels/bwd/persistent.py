"""The backward's persistent scheduler (spec.scheduler = "persistent", issue 30): the forward's rule
(kernels/common/schedulers.py) over the backward's tile axes.

The main kernel's tile is a KV tile of one head (of one KV head with deterministic GQA, whose
block visits the group's query heads): a block per SM takes tiles from the atomic counter, longest
first, and hands each to its consumers as the forward does (templates/common/persistent.py.j2).
The deterministic dq kernel's tile is a Q tile of one head: its order is fixed, shortest first
(FA3's deterministic order, flash-attention PR #1893), each block taking every num_sms-th tile of
it (no counter: which block sums a tile never changes its bits).

A varlen batch's tiles come from call-time lists instead (varlen_main_list, varlen_dq_list: the
forward's builder, schedulers.varlen_pairs, over (sequence, KV tile) and (sequence, Q tile) pairs),
and each tile reads its sequence's bounds.

"Longest" and "shortest" come from tiles.Frame's ranges (schedulers.walks_backwards): a tile's
visits at a sample shape, the axis walked backwards when its last tile has more (fewer) of them.
"""

from __future__ import annotations

from attngen import tiles
from attngen.hw import DTYPES
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.common.schedulers import (COUNTER_CONSTANT, SLOT_LINE, Persistent, persistent_tile_lines,
                                               sample_frame, section_heads, varlen_pairs,
                                               varlen_tile_lines, varlen_total_line, walks_backwards)

# A varlen persistent backward's tile lists (schedulers.varlen_pairs): the main kernel's (sequence, KV
# tile) pairs, longest first, and the deterministic dq kernel's (sequence, Q tile) pairs, shortest first
MAIN_LIST = ("tile_list", "tile_rows")
DQ_LIST = ("dq_tile_list", "dq_tile_rows")

def main_backwards(bp) -> bool:
    """The main kernel's order walks the KV tiles backwards: the tiles that see the most Q tiles first
    (under causal attention with bottom-right alignment, the first KV tile: the axis stays forward)."""
    fr = sample_frame(bp.forward, bp.block_m, bp.block_n)
    return walks_backwards(lambda t: len(fr.q_span(t).tiles), tiles.ceildiv(fr.kv_len, fr.block_n), "longest")


def dq_backwards(bp) -> bool:
    """The dq kernel's fixed order walks the Q tiles backwards: the tiles that see the fewest KV tiles
    first (under causal attention, the first Q tile: forward)."""
    fr = sample_frame(bp.forward, bp.dq_block_m, bp.dq_block_n)
    return walks_backwards(lambda t: fr.row_tile_visits(t), fr.q_tiles(), "shortest")


def grouped(bp) -> bool:
    return bp.deterministic and bp.spec.gqa_group > 1


def varlen_main_list(bp, cu_seqlens_q, cu_seqlens_k, total_k: int):
    """The main kernel's tile list for a varlen call (total_k: k's packed rows, a shape): (sequence,
    KV tile) pairs, the most Q tiles first, built on cu_seqlens' device (schedulers.varlen_pairs)."""
    return varlen_pairs(cu_seqlens_q, cu_seqlens_k, total_k, _edges(bp), bp.block_m, bp.block_n, kv_tiles=True)


def varlen_dq_list(bp, cu_seqlens_q, cu_seqlens_k, total_q: int):
    """The deterministic dq kernel's fixed order for a varlen call: (sequence, Q tile) pairs, the fewest
    KV tiles first (FA3's deterministic order)."""
    return varlen_pairs(cu_seqlens_q, cu_seqlens_k, total_q, _edges(bp), bp.dq_block_m, bp.dq_block_n, first="shortest")


def _edges(bp) -> tiles.Edges:
    return tiles.Edges(bp.forward.window_left, bp.forward.window_right)


def main_section(spec, q_len: int, group_visits: bool) -> int:
    """The main kernel's L2 section: the heads whose Q, dO (and their row statistics) every KV tile of
    theirs reads fit L2 together (schedulers.section_heads over the query side; a grouped tile reads
    its group's query heads)."""
    per_row = (spec.head_dim + (spec.head_dim_v or spec.head_dim)) * DTYPES[spec.dtype].bytes + 8
    return section_heads(q_len * (spec.gqa_group if group_visits else 1), per_row, 1)


def _held(names: list) -> list:
    return [f'{name} = T.alloc_var("int32", 0)' for name in names]


def main_context(bp, q_range: dict, has_edges: bool, seq_setup: list) -> dict:
    """The main kernel's persistent lines (the template's `persistent`): "setup", "vars", "tile", "constants".
    `seq_setup`: the lines that read a varlen sequence's bounds (each tile's, here)."""
    heads, head = ("kv_heads", "kv_head") if grouped(bp) else ("heads", "head")
    varlen = layout_of(bp.forward).per_sequence
    if varlen:  # the launcher listed the (sequence, KV tile) pairs longest first (schedulers.varlen_pairs)
        lines = varlen_tile_lines("kv_block", MAIN_LIST[0], heads, head)
    else:
        lines = persistent_tile_lines("kv_blocks", main_backwards(bp), "kv_block")
        if not main_backwards(bp) and bp.forward.spec.causal:
            lines[-1] += "  # longest first: under causal attention the first KV tile sees the most Q tiles"
        lines += [f"batch_idx = T.truncdiv(bh, {heads})  # truncdiv: both >= 0", f"{head} = T.truncmod(bh, {heads})"]
    lines += [] if grouped(bp) else ["kv_head = head // GQA_GROUP"]
    bounds = seq_setup if varlen else []  # the tile's sequence changes from tile to tile: its bounds too
    lines += bounds + [Persistent().tile_start("kv0", "kv_block", "BLOCK_N"),
                       "kv_partial = kv0 + BLOCK_N > kv_len  # keys past kv_len: every visit masked",
                       f"q_first = {q_range['q_first']}  # the first Q tile with a row that sees this KV tile",
                       f"n_q = {q_range['n_q']}  # Q tiles [q_first, q_first + n_q) see it (0: none; dK = dV = 0)"]
    held = ["kv_block", "batch_idx"] + ([] if grouped(bp) else ["head"]) + ["kv_head"] + _names(bounds) + ["kv0", "q_first", "n_q"]
    if has_edges:
        lines += [f"full_first = {q_range['full_first']}", f"full_stop = {q_range['full_stop']}"]
        held += ["full_first", "full_stop"]
    setup = ["kv_blocks = T.ceildiv(kv_len, BLOCK_N)  # KV tiles per head",
             f"heads_total = batch * {heads}  # tile t's (batch, head) pair is bh = batch_idx * {heads} + {head}",
             "total_tiles = kv_blocks * heads_total  # the counter hands out [0, total_tiles), then an end mark per block",
             SLOT_LINE]
    if varlen:  # total_tiles: the list's real pairs, times the heads
        setup = [varlen_total_line(*MAIN_LIST, heads), SLOT_LINE]
    # the producer binds only what its loads read (the masks are the consumers'), as lets: held in vars
    # as the consumers hold them, its 40 registers spilled 16 B (hd64 GQA 2; attngen build), as lets none
    producer = [line for line in lines if not line.startswith(("full_first", "full_stop", "kv_partial"))]
    return {"setup": setup, "tile": lines, "vars": _held(held), "constants": [COUNTER_CONSTANT], "producer_tile": producer}


def dq_context(bp, dq_range: dict, seq_setup: list) -> dict:
    """The dq kernel's persistent lines (the template's `dq_persistent`): "setup", "vars", "tile"."""
    varlen = layout_of(bp.forward).per_sequence
    if varlen:  # the launcher listed the (sequence, Q tile) pairs shortest first (schedulers.varlen_pairs)
        lines = varlen_tile_lines("q_block", DQ_LIST[0])
    else:
        lines = persistent_tile_lines("q_blocks", dq_backwards(bp), "q_block")
        if not dq_backwards(bp) and bp.forward.spec.causal:
            lines[-1] += "  # shortest first: under causal attention the first Q tile sees the fewest KV tiles"
        lines += ["batch_idx = T.truncdiv(bh, heads)", "head = T.truncmod(bh, heads)"]
    bounds = seq_setup if varlen else []  # the tile's sequence changes from tile to tile: its bounds too
    lines += ["kv_head = head // GQA_GROUP"] + bounds + [
        Persistent().tile_start("q0", "q_block", "DQ_BLOCK_M"),
        f"kv_first = {dq_range['dq_kv_first']}  # the first KV tile these rows see",
        f"n_kv = {dq_range['dq_n_kv']}  # KV tiles [kv_first, kv_first + n_kv) (0: none, dQ = 0)"]
    setup = ["q_blocks = T.ceildiv(q_len, DQ_BLOCK_M)  # Q tiles per head",
             "heads_total = batch * heads",
             "total_tiles = q_blocks * heads_total  # block sm runs tiles sm, sm + num_sms, ... of the fixed order"]
    if varlen:
        setup = [varlen_total_line(*DQ_LIST)]
    held = ["batch_idx", "head", "kv_head"] + _names(bounds) + ["q0", "kv_first", "n_kv"]
    return {"setup": setup, "tile": lines, "vars": _held(held)}


def _names(lines: list) -> list:
    return [line.split(" = ", 1)[0] for line in lines]
