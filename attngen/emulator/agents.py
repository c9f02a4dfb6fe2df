"""Agents (warpgroups), their scheduler, and the two kinds of barrier they meet at.

Each warpgroup of a CTA is an agent: a Python thread running the kernel body. Exactly one
holds the baton at a time; it hands it over only at synchronization points (barrier
arrive/wait, named barriers, wgmma issue/wait, TMA issue), where the scheduler picks the
next runnable agent with a seeded RNG under a policy:

- "random":          any runnable agent, uniformly;
- "producer-first":  the producer whenever it can move, so it runs as far ahead as the
                     barriers allow (stresses stage reuse);
- "consumers-first": consumers whenever one can move; the producer only when all are stuck
                     (stresses consumers racing ahead of loads).

When no agent can move and some have not finished, that is a deadlock; the report lists
every agent's line and what it waits for.
"""

from __future__ import annotations

import ctypes
import random
import threading

import numpy as np

from attngen.emulator.clocks import advance, join
from attngen.emulator.errors import Abort, DeadlockError, KernelError
from attngen.hw import WARPGROUP_THREADS

WARPGROUP = WARPGROUP_THREADS  # threads per agent (one warpgroup)
POLICIES = ("random", "producer-first", "consumers-first")
STALL_SECONDS = 300  # one CTA running this long without a hand-over is stuck, not slow


class MBarrier:
    """An mbarrier: an expected arrival count, a transaction count and a phase number (starts at 0).

    A phase completes when its pending arrivals reach 0 *and* its transaction count is 0;
    arrivals beyond the count go to the next phase (each thread arrives on its own). A TMA
    load adds its box's bytes (expect_tx) and its completion removes them (complete_tx).
    `wait_parity(p)` returns once the phase with parity p has completed, i.e. it blocks
    while the *current* phase has parity p: on a fresh barrier (phase 0) a wait on parity 1
    returns at once, a wait on parity 0 blocks until phase 0 completes.

    For happens-before, `vc` joins the clock of every arrival (arrivals are read-modify-writes
    of one object, so a later phase's waiters see earlier arrivals too); when a phase
    completes, `comp` (this barrier's clock component) becomes the number of completed
    phases and `done_vc` keeps the clock that a waiter acquires.
    """

    __slots__ = ("name", "count", "phase", "pending", "tx", "loads", "comp", "vc", "done_vc")

    def __init__(self, name: str, count: int, comp: int = -1):
        if count < 1:
            raise KernelError(f"barrier {name} expects {count} arrivals: must be positive")
        self.name, self.count, self.phase, self.pending, self.tx = name, count, 0, count, 0
        self.loads = []  # (phase, op) of TMA loads completing on this barrier
        self.comp, self.vc, self.done_vc = comp, [], None

    def arrive(self, n: int, vc=None) -> int:
        """Add n arrivals (releasing clock vc); return how many phases completed."""
        if vc is not None:
            join(self.vc, vc)
        done = 0
        while n > 0:
            if self.pending == 0:
                raise KernelError(f"{n} more arrival(s) on {self.name} while its phase {self.phase} still waits "
                                  f"for {self.tx} transaction bytes (the pending arrival count would go below zero)")
            take = min(n, self.pending)
            self.pending -= take
            n -= take
            if self.pending == 0 and self.tx == 0:
                self._complete()
                done += 1
        return done

    def expect_tx(self, nbytes: int):
        self.tx += nbytes

    def complete_tx(self, nbytes: int) -> int:
        """The TMA engine wrote nbytes; return how many phases completed (0 or 1)."""
        if nbytes > self.tx:
            raise KernelError(f"{self.name}: {nbytes} transaction bytes completed but only {self.tx} expected")
        self.tx -= nbytes
        if self.pending == 0 and self.tx == 0:
            self._complete()
            return 1
        return 0

    def _complete(self):
        self.phase += 1
        self.pending = self.count
        if self.comp >= 0:
            advance(self.vc, self.comp, self.phase)
        self.done_vc = list(self.vc)

    def blocks(self, parity: int) -> bool:
        return self.phase % 2 == parity

    def state(self) -> str:
        tx = f", {self.tx} transaction bytes outstanding" if self.tx else ""
        return (f"now in phase {self.phase} (parity {self.phase % 2}), "
                f"{self.count - self.pending} of {self.count} arrivals{tx}")


