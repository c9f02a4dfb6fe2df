"""In-flight asynchronous operations and the races against them.

A wgmma is in flight from its issue until a `T.wait_wgmma` retires it; a TMA load from its
issue until its mbarrier phase completes. Each records the regions it reads and writes.
A hazard is an overlap, at the moment something else touches memory, between that access
and an in-flight operation where at least one side writes:

- ordinary code reading a wgmma's accumulator, or writing any of its operands;
- a TMA load writing a stage that a wgmma (of any agent) still reads, or that an earlier
  TMA load still writes;
- a wgmma issued on a buffer whose TMA load has not landed, or reading another wgmma's
  accumulator.

Reading a wgmma's A/B operand from ordinary code is a read-read pair: not a race, not
reported. Chained wgmmas of one warpgroup on the same accumulator are ordered by the
hardware and allowed.

Proxy fences (opt-in, `proxy_fences=True`): shared memory written by ordinary code (the
generic proxy, many threads) may be read by the async proxy (a TMA store, a wgmma operand)
only after the writers executed `T.fence_proxy_async()` and then a named barrier ordered
them before the reading thread (one elected thread issues a TMA store).
"""

from __future__ import annotations

from attngen.emulator.errors import HazardError


class Op:
    """One asynchronous operation in flight."""

    __slots__ = ("kind", "agent", "line", "reads", "writes", "action", "done")

    def __init__(self, kind, agent, line, reads, writes, action):
        self.kind, self.agent, self.line, self.reads, self.writes = kind, agent, line, reads, writes
        self.action = action  # applies the effect (wgmma: the product; TMA: the data) when it completes
        self.done = False


def overlap(a, b) -> bool:
    (alo, ahi), (blo, bhi) = a, b
    return all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(alo, ahi, blo, bhi))


def box_text(box) -> str:
    lo, hi = box
    return "[" + ", ".join(f"{a}:{b}" if b - a != 1 else f"{a}" for a, b in zip(lo, hi)) + "]"


class Tracker:
    """The in-flight operations of one CTA, indexed by buffer for cheap checks."""

    def __init__(self, where):
        self.where = where  # () -> (agent, line) of the access being made now
        self.describe_line = lambda line: f"line {line}"
        self.context = ""  # CTA and schedule, appended to reports
        self.ops: list[Op] = []
        self.watch: dict = {}  # Buffer -> [(op, region, is_write)]
        self.proxy_fences = False
        self.generic: dict = {}  # shared Buffer -> [[agent, box, line, threads, fenced]] not yet ordered for the async proxy

    def add(self, op: Op):
        self.ops.append(op)
        for regions, is_write in ((op.reads, False), (op.writes, True)):
            for r in regions:
                self.watch.setdefault(r.buf, []).append((op, r, is_write))

    def remove(self, op: Op):
        op.done = True
        self.ops.remove(op)
        for r in op.reads + op.writes:
            entries = self.watch.get(r.buf)
            if entries:
                entries[:] = [e for e in entries if e[0] is not op]
                if not entries:
                    del self.watch[r.buf]

    def check(self, buf, box, write: bool, *, by: str = "", exempt=None):
        """Raise HazardError if this access conflicts with an in-flight operation."""
        if write and not by and self.proxy_fences and buf.scope == "shared":
            agent, line = self.where()
            self.generic.setdefault(buf, []).append([agent, box, line, agent.nthreads, False])
        entries = self.watch.get(buf)
        if not entries:
            return
        for op, region, op_writes in entries:
            if not (write or op_writes) or not overlap(box, region.box):
                continue
            if exempt is not None and exempt(op, region, op_writes):
                continue
            raise HazardError(self.report(buf, box, write, op, region, op_writes, by))

    # -- generic proxy -> async proxy ---------------------------------------------------
    def fence(self, agent):
        """T.fence_proxy_async(): this warpgroup's earlier shared writes are fenced."""
        for entries in self.generic.values():
            for e in entries:
                if e[0] is agent:
                    e[4] = True

    def barrier_passed(self, agents):
        """A named barrier released with these warpgroups: their fenced writes are now ordered."""
        for buf in list(self.generic):
            self.generic[buf] = [e for e in self.generic[buf] if not (e[4] and e[0] in agents)]
            if not self.generic[buf]:
                del self.generic[buf]

    def check_async_read(self, region, by: str):
        """A TMA store or wgmma reads shared memory: ordinary writes to it must be fenced and ordered."""
        for agent, box, line, threads, fenced in self.generic.get(region.buf, ()):
            if overlap(box, region.box):
                reader, rline = self.where()
                missing = "a named barrier after its fence" if fenced else "T.fence_proxy_async() followed by a named barrier"
                raise HazardError("\n".join([
                    f"HAZARD: {reader.name} ({by}) reads {region} through the async proxy, but ordinary code wrote it "
                    f"without {missing}",
                    f"  buffer:    {region.buf.label}; written {region.buf.name}{box_text(box)}",
                    f"  access:    {reader.name}, {self.describe_line(rline)}",
                    f"  written:   by {threads} threads of {agent.name}, {self.describe_line(line)}",
                    "             (one elected thread issues the async read; the other writers are not ordered before it)",
                    f"  where:     {self.context}",
                ]))

    def report(self, buf, box, write, op, region, op_writes, by):
        agent, line = self.where()
        verb = "writes" if write else "reads"
        theirs = "writes" if op_writes else "reads"
        if op.kind == "wgmma":
            pending = "not yet retired: no T.wait_wgmma has covered it"
        else:
            pending = "not yet landed: its mbarrier phase has not completed"
        return "\n".join([
            f"HAZARD: {agent.name} ({by or 'ordinary code'}) {verb} {region} while the in-flight {op.kind} "
            f"of {op.agent.name} {theirs} it",
            f"  buffer:    {buf.label}; in flight on {region}, access covers {buf.name}{box_text(box)}",
            f"  access:    {agent.name}, {self.describe_line(line)}",
            f"  in flight: {op.kind} issued by {op.agent.name}, {self.describe_line(op.line)}",
            f"             ({pending})",
            f"  where:     {self.context}",
        ])

    def pending_report(self) -> str:
        lines = []
        for op in self.ops:
            regions = ", ".join(str(r) for r in op.writes + op.reads)
            lines.append(f"  {op.kind} of {op.agent.name} on {regions}, {self.describe_line(op.line)}")
        return "\n".join(lines)
