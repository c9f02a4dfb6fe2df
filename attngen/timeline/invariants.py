"""Checks on a replayed Timeline: the cycle schedule respects the kernel's synchronisation.

Each returns a list of violations (empty: holds). tests/test_timeline.py runs them on every
preset and shows each catching a tampered timeline.
"""

from __future__ import annotations


def pingpong_alternates(tl) -> list:
    """Consumers take turns on the tensor cores: turns never overlap, they go round in a fixed
    order, and every QK wgmma is issued inside its warpgroup's turn."""
    out = []
    turns = sorted(tl.turns, key=lambda t: t[1])
    for (a, s0, e0, _), (b, s1, e1, _) in zip(turns, turns[1:]):
        if a == b:
            out.append(f"{tl.agents[a]} took two turns in a row (at {s0:.0f} and {s1:.0f})")
        if s1 < e0:
            out.append(f"turns overlap: {tl.agents[a]} [{s0:.0f}, {e0:.0f}) and {tl.agents[b]} [{s1:.0f}, {e1:.0f})")
    ring = len({t[0] for t in turns})
    for i in range(ring, len(turns)):
        if turns[i][0] != turns[i - ring][0]:
            out.append(f"turn {i} by {tl.agents[turns[i][0]]} breaks the round-robin order")
            break
    if turns:
        mine = {}
        for a, s, e, _ in turns:
            mine.setdefault(a, []).append((s, e))
        for sp in tl.spans:
            if sp.kind == "QK":  # the QK of tile k is issued in the warpgroup's k-th turn
                issued, own = sp.info["issued"], mine.get(sp.agent, [])
                if sp.tile >= len(own) or not own[sp.tile][0] <= issued <= own[sp.tile][1]:
                    out.append(f"{tl.agents[sp.agent]} issued QK of tile {sp.tile} at {issued:.0f}, outside its ping-pong turn")
    return out


def wgmma_depth(tl) -> list:
    """At most wait-depth wgmmas of a warpgroup are in flight (issued, not yet retired) at any time."""
    out = []
    for a in range(len(tl.agents)):
        if tl.inflight_max[a] > tl.wait_depth[a]:
            out.append(f"{tl.agents[a]}: {tl.inflight_max[a]} wgmmas in flight, wait depth {tl.wait_depth[a]}")
        edges = []
        for sp in tl.spans:
            if sp.agent == a and sp.kind in ("QK", "PV"):
                edges += [(sp.info["issued"], 1), (sp.info.get("retired", float("inf")), -1)]
        level = 0
        for t, d in sorted(edges, key=lambda x: (x[0], x[1])):
            level += d
            if level > tl.wait_depth[a]:
                out.append(f"{tl.agents[a]}: {level} wgmmas in flight at cycle {t:.0f} (wait depth {tl.wait_depth[a]})")
                break
    return out


def stages_exclusive(tl) -> list:
    """A shared-memory stage is never being loaded (TMA issue .. land) while a wgmma reads it."""
    out = []
    for region, l0, l1 in tl.loads:
        for a, r, s, e in tl.reads:
            if r == region and s < l1 and l0 < e:
                out.append(f"{region} loaded during [{l0:.0f}, {l1:.0f}) while {tl.agents[a]}'s wgmma reads it "
                           f"during [{s:.0f}, {e:.0f})")
    return out


def check_all(tl, pingpong: bool) -> list:
    return (pingpong_alternates(tl) if pingpong else []) + wgmma_depth(tl) + stages_exclusive(tl)
