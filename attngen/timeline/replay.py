"""Trace -> cycles: a conservative discrete-event replay of one CTA's recorded events.

Each agent's events are taken in its program order (which does not depend on the
emulator's schedule) with a clock per agent. The replay always advances the agent with the
smallest clock whose next event can proceed, so shared units (the SM's tensor cores, the
TMA engine) serve requests in time order and the result does not depend on which valid
schedule the emulator happened to take. Cross-agent order comes from the recorded
synchronisation, named by schedule-independent facts (barrier, phase, generation):

- an mbarrier phase completes at the latest of its arrivals and of the land times of the
  TMA loads issued against it (issue + latency + bytes / bandwidth, in TMA-engine order);
  a parity wait ends at max(own clock, that completion);
- a named barrier generation releases at the latest of its arrivals; bar.sync waits for it;
- a wgmma starts at max(issue, tensor cores free) and holds them for cycles(M, N, K, dtype);
  wait_wgmma(n) ends when every wgmma it retires has finished (plus the pipeline drain);
- tile statements (T.Parallel, reductions, copies) cost what latency.toml says.
"""

from __future__ import annotations

import dataclasses
import re

from attngen.timeline.latency import Latency, SourceInfo, classify
from attngen.timeline.trace import CTATrace


class ReplayError(RuntimeError):
    """The recorded events cannot be ordered (a wait nothing completes)."""


@dataclasses.dataclass
class Span:
    agent: int
    row: str  # "simt" (the warpgroup's own instructions) or "async" (its wgmmas, or the TMA loads it issued)
    kind: str  # QK, PV, softmax, rescale, epilogue, TMA, wait, other
    start: float
    end: float
    line: int | None
    tile: int | None
    info: dict


@dataclasses.dataclass
class Timeline:
    index: tuple
    agents: list
    producers: list
    spans: list
    arrows: list  # (from agent, time, to agent, time, label): ping-pong hand-overs
    turns: list  # (agent, start, end, barrier): a consumer's turn on the tensor cores
    loads: list  # (region, start, land)
    reads: list  # (agent, region, start, end): wgmma operand reads of shared stages
    inflight_max: dict  # agent -> most wgmmas in flight at once
    wait_depth: dict  # agent -> 1 + the largest n of its wait_wgmma(n)
    total: float
    times: list = dataclasses.field(default_factory=list)  # per agent, per event: (start, end) cycles

    def summary(self) -> dict:
        return summarize(self)


def _base(name: str) -> str:
    return re.sub(r"\[\d+\]$", "", name)