class NamedBarrier:
    """bar.sync / bar.arrive: arrivals count across agents; at n it releases its waiters and resets.

    `vc` joins the clocks of the current generation's arrivals; `released_vc[g]` is what the
    syncers released by generation g acquire (bar.arrive only contributes to it).
    """

    __slots__ = ("id", "arrived", "expected", "generation", "arrivers", "vc", "released_vc")

    def __init__(self, bar_id: int):
        self.id, self.arrived, self.expected, self.generation = bar_id, 0, None, 0
        self.arrivers = []  # who arrived in the current generation
        self.vc, self.released_vc = [], {}

    def arrive(self, n: int, expected: int, who=None, vc=None) -> list:
        """Add n arrivals; return the participants of a release (empty if none happened)."""
        if expected < 1:
            raise KernelError(f"named barrier {self.id} used with thread count {expected}")
        if self.arrived and self.expected != expected:
            raise KernelError(f"named barrier {self.id} used with thread counts {self.expected} and {expected} at once")
        self.expected = expected
        self.arrived += n
        self.arrivers.append(who)
        if vc is not None:
            join(self.vc, vc)
        released = []
        while self.arrived >= expected:
            self.arrived -= expected
            self.generation += 1
            self.released_vc[self.generation] = self.vc
            released, self.arrivers = self.arrivers, []
            self.vc = []
            if self.arrived:  # the rest of this call's threads start the next generation
                self.arrivers.append(who)
                if vc is not None:
                    self.vc = list(vc)
        return released

    def state(self) -> str:
        return f"named barrier {self.id} to release ({self.arrived} of {self.expected} threads arrived)"


class Agent:
    """One warpgroup of the CTA being emulated."""

    def __init__(self, index: int, name: str, is_producer: bool):
        self.index, self.name, self.is_producer = index, name, is_producer
        self.lanes = np.arange(WARPGROUP * index, WARPGROUP * (index + 1))
        self.active = [np.ones(WARPGROUP, bool)]  # stack of "which threads run this statement"
        self.nthreads = WARPGROUP
        self.gate = threading.Semaphore(0)
        self.done = False
        self.waiting = None  # (ready(), describe(), line) while blocked
        self.wgmma = []  # this warpgroup's in-flight wgmma ops, oldest first
        self.alloc_seen = {}  # alloc site -> times executed: the n-th execution names the n-th buffer
        self.line = None
        self.stores = []  # in-flight asynchronous TMA stores (T.tma_copy to global), oldest first
        self.cta = None  # a concurrent launch: the block this warpgroup belongs to (driver.CTA)
        # happens-before state (hazards.Tracker sets the components)
        self.comp = self.wg_comp = self.store_comp = self.bulk_comp = -1
        self.vc = []
        self.wg_issued = self.store_issued = 0
        self.bulk_issued = 0  # bulk groups committed (TMA stores, reduce-adds): their global writes' sequence
        self.selfsync = 0  # own clock covered by a synchronization this warpgroup acquired (proxy rule)
        self.unfenced = []  # generic shared writes not yet followed by T.fence_proxy_async()

    def push_active(self, mask):
        self.active.append(mask)
        self.nthreads = int(mask.sum())

    def pop_active(self):
        self.active.pop()
        self.nthreads = int(self.active[-1].sum())


