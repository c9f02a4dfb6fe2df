"""The emulator's observer: what each agent (warpgroup) did, in program order, per CTA.

`Recorder` is set as `Runtime.trace` (attngen/emulator/driver.py); the emulator calls
`event(kind, line, **info)` at every synchronization, asynchronous issue and tile
statement (attngen/emulator/tlang.py). The recorder keeps plain, schedule-independent
facts (barrier names, phase and generation numbers, operand regions, element counts)
and no references to emulator objects, so a trace can be replayed, saved or compared.

Event kinds (`Event.kind`) and their `info`:

    tma_issue   bar, phase (the barrier phase the load completes with), dst, bytes
    tma_land    bar, phase, dst                      (recorded when that phase completes)
    mbar_arrive bar, phase (the phase arrived on), n (threads), count (expected arrivals)
    mbar_wait   bar, parity, need (the phase whose completion released it; -1: none)
    bar_arrive  bar (named barrier id), gen, n, count, sync (True: bar.sync, then bar_wait)
    bar_wait    bar, gen
    wgmma       a, b, c (operand regions), m, n, k, dtype, op (QK, PV or MMA)
    wgmma_wait  keep
    parallel    extents, elems                        (one T.Parallel loop)
    reduce      op, elems
    copy        src, dst, elems, scopes ("fragment->shared", "shared->global", ...)
    fill        dst, elems
    stamp       slot                                  (instrumented source only)
"""

from __future__ import annotations

import dataclasses
import math

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3": 1, "float8_e5m2": 1, "float8_e4m3fn": 1, "int64": 8,
            "int32": 4}


@dataclasses.dataclass
class Event:
    agent: int
    kind: str
    line: int | None
    info: dict


@dataclasses.dataclass
class CTATrace:
    index: tuple
    agents: list  # names, in warpgroup order
    producers: list  # bool per agent
    events: list = dataclasses.field(default_factory=list)

    def of(self, agent: int) -> list:
        return [e for e in self.events if e.agent == agent]


def _region(r) -> str:
    return str(r)


def _elems(r) -> int:
    return math.prod(r.shape) if r.shape else 1


class Recorder:
    """Records the events of the CTAs it is asked for (`blocks`: a set of indices, or None for all)."""

    def __init__(self, rt=None, blocks=None):
        self.rt = rt
        self.blocks = blocks
        self.ctas: list[CTATrace] = []
        self.grid = None
        self.cur: CTATrace | None = None

    def attach(self, rt):
        self.rt = rt
        rt.trace = self
        return self

    # -- called by the driver --------------------------------------------------------------
    def begin_cta(self, index, grid, names, roles) -> bool:
        """A new CTA starts; False: do not run it (not sampled)."""
        self.grid = tuple(grid)
        if self.blocks is not None and tuple(index) not in self.blocks:
            self.cur = None
            return False
        self.cur = CTATrace(tuple(index), list(names), list(roles))
        self.ctas.append(self.cur)
        return True

    # -- called by tlang -------------------------------------------------------------------
    def event(self, kind, line, **info):
        cur = self.cur
        if cur is None:
            return True
        agent = self.rt.agent.index
        get = getattr(self, "_" + kind, None)
        cur.events.append(Event(agent, kind, line, get(info) if get else info))
        return True

    @staticmethod
    def _tma_issue(i):
        dst, bar = i["dst"], i["bar"]
        return {"bar": bar.name, "phase": bar.phase, "dst": _region(dst),
                "bytes": _elems(dst) * ITEMSIZE.get(dst.buf.dtype, 2)}

    @staticmethod
    def _tma_land(i):
        return {"bar": i["bar"].name, "phase": i["phase"], "dst": ", ".join(str(w) for w in i["op"].writes)}

    @staticmethod
    def _mbar_arrive(i):
        bar = i["bar"]
        return {"bar": bar.name, "phase": bar.phase, "n": int(i["n"]), "count": bar.count}

    @staticmethod
    def _mbar_wait(i):
        bar = i["bar"]
        # wait_parity(p) returned, so the current phase has parity != p and the phase before it
        # (parity p) is the completion it needed: -1 on a fresh barrier (the first "empty" waits).
        return {"bar": bar.name, "parity": i["parity"], "need": bar.phase - 1}

    @staticmethod
    def _bar_arrive(i):
        return {"bar": i["bar"].id, "gen": i["gen"], "n": int(i["n"]), "count": int(i["count"]), "sync": i["sync"]}

    @staticmethod
    def _bar_wait(i):
        return {"bar": i["bar"].id, "gen": i["gen"]}

    @staticmethod
    def _wgmma(i):
        a, b, c = i["a"], i["b"], i["c"]
        # QK reads K; PV reads V, or fp8's V^T with P from shared memory (P_shared)
        kind = "QK" if _region(b).startswith("K_shared") else "PV"
        return {"a": _region(a), "b": _region(b), "c": _region(c), "m": int(i["m"]), "n": int(i["n"]), "k": int(i["k"]),
                "dtype": b.buf.dtype, "op": kind}

    @staticmethod
    def _parallel(i):
        ext = tuple(int(e) for e in i["extents"])
        return {"extents": ext, "elems": math.prod(ext)}

    @staticmethod
    def _copy(i):
        src, dst = i["src"], i["dst"]
        return {"src": _region(src), "dst": _region(dst), "elems": _elems(dst),
                "scopes": f"{src.buf.scope}->{dst.buf.scope}", "bytes": _elems(dst) * ITEMSIZE.get(dst.buf.dtype, 4)}

    @staticmethod
    def _fill(i):
        return {"dst": _region(i["dst"]), "elems": _elems(i["dst"])}