def replay(cta: CTATrace, lat: Latency, src: SourceInfo) -> Timeline:
    n = len(cta.agents)
    streams = [cta.of(a) for a in range(n)]
    pos, clock = [0] * n, [0.0] * n
    spans, arrows, turns, loads, reads = [], [], [], [], []
    mphase: dict = {}  # (bar, phase) -> [arrived, count, latest arrival, latest land]
    named: dict = {}  # (id, gen) -> [arrived, count, [(agent, time, sync)]]
    tc_free, tma_free = 0.0, 0.0
    inflight = [[] for _ in range(n)]  # per agent: (end, span)
    inflight_max = {a: 0 for a in range(n)}
    wait_depth = {a: 1 for a in range(n)}
    qk, pv, loaded = [0] * n, [0] * n, [dict() for _ in range(n)]
    turn_open: dict = {}  # agent -> (start, bar)
    times = [[None] * len(st) for st in streams]
    P = lat.params
    tc, tma, bar_p = P["tensor_core"], P["tma"], P["barrier"]

    def tile_of(a):
        return max(qk[a] - 1, 0) if not cta.producers[a] else None

    def ready(a, e) -> bool:
        i = e.info
        if e.kind == "mbar_wait":
            if i["need"] < 0:
                return True
            ph = mphase.get((i["bar"], i["need"]))
            return ph is not None and ph[0] >= ph[1]
        if e.kind == "bar_wait":
            nb = named.get((i["bar"], i["gen"]))
            return nb is not None and nb[0] >= nb[1]
        return True

    def wait_span(a, e, t0, t1, on, **info):
        if t1 > t0:
            spans.append(Span(a, "simt", "wait", t0, t1, e.line, tile_of(a), {"on": on, **info}))

    def compute(a, e, cycles, role, **info):
        t0 = clock[a]
        clock[a] = t0 + cycles
        spans.append(Span(a, "simt", role, t0, clock[a], e.line, tile_of(a), info))

    while True:
        best = None
        for a in range(n):
            if pos[a] < len(streams[a]) and (best is None or clock[a] < clock[best]) and ready(a, streams[a][pos[a]]):
                best = a
        if best is None:
            stuck = [f"{cta.agents[a]} at line {streams[a][pos[a]].line} ({streams[a][pos[a]].kind})"
                     for a in range(n) if pos[a] < len(streams[a])]
            if stuck:
                raise ReplayError("replay cannot proceed: " + "; ".join(stuck))
            break
        a = best
        e = streams[a][pos[a]]
        pos[a] += 1
        i, t = e.info, clock[a]
        k = e.kind
        if k == "tma_issue":
            start = max(t + tma["issue_cycles"], tma_free)
            tma_free = start + lat.tma_transfer(i["bytes"])
            land = tma_free + tma["latency_cycles"]
            clock[a] = t + tma["issue_cycles"]
            ph = mphase.setdefault((i["bar"], i["phase"]), [0, 1, 0.0, 0.0])
            ph[3] = max(ph[3], land)
            buf = _base(i["dst"].split("[")[0])
            tile = loaded[a].get(buf, 0)
            loaded[a][buf] = tile + 1
            loads.append((i["dst"], t, land))
            spans.append(Span(a, "async", "TMA", t, land, e.line, tile,
                              {"dst": i["dst"], "bytes": i["bytes"], "barrier": i["bar"], "phase": i["phase"],
                               "queued": round(start - t - tma["issue_cycles"], 1)}))
        elif k == "mbar_arrive":
            clock[a] = t + bar_p["mbarrier_arrive_cycles"]
            ph = mphase.setdefault((i["bar"], i["phase"]), [0, i["count"], 0.0, 0.0])
            ph[1] = i["count"]
            ph[0] += i["n"]
            ph[2] = max(ph[2], clock[a])
        elif k == "mbar_wait":
            done = 0.0
            if i["need"] >= 0:
                ph = mphase[(i["bar"], i["need"])]
                done = max(ph[2], ph[3])
            end = max(t, done) + bar_p["mbarrier_wait_cycles"]
            wait_span(a, e, t, end, i["bar"], barrier=i["bar"], phase=i["need"], parity=i["parity"])
            clock[a] = end
        elif k == "bar_arrive":
            clock[a] = t + bar_p["named_barrier_cycles"] * (not i["sync"])
            nb = named.setdefault((i["bar"], i["gen"]), [0, i["count"], []])
            nb[0] += i["n"]
            nb[2].append((a, clock[a] if not i["sync"] else t, i["sync"]))
            if not i["sync"] and a in turn_open:
                start, tb = turn_open.pop(a)
                turns.append((a, start, clock[a], tb))
        elif k == "bar_wait":
            _, _, arrivals = named[(i["bar"], i["gen"])]
            release = max(ta for _, ta, _ in arrivals)
            end = max(t, release) + bar_p["named_barrier_cycles"]
            others = [(ta, b) for b, ta, _ in arrivals if b != a]
            label = f"named barrier {i['bar']}"
            if others:
                tb, b = max(others)
                label = f"named barrier {i['bar']} (turn from {cta.agents[b]})"
                arrows.append((b, tb, a, end, f"bar {i['bar']} gen {i['gen']}"))
                turn_open[a] = (end, i["bar"])
            wait_span(a, e, t, end, label, barrier=f"named barrier {i['bar']}", phase=i["gen"])
            clock[a] = end
        elif k == "wgmma":
            issue = t + tc["issue_cycles"]
            start = max(issue, tc_free) if tc.get("sm_shared", True) else issue
            if inflight[a]:  # a warpgroup's wgmmas run in order
                start = max(start, inflight[a][-1][0])
            end = start + lat.wgmma_cycles(i["m"], i["n"], i["k"], i["dtype"])
            tc_free = max(tc_free, end)
            clock[a] = issue
            tile = qk[a] if i["op"] == "QK" else pv[a]
            if i["op"] == "QK":
                qk[a] += 1
            else:
                pv[a] += 1
            sp = Span(a, "async", i["op"], start, end, e.line, tile,
                      {"M": i["m"], "N": i["n"], "K": i["k"], "dtype": i["dtype"], "A": i["a"], "B": i["b"],
                       "issued": round(t, 1), "queued": round(start - issue, 1)})
            spans.append(sp)
            for r in (i["a"], i["b"]):
                if "_shared" in r:
                    reads.append((a, r, start, end))
            inflight[a].append((end, sp))
            inflight_max[a] = max(inflight_max[a], len(inflight[a]))
        elif k == "wgmma_wait":
            keep = i["keep"]
            wait_depth[a] = max(wait_depth[a], keep + 1)
            retire = inflight[a][:max(len(inflight[a]) - keep, 0)]
            del inflight[a][:len(retire)]
            done = max((end for end, _ in retire), default=0.0) + (tc["latency_cycles"] if retire else 0)
            end = max(t, done) + bar_p["wgmma_wait_cycles"]
            what = "+".join(f"{sp.kind}({sp.tile})" for _, sp in retire)
            for _, sp in retire:
                sp.info["retired"] = round(end, 1)
            wait_span(a, e, t, end, f"wgmma {what}" if what else "wgmma", waits_for=what)
            clock[a] = end
        elif k == "parallel":
            st = src.loops.get(e.line)
            fp, mufu, role = (st.fp, st.mufu, st.role) if st else (1, 0, classify(src.text(e.line)))
            el, smem = i["elems"], st.smem_bytes if st else 0
            compute(a, e, lat.compute_cycles(el * fp, el * mufu, smem_bytes=el * smem), role, elements=el,
                    ops=f"{fp} fp32 + {mufu} exp2 per element" + (f" + {smem} shared-memory bytes" if smem else ""))
        elif k == "reduce":
            el = i["elems"]
            compute(a, e, lat.compute_cycles(el, shuffles=2), "softmax", elements=el, reduce=i["op"])
        elif k == "copy":
            el, scopes = i["elems"], i["scopes"]
            if scopes.endswith("->global"):
                cyc = tma["issue_cycles"] + i["bytes"] / tma["store_bytes_per_cycle"]
                role = "epilogue"
            elif scopes.endswith("->shared"):
                cyc = lat.compute_cycles(el, smem_bytes=i["bytes"])
                role = "epilogue" if "O_" in i["dst"] or not cta.producers[a] else "other"
                role = "softmax" if i["dst"].startswith("P_shared") else role  # fp8's P, stored for its PV
            else:
                cvt = el if i["src"].split("[")[0] != i["dst"].split("[")[0] else 0
                cyc = lat.compute_cycles(el, cvt=cvt)
                role = classify(src.text(e.line))
            compute(a, e, cyc, role, elements=el, copy=f"{i['src']} -> {i['dst']}")
        elif k == "fill":
            compute(a, e, lat.compute_cycles(i["elems"]), "other", elements=i["elems"])
        elif k == "stamp":
            clock[a] = t + 2
        # tma_land: the replay computes land times itself
        times[a][pos[a] - 1] = (t, clock[a])

    total = max([sp.end for sp in spans] + clock + [0.0])
    return Timeline(cta.index, cta.agents, cta.producers, spans, arrows, turns, loads, reads, inflight_max,
                    wait_depth, total, times)


