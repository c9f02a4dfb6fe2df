"""A grid's tiles on many SMs: one block per tile against a persistent kernel (issue 30).

A tile's cycles come from the timeline: `fit_tile_cost` records one block of the emitted kernel
per KV length on the CPU model, replays it under latency.toml (replay.py) and fits
cycles = fixed + per_visit * visits, where `fixed` is the prologue and epilogue (Q's load, the
pipeline's fill, O's store) and `per_visit` one KV tile in the steady loop. `row_tile_visits`
counts each row tile's KV visits with tiles.py (the kernel's own rule).

`list_schedule` then runs tiles in a given order on `sms` SMs, each SM taking the next tile when
it finishes its last. That is both policies:
- single-tile: the order is the hardware's block order (blockIdx.x fastest, then y, then z:
  `single_tile_order`), and the block scheduler gives the next block to the SM that frees;
- persistent: the order is schedulers.persistent_tile's, handed out by an atomic counter, plus
  `handover` cycles per tile for fetching the index and passing it to the consumers; a varlen
  kernel's is its launcher's sorted tile list (`varlen_pair_order`).
`static_schedule` is FA4's static round-robin (tile i on SM i % sms), for comparison.

Assumptions: one resident block per SM (the forward's shared memory fills it); a tile costs the
same whatever ran before it (no L2 model: head sections only change the order here, not the
hit rate); blocks launch for free, and a varlen block past its sequence's end costs nothing.
A model, not a GPU figure.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from attngen import tiles
from attngen.kernels.common.schedulers import persistent_tile, varlen_pairs


@dataclasses.dataclass(frozen=True)
class TileCost:
    """cycles(visits) = fixed + per_visit * visits: one row tile on one SM."""
    fixed: float
    per_visit: float

    def __call__(self, visits: int) -> float:
        return self.fixed + self.per_visit * visits


def fit_tile_cost(plan, lat, visits=(1, 2, 4, 8, 16)) -> tuple[TileCost, float]:
    """The plan's TileCost from the timeline: one block (q_len = block_m) per KV length of `visits`
    KV tiles, emulated and replayed; a least-squares line through (tiles loaded, cycles). Also the
    largest relative residual, so a caller can say how straight the line is."""
    from attngen.timeline.latency import SourceInfo
    from attngen.timeline.record import record
    from attngen.timeline.replay import replay

    spec = plan.spec
    points = []
    for v in visits:
        rec = record(plan, q_len=spec.block_m, kv_len=v * spec.block_n, blocks={(0, 0, 0)})
        cycles = replay(rec.ctas[0], lat, SourceInfo(rec.source)).total
        points.append((rec.stats.k_tiles_by_cta[(0, 0, 0)], cycles))
    x, y = np.array(points, dtype=float).T
    per_visit, fixed = np.polyfit(x, y, 1)
    cost = TileCost(float(fixed), float(per_visit))
    return cost, float(max(abs(cost(a) - b) / b for a, b in points))


def row_tile_visits(q_len: int, kv_len: int, block_m: int, block_n: int, causal: bool, window=(-1, -1)) -> list[int]:
    """KV tiles each row tile of one (sequence, head) visits: [first, stop) of tiles.py, at least one."""
    frame = tiles.Frame.of(q_len, kv_len, tiles.edges(causal, window), block_m, block_n)
    out = []
    for m in range(-(-q_len // block_m)):
        rows = tiles.Rows(m * block_m, m * block_m + block_m - 1)
        out.append(tiles.at_least_one(frame.kv_stop(rows) - frame.kv_first(rows)))
    return out


# -- orders: lists of (batch, head, row tile) ------------------------------------------------
def single_tile_order(m_blocks: list[int], heads: int) -> list[tuple]:
    """The single-tile grid (max row tiles, heads, batch) in launch order, x fastest. A block past
    its sequence's row tiles (varlen) is listed with row tile None: it exits at once."""
    grid_x = max(m_blocks)
    return [(b, h, m if m < m_blocks[b] else None) for b in range(len(m_blocks)) for h in range(heads) for m in range(grid_x)]


def persistent_order(m_blocks: list[int], heads: int, sections: list[int], longest_first: bool,
                     sequence_order=None) -> list[tuple]:
    """The counter's order: sequence by sequence (`sequence_order`, default batch order), each by
    schedulers.persistent_tile over its heads with its head section. Equal lengths run as one
    problem over batch * heads (the fixed-length kernel's counter)."""
    if len(set(m_blocks)) == 1 and sequence_order is None:
        total, m = len(m_blocks) * heads, m_blocks[0]
        pairs = (persistent_tile(i, m, total, sections[0], longest_first) for i in range(total * m))
        return [(bh // heads, bh % heads, mb) for bh, mb in pairs]
    out = []
    for b in sequence_order if sequence_order is not None else range(len(m_blocks)):
        for i in range(heads * m_blocks[b]):
            h, mb = persistent_tile(i, m_blocks[b], heads, sections[b], longest_first)
            out.append((b, h, mb))
    return out


def varlen_pair_order(q_lens: list[int], kv_lens: list[int], heads: int, block_m: int, block_n: int, causal: bool,
                      window=(-1, -1)) -> list[tuple]:
    """The varlen persistent kernel's order as (sequence, head, row tile): the tile list its launcher
    builds per call, (sequence, row tile) pairs longest first (schedulers.varlen_pairs, the one home,
    on CPU torch tensors), heads innermost; the padding is never handed out."""
    import torch

    cu = [torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0) for lens in (q_lens, kv_lens)]
    listed = varlen_pairs(*cu, sum(q_lens), tiles.edges(causal, window), block_m, block_n).tolist()
    return [(b, h, t) for b, t in listed[:listed[-1][0]] for h in range(heads)]


# -- schedules -----------------------------------------------------------------------------
@dataclasses.dataclass
class Schedule:
    makespan: float
    runs: list  # (index in the order, sm, start, end)


def list_schedule(costs, sms: int, handover: float = 0.0) -> Schedule:
    """Tiles in order, each to the SM that frees first (the lowest-numbered on a tie), `handover`
    cycles before each tile."""
    free = [(0.0, sm) for sm in range(sms)]
    runs = []
    for i, c in enumerate(costs):
        t, sm = heapq.heappop(free)
        end = t + handover + c
        runs.append((i, sm, t, end))
        heapq.heappush(free, (end, sm))
    return Schedule(max((r[3] for r in runs), default=0.0), runs)


def static_schedule(costs, sms: int, handover: float = 0.0) -> Schedule:
    """Tile i on SM i % sms, back to back (FA4's static round-robin)."""
    clock = [0.0] * sms
    runs = []
    for i, c in enumerate(costs):
        sm = i % sms
        runs.append((i, sm, clock[sm], clock[sm] + handover + c))
        clock[sm] += handover + c
    return Schedule(max(clock, default=0.0), runs)
