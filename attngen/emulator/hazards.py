"""Happens-before race detection: vector clocks over every synchronization of one CTA, and
the unordered CTAs of one launch against each other in global memory (`Launch`).

A *race* is a pair of accesses to overlapping bytes of a buffer, at least one a write, that
no chain of synchronization orders. Whether such a chain exists does not depend on how the
scheduler interleaved the agents (the kernels' control flow depends only on the shape), so
a race is reported in every schedule, not only in one that happens to interleave the two.

Clocks (clocks.py) have one component per

- agent (warpgroup): its program order; it ticks after each release, so accesses made
  after a release are not covered by it;
- warpgroup's wgmma stream: how many of its wgmmas `T.wait_wgmma` has retired (they retire
  oldest first, so a count suffices);
- warpgroup's stream of asynchronous TMA stores (`T.tma_copy` to global): how many
  `T.tma_store_wait` has retired;
- mbarrier: how many of its phases have completed; a TMA load completes with a phase.

Releases publish the agent's clock; acquires join a published clock into the agent's:

- `T.mbarrier_arrive`: release into the barrier (its clock is the join of every arrival so
  far: arrivals are read-modify-writes of one object). When a phase completes, the barrier
  records its clock with the phase count; `T.mbarrier_wait_parity` acquires the clock of
  the latest completed phase (nothing on a fresh barrier).
- `T.sync_threads(id, n)` (bar.sync): release, and acquire the join of every arrival of the
  generation that releases it; `T.named_barrier_arrive` (bar.arrive) only releases.
- `T.wait_wgmma(n)` acquires the retirement of all but the n newest wgmmas of the warpgroup.

Asynchronous operations are agents of their own whose accesses happen somewhere between
their issue and the event that completes them. An access record carries that completion
as an epoch (component, value): a wgmma's is (its warpgroup's wgmma stream, its sequence
number); a TMA load's is (its mbarrier, the phase count after the phase it completes in).
The issuing agent's clock at issue orders everything before the issue before the access.

Every access is checked against the records of earlier accesses to the buffer: it is
ordered after a record iff its agent's clock (for an asynchronous access: the issuer's
clock at issue) has [comp] >= clock. Records that every agent still able to touch the
buffer has already observed can never race again and are pruned.

What counts as an access: ordinary code (the generic proxy) on shared buffers, fragments
and global tensors; TMA loads (writes of shared, reads of global) and TMA stores and
reduce-adds (reads of shared, writes of global); wgmma operands (reads) and accumulators
(read-modify-write); `T.atomic_add` (an atomic read-modify-write). An element access under a
per-element `if` covers the box around the elements its mask selects. Chained wgmmas of one
warpgroup on the same accumulator are ordered by the hardware and exempt, and so are two
atomics: they commute (an atomic still races with a plain load or store of its bytes).

A bulk store's global writes (a TMA store, a TMA reduce-add) complete at an unknown time:
`T.tma_store_wait(n)` (`.read`, the default, and what T.copy and T.atomic_add(use_tma=True)
emit) waits for the shared-memory read only; only `T.tma_store_wait(n, read=False)` orders
the writes (a component per warpgroup: its bulk groups whose writes completed).

An operation issued by fewer of a warpgroup's threads than made an ordinary access of the same
bytes (a TMA load one warp issues into a tile all four warps read) is ordered after the other
warps' part of that access only by a synchronization of the warpgroup after it: warps are not
in lockstep, and program order is one thread's.

One elected thread issues a TMA store or reduce-add that waits for its own read (T.copy to
global, T.atomic_add(use_tma=True): TileLang 0.1.15 lowers both to store + commit +
`tma_store_wait<0, read>` in that thread). Its read of shared memory is an *elected* record:
the warpgroup's other threads are ordered after it only by a synchronization that includes
the warpgroup's own release after the statement (a bar.sync of its threads), as for fences.

Across CTAs (`Launch`): the CTAs of one launch are unordered, so two of them touching the
same global element, at least one access a plain write (or a plain read against the other's
atomic), race whatever order they run in. Each CTA's global accesses are checked against
the elements earlier CTAs touched (a map per tensor and kind of access), and merged into
those maps when the CTA ends; the pair is found whichever of the two runs first.

Proxy fences (`proxy_fences=True`): shared memory written by ordinary code may be read by
the async proxy (a TMA store, a wgmma operand) only if the writers then executed
`T.fence_proxy_async()` and a barrier orders that fence before the read. For a reader in
another warpgroup that is the clock rule applied to the fence; within the writing
warpgroup (one elected thread issues a TMA store) the warpgroup must have acquired a
synchronization that includes its own post-fence release (e.g. a bar.sync of its threads).
"""

