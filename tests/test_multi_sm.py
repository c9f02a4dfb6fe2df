"""The multi-SM model (attngen.timeline.multi_sm): its schedules' invariants and hand-computed cases."""

import random

import numpy as np
import pytest

from attngen import tiles
from attngen.timeline.multi_sm import (TileCost, list_schedule, persistent_order, row_tile_visits, single_tile_order,
                                       static_schedule, varlen_pair_order)

SCHEDULES = {"list": list_schedule, "static": static_schedule}


def check_runs(schedule, costs, sms, handover):
    """Every tile exactly once, for its own cycles, on one SM at a time; the makespan is the last end."""
    assert sorted(i for i, *_ in schedule.runs) == list(range(len(costs)))
    by_sm = {}
    for i, sm, start, end in schedule.runs:
        assert 0 <= sm < sms and start >= 0
        assert end - start == pytest.approx(handover + costs[i])
        by_sm.setdefault(sm, []).append((start, end))
    for spans in by_sm.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    assert schedule.makespan == max((r[3] for r in schedule.runs), default=0.0)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("seed", range(6))
def test_every_tile_once_and_the_lower_bounds(name, seed):
    rng = random.Random(seed)
    sms, handover = rng.randint(1, 9), rng.choice([0.0, 3.0])
    costs = [rng.uniform(1, 100) for _ in range(rng.randint(1, 60))]
    s = SCHEDULES[name](costs, sms, handover)
    check_runs(s, costs, sms, handover)
    work = [c + handover for c in costs]
    assert s.makespan >= sum(work) / sms - 1e-9
    assert s.makespan >= max(work)


def test_list_schedule_hand_case():
    """3 SMs, 7 tiles in this order: SM0 2 then 7 (ends 9); SM1 5 then 6 (11); SM2 3, 1, 4 (8)."""
    costs = [2, 5, 3, 7, 1, 4, 6]
    assert list_schedule(costs, 3).makespan == 11
    # with 1 cycle per handover: SM0 3, 8 (11); SM1 6, 5 (11); SM2 4, 2, 7 (13)
    assert list_schedule(costs, 3, handover=1).makespan == 13
    assert [sm for _, sm, _, _ in list_schedule(costs, 3, handover=1).runs] == [0, 1, 2, 0, 2, 1, 2]
    # round robin: SM0 2 + 7 + 6
    assert static_schedule(costs, 3).makespan == 15


def test_causal_hand_case_longest_first_beats_launch_order():
    """One head of 7 causal row tiles (visits 1..7, 1 cycle each) on 3 SMs. Launch order: 1, 2, 3 start;
    4 on SM0 at 1 (ends 5), 5 on SM1 at 2 (7), 6 on SM2 at 3 (9), 7 on SM0 at 5 (12). Longest first: 7, 6, 5;
    4 at 5, 3 at 6, 2 at 7 (all end at 9), 1 at 9: 10, the optimum (28 cycles over 3 SMs)."""
    visits = row_tile_visits(7, 7, 1, 1, causal=True)
    assert visits == [1, 2, 3, 4, 5, 6, 7]
    cost = TileCost(0.0, 1.0)

    def makespan(order):
        return list_schedule([cost(visits[m]) for _, _, m in order], 3).makespan
    assert makespan(single_tile_order([7], 1)) == 12
    assert makespan(persistent_order([7], 1, [1], longest_first=False)) == 12
    assert makespan(persistent_order([7], 1, [1], longest_first=True)) == 10


@pytest.mark.parametrize("seqlen, batch, heads", [(1024, 4, 33), (512, 2, 66)])
def test_equal_tiles_filling_every_wave_take_the_same_time(seqlen, batch, heads):
    """Non-causal: every tile the same cost; 132 | tiles, so every order and policy gives tiles/132 waves."""
    visits = row_tile_visits(seqlen, seqlen, 128, 128, causal=False)
    m = len(visits)
    assert len(set(visits)) == 1 and batch * heads * m % 132 == 0
    cost = TileCost(100.0, 7.0)
    one = cost(visits[0])
    single = list_schedule([one for _ in single_tile_order([m] * batch, heads)], 132).makespan
    lpt = [one for _ in persistent_order([m] * batch, heads, [8] * batch, True)]
    assert single == list_schedule(lpt, 132).makespan == static_schedule(lpt, 132).makespan
    assert single == one * batch * heads * m // 132


