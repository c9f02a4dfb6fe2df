"""emulate() and the `attngen emulate` command: run an emitted kernel's text on the CPU model.

The driver executes the rewritten module, calls its `build_kernel()` (or another entry, such
as a split-KV module's `build_combine_kernel()`), asks the prim_func for its launch grid
(T.Kernel raises a probe), then runs the CTAs one after another; within a CTA every warpgroup
is an agent and the scheduler interleaves them (agents.py). An ownership rule (`ownership`
for the serving ABI, docs/emulator.md) makes every global store check that the CTA writes
only its own rows.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import os
import random
import sys
import time
import traceback

import numpy as np

from attngen.run import inputs as call_checks
from attngen.emulator import blas
from attngen.emulator.agents import POLICIES, WARPGROUP, Agent, Scheduler
from attngen.emulator.errors import DeadlockError, EmulationError, HazardError, KernelError, UnsupportedConstruct
from attngen.emulator.hazards import Launch, Tracker
from attngen.emulator.memory import Buffer, Owned, stored
from attngen.emulator.rewrite import RT, TL, rewrite
from attngen.emulator.tlang import FakeTileLang, GridProbe, Helpers, PrimFunc, TensorType, TLang
from attngen.reference.forward import InputError, check_close, check_scale, fa3_descale, random_inputs, resolve_scale, to_numpy
from attngen.reference.kv_cache import dequantize, quantize, random_descales, row_batches
from attngen.kernels.fwd.kv_cache import DESCALES
from attngen.kernels.fwd.plan import DESCALE_TENSORS


# Generic-proxy smem writes read by TMA or wgmma must be fenced and barrier-ordered
# (docs/emulator.md, "Proxy fences"); the template's epilogue does both.
PROXY_FENCES = True
BLOCK_ORDERS = ("grid", "shuffled")


@dataclasses.dataclass
class Stats:
    """What one emulation did (the benchmark and the CLI print these)."""

    ctas: int = 0
    handovers: int = 0  # scheduler decisions: one per synchronization point reached
    wgmma: int = 0
    tma: int = 0
    atomics: int = 0  # T.atomic_add statements executed by a warpgroup (register and shared sources)
    reduce_adds: int = 0  # TMA reduce-adds: T.atomic_add(..., use_tma=True)
    k_tiles: int = 0  # TMA loads from the kernel's K tensor: the K tiles the blocks loaded
    k_tiles_by_cta: dict = dataclasses.field(default_factory=dict)  # (x, y, z) -> K tiles that block loaded
    q_tiles: int = 0  # TMA loads from the kernel's Q tensor: the backward's Q tiles (a block mask skips the rest)
    q_tiles_by_cta: dict = dataclasses.field(default_factory=dict)  # (entry, x, y, z) -> Q tiles that block loaded
    seconds: float = 0.0
    schedule: str = ""  # digest of every CTA's schedule: equal seeds give equal digests
    partials: dict | None = None  # a split-KV run: the split kernel's O_partial and LSE_partial, as written
    q_boxes: list = dataclasses.field(default_factory=list)  # a concurrent run: every Q box loaded (CTA.q_boxes)
    k_boxes: list = dataclasses.field(default_factory=list)  # ... and every K box (the backward's tiles)


class CTA:
    """The state one thread block shares: shared buffers, barriers, in-flight operations."""

    def __init__(self, index, grid, threads, tracker, stats):
        self.index, self.grid, self.threads, self.tracker, self.stats = index, grid, threads, tracker, stats
        self.shared, self.barriers, self.named = {}, {}, {}
        self.q_boxes = []  # the Q boxes this block loaded by TMA: (batch, first row, head), one per load
        self.k_boxes = []  # ... and the K boxes: (batch, first key, KV head, first column)


@functools.lru_cache(maxsize=64)
def _compiled(source: str, filename: str):
    return rewrite(source, filename)


class Runtime:
    """One emulation of one emitted source for one problem shape."""

    def __init__(self, source: str, filename: str, dims: dict):
        self.rw = _compiled(source, filename)
        self.filename = filename
        self.dims = dims
        self.T = TLang(self)
        self.probe = False
        self.cta = None
        self.sched = None
        self.context = "module load"
        self.trace = None  # an observer of synchronization and compute events (attngen.timeline); None: off
        self.tensors = {}  # after run(): every prim_func parameter by name, as the kernel left it

    @property
    def agent(self) -> Agent:
        return self.sched.agent

    def alloc_name(self, line) -> str:
        return self.rw.alloc_names.get(line, f"buffer@{line}")

    def describe_line(self, line) -> str:
        if line is None:
            return "(no line)"
        return f"line {line}: {self.rw.line_text(line)}"

    def current_line(self):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename != self.filename:
            f = f.f_back
        return f.f_lineno if f is not None else None

    def wrap_error(self, e: BaseException) -> EmulationError:
        """Locate an error at the emitted line that raised it; reports of hazards and deadlocks are complete."""
        if isinstance(e, (HazardError, DeadlockError)):
            return e
        line = None
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            if frame.f_code.co_filename == self.filename:
                line = lineno
        if isinstance(e, EmulationError):
            cls, msg = type(e), e.report
        else:
            cls, msg = KernelError, f"{type(e).__name__}: {e}"
        head = "UNSUPPORTED" if cls is UnsupportedConstruct else "KERNEL ERROR"
        where = f"\n  at {self.describe_line(line)}" if line is not None else ""
        return cls(f"{head}: {msg}{where}\n  where: {self.context}")

    # -- running ---------------------------------------------------------------------
    def load(self, entry: str = "build_kernel"):
        ns = {"__name__": "attngen_emulated", "__builtins__": builtins, RT: Helpers(self), TL: FakeTileLang(self.T)}
        try:
            exec(self.rw.code, ns)
            build = ns.get(entry)
            if build is None:
                raise KernelError(f"the emitted module defines no {entry}()")
            prim = build()
        except GridProbe:
            raise
        except Exception as e:
            raise self.wrap_error(e) from None
        if not isinstance(prim, PrimFunc):
            raise self.wrap_error(KernelError(f"{entry}() returned {type(prim).__name__}, expected a @T.prim_func"))
        return ns, prim

    def _arguments(self, prim, inputs):
        """The prim_func's arguments: a global Buffer per tensor (an output, given as None, starts
        NaN, so rows nobody wrote show), a Python int per T.int32 scalar, a numpy float32 per
        T.float32 scalar (what the GPU's kernel parameter holds)."""
        args = []
        for (name, ann), x in zip(prim.params, inputs):
            if ann == "float32":
                if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
                    raise KernelError(f"{prim.name}: scalar {name} ({ann}) needs a float, got {type(x).__name__}")
                args.append(np.float32(x))
                continue
            if not isinstance(ann, TensorType):
                if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                    raise KernelError(f"{prim.name}: scalar {name} ({ann}) needs an int, got {type(x).__name__}")
                args.append(int(x))
                continue
            if x is not None and tuple(np.shape(x)) != ann.shape:
                raise KernelError(f"{prim.name}: tensor {name} is declared {list(ann.shape)} "
                                  f"but the input is {list(np.shape(x))}")
            args.append(Buffer(name, ann.shape, ann.dtype, "global", data=None if x is None else stored(x, ann.dtype, name)))
        return args

    def run(self, inputs: list, *, seed: int, policy: str, stats: Stats, proxy_fences: bool = False,
            entry: str = "build_kernel", owner=None, block_order: str = "grid", concurrent: bool = False):
        """Run the prim_func that `entry()` of the emitted module returns, on every CTA of its grid.

        `inputs` holds one value per prim_func parameter in order: an array for an input tensor
        (copied, rounded to the tensor's dtype), None for an output (which starts NaN), an int for
        a T.int32 scalar, a float for a T.float32 one; a list one short means "the inputs, then
        one output" (Q, K, V -> O).
        Returns the output array, or a tuple of them when there are several (O, LSE); `self.tensors`
        then maps every parameter name to its array, so a second kernel (a split-KV combine) can be
        fed what the first wrote. `owner(cta_index, name)`, if given, says which elements of that
        tensor the CTA (x, y, z) may write: a boolean mask broadcastable to its shape, or None for
        no rule; any global store outside it is a KernelError naming the CTA and the element.
        `block_order`: "grid" runs the blocks x fastest, then y, then z; "shuffled" in an order drawn
        from the seed (blocks are unordered on the GPU: a result that depends on it, such as float
        atomics from several blocks, then varies with the seed; race verdicts never do).
        `concurrent`: every block of the grid runs at once, interleaved by one scheduler (a persistent
        kernel: its blocks race for tiles at an atomic counter), instead of one block after another."""
        if block_order not in BLOCK_ORDERS:
            raise ValueError(f"block_order {block_order!r}: expected one of {', '.join(BLOCK_ORDERS)}")
        ns, prim = self.load(entry)
        if len(prim.params) == len(inputs) + 1:
            inputs = inputs + [None]
        if len(prim.params) != len(inputs):
            raise self.wrap_error(KernelError(f"{prim.name} takes {len(prim.params)} parameters; expected "
                                              f"{len(inputs)} (inputs and outputs)"))
        try:
            bufs = self._arguments(prim, inputs)
        except EmulationError as e:
            raise self.wrap_error(e) from None
        tensors = [b for b in bufs if isinstance(b, Buffer)]
        self.tensors = {b.name: b.data for b in tensors}  # live: a run that fails leaves what it wrote

        self.probe = True
        try:
            prim.func(*bufs)
        except GridProbe as g:
            grid, threads = g.grid, g.threads
        except Exception as e:
            raise self.wrap_error(e) from None
        else:
            raise self.wrap_error(KernelError(f"{prim.name} never entered T.Kernel"))
        finally:
            self.probe = False
        if threads % WARPGROUP:
            raise self.wrap_error(UnsupportedConstruct(
                f"T.Kernel(threads={threads}): only whole warpgroups (multiples of 128) are modeled"))

        nwg = threads // WARPGROUP
        consumer_threads = ns.get("CONSUMER_THREADS")
        roles = [(i * WARPGROUP >= consumer_threads) if isinstance(consumer_threads, int) else (nwg > 1 and i == nwg - 1)
                 for i in range(nwg)]
        n_prod = sum(roles)
        names, c, p = [], 0, 0
        for is_prod in roles:
            if is_prod:
                names.append("producer" if n_prod == 1 else f"producer {p}")
                p += 1
            else:
                names.append(f"consumer {c}")
                c += 1

        if concurrent:
            return self._run_concurrent(prim, bufs, inputs, grid, threads, names, roles, seed=seed, policy=policy,
                                        stats=stats, proxy_fences=proxy_fences, block_order=block_order, owner=owner)
        digest = hashlib.sha1()
        counters = {"wgmma": 0, "tma": 0, "atomic": 0, "reduce_add": 0, "k_tiles": 0, "q_tiles": 0}
        launch = Launch()  # the blocks of this launch are unordered: their global accesses are checked across
        gx, gy, gz = (tuple(grid) + (1, 1, 1))[:3]
        blocks = [(bx, by, bz) for bz in range(gz) for by in range(gy) for bx in range(gx)]
        if block_order == "shuffled":  # blocks are unordered: a seeded order shows what depends on it
            random.Random(f"{seed}/blocks").shuffle(blocks)
        for index in blocks:
            bx, by, bz = index
            if self.trace is not None and not self.trace.begin_cta(index, grid, names, roles):
                continue  # the observer samples blocks: this one is not recorded, so not run
            who = f"block (x={bx}, y={by}, z={bz})"
            self.context = f"{who} of grid {tuple(grid)}; schedule seed={seed}, policy={policy}"
            for b in tensors:  # masks are computed on a CTA's first store to each tensor
                b.owned = None if owner is None else Owned(functools.partial(owner, index, b.name), who)
            agents = [Agent(i, names[i], roles[i]) for i in range(nwg)]
            sched = Scheduler(agents, policy, random.Random(f"{seed}/{bx},{by},{bz}"), self.describe_line)
            tracker = Tracker(agents, current=lambda: self.agent, line=self.current_line, launch=launch)
            tracker.describe_line = self.describe_line
            tracker.proxy_fences = proxy_fences
            tracker.context = sched.context = self.context
            launch.begin(who)
            for b in tensors:
                b.tracker = tracker
            sched.on_finish = self._finish_agent
            k_before, q_before = counters["k_tiles"], counters["q_tiles"]
            self.cta = CTA(index, tuple(grid), threads, tracker, counters)
            self.sched = sched
            sched.run(lambda agent: prim.func(*bufs), self.wrap_error)
            if tracker.ops:
                raise HazardError("HAZARD: TMA loads still in flight when the block exited "
                                  "(their mbarrier phase never completed)\n"
                                  f"{tracker.pending_report()}\n  where: {self.context}")
            launch.end()
            stats.k_tiles_by_cta[index] = counters["k_tiles"] - k_before
            if counters["q_tiles"] > q_before:  # by kernel: one Stats spans the backward's launches
                stats.q_tiles_by_cta[(entry, *index)] = counters["q_tiles"] - q_before
            digest.update(repr(sched.trace).encode())
            stats.ctas += 1
            stats.handovers += len(sched.trace)
        stats.wgmma += counters["wgmma"]
        stats.tma += counters["tma"]
        stats.atomics += counters["atomic"]
        stats.reduce_adds += counters["reduce_add"]
        stats.k_tiles += counters["k_tiles"]
        stats.q_tiles += counters["q_tiles"]
        stats.schedule = digest.hexdigest()[:16]
        self.tensors = {b.name: b.data for b in tensors}
        outs = [b.data for b, x in zip(bufs, inputs) if x is None]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run_concurrent(self, prim, bufs, inputs, grid, threads, names, roles, *, seed, policy, stats, proxy_fences,
                        block_order, owner):
        """Runtime.run's `concurrent` launch: the warpgroups of every block are agents of one scheduler,
        so blocks interleave at every synchronization point (and at each atomic fetch-and-add). Each
        block keeps its own clocks (a Tracker); the Launch checks their global accesses against each
        other's as they happen. A deadlock names every block's warpgroups."""
        if self.trace is not None or owner is not None:
            raise self.wrap_error(UnsupportedConstruct("a concurrent launch is traced or ownership-checked: neither "
                                                       "is modeled (a persistent kernel's blocks own no fixed rows)"))
        tensors = [b for b in bufs if isinstance(b, Buffer)]
        gx, gy, gz = (tuple(grid) + (1, 1, 1))[:3]
        blocks = [(bx, by, bz) for bz in range(gz) for by in range(gy) for bx in range(gx)]
        if block_order == "shuffled":
            random.Random(f"{seed}/blocks").shuffle(blocks)
        launch = Launch(concurrent=True)
        ctas, agents = [], []
        for index in blocks:
            who = f"block (x={index[0]}, y={index[1]}, z={index[2]})"
            mine = [Agent(i, f"{who} {names[i]}", roles[i]) for i in range(len(roles))]
            tracker = Tracker(mine, current=lambda: self.agent, line=self.current_line, launch=launch)
            tracker.describe_line, tracker.proxy_fences = self.describe_line, proxy_fences
            tracker.context = (f"{who} of {len(blocks)} concurrent blocks (grid {tuple(grid)}); schedule seed={seed}, "
                               f"policy={policy}, block order {block_order}")
            cta = CTA(index, tuple(grid), threads, tracker, dict.fromkeys(("wgmma", "tma", "atomic", "reduce_add",
                                                                            "k_tiles", "q_tiles"), 0))
            cta.who = who
            for a in mine:
                a.cta = cta
            ctas.append(cta)
            agents += mine
        sched = Scheduler(agents, policy, random.Random(f"{seed}/concurrent"), self.describe_line)
        sched.context = f"{len(blocks)} concurrent blocks of grid {tuple(grid)}; schedule seed={seed}, policy={policy}"

        def resume(agent):  # the running block's state is what T.* and the global buffers see
            self.cta, self.context, launch.block = agent.cta, agent.cta.tracker.context, agent.cta.who
            for b in tensors:
                b.tracker = agent.cta.tracker

        sched.on_resume, sched.on_finish = resume, self._finish_agent
        for b in tensors:
            b.owned = None
        self.sched = sched
        sched.run(lambda agent: prim.func(*bufs), self.wrap_error)
        for cta in ctas:
            if cta.tracker.ops:
                raise HazardError("HAZARD: TMA loads still in flight when the block exited (their mbarrier phase never "
                                  f"completed)\n{cta.tracker.pending_report()}\n  where: {cta.tracker.context}")
            for key, n in cta.stats.items():
                stats_key = {"atomic": "atomics", "reduce_add": "reduce_adds"}.get(key, key)
                setattr(stats, stats_key, getattr(stats, stats_key) + n)
            stats.k_tiles_by_cta[cta.index] = cta.stats["k_tiles"]
            stats.q_tiles_by_cta[("concurrent", *cta.index)] = cta.stats["q_tiles"]
            stats.q_boxes.extend(cta.q_boxes)
            stats.k_boxes.extend(cta.k_boxes)
        stats.ctas += len(ctas)
        stats.handovers += len(sched.trace)
        stats.schedule = hashlib.sha1(repr(sched.trace).encode()).hexdigest()[:16]
        self.tensors = {b.name: b.data for b in tensors}
        outs = [b.data for b, x in zip(bufs, inputs) if x is None]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _finish_agent(self, agent):
        if agent.stores:
            ops = "\n".join(f"  TMA store issued at {self.describe_line(op.line)}" for op in agent.stores)
            raise HazardError(f"HAZARD: {agent.name} finished with {len(agent.stores)} TMA store(s) in flight "
                              f"(no T.tma_store_wait retired them, so their shared-memory source may be released "
                              f"before it is read)\n{ops}\n  where: {self.context}")
        if agent.wgmma:
            ops = "\n".join(f"  wgmma issued at {self.describe_line(op.line)}" for op in agent.wgmma)
            raise HazardError(f"HAZARD: {agent.name} finished with {len(agent.wgmma)} wgmma(s) in flight "
                              f"(no T.wait_wgmma retired them, so their accumulators are never valid)\n{ops}\n"
                              f"  where: {self.context}")


# -- ownership: the rows each CTA of a serving kernel may write -----------------------------------
@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """What an ownership rule needs of a kernel's row mapping (docs: serving ABI, "Row mapping")."""

    layout: str = "bshd"  # "bshd" or "varlen" (packed rows, cu_seqlens_q)
    pack_gqa: bool = False  # a block's packed row p is query position p // gqa_group, head y * gqa_group + p % gqa_group
    gqa_group: int = 1
    block_m: int = 128
    splits: bool = False  # the split-KV kernel: it writes O_partial / LSE_partial; grid z = batch * num_splits


def _rows_mask(facts: ServingLayout, dims: dict, base: str, b: int, rows, heads):
    """The mask over O (broadcast along its head dim) or LSE, no split axis, of (row, head) pairs:
    rows are positions on the tensor's row axis (varlen: packed rows), b the batch (bshd)."""
    h = dims["heads"]
    if facts.layout == "varlen":
        n = dims["total_q"]
        shape, at = ((n, h, 1), (rows, heads)) if base == "O" else ((h, n), (heads, rows))
    else:
        n, nb = dims["q_len"], dims["batch"]
        shape, at = ((nb, n, h, 1), (b, rows, heads)) if base == "O" else ((nb, h, n), (b, heads, rows))
    mask = np.zeros(shape, bool)
    mask[at] = True
    return mask


def ownership(facts: ServingLayout, dims: dict, serving_inputs: dict):
    """The ownership rule of a serving ABI main kernel, for `Runtime.run(owner=...)`.

    Block (x, y, z) owns packed rows p in [x block_m, x block_m + block_m) of sequence b (z, or
    z // num_splits with split z % num_splits) whose query position is below that sequence's
    q_len: O / LSE (O_partial / LSE_partial at its split) of exactly those rows and heads. Any
    other tensor it may not write. `dims` holds heads, batch and q_len (bshd) or total_q
    (varlen), num_splits (splits); `serving_inputs["cu_seqlens_q"]` the varlen boundaries.
    """
    cu = np.asarray(serving_inputs["cu_seqlens_q"]).astype(np.int64) if facts.layout == "varlen" else None
    n_splits = dims["num_splits"] if facts.splits else 1
    names = ("O_partial", "LSE_partial") if facts.splits else ("O", "LSE")
    g = facts.gqa_group if facts.pack_gqa else 1

    def owner(index, name):
        if name not in names:
            return np.False_
        x, y, z = index
        b, split = divmod(z, n_splits)
        p = x * facts.block_m + np.arange(facts.block_m)
        qpos, heads = p // g, y * g + p % g
        start, q_len = (int(cu[b]), int(cu[b + 1] - cu[b])) if cu is not None else (0, dims["q_len"])
        keep = qpos < q_len
        mask = _rows_mask(facts, dims, name.removesuffix("_partial"), b, start + qpos[keep], heads[keep])
        if facts.splits:
            full = np.zeros((n_splits, *mask.shape), bool)
            full[split] = mask
            mask = full
        return mask

    return owner


def combine_ownership(facts: ServingLayout, dims: dict, rows_per_block: int, serving_inputs: dict | None = None):
    """The ownership rule of the combine kernel: grid (ceildiv(rows, rows_per_block), heads, batch
    or 1); block (x, y, z) owns rows [x R, x R + R) of head y in O and LSE, of batch z (bshd: rows
    = q_len) or of the packed rows (varlen: the rows before cu_seqlens_q[-1], from
    `serving_inputs`; the rows after it, up to total_q, are padding that no kernel writes). It may
    not write anything else."""
    if facts.layout == "varlen":
        cu = (serving_inputs or {}).get("cu_seqlens_q")
        total = int(np.asarray(cu)[-1]) if cu is not None else dims["total_q"]
    else:
        total = dims["q_len"]

    def owner(index, name):
        if name not in ("O", "LSE"):
            return np.False_
        x, y, z = (*index, 0)[:3]  # a varlen combine grid has no batch axis
        rows = np.arange(x * rows_per_block, min(x * rows_per_block + rows_per_block, total))
        return _rows_mask(facts, dims, name, z, rows, np.full(len(rows), y))

    return owner


def append_ownership(call, rows_per_block: int):
    """The ownership rule of the KV-cache append kernel: block (x, y, z) owns, in K_cache and V_cache,
    the cache rows of new keys [x R, x R + R) (below seqlen_new) of sequence z at KV head y, found
    through the block table at positions cache_seqlens[z] + those rows (append.cache_slots). It may
    write nothing else: not another row, head or page, not K_new, V_new or the int tensors."""
    from attngen.run.append import cache_slots

    shape = (call.dims["num_pages"], call.page_size, call.kv_heads, 1)

    def owner(index, name):
        if name not in ("K_cache", "V_cache"):
            return np.False_
        x, y, z = index
        new = np.arange(x * rows_per_block, min((x + 1) * rows_per_block, call.seqlen_new))
        pages, rows = cache_slots(call.block_table[z], call.cache_seqlens[z] + new, call.page_size)
        mask = np.zeros(shape, bool)
        mask[pages, rows, y] = True
        return mask

    return owner


def emulate_append(k_cache, v_cache, k, v, block_table, cache_seqlens, *, seed: int = 0, policy: str = "random",
                   source: str | None = None, stats: Stats | None = None, k_descale=None, v_descale=None):
    """Run the KV-cache append kernel (render.render_append_source) on the CPU model: k, v
    [batch, seqlen_new, kv_heads, D(v)] into the paged caches [num_pages, page_size, kv_heads, D(v)]
    at cache_seqlens[b] through block_table. Returns the caches as the kernel left them (float32
    numpy arrays holding the cache dtype's values; the caller copies them back for in-place
    semantics). Every store is held to append_ownership: a write outside the block's appended rows
    is a KernelError. Inputs are checked first (append.check_append, inputs.check_append_tensors).
    An e4m3 cache (an fp8 KV cache) takes k_descale and v_descale, float32 [num_pages, kv_heads]."""
    from attngen.kernels.append.plan import append_plan
    from attngen.kernels.append.render import render_append_source
    from attngen.run.append import check_append, check_append_descales

    seed = check_schedule(seed, policy)
    call = check_append(k_cache, v_cache, k, v, block_table, cache_seqlens)
    dtype = call_checks.check_append_tensors(k_cache, v_cache, k, v, block_table, cache_seqlens, cpu=True)
    plan = append_plan(dtype, call.head_dim, call.head_dim_v, call.page_size, call_checks.dtype_name(k_cache))
    descales = check_append_descales(plan, call, k_descale, v_descale, cpu=True)
    caches = [_host_array(x) for x in (k_cache, v_cache)]
    if call.empty:  # no new key: nothing to launch
        return caches[0], caches[1]
    text = render_append_source(plan) if source is None else source
    stats = stats if stats is not None else Stats()
    inputs = caches + [_host_array(x) for x in (k, v)] + [call.block_table, call.cache_seqlens.astype(np.int32)]
    inputs += [_host_array(x) for x in descales]
    t0 = time.perf_counter()
    rt = Runtime(text, f"<emitted {plan.name}>", call.dims)
    rt.run(inputs, seed=seed, policy=policy, stats=stats, entry="build_append_kernel",
           owner=append_ownership(call, plan.rows))
    stats.seconds += time.perf_counter() - t0
    return rt.tensors["K_cache"], rt.tensors["V_cache"]


# -- public API ----------------------------------------------------------------------------
def _host_array(x) -> np.ndarray:
    """A checked input (inputs.py) as the float32 array the emulator's buffers take."""
    return np.asarray(to_numpy(x), np.float32)


def call_time_array(t, x) -> np.ndarray:
    """A checked call-time tensor of the plan's ExtraTensor `t` as the array its buffer takes."""
    return np.asarray(to_numpy(x), np.int32) if t.dtype == "int32" else _host_array(x)


def check_seed(seed, argument: str = "seed") -> int:
    """A schedule and input seed: a non-negative integer (numpy's generators take no negatives)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(argument, repr(seed), "a non-negative integer")
    return int(seed)


def check_schedule(seed, policy: str, block_order: str = "grid") -> int:
    """An emulation's schedule arguments (emulate, emulate_append, emulate_backward): the checked seed."""
    if policy not in POLICIES:
        raise InputError("policy", repr(policy), f"one of {', '.join(POLICIES)}")
    if block_order not in BLOCK_ORDERS:
        raise InputError("block_order", repr(block_order), f"one of {', '.join(BLOCK_ORDERS)}")
    return check_seed(seed)


def _prepare(plan, q, k, v, tensors=None, serving=None, softmax_scale=None):
    """Inputs in the prim_func's parameter order (None for outputs), the dims T.dynamic reads and
    the checked serving call (None for a bshd, dense, unsplit kernel called without serving keywords).

    Every tensor goes through the runtime's own checks (attngen/run/inputs.py, cpu=True): a call the
    GPU path refuses is refused here with the same InputError. The last parameter is the run-time
    softmax_scale (None: 1 / sqrt(head_dim))."""
    from attngen.run.serving import check_serving, serving_fields

    scale = check_scale(softmax_scale, plan.spec.head_dim)
    tensors = {n: t for n, t in (tensors or {}).items() if t is not None}
    serving = {n: x for n, x in (serving or {}).items() if x is not None}
    if serving or serving_fields(plan).uses_serving:  # shapes, cu_seqlens, pages: serving.py checks them all
        call = check_serving(plan, q, k, v, **serving)
        ints = {n: serving.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")}
        call_checks.check_serving_tensors(plan, call, q, k, v, None, ints, cpu=True)
        dims = dict(call.dims, heads=call.heads)
        extra = call_checks.check_extra(plan, call_checks.extra_dims(call), tensors, cpu=True)
        args = [_host_array(x) for x in (q, k, v)] + [None] + ([None] if plan.split_kv else [])
        return _extra_inputs(plan, args, dims, extra) + call.host_args() + [scale], dims, call
    b, h, hkv, sq, skv = call_checks.check_tensors(plan, q, k, v, cpu=True)
    dims = {"batch": b, "q_len": sq, "kv_len": skv, "kv_heads": hkv, "heads": h}
    extra = call_checks.check_extra(plan, (b, h, hkv, sq, skv), tensors, cpu=True)
    args = [_host_array(x) for x in (q, k, v)] + [None]
    return _extra_inputs(plan, args, dims, extra) + [scale], dims, None


def _extra_inputs(plan, args: list, dims: dict, extra: list) -> list:
    from attngen.kernels.common.plan import BLOCK_MASK_AXES

    """`args` + the LSE output and the checked call-time tensors (docs/variants.md), in parameter
    order; a free axis's extent joins `dims` (its T.dynamic)."""
    given = iter(extra)
    for t in plan.extra:
        if t.output:
            if not plan.split_kv:  # a split kernel's LSE_partial is already in; the combine writes the LSE
                args.append(None)
            continue
        x = next(given)
        x = call_time_array(t, x)
        dims.update({t.dim(i): x.shape[i] for i, a in enumerate(t.shape) if a is None or a in BLOCK_MASK_AXES})
        args.append(x)
    return args


def emulate_stats(spec_or_plan, q, k, v, *, seed: int = 0, policy: str = "random", source: str | None = None,
                  filename: str | None = None, proxy_fences: bool = PROXY_FENCES, tensors: dict | None = None,
                  serving: dict | None = None, softmax_scale: float | None = None, block_order: str = "grid",
                  num_sms: int | None = None, counters=None):
    """Like `emulate`, returning (out as float32 numpy, Stats); out is (out, lse) for a spec with lse.
    `tensors`: the call-time tensors by name (alibi_slopes, sinks, score_mod/mask_mod tensors);
    `serving`: the serving keywords (cu_seqlens_q, ..., num_splits); `softmax_scale` the kernel's
    run-time scale (None: 1 / sqrt(head_dim)); `block_order` "grid" or "shuffled" (Runtime.run).
    Outputs start as NaN, so an element no block wrote stays NaN; a split kernel's partials are
    left in `stats.partials`. A persistent spec's kernel runs `num_sms` blocks at once (None: one per
    SM, at most one per tile) taking tiles from `counters` (emulator/persistent.py; None: the model's
    launcher's), and each tile must run exactly once."""
    from attngen.emulator import persistent
    from attngen.kernels.fwd.plan import Plan, as_plan
    from attngen.kernels.fwd.render import render_source
    from attngen.spec import Spec

    if not isinstance(spec_or_plan, (Spec, Plan)):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    plan = as_plan(spec_or_plan)
    seed = check_schedule(seed, policy, block_order)
    if source is not None and not isinstance(source, str):
        raise InputError("source", type(source).__name__, "the emitted module's text (a str)")
    inputs, dims, call = _prepare(plan, q, k, v, tensors, serving, softmax_scale)
    if plan.spec.scheduler == "persistent" and call is not None:  # per-sequence: varlen queries or a paged cache
        persistent.varlen_tiles(plan, dims, call.arrays)
        dims["cu_seqlens_q"] = call.arrays.get("cu_seqlens_q")
    num_sms = persistent.check_num_sms(num_sms, plan, dims)
    counters = counters if counters is not None else persistent.DEFAULT_COUNTERS
    if num_sms:
        inputs += persistent.launch_inputs(plan, dims, num_sms, counters)
    text = render_source(plan) if source is None else source
    filename = filename or f"<emitted {plan.name}>"
    stats = Stats()
    if call is not None and call.empty:  # no query row: nothing to launch
        out = np.zeros(call.out_shape, np.float32)
        return ((out, np.full(call.lse_shape, -np.inf, np.float32)) if plan.spec.lse else out), stats
    facts = ServingLayout(layout="varlen" if plan.varlen else "bshd", pack_gqa=plan.pack_gqa,
                          gqa_group=plan.spec.gqa_group, block_m=plan.spec.block_m, splits=plan.split_kv)
    owner = ownership(facts, dims, call.arrays if call is not None else {})  # every store stays in its block's rows
    t0 = time.perf_counter()
    with blas.single_threaded():
        rt = Runtime(text, filename, dims)
        try:
            out = rt.run(inputs, seed=seed, policy=policy, stats=stats, proxy_fences=proxy_fences,
                         owner=None if num_sms else owner, block_order=block_order, concurrent=bool(num_sms))
        finally:
            if num_sms:
                persistent.keep(counters, rt.tensors)
        if num_sms:
            persistent.check_each_tile_once(plan, dims, stats.q_boxes)
        if plan.split_kv:  # the combine kernel merges the splits' partial O and LSE
            from attngen.kernels.combine.render import COMBINE_ROWS

            partials = rt.tensors
            combine_inputs = [partials["O_partial"], partials["LSE_partial"], None] + ([None] if plan.spec.lse else [])
            if plan.varlen:  # the combine writes only the rows before cu_seqlens_q[-1]
                combine_inputs.append(call.arrays["cu_seqlens_q"])
            out = rt.run(combine_inputs, seed=seed, policy=policy, stats=stats, proxy_fences=proxy_fences,
                         entry="build_combine_kernel", owner=combine_ownership(facts, dims, COMBINE_ROWS, call.arrays),
                         block_order=block_order)
            stats.partials = partials
    stats.seconds = time.perf_counter() - t0
    return out, stats


def emulate(spec_or_plan, q, k, v, *, seed: int = 0, policy: str = "random", source: str | None = None,
            proxy_fences: bool = PROXY_FENCES, alibi_slopes=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, block_table=None, seqused_k=None, num_splits=None, softmax_scale=None, scale=None,
            num_sms=None, **tensors):
    """Run the kernel emitted for a spec (or plan) on the CPU model of Hopper and return its output.

    q [B, Sq, H, D], k and v [B, Skv, HKV, D] as torch tensors or numpy arrays (rounded to the
    spec's dtype on the way in, as the kernel reads them). Returns O [B, Sq, H, D]: a torch
    tensor of the spec's dtype for torch input, else a float32 numpy array holding values of
    the spec's dtype. `source` replaces the rendered text (a hand-edited emitted file).
    `seed` and `policy` ("random", "producer-first", "consumers-first") pick the schedule.
    `proxy_fences` also requires fence.proxy.async + a named barrier between ordinary
    shared-memory writes and a TMA store or wgmma reading them (see hazards.py).
    `softmax_scale` (or `scale`, SDPA's name): score = q . k * softmax_scale, a run-time argument
    of the kernel; None gives 1 / sqrt(head_dim); a non-finite or non-positive one is an InputError.
    Variants (docs/variants.md): `alibi_slopes` and `sinks` (float32 (heads,)) and the spec's
    score_mod/mask_mod tensors by name; returns (out, lse) when the spec has lse (lse float32
    [B, H, Sq]). Every tensor is checked first by the runtime's own rules (attngen/run/inputs.py:
    shapes, dtypes, layouts, the call-time tensors, finite sinks), so a call attngen.attention
    refuses is the same InputError here; numpy arrays, any device with values, and float32/float64
    holding values to round are what the CPU model takes besides.
    Serving (docs/serving.md): a varlen spec takes packed q (total_q, H, D) with cu_seqlens_q,
    cu_seqlens_k and max_seqlen_q; a paged one k/v caches (num_pages, page_size, HKV, D) with
    block_table and seqused_k; a split one num_splits (None: "auto"). Each is validated first.
    An fp8 cache (spec kv_dtype, docs/fp8-kv-cache.md): e4m3 k/v (or float32 holding values to
    round) with k_descale and v_descale (float32 [batch or num_pages, kv_heads]) by name.
    Raises HazardError, DeadlockError, UnsupportedConstruct or KernelError (all EmulationError);
    a store outside the rows its block owns is a KernelError.
    A persistent spec (scheduler = "persistent") runs `num_sms` blocks at once, racing for tiles at
    the kernel's atomic counter (None: one per SM, at most one per tile); a tile run twice or
    skipped is a KernelError.
    """
    from attngen.kernels.fwd.plan import Plan, as_plan
    from attngen.spec import Spec, out_dtype_of

    if not isinstance(spec_or_plan, (Spec, Plan)):
        raise InputError("spec", type(spec_or_plan).__name__, "an attngen.Spec or attngen.Plan")
    plan = as_plan(spec_or_plan)
    softmax_scale = resolve_scale(softmax_scale, scale, head_dim=plan.spec.head_dim)
    tensors = dict(tensors, alibi_slopes=alibi_slopes, sinks=sinks)
    tensors = {n: t for n, t in tensors.items() if t is not None}
    serving = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   block_table=block_table, seqused_k=seqused_k, num_splits=num_splits)
    result, _ = emulate_stats(plan, q, k, v, seed=seed, policy=policy, source=source, proxy_fences=proxy_fences,
                              tensors=tensors, serving=serving, softmax_scale=softmax_scale, num_sms=num_sms)
    out, lse = result if plan.spec.lse else (result, None)
    if hasattr(q, "detach"):
        import torch

        out = torch.from_numpy(out.copy()).to(getattr(torch, out_dtype_of(plan.spec)))
        lse = None if lse is None else torch.from_numpy(lse.copy())
    return (out, lse) if plan.spec.lse else out


def stored_v(spec, v):
    """v [B, Skv, HKV, Dv] as the kernel takes it: fp8's v_layout = "transposed" stores it [B, HKV, Dv, Skv]."""
    return v.transpose(0, 2, 3, 1).copy() if spec.v_layout == "transposed" else v


def variant_inputs(plan, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, seed: int = 0):
    """Random q, k, v (v with head_dim_v) and every call-time tensor the plan takes, by name.

    ALiBi slopes follow the usual 2**(-8 (h + 1) / H); sinks are standard normal; score_mod and
    mask_mod tensors hold small non-decreasing integers along their last axis (document ids, a
    bias table), with free axes max(q_len, kv_len) + 8 long.
    """
    spec = plan.spec
    q, k, _ = random_inputs(spec.dtype, spec.head_dim, batch, heads, kv_heads, q_len, kv_len, seed)
    _, _, v = random_inputs(spec.dtype, plan.head_dim_v, batch, heads, kv_heads, q_len, kv_len, seed)
    tensors = variant_tensors(plan, batch, heads, kv_heads, q_len, kv_len, seed)
    if plan.block_mask:
        tensors.update(block_mask_lists(plan, batch, heads, q_len, kv_len, tensors))
    if spec.kv_dtype is not None:  # an fp8 cache: k and v quantized by descales per (batch, KV head)
        kd, vd = random_descales(batch, kv_heads, seed + 2)
        tensors.update(k_descale=kd, v_descale=vd)
        k, v = quantize(k, kd), quantize(v, vd)
    return q, k, v, tensors



def variant_tensors(plan, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, seed: int = 0) -> dict:
    """The variant's call-time tensors by name, drawn as variant_inputs says (not a block mask's lists,
    derived from its mask_mod, nor an fp8 cache's descales, drawn with the cache); q_len and kv_len:
    the longest sequence's (a serving call's batch is its sequences)."""
    from attngen.kernels.common.plan import BLOCK_MASK_TENSORS

    lists = {n for n, _, _ in BLOCK_MASK_TENSORS} | (set(DESCALES) if plan.spec.kv_dtype is not None else set())
    rng = np.random.default_rng(seed + 1)
    dims = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    tensors = {}
    for t in plan.extra:
        if t.output or t.name in lists:
            continue
        if t.name == "alibi_slopes":
            tensors[t.name] = (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)
        elif t.name == "sinks":
            tensors[t.name] = rng.standard_normal(heads).astype(np.float32)
        elif t.name in DESCALE_NAMES:  # fp8 Q, K and V's, per (batch, KV head)
            tensors[t.name] = fa3_descale(rng, batch, kv_heads)
        else:
            shape = [dims[a] if a else max(q_len, kv_len) + 8 for a in t.shape]
            tensors[t.name] = np.sort(rng.integers(0, 3, size=shape), axis=-1).astype(np.dtype(t.dtype))
    return tensors


def reference_kv(k, v, tensors: dict, row_batch=None) -> tuple:
    """The k and v the fp64 reference takes, and the call-time tensors that are the variant's: an
    fp8 cache dequantized by its descales (reference/kv_cache.py), which are no variant's tensors."""
    if "k_descale" not in tensors:
        return k, v, tensors
    rest = {n: x for n, x in tensors.items() if n not in DESCALES}
    return dequantize(k, tensors["k_descale"], row_batch), dequantize(v, tensors["v_descale"], row_batch), rest


def block_mask_lists(plan, batch: int, heads: int, q_len: int, kv_len: int, tensors: dict) -> dict:
    """A block-mask kernel's four int32 lists for its own mask_mod over these lengths and tensors
    (what attngen.create_block_mask computes: tiles.mask_states, tiles.tile_lists)."""
    from attngen import expr, tiles

    def rows(q0, q1):
        env = {"b": np.arange(batch)[:, None, None, None], "h": np.arange(heads)[None, :, None, None],
               "q_idx": np.arange(q0, q1)[None, None, :, None], "kv_idx": np.arange(kv_len)[None, None, None, :]}
        return np.broadcast_to(expr.evaluate(plan.mask_expr, env, tensors), (batch, heads, q1 - q0, kv_len))
    st = tiles.mask_states(rows, q_len, plan.spec.block_m, plan.spec.block_n)
    out = {}
    for prefix, state in (("", tiles.PARTIAL), ("full_", tiles.FULL)):
        counts, idx = tiles.tile_lists(st == state)
        out[f"{prefix}kv_num_blocks"], out[f"{prefix}kv_indices"] = counts, idx
    return out


def check_emulated(plan, batch, heads, kv_heads, q_len, kv_len, *, seed=0, policy="random", source=None, filename=None,
                   run=None, softmax_scale=None):
    """Emulate the plan's kernel on variant_inputs and compare out (and lse) with the fp64 reference.

    Returns (ok, text, stats); raises EmulationError for a hazard or deadlock. `run` replaces
    emulate_stats (the CLI passes the package's, which its tests may wrap). `softmax_scale` is
    passed to the kernel and to the reference alike (None: both use 1 / sqrt(head_dim))."""
    from attngen.run.serving import serving_fields

    if serving_fields(plan).uses_serving:
        return check_serving_emulated(plan, heads, kv_heads, q_len, kv_len, batch=batch, seed=seed, policy=policy,
                                      source=source, filename=filename, run=run, softmax_scale=softmax_scale)
    spec = plan.spec
    q, k, v, tensors = variant_inputs(plan, batch, heads, kv_heads, q_len, kv_len, seed)
    result, stats = (run or emulate_stats)(plan, q, k, stored_v(plan.spec, v), seed=seed, policy=policy, source=source,
                                           filename=filename, tensors=tensors, softmax_scale=softmax_scale)
    out, lse = result if spec.lse else (result, None)
    if spec.kv_dtype is not None:
        k, v, tensors = reference_kv(k, v, tensors)
    return (*check_output(spec, out, lse, q, k, v, tensors, softmax_scale), stats)


def check_output(spec, out, lse, q, k, v, tensors: dict, softmax_scale=None) -> tuple:
    """A dense kernel's out (and lse, or None) against the fp64 reference under the spec's rule (FA3's;
    fp8's with its twin), the call-time tensors by name (descales, ALiBi slopes, sinks, mod tensors):
    (ok, text). The CPU model's check and the GPU tests and smoke stage share it."""
    from attngen.reference.forward import check_lse

    variant, descales = reference_variant(spec, tensors), descales_of(tensors)
    res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype, scale=softmax_scale, descales=descales,
                      out_dtype=spec.out_dtype, block_n=spec.block_n, **variant)
    ok, text = res.ok, str(res)
    if lse is not None:
        r2 = check_lse(lse, q, k, v, spec.causal, dtype=spec.dtype, scale=softmax_scale, descales=descales, **variant)
        ok, text = ok and r2.ok, f"{text}; lse: max excess {r2.err:.2e} <= {r2.bound:.1e}: {r2.verdict}"
    return ok, text