from __future__ import annotations

import numpy as np

from attngen.emulator.clocks import advance, get, join
from attngen.emulator.errors import HazardError

PRUNE_AT = 16  # a buffer's history is pruned when it grows past this (or twice what survived)
ORDINARY = "ordinary code"
ATOMIC = "atomic add"
REDUCE_ADD = "TMA reduce-add"


class Op:
    """One asynchronous operation in flight: its effect is applied when it completes."""

    __slots__ = ("kind", "agent", "line", "reads", "writes", "action", "done", "comp", "clock", "bar")

    def __init__(self, kind, agent, line, reads, writes, action):
        self.kind, self.agent, self.line, self.reads, self.writes = kind, agent, line, reads, writes
        self.action = action  # applies the effect (wgmma: the product; TMA: the data) when it completes
        self.done = False
        self.comp, self.clock, self.bar = -1, 0, None  # completion epoch; TMA loads: their mbarrier


class Access:
    """One access in a buffer's history."""

    __slots__ = ("box", "write", "comp", "clock", "agent", "kind", "line", "op", "acc", "generic", "fence", "threads",
                 "atomic", "elected")

    def __init__(self, box, write, comp, clock, agent, kind, line, op=None, acc=False, generic=False, threads=0,
                 atomic=False, elected=False):
        self.box, self.write, self.comp, self.clock = box, write, comp, clock
        self.agent, self.kind, self.line, self.op = agent, kind, line, op  # agent: who made or issued it
        self.acc = acc  # a wgmma accumulator access (chained wgmmas on it are ordered)
        self.generic = generic  # an ordinary (generic-proxy) write to shared memory
        self.fence = None  # generic writes: the writer's clock at its next T.fence_proxy_async()
        self.threads = threads
        self.atomic = atomic  # an atomic read-modify-write (write is True): atomics commute with each other
        self.elected = elected  # made by one elected thread: its warpgroup's other threads need a bar.sync after it


BULK = Op("bulk store", None, None, [], [], None)  # marks a bulk store's global writes (in flight until a non-.read wait)


def box_index(box) -> tuple:
    lo, hi = box
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def overlap(a, b) -> bool:
    (alo, ahi), (blo, bhi) = a, b
    return all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(alo, ahi, blo, bhi))


def box_text(box) -> str:
    lo, hi = box
    return "[" + ", ".join(f"{a}:{b}" if b - a != 1 else f"{a}" for a, b in zip(lo, hi)) + "]"


def box_name(buf, box) -> str:
    """K_shared[1] for a whole stage, p_reg for a whole fragment, else the box."""
    lo, hi = box
    parts = [str(a) if b - a == 1 else (":" if (a, b) == (0, n) else f"{a}:{b}") for a, b, n in zip(lo, hi, buf.shape)]
    while parts and parts[-1] == ":":
        parts.pop()
    return f"{buf.name}[{', '.join(parts)}]" if parts else buf.name