class Scheduler:
    """Runs a CTA's agents one at a time, switching only at synchronization points."""

    def __init__(self, agents, policy: str, rng: random.Random, describe_line):
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.agents, self.policy, self.rng, self.describe_line = agents, policy, rng, describe_line
        self.tls = threading.local()
        self.error = None
        self.aborted = False
        self.main_gate = threading.Semaphore(0)
        self.trace = []  # (agent index, line) at every hand-over: the schedule, for determinism checks
        self.context = ""
        self.on_finish = None  # agent -> None; may raise EmulationError (end-of-warpgroup checks)
        self.on_resume = None  # agent -> None: the agent takes the baton (a concurrent launch switches blocks)

    # -- the running agent ---------------------------------------------------
    @property
    def agent(self) -> Agent:
        return self.tls.agent

    def run(self, body, wrap_error):
        """Run body(agent) on every agent until all finish; re-raise the first failure."""
        threads = [threading.Thread(target=self._main, args=(a, body, wrap_error), daemon=True,
                                    name=f"attngen-{a.name}") for a in self.agents]
        for t in threads:
            t.start()
        first = self._choose()
        self._hand(first, None)
        if not self.main_gate.acquire(timeout=STALL_SECONDS):
            # An agent runs code that never reaches a synchronization point (an endless loop?).
            # Python cannot stop a thread: mark the run aborted so it ends at its next sync point.
            stuck = next((a for a in self.agents if a.index == self.trace[-1][0]), None)
            self._fail(KernelError(f"KERNEL ERROR: no synchronization point reached for {STALL_SECONDS} s; "
                                   f"{stuck.name if stuck else 'an agent'} last synchronized at "
                                   f"{self.describe_line(stuck.line if stuck else None)}\n  where: {self.context}"))
            for t in threads:  # stop the runaway thread (it would otherwise spin, holding the GIL, forever)
                if t.is_alive():
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(Abort))
                    t.join(timeout=5)
            raise self.error
        for t in threads:
            t.join(timeout=10)
        if self.error is not None:
            raise self.error

    def _main(self, agent, body, wrap_error):
        self.tls.agent = agent
        agent.gate.acquire()
        if self.aborted:
            return
        if self.on_resume is not None:
            self.on_resume(agent)
        try:
            with np.errstate(all="ignore"):  # inf/NaN arithmetic is the kernel's business; checks catch it
                body(agent)
            if self.on_finish is not None:
                self.on_finish(agent)
            agent.done = True
            nxt = self._choose()
            if nxt is None:
                if all(a.done for a in self.agents):
                    self.main_gate.release()
                else:
                    self._fail(DeadlockError(self.deadlock_report()))
            else:
                self._hand(nxt, agent)
        except Abort:
            return
        except Exception as e:  # EmulationError, or an ordinary Python error in the emitted code
            self._fail(wrap_error(e))

    def _fail(self, err):
        if self.error is None:
            self.error = err
        self.aborted = True
        for a in self.agents:
            a.gate.release()
        self.main_gate.release()

    def _runnable(self, a: Agent) -> bool:
        return not a.done and (a.waiting is None or a.waiting[0]())

    def _choose(self):
        cands = [a for a in self.agents if self._runnable(a)]
        if not cands:
            return None
        if self.policy == "producer-first":
            pick = [a for a in cands if a.is_producer] or cands
        elif self.policy == "consumers-first":
            pick = [a for a in cands if not a.is_producer] or cands
        else:
            pick = cands
        return pick[0] if len(pick) == 1 else self.rng.choice(pick)

    def _hand(self, nxt: Agent, me):
        self.trace.append((nxt.index, nxt.line))
        if nxt is not me:
            nxt.gate.release()

    # -- called by the running agent -----------------------------------------
    def pause(self, line=None):
        """A synchronization point: let the scheduler pick who runs next (maybe us)."""
        me = self.agent
        me.line = line if line is not None else me.line
        nxt = self._choose()
        if nxt is None:
            self._fail(DeadlockError(self.deadlock_report()))
            raise Abort()
        if nxt is me:
            return
        self._hand(nxt, me)
        me.gate.acquire()
        if self.aborted:
            raise Abort()
        if self.on_resume is not None:
            self.on_resume(me)

    def block(self, ready, describe, line):
        """Wait until ready() holds; describe() says what for (deadlock reports)."""
        if ready():
            return
        me = self.agent
        me.waiting = (ready, describe, line)
        try:
            while not ready():
                self.pause(line)
        finally:
            me.waiting = None

    def deadlock_report(self) -> str:
        lines = [f"DEADLOCK: every agent still running is blocked ({self.context})"]
        for a in self.agents:
            if a.done:
                lines.append(f"  {a.name}: finished")
            elif a.waiting is not None:
                _, describe, line = a.waiting
                lines.append(f"  {a.name}: blocked at {self.describe_line(line)}")
                lines.append(f"      waits for {describe()}")
            else:
                lines.append(f"  {a.name}: runnable at {self.describe_line(a.line)}")
        return "\n".join(lines)
