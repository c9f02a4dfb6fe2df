"""How a block gets its tile, and the one place that turns a visit into a pipeline stage and a parity.

A kernel's blocks walk a ring of shared-memory stages, each guarded by a "full" barrier (the
producer's TMA landed) and an "empty" one (the consumers released it). Visit v of a ring of S
stages uses stage v % S, and waits for the barrier's phase (v // S) % 2: each barrier flips once
per lap. The templates ask the scheduler for these texts (`schedule.stage("k", "K_STAGES")`,
`schedule.parity("k", "K_STAGES")`), never spell them.

SingleTile, today's scheduler: the grid has one block per tile (grid / block_vars /
tile_start), and every block starts its visit count at 0, so a barrier that completes once per
tile (Q's in the forward, K/V's in the backward) is waited at parity 0.

A persistent scheduler (issue 30; FA3's tile_scheduler.hpp, FA4's scheduler protocol) would
launch one block per SM that loops over tiles: it would override grid and block_vars (the SMs),
tile_start (the tile of loop iteration `tile_iter`, with a `next tile` step around the block's
body), and stage / parity / tile_parity to add the visits of the block's earlier tiles (a
running offset carried from tile to tile, e.g. `(k_base + k) % K_STAGES`), leaving the
mainloop's text as it is.
"""

from __future__ import annotations

from attngen import tiles
from attngen.hw import L2_KV_BYTES


def _operand(visit: str) -> str:
    """`visit` as an operand of % or //: parenthesised when it is a sum."""
    return f"({visit})" if " " in visit else visit


class SingleTile:
    """One tile per block; visit counts start at 0 in every block."""

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


def schedule_of(plan) -> SingleTile:
    """The plan's scheduler (every plan is single-tile today)."""
    return SingleTile()


# -- the persistent order: which (batch*head, row tile) the counter's i-th tile is ------------
def section_heads(kv_len: int, kv_head_bytes_per_key: int, group: int) -> int:
    """Query heads a persistent schedule runs together so that their K/V fits hw.L2_KV_BYTES
    (FA3's "swizzle"): the KV heads that fit, rounded down to a power of two (at least one),
    times the query heads sharing each (`group`, 1 when GQA is packed into the rows).
    `kv_head_bytes_per_key`: one key's K and V bytes, (head_dim + head_dim_v) * element bytes."""
    one_kv_head = kv_len * kv_head_bytes_per_key
    fit = L2_KV_BYTES // one_kv_head if one_kv_head <= L2_KV_BYTES else 1
    return (1 << (fit.bit_length() - 1)) * group


def persistent_tile(tile, m_blocks, heads_total, section, longest_first: bool):
    """The `tile`-th tile a persistent schedule hands out, as (bh, m_block): bh = batch * heads +
    head, m_block the row tile. Written over tiles.py's builder: ints give ints (the bench, the
    tests, the CPU model's checks), Syms give the kernel's TileLang text, so both read one rule.

    Tiles go out section by section (`section` heads of bh order, the last section the rest):
    within one, row tile by row tile, each across the section's heads, so the heads whose K/V
    share L2 run together. `longest_first` reverses the row tiles (FA3's LPT for causal and
    local attention: with bottom-right alignment the last row tile sees the most keys)."""
    per_section = tiles.mul(section, m_blocks)
    sec = tiles.floordiv(tile, per_section)
    within = tiles.sub(tile, tiles.mul(sec, per_section))
    width = tiles.min_(section, tiles.sub(heads_total, tiles.mul(sec, section)))  # the last section may be narrower
    block = tiles.floordiv(within, width)
    bh = tiles.add(tiles.mul(sec, section), tiles.sub(within, tiles.mul(block, width)))
    m_block = tiles.sub(tiles.sub(m_blocks, 1), block) if longest_first else block
    return bh, m_block