class Tracker:
    """Clocks, access histories and in-flight operations of one CTA."""

    enabled = True  # tests switch race detection off to see what the races do to the numbers

    def __init__(self, agents, current, line, launch=None):
        self.agents = agents
        self.current = current  # () -> the running agent
        self.line = line  # () -> the emitted line being executed
        self.describe_line = lambda line: f"line {line}"
        self.context = ""  # CTA and schedule, appended to reports
        self.proxy_fences = False
        self.launch = launch  # the launch's cross-CTA record of global accesses (None: not checked)
        self.ops: list[Op] = []  # in flight (effects not applied yet)
        self.hist: dict = {}  # Buffer -> [Access] that some agent able to touch it has not observed
        self.written: set = set()  # buffers with a write in their history (a read need not scan the others)
        self.limit: dict = {}
        self.components: list[str] = []
        for a in agents:
            a.comp = self.component(a.name)
        for a in agents:
            a.wg_comp = self.component(f"wgmmas of {a.name} retired")
            a.store_comp = self.component(f"TMA stores of {a.name} retired")
            a.bulk_comp = self.component(f"global writes of the bulk stores of {a.name} completed")
        for a in agents:
            a.vc = [0] * len(self.components)
            a.vc[a.comp] = 1

    def component(self, name: str) -> int:
        self.components.append(name)
        return len(self.components) - 1

    # -- synchronization ------------------------------------------------------------
    @staticmethod
    def released(agent):
        """The agent has published its clock (an arrive): later events are not covered by it."""
        agent.vc[agent.comp] += 1

    @staticmethod
    def acquire(agent, vc):
        if vc:
            join(agent.vc, vc)
            own = get(vc, agent.comp)
            if own > agent.selfsync:  # a synchronization that includes this warpgroup's own release
                agent.selfsync = own

    def retire(self, agent, comp, upto, bufs=()):
        """wait_wgmma / tma_store_wait: the agent acquires its first `upto` operations of a stream."""
        advance(agent.vc, comp, upto)
        for buf in bufs:  # fragments: only their owner can race with them, and it now has
            if buf.scope == "fragment" and buf in self.hist:
                self._prune(buf, self.hist[buf])

    def fence(self, agent):
        """T.fence_proxy_async(): the warpgroup's earlier generic shared writes are fenced now."""
        now = agent.vc[agent.comp]
        for r in agent.unfenced:
            r.fence = now
        agent.unfenced = []

    # -- in-flight operations (their effects) ------------------------------------------
    def add(self, op: Op):
        self.ops.append(op)

    def remove(self, op: Op):
        op.done = True
        self.ops.remove(op)

    # -- accesses ---------------------------------------------------------------------------
    def check(self, buf, box, write: bool, by: str = ORDINARY, index=None, atomic: bool = False, elected: bool = False):
        """An access by the running agent's own threads: ordinary code, a synchronous copy (`by`), an
        atomic (`atomic`: a write that commutes with other atomics), or one elected thread's access
        (`elected`). `index`: a global access's exact numpy index (default: the box), for the
        cross-CTA check."""
        if not self.enabled:
            return
        hist = self.hist.get(buf)
        scope = buf.scope
        if scope == "fragment":
            # A fragment is touched only by its warpgroup, whose own accesses are in program
            # order: only its in-flight wgmmas (recorded) can race with them. Nothing to record.
            if hist:
                agent = self.current()
                self._against(hist, buf, box, write, agent.vc, agent, by, None, None)
            return
        agent = self.current()
        line = self.line()
        if hist and (write or buf in self.written):
            self._against(hist, buf, box, write, agent.vc, agent, by, line, None, atomic=atomic)
        generic = write and scope == "shared" and not elected  # generic-proxy writes (atomics too)
        rec = Access(box, write, agent.comp, agent.vc[agent.comp], agent, by, line, generic=generic,
                     threads=1 if elected else agent.nthreads, atomic=atomic, elected=elected)
        if not self._coalesce(buf, rec):
            self._record(buf, rec)
            if generic:
                agent.unfenced.append(rec)
        if scope == "global" and self.launch is not None:
            self.launch.access(self, buf, box_index(box) if index is None else index, write, atomic, agent, by, line)

    def bulk_write(self, region, agent, seq: int, kind: str, op=None, atomic: bool = False):
        """The global writes of a bulk store (TMA store, reduce-add) by `agent`, its `seq`-th bulk
        group: they complete only at a T.tma_store_wait(read=False) (the writes' component)."""
        if not self.enabled:
            return
        cl = region.clipped_box()
        if cl is None:
            return
        buf, line = region.buf, op.line if op is not None else self.line()
        hist = self.hist.get(buf)
        if hist:
            self._against(hist, buf, cl, True, agent.vc, agent, kind, line, op, atomic=atomic)
        self._record(buf, Access(cl, True, agent.bulk_comp, seq, agent, kind, line, op or BULK, atomic=atomic))
        if self.launch is not None:
            self.launch.access(self, buf, box_index(cl), True, atomic, agent, kind, line)

    def global_read(self, region, agent, kind: str, op=None):
        """A TMA load's read of global memory (the part inside the tensor): ordinary epoch, or the op's."""
        if not self.enabled:
            return
        cl = region.clipped_box()
        if cl is None:
            return
        buf = region.buf
        line = op.line if op is not None else self.line()
        hist = self.hist.get(buf)
        if hist and buf in self.written:
            self._against(hist, buf, cl, False, agent.vc, agent, kind, line, op)
        comp, clock = (op.comp, op.clock) if op is not None else (agent.comp, agent.vc[agent.comp])
        rec = Access(cl, False, comp, clock, agent, kind, line, op)
        if op is not None or not self._coalesce(buf, rec):
            self._record(buf, rec)
        if self.launch is not None:
            self.launch.access(self, buf, box_index(cl), False, False, agent, kind, line)

    def issue(self, op: Op, reads=(), writes=(), acc=None):
        """Check and record the accesses of an asynchronous operation issued now by op.agent."""
        if not self.enabled:
            return
        agent = op.agent
        vc = agent.vc  # the issue: everything ordered before it is ordered before the accesses
        for regions, write in ((reads, False), (writes, True)):
            for r in regions:
                buf = r.buf
                if buf.scope == "global":
                    continue
                is_acc = r is acc
                hist = self.hist.get(buf)
                if hist:
                    self._against(hist, buf, r.box, write, vc, agent, op.kind, op.line, op, is_acc, issuers=agent.nthreads)
                self._record(buf, Access(r.box, write, op.comp, op.clock, agent, op.kind, op.line, op, is_acc))

    def _against(self, hist, buf, box, write, vc, agent, kind, line, op, acc=False, atomic=False, issuers=None):
        n = len(vc)
        for r in hist:
            if not (write or r.write):
                continue
            if atomic and r.atomic:
                continue  # atomics commute
            c = r.comp
            if c < n and vc[c] >= r.clock:
                own = agent is r.agent and agent.selfsync < r.clock  # not covered by a bar.sync of the warpgroup
                # an operation issued by fewer threads (a TMA warp) than made an ordinary access of its
                # warpgroup is ordered after the other warps' part of it only by such a bar.sync
                others = issuers is not None and r.op is None and r.threads > issuers
                if not (own and (r.elected or others)):
                    continue  # r happens-before this access
            if not overlap(box, r.box):
                continue
            if acc and r.acc and op is not None and r.comp == op.comp:
                continue  # chained wgmmas of one warpgroup on one accumulator
            if line is None:
                line = self.line()
            raise HazardError(self.report(buf, box, write, agent, kind, line, op, r))

    def _coalesce(self, buf, rec) -> bool:
        """A repeat of the agent's last access to the same box replaces it (a later access that
        is unordered with the old one is unordered with the new one too)."""
        hist = self.hist.get(buf)
        if not hist:
            return False
        last = hist[-1]
        if (last.agent is rec.agent and last.op is None and last.kind == rec.kind and last.box == rec.box
                and last.fence is None and last.generic == rec.generic and (rec.write or not last.write)
                and last.atomic == rec.atomic and last.elected == rec.elected):
            last.clock, last.line, last.write, last.threads = rec.clock, rec.line, rec.write, rec.threads
            return True
        return False

    def _record(self, buf, rec):
        if rec.write:
            self.written.add(buf)
        hist = self.hist.get(buf)
        if hist is None:
            self.hist[buf] = [rec]
            return
        hist.append(rec)
        if len(hist) > self.limit.get(buf, PRUNE_AT):
            self._prune(buf, hist)

    def _prune(self, buf, hist):
        """Drop records that every agent still able to touch the buffer has observed."""
        if buf.scope == "fragment":
            who = [buf.owner]
        else:
            who = [a for a in self.agents if not a.done]
        keep = [r for r in hist if not self._seen_by_all(r, who)]
        if keep:
            hist[:] = keep
            self.limit[buf] = max(PRUNE_AT, 2 * len(keep))
        else:
            del self.hist[buf]

    @staticmethod
    def _seen_by_all(r, who) -> bool:
        if r.generic:  # must stay until its fence is ordered before everyone (proxy rule)
            if r.fence is None:
                return False
            return all((a.selfsync if a is r.agent else get(a.vc, r.comp)) >= r.fence for a in who)
        if r.elected:
            return all((a.selfsync if a is r.agent else get(a.vc, r.comp)) >= r.clock for a in who)
        return all(get(a.vc, r.comp) >= r.clock for a in who)

    # -- generic proxy -> async proxy ---------------------------------------------------
    def check_async_read(self, region, by: str, reader):
        """A TMA store or wgmma reads shared memory: ordinary writes to it must be fenced and ordered."""
        if not (self.proxy_fences and self.enabled):
            return
        hist = self.hist.get(region.buf)
        if not hist:
            return
        vc = reader.vc
        for r in hist:
            if not r.generic or not overlap(r.box, region.box):
                continue
            if get(vc, r.comp) < r.clock:
                continue  # not ordered at all: a race, which the race check reports
            if r.fence is not None and (reader.selfsync if r.agent is reader else get(vc, r.comp)) >= r.fence:
                continue
            rline = self.line()
            missing = "a named barrier after its fence" if r.fence is not None else "T.fence_proxy_async() followed by a named barrier"
            why = ("(one elected thread issues the async read; the other writers are not ordered before it)"
                   if r.agent is reader else
                   f"({reader.name} has not synchronized with {r.agent.name} after its fence)")
            raise HazardError("\n".join([
                f"HAZARD: {reader.name} ({by}) reads {region} through the async proxy, but ordinary code wrote it "
                f"without {missing}",
                f"  buffer:    {region.buf.label}; written {region.buf.name}{box_text(r.box)}",
                f"  access:    {reader.name}, {self.describe_line(rline)}",
                f"  written:   by {r.threads} threads of {r.agent.name}, {self.describe_line(r.line)}",
                f"             {why}",
                f"  where:     {self.context}",
            ]))

    # -- reports ------------------------------------------------------------------------------
    def report(self, buf, box, write, agent, kind, line, op, r) -> str:
        verb = "writes" if write else "reads"
        theirs = "writes" if r.write else "reads"
        if r.op is not None:
            other = f"the in-flight {r.kind} of {r.agent.name}"
            other_line = f"  in flight: {r.kind} issued by {r.agent.name}, {self.describe_line(r.line)}"
            why = self._pending(r)
        else:
            other = f"{r.agent.name} ({r.kind})"
            other_line = f"  other:     {r.agent.name} ({r.kind}), {self.describe_line(r.line)}"
            if r.elected and r.agent is agent:
                why = (f"one elected thread of {agent.name} made it (and waited for it); the warpgroup's other "
                       f"threads are ordered after it only by a synchronization of the warpgroup after it "
                       f"(a T.sync_threads of its threads); a T.tma_store_wait does not order them")
            elif op is not None and r.agent is agent:
                why = (f"{r.threads} threads of {agent.name} made it; the {agent.nthreads} that issue this {kind} "
                       f"are ordered after the other warps' part only by a synchronization of the warpgroup after it "
                       f"(a T.sync_threads of its threads)")
            elif op is not None:
                why = f"{r.agent.name}'s access does not happen-before the issue of this {kind}"
            else:
                why = f"no synchronization orders {r.agent.name}'s access before this one"
        return "\n".join([
            f"HAZARD: {agent.name} ({kind}) {verb} {box_name(buf, box)} while {other} {theirs} it",
            f"  buffer:    {buf.label}; {'in flight on' if r.op is not None else 'other access covers'} "
            f"{box_name(buf, r.box)}, access covers {buf.name}{box_text(box)}",
            f"  access:    {agent.name}, {self.describe_line(line)}",
            other_line,
            f"             ({why})",
            "             (neither access happens-before the other: a race in every schedule)",
            f"  where:     {self.context}",
        ])

    @staticmethod
    def _pending(r) -> str:
        if r.comp == r.agent.bulk_comp:
            return (f"its global writes complete at an unknown time: only a T.tma_store_wait(n, read=False) of "
                    f"{r.agent.name} orders them (T.tma_store_wait's default .read form, which T.copy and "
                    f"T.atomic_add(use_tma=True) emit, waits for the shared-memory read only)")
        if r.kind == "wgmma":
            return f"not retired first: no T.wait_wgmma of {r.agent.name} that retires it happens-before this access"
        if r.kind == "TMA load":
            bar = r.op.bar
            state = "has completed" if bar is not None and bar.phase >= r.clock else "has not completed yet"
            return (f"not landed first: it lands with phase {r.clock - 1} of {bar.name if bar else '?'}, which {state}, "
                    f"and no wait on that phase happens-before this access")
        return f"not completed first: no T.tma_store_wait of {r.agent.name} that retires it happens-before this access"

    def pending_report(self) -> str:
        lines = []
        for op in self.ops:
            regions = ", ".join(str(r) for r in op.writes + op.reads)
            lines.append(f"  {op.kind} of {op.agent.name} on {regions}, {self.describe_line(op.line)}")
        return "\n".join(lines)