def summarize(tl: Timeline) -> dict:
    total = tl.total or 1.0
    tc_busy, reach = 0.0, 0.0  # the union of wgmma intervals (measured issue..retire intervals may overlap)
    for s0, s1 in sorted((sp.start, sp.end) for sp in tl.spans if sp.kind in ("QK", "PV")):
        if s1 > reach:
            tc_busy += s1 - max(s0, reach)
            reach = s1
    agents = []
    for a, name in enumerate(tl.agents):
        mine = [sp for sp in tl.spans if sp.agent == a]
        waits: dict = {}
        for sp in mine:
            if sp.kind == "wait":
                key = sp.info["on"].split(" (")[0]
                key = "wgmma" if key.startswith("wgmma") else _base(key)
                waits[key] = waits.get(key, 0.0) + sp.end - sp.start
        idle = sum(waits.values())
        busy = {kind: sum(sp.end - sp.start for sp in mine if sp.kind == kind and sp.row == "simt")
                for kind in ("softmax", "rescale", "epilogue", "other")}
        agents.append({"name": name, "producer": tl.producers[a], "idle": round(idle, 1),
                       "idle_fraction": round(idle / total, 4),
                       "waited_on": {k: round(v, 1) for k, v in sorted(waits.items(), key=lambda kv: -kv[1])},
                       "busy": {k: round(v, 1) for k, v in busy.items() if v}})
    tiles = max([sp.tile + 1 for sp in tl.spans if sp.kind == "QK"] + [1])
    return {"block": list(tl.index), "cycles": round(tl.total, 1), "tensor_core_busy": round(tc_busy / total, 4),
            "tiles": tiles, "cycles_per_tile": round(tl.total / tiles, 1), "agents": agents}