DESCALE_NAMES = tuple(name for name, _ in DESCALE_TENSORS)  # fp8 Q, K and V's descales, by call-time name


def reference_variant(spec, tensors: dict) -> dict:
    """The fp64 reference's variant keywords (reference.variant_of) from a call's tensors by name: ALiBi's
    slopes, the sinks, and the mod tensors (the fp8 descales are the reference's `descales`)."""
    from attngen.reference.forward import variant_of

    mods = {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks") and n not in DESCALE_NAMES}
    return variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"), mods)


def descales_of(tensors: dict):
    """(q_descale, k_descale, v_descale) of a call's tensors, or None when it has none (a 16-bit kernel)."""
    found = tuple(tensors.get(n) for n in DESCALE_NAMES)
    return None if all(d is None for d in found) else found


PADDING_ROWS = 5  # packed rows past the last sequence: a kernel must leave them as they are
CHECK_SPLITS = 3


def dense_kv(layout: str, paged: bool) -> bool:
    """Whether a kernel's sequences share one key length (a dense bshd KV: a plain call's shape)."""
    return layout == "bshd" and not paged


def serving_lengths(layout: str, q_len: int, kv_len: int, *, paged: bool, batch: int = 1) -> tuple:
    """The batch `check` runs a serving kernel on: where lengths may differ (varlen, or a paged
    cache) a ragged one: the requested lengths, a 1-row query, more queries than keys (causal
    rows that see nothing), and (varlen) an empty sequence. A dense bshd KV (split-KV alone) has
    one key length: `batch` sequences of the requested lengths, the shape a plain call takes."""
    if dense_kv(layout, paged):
        return [q_len] * batch, [kv_len] * batch
    kv = [kv_len, kv_len // 3 + 1, 5, 9]
    if layout == "bshd":  # one query length for the batch
        return [q_len] * 4, kv
    return [q_len, 1, q_len // 2 + 1, 0], kv


def run_shape_text(plan, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> str:
    """The shape a CPU run takes, in the user's terms: B, H, HKV, Sq, Skv, or for a kernel whose
    sequences may differ in length, the ragged batch serving_lengths builds from Sq and Skv."""
    spec = plan.spec
    if dense_kv(spec.layout, spec.paged_kv):
        return f"B={batch} H={heads} HKV={kv_heads} Sq={q_len} Skv={kv_len}"
    n = len(serving_lengths(spec.layout, q_len, kv_len, paged=spec.paged_kv)[0])
    note = "" if batch == 1 else f" (--batch {batch} does not apply)"
    return f"H={heads} HKV={kv_heads}, a ragged batch of {n} from Sq={q_len} Skv={kv_len}" + note


def check_serving_emulated(plan, heads, kv_heads, q_len, kv_len, *, batch=1, seed=0, policy="random", source=None,
                           filename=None, run=None, softmax_scale=None):
    """check_emulated for a serving kernel: a ragged batch (serving_lengths) whose unused cache rows and
    pages hold 1e4 values, so a leak shows; every sequence against its own fp64 reference; the LSE
    when the spec has one; and, varlen, padding rows after the last sequence still NaN (untouched)."""
    from attngen.reference.serving import check_serving_close, random_serving_inputs
    from attngen.run.serving import check_serving

    spec = plan.spec
    lq, lk = serving_lengths(spec.layout, q_len, kv_len, paged=spec.paged_kv, batch=batch)
    x = random_serving_inputs(spec.layout, spec.paged_kv, plan.page_size or None, spec.dtype, spec.head_dim,
                              plan.head_dim_v, lq, lk, heads, kv_heads, seed=seed, neighbour_fill=1e4)
    q, keywords = x.q, dict(x.keywords)
    if plan.varlen:
        q = np.concatenate([q, np.zeros((PADDING_ROWS, *q.shape[1:]), np.float32)])
    if plan.split_kv:
        keywords["num_splits"] = CHECK_SPLITS
    k, v, row_batch = x.k, x.v, None
    # ALiBi's slopes, sinks, mod tensors, fp8 Q/K/V's descales (per sequence and KV head, as FA3's test draws them)
    tensors = variant_tensors(plan, len(lq), heads, kv_heads, max(lq), max(lk), seed)
    if spec.kv_dtype is not None:  # an fp8 cache: descales per (page, or sequence; KV head)
        kd, vd = random_descales(k.shape[0] if spec.paged_kv else len(lk), kv_heads, seed + 2)
        if plan.varlen and not spec.paged_kv:
            row_batch = row_batches(x.cu_seqlens_k[:-1], lk, k.shape[0])
        k, v = quantize(k, kd, row_batch), quantize(v, vd, row_batch)
        tensors.update(k_descale=kd, v_descale=vd)
    result, stats = (run or emulate_stats)(plan, q, k, v, seed=seed, policy=policy, source=source, filename=filename,
                                           serving=keywords, softmax_scale=softmax_scale, tensors=tensors)
    out, lse = result if spec.lse else (result, None)
    call = check_serving(plan, q, k, v, **keywords)
    if spec.kv_dtype is not None:  # the cache dequantized; its descales are no variant's tensors
        k, v, tensors = reference_kv(k, v, tensors, row_batch)
    res = check_serving_close(out, q, k, v, call, spec.causal, spec.dtype, lse=lse, scale=softmax_scale,
                              descales=descales_of(tensors), out_dtype=spec.out_dtype, block_n=spec.block_n,
                              **reference_variant(spec, tensors))
    ok, text = res.ok, f"{len(lq)} sequence{'s' if len(lq) > 1 else ''} (q {lq}, kv {lk}"
    text += f", {keywords['num_splits']} splits): " if plan.split_kv else "): "
    text += str(res)
    if plan.varlen:
        padding = out[int(x.cu_seqlens_q[-1]):]
        untouched = bool(np.isnan(padding).all())
        ok = ok and untouched
        text += f"; {PADDING_ROWS} padding rows {'untouched' if untouched else 'WRITTEN'}"
    return ok, text, stats


# What one CPU-model run costs: `python bench/bench_emulator.py --calibrate` fits seconds = RUN +
# CTA x blocks + WGMMA x wgmma issued. On the shared 2-core development machine the per-wgmma
# cost moved with its load: 0.66 ms fitted at a load average of 5 (a run of 8192 wgmma, hd128,
# B=1, H=4, Sq=2048, Skv=4096, took 4.6 s), 1.4-1.8 ms at 12-14 (the same run: 14.6 s). The
# constants sit between, so an estimate is within about a factor of two either way.
SECONDS_PER_RUN = 0.02
SECONDS_PER_CTA = 0.003
SECONDS_PER_WGMMA = 0.001


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a CPU-model run of one call would do and take (estimate_seconds)."""

    ctas: int
    wgmma: int
    seconds: float


def estimate_seconds(plan, batch: int, heads: int, kv_heads: int, q_lens, kv_lens, num_splits: int = 1,
                     max_seqlen_q: int | None = None, total_q: int | None = None) -> Estimate:
    """The blocks, wgmma and seconds of emulating the plan's kernel over sequences of q_lens[b]
    queries and kv_lens[b] keys (varlen: the grid covers max_seqlen_q rows, and a split call's
    combine kernel total_q packed rows). Every consumer issues two wgmma (S = QK^T, O += PV) per
    K tile its block visits, as the template counts them: every block of the grid, at least one
    tile, and one per empty split; a causal block stops at its last row's diagonal. Windows and
    masks are not counted, so the estimate is an upper bound there."""
    from attngen.kernels.combine.render import COMBINE_ROWS

    spec = plan.spec
    group = spec.gqa_group if plan.pack_gqa else 1  # packed GQA: a block's rows are (query, head) pairs
    y = kv_heads if plan.pack_gqa else heads
    q_lens = [int(n) for n in q_lens]
    kv_lens = [int(n) for n in kv_lens]
    rows = (max_seqlen_q if max_seqlen_q is not None else max(q_lens, default=0)) * group
    grid_x = -(-rows // spec.block_m)
    splits = max(num_splits, 1)
    ctas = grid_x * y * batch * splits
    tiles = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for x in range(grid_x):  # every block of the grid runs, past its sequence's rows too
            keys = kv_len
            if spec.causal:  # the block's last row sees keys up to its query position + kv_len - q_len
                keys = min(kv_len, ((x + 1) * spec.block_m - 1) // group + 1 + kv_len - q_len)
            block_tiles = max(-(-keys // spec.block_n), 1)  # rows that see no key still run one masked tile
            per = -(-block_tiles // splits)  # each split takes its share, and an empty one a masked tile
            tiles += sum(max(min(block_tiles - s * per, per), 1) for s in range(splits))
    wgmma = 2 * spec.consumers * tiles * y
    if num_splits > 1 or plan.split_kv:  # the combine kernel: a block per COMBINE_ROWS rows of a head (and sequence)
        if plan.varlen:
            ctas += -(-(sum(q_lens) if total_q is None else total_q) // COMBINE_ROWS) * heads
        else:
            ctas += -(-max(q_lens, default=0) // COMBINE_ROWS) * heads * batch
    return Estimate(ctas, wgmma, SECONDS_PER_RUN + SECONDS_PER_CTA * ctas + SECONDS_PER_WGMMA * wgmma)


# A CPU run past this many bytes is refused even when the machine has them: it would take hours.
MAX_RUN_BYTES = 16 * 2**30


def available_bytes() -> int | None:
    """Memory the system can give a new allocation now (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def run_bytes(head_dim: int, gqa_group: int, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> int:
    """About what one CPU run needs: drawn inputs, emulator buffers, the fp64 reference and its twin.

    Per q/k/v/out element about 64 bytes (float64 draws, float32 buffers, float64 copies);
    per score (group x Sq x Skv for each batch and KV head, one at a time) about 64 bytes
    (the reference's float64 scores and weights, the twin's float32 ones).
    """
    elems = batch * head_dim * (q_len * heads + 2 * kv_len * kv_heads)
    return 64 * elems + 64 * gqa_group * q_len * kv_len


def check_run(spec, shape, seed, options: dict) -> None:
    """Check a CPU run's shape and seed before any input is drawn: InputError naming the option.

    `shape` is the run's plan.Shape; `options` maps each shape field the user set to
    (option, default), e.g. {"q_len": ("--q-len", 128)}. A size past a launch limit or past
    memory names the option to shrink (for memory, the one furthest above its default).
    """
    from attngen.kernels.common.plan import check_shape
    from attngen.spec import SpecError

    for field, (option, _) in options.items():
        if getattr(shape, field) < 1:
            raise InputError(option, getattr(shape, field), "a positive integer")
    check_seed(seed, "--seed")

    def biggest():
        field = max(options, key=lambda f: getattr(shape, f) / max(options[f][1], 1))
        return options[field][0], getattr(shape, field)

    try:
        check_shape(spec, shape)  # grid and int32 limits, H = HKV * gqa_group, aligned multiples
    except SpecError as e:
        field = e.field.removeprefix("shape.")
        option, value = (options[field][0], getattr(shape, field)) if field in options else biggest()
        valid = e.valid.removeprefix("expected ") if e.valid.startswith("expected ") else f"a smaller value: {e.valid}"
        raise InputError(option, value, valid) from None
    need = run_bytes(spec.head_dim, spec.gqa_group, shape.batch, shape.heads, shape.kv_heads, shape.q_len, shape.kv_len)
    avail = available_bytes()
    limit = min(MAX_RUN_BYTES, int(0.8 * avail)) if avail else MAX_RUN_BYTES
    if need > limit:
        option, value = biggest()
        have = f"{avail / 2**30:.1f} GiB available, " if avail else ""
        raise InputError(option, value,
                         f"a smaller value: this CPU run needs about {need / 2**30:.1f} GiB (inputs, emulator and the fp64 "
                         f"reference) and the limit is {limit / 2**30:.1f} GiB ({have}at most {MAX_RUN_BYTES // 2**30} GiB)")