# -- across the CTAs of one launch ---------------------------------------------------------------
READ, WRITE, ATOMIC_RMW = 0, 1, 2
MODE_TEXT = ("reads", "writes", "atomically adds to")
MODE_PAST = ("read", "wrote", "atomically added to")
# The kinds of access by other CTAs that each kind races with: atomics commute only with atomics.
CONFLICTS = ((WRITE, ATOMIC_RMW), (READ, WRITE, ATOMIC_RMW), (READ, WRITE))


class _Touched:
    """Which elements of one global tensor earlier CTAs of the launch touched, by kind of access:
    an int32 map per kind holding the id of the last access (-1: none). Reads of boxes are kept as
    a log and written into their map only when a write or an atomic needs it (inputs, only ever
    read by TMA, never get one)."""

    __slots__ = ("maps", "reads")

    def __init__(self):
        self.maps = [None, None, None]
        self.reads = []  # (index, access id) not in maps[READ] yet

    def get(self, buf, mode):
        if mode == READ and self.reads:
            self._put(buf, READ, self.reads)
            self.reads = []
        return self.maps[mode]

    def _put(self, buf, mode, entries):
        m = self.maps[mode]
        if m is None:
            m = self.maps[mode] = np.full(buf.shape, -1, np.int32)
        for index, rid in entries:
            m[index] = rid