@pytest.mark.parametrize("lengths, heads, sections", [([300, 1000, 40], 3, [2, 1, 4]), ([256] * 3, 5, [2] * 3)])
def test_orders_list_every_tile_once(lengths, heads, sections):
    m_blocks = [-(-n // 128) for n in lengths]
    want = sorted((b, h, m) for b, mb in enumerate(m_blocks) for h in range(heads) for m in range(mb))
    single = single_tile_order(m_blocks, heads)
    assert sorted(t for t in single if t[2] is not None) == want
    assert len(single) == len(lengths) * heads * max(m_blocks)  # the grid, exiting blocks included
    gx = max(m_blocks)  # blockIdx.x (the row tile) fastest, then the head, then the sequence
    assert single[:gx + 1] == [(0, 0, m if m < m_blocks[0] else None) for m in range(gx)] + [(0, 1, 0)]
    assert single[gx * heads] == (1, 0, 0)
    for lpt in (True, False):
        for seq_order in (None, [2, 0, 1]):
            order = persistent_order(m_blocks, heads, sections, lpt, seq_order)
            assert sorted(order) == want
            if seq_order:
                assert [b for b, _, _ in order[:heads * m_blocks[2]]] == [2] * (heads * m_blocks[2])


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (200, 0)), (False, (-1, -1))])
def test_the_varlen_kernels_order_lists_every_tile_once_longest_first(causal, window):
    """varlen_pair_order (the kernel's tile list): each (sequence, head, row tile) once, visits never
    rising (the model's own row_tile_visits), a pair's heads consecutive."""
    lq, lk, heads = [300, 0, 1000, 40, 129], [300, 9, 700, 400, 129], 3
    order = varlen_pair_order(lq, lk, heads, 128, 64, causal, window)
    visits = [row_tile_visits(q, k, 128, 64, causal, window) if q else [] for q, k in zip(lq, lk)]
    assert sorted(order) == sorted((b, h, m) for b, v in enumerate(visits) for h in range(heads) for m in range(len(v)))
    seen = [visits[b][m] for b, _, m in order]
    assert seen == sorted(seen, reverse=True)
    assert all(order[i][::2] == order[i + h][::2] for i in range(0, len(order), heads) for h in range(heads))


@pytest.mark.parametrize("q_len, kv_len, causal, window", [(1000, 1000, True, (-1, -1)), (300, 1000, True, (-1, -1)),
                                                          (1000, 300, True, (-1, -1)), (640, 640, False, (-1, -1)),
                                                          (700, 900, False, (200, 0))])
def test_row_tile_visits_are_the_tiles_with_a_visible_key(q_len, kv_len, causal, window):
    """tiles.visible, brute force: the KV tiles holding a key some row of the tile sees (at least one)."""
    bm, bn = 128, 64
    rows, keys = np.arange(-(-q_len // bm) * bm)[:, None], np.arange(kv_len)[None, :]
    vis = tiles.visible(rows, keys, q_len, kv_len, tiles.edges(causal, window))
    want = []
    for m in range(-(-q_len // bm)):
        seen = vis[m * bm:(m + 1) * bm].any(axis=0)
        want.append(max(len({k // bn for k in np.flatnonzero(seen)}), 1))
    assert row_tile_visits(q_len, kv_len, bm, bn, causal, window) == want


def test_fit_tile_cost_passes_through_the_replayed_blocks():
    """The line fitted to replayed one-block kernels gives each block's cycles back (within 2%), and a
    visit costs more than nothing: a fixed cost and a slope, in that order."""
    from attngen.kernels.fwd.plan import make_plan
    from attngen.spec import Spec
    from attngen.timeline.latency import Latency, SourceInfo
    from attngen.timeline.multi_sm import fit_tile_cost
    from attngen.timeline.record import record
    from attngen.timeline.replay import replay

    plan, lat = make_plan(Spec(head_dim=64, causal=True)), Latency.load()
    cost, residual = fit_tile_cost(plan, lat, visits=(1, 3, 6))
    assert residual < 0.02 and cost.fixed > 0 and cost.per_visit > 0
    s = plan.spec
    rec = record(plan, q_len=s.block_m, kv_len=4 * s.block_n, blocks={(0, 0, 0)})
    assert cost(4) == pytest.approx(replay(rec.ctas[0], lat, SourceInfo(rec.source)).total, rel=0.02)