class Launch:
    """Global accesses of the CTAs of one launch, which nothing orders with each other.

    A CTA's access is checked against what earlier CTAs did to the same elements (CONFLICTS);
    the CTA's own accesses join the maps when it ends, so accesses within a CTA are left to its
    happens-before tracker. Every pair of CTAs is checked once, whichever runs first, so the
    verdict does not depend on the order the driver runs them in."""

    def __init__(self, concurrent: bool = False):
        self.touched: dict = {}  # Buffer -> _Touched
        self.accesses: list = []  # access id -> (block, agent name, kind, line)
        self.pending: list = []  # this CTA's (Buffer, mode, index, access id)
        self.block = ""
        # A concurrent launch (a persistent kernel's blocks run interleaved): every block keeps its own
        # maps from its first access on, and each access is checked against every other block's
        self.concurrent = concurrent
        self.by_block: dict = {}  # block -> {Buffer: _Touched}

    def begin(self, block: str):
        self.block = block
        self.pending = []

    def access(self, tracker, buf, index, write, atomic, agent, kind, line):
        mode = ATOMIC_RMW if atomic else WRITE if write else READ
        if self.concurrent:
            others = [m[buf] for b, m in self.by_block.items() if b != self.block and buf in m]
        else:
            others = [self.touched[buf]] if buf in self.touched else []
        for t in others:
            for other in CONFLICTS[mode]:
                m = t.get(buf, other)
                if m is None:
                    continue
                if (m[index] >= 0).any():
                    raise HazardError(self._report(tracker, buf, index, mode, other, m, agent, kind, line))
        rid = len(self.accesses)
        self.accesses.append((self.block, agent.name, kind, line))
        if self.concurrent:
            self._keep(self.by_block.setdefault(self.block, {}), buf, mode, index, rid)
        else:
            self.pending.append((buf, mode, index, rid))

    def end(self):
        """The CTA finished: its accesses are what later CTAs are checked against."""
        for buf, mode, index, rid in self.pending:
            self._keep(self.touched, buf, mode, index, rid)
        self.pending = []

    @staticmethod
    def _keep(touched: dict, buf, mode, index, rid):
        t = touched.get(buf)
        if t is None:
            t = touched[buf] = _Touched()
        if mode == READ and all(isinstance(x, (slice, int)) for x in index):
            t.reads.append((index, rid))  # a box: cheap to keep until a write or an atomic needs it
        else:  # element gathers keep index arrays: put them in their map now, not in memory until then
            t._put(buf, mode, [(index, rid)])

    def _report(self, tracker, buf, index, mode, other, m, agent, kind, line) -> str:
        hit = np.zeros(buf.shape, bool)
        hit[index] = m[index] >= 0
        first = tuple(int(i) for i in np.argwhere(hit)[0])
        block, who, their_kind, their_line = self.accesses[int(m[first])]
        element = f"{buf.name}[{', '.join(map(str, first))}]"
        why = ("atomics commute only with atomics: a plain access of the same bytes in another block races with them"
               if ATOMIC_RMW in (mode, other) else "a plain write races with any other block's access of the same bytes")
        return "\n".join([
            f"HAZARD: {self.block}, {agent.name} ({kind}) {MODE_TEXT[mode]} {element}, which {block}, {who} "
            f"({their_kind}) {MODE_PAST[other]}",
            f"  buffer:    {buf.label}; {int(hit.sum())} element(s) in common, first {element}",
            f"  access:    {self.block}, {agent.name}, {tracker.describe_line(line)}",
            f"  other:     {block}, {who}, {tracker.describe_line(their_line)}",
            f"             (the blocks of one launch are unordered: nothing orders one block's global accesses with "
            f"another's; {why})",
            "             (a race whatever order the blocks run in)",
            f"  where:     {tracker.context}",
        ])
