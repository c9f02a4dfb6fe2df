"""Sweep the specs the plan accepts: build each one and compare the plan's register estimate with ptxas.

Specs are drawn with a fixed seed across every field (head dims, dtypes, causal, GQA, consumers,
stages, block sizes, ping-pong, the variants, the serving layouts); a draw that make_plan refuses
is dropped and another is drawn, so every row is a spec a user could build. The issue-21
reproducer (hd64, 3 consumers, k3v2, causal GQA 8) is row 0. Each spec is built (-j workers,
the build cache makes a rerun cheap: only specs whose emitted source changed rebuild) and the
table shows, per spec, the plan's estimate for a consumer thread, its setmaxnreg count, the
highest register the SASS names (the registers the kernel really uses: ptxas's own "Used N
registers" is the launch cap, equal for every kernel of a thread count), and the spill bytes
and LDL/STL counts. The summary line counts the specs that spill and the estimate's error
against the SASS figure (estimate - used, over the specs that do not spill). `--neighbours` also
builds, for each default block_n that only the estimate keeps from the next larger candidate,
that candidate with the estimate off: if ptxas fits it, the default is smaller than it need be.

    python bench/plan_sweep.py [-n 220] [--seed 21] [-j 2] [--neighbours] [--jsonl results.jsonl] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import random
import re
import subprocess
import sys
import time

import attngen
from attngen import hw
from attngen.build import toolchain
from attngen.kernels.fwd.plan import BLOCK_N_CANDIDATES, smem_layout
from attngen.spec import HEAD_DIMS, SpecError

# The issue-21 reproducer: accepted by the plan at 192x128, spilled 24 bytes (LDL/STL 6/6).
REPRODUCER = dict(head_dim=64, dtype="float16", causal=True, gqa_group=8, consumers=3, k_stages=3, v_stages=2)

SCORE_MODS = (
    "score + rel_bias[h, min(max(q_idx - kv_idx, -255), 255) + 255]",
    "score - 0.05 * abs(q_idx - kv_idx)",
    "30 * tanh(score / 30)",
    "where(kv_idx < 4, score + 1, score)",
)
MASK_MODS = (
    "doc_id[b, q_idx] == doc_id[b, kv_idx]",
    "kv_idx < 4 or q_idx - kv_idx < 256",
    "q_idx - kv_idx < 512 and q_idx - kv_idx > -512",
)


def draw(rng: random.Random, dtypes: tuple = ("float16", "bfloat16")) -> dict:
    """One spec's fields: every field drawn, the defaults ("choose for me") more often than not."""
    f = dict(
        head_dim=rng.choice(HEAD_DIMS),
        dtype=rng.choice(dtypes),
        causal=rng.random() < 0.5,
        gqa_group=rng.choice((1, 1, 2, 4, 8, 16)),
        consumers=rng.choice((1, 2, 2, 3, 3)),
        k_stages=rng.choice((1, 2, 2, 3, 4)),
        v_stages=rng.choice((1, 2, 2, 3, 4)),
    )
    if rng.random() < 0.3:
        f["block_n"] = rng.randrange(16, 257, 16)
    if f["consumers"] >= 2 and rng.random() < 0.25:
        f["pingpong"] = rng.random() < 0.5
    if rng.random() < 0.1:
        f["aligned"] = True
    # variants
    if rng.random() < 0.15:
        f["lse"] = True
    if rng.random() < 0.15:
        f["window"] = (rng.choice((-1, 0, 127, 511)), rng.choice((-1, 0, 64, 256)))
    if rng.random() < 0.15:
        f["softcap"] = rng.choice((15.0, 30.0, 50.0))
    if rng.random() < 0.12:
        f["alibi"] = True
    if rng.random() < 0.12:
        f["sinks"] = True
    if rng.random() < 0.15:
        f["head_dim_v"] = rng.choice(HEAD_DIMS)
    if rng.random() < 0.12:
        f["score_mod"] = rng.choice(SCORE_MODS)
    if rng.random() < 0.12:
        f["mask_mod"] = rng.choice(MASK_MODS)
    # serving
    if rng.random() < 0.15:
        f["layout"] = "varlen"
    if rng.random() < 0.15:
        f["paged_kv"] = True
        if rng.random() < 0.5:
            f["page_size"] = rng.choice((64, 128, 256))
    if rng.random() < 0.12:
        f["splits"] = rng.choice((2, 4, "auto"))
    return f


def draw_specs(n: int, seed: int, dtypes: tuple = ("float16", "bfloat16")) -> list:
    """The reproducer, then `n` distinct accepted specs (plans) from the seeded draw; a plan whose
    block_n the plan chose carries `defaulted` (its register-bound neighbour is then probed).
    `dtypes`: what the draw takes the dtype from (--fp8: float8_e4m3fn alone, no reproducer)."""
    rng = random.Random(seed)
    plans, seen, tries = [], set(), 0
    candidates = [REPRODUCER] if REPRODUCER["dtype"] in dtypes else []
    while len(plans) < n + (1 if REPRODUCER["dtype"] in dtypes else 0):
        fields = candidates.pop() if candidates else draw(rng, dtypes)
        tries += 1
        if tries > 100 * (n + 1):
            raise RuntimeError(f"only {len(plans)} accepted specs in {tries} draws")
        try:
            plan = attngen.make_plan(attngen.Spec(**fields))
        except SpecError:
            continue
        if plan.hash in seen:
            continue
        seen.add(plan.hash)
        plans.append((plan, "block_n" not in fields))
    return plans


def register_bound_neighbour(plan) -> int | None:
    """The next larger block_n candidate when only the register estimate keeps the default from it
    (shared memory and the page would allow it); None when something else binds, or none is larger."""
    spec = plan.spec
    larger = [bn for bn in BLOCK_N_CANDIDATES if bn > spec.block_n and (not spec.paged_kv or spec.page_size % bn == 0)]
    if not larger:
        return None
    bn = min(larger)
    if sum(smem_layout(spec, bn).values()) > hw.SMEM_PER_BLOCK:
        return None
    return bn


def sass_max_register(cubin) -> int | None:
    """1 + the highest general register the SASS names: the registers the busiest thread really uses."""
    tc = toolchain.current()
    out = subprocess.run([tc.cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True, env=tc.subprocess_env()).stdout
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", out)]
    return max(regs) + 1 if regs else None


@dataclasses.dataclass
class Row:
    name: str
    spec: dict
    estimate: int  # plan.consumer_regs_needed
    budget: int  # setmaxnreg count of a consumer
    producer: int  # setmaxnreg count of the producer
    launch: int | None = None  # ptxas "Used N registers"
    used: int | None = None  # SASS: 1 + highest register named
    spill_st: int | None = None
    spill_ld: int | None = None
    stack: int | None = None
    ldl: int | None = None
    stl: int | None = None
    combine_spill: int | None = None
    cached: bool | None = None
    error: str | None = None
    defaulted: bool = False  # the plan chose block_n
    neighbour: int | None = None  # the next larger block_n, when only the register estimate refused it
    neighbour_spills: bool | None = None  # ptxas on that neighbour (built with the estimate off)
    neighbour_estimate: int | None = None

    @property
    def spills(self) -> bool:
        return bool(self.spill_st or self.spill_ld or self.stack or self.ldl or self.stl or self.combine_spill)


def spills_of(report: dict) -> int:
    """Nonzero when a kernel (or its combine kernel) touches local memory: spill and stack bytes plus LDL/STL."""
    c = report.get("combine", {})
    return (report["spill_store_bytes"] + report["spill_load_bytes"] + report["stack_frame_bytes"] + report["sass"]["LDL"]
            + report["sass"]["STL"] + sum(c.get(k, 0) for k in ("spill_store_bytes", "spill_load_bytes", "stack_frame_bytes")))


def build_one(fields: dict, defaulted: bool, cache_dir, neighbours: bool = True) -> dict:
    """Worker: plan and build one spec (and its register-bound neighbour), return its row (never
    raises). The spec's fields travel, not the plan: a parsed score_mod keys its node types by
    id(), which a pickled copy does not keep."""
    from attngen.build.nvcc import build, one_line

    plan = attngen.make_plan(attngen.Spec(**fields))
    row = Row(plan.name, plan.spec.canonical_dict(), plan.consumer_regs_needed, plan.consumer_regs, plan.producer_regs,
              defaulted=defaulted)
    try:
        result = build(plan, cache_dir=cache_dir)
        row.neighbour = register_bound_neighbour(plan) if defaulted and neighbours else None
        if row.neighbour:
            near = attngen.make_plan(attngen.Spec(**{**fields, "block_n": row.neighbour}), check_registers=False)
            row.neighbour_estimate = near.consumer_regs_needed
            row.neighbour_spills = spills_of(build(near, cache_dir=cache_dir).report) > 0
    except Exception as e:  # noqa: BLE001 - one failed build is a row, not the end of the sweep
        row.error = f"{type(e).__name__}: {one_line(e)}"
        return dataclasses.asdict(row)
    r = result.report
    row.launch, row.cached = r["registers"], r["cached"]
    row.spill_st, row.spill_ld, row.stack = r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]
    row.ldl, row.stl = r["sass"]["LDL"], r["sass"]["STL"]
    row.used = sass_max_register(result.cubin_path)
    if "combine" in r:
        c = r["combine"]
        row.combine_spill = c["spill_store_bytes"] + c["spill_load_bytes"] + c["stack_frame_bytes"]
    return dataclasses.asdict(row)


def spec_fields(plan) -> dict:
    """The resolved spec's fields (planning them again gives the same plan)."""
    return {k: v for k, v in plan.spec.to_dict().items() if v is not None}


def run(plans: list, jobs: int, cache_dir=None, on_row=None, neighbours: bool = True) -> list:
    """Build every plan, `jobs` at a time; rows in the order given."""
    rows = [None] * len(plans)
    if jobs <= 1:
        for i, (p, defaulted) in enumerate(plans):
            rows[i] = Row(**build_one(spec_fields(p), defaulted, cache_dir, neighbours))
            on_row and on_row(i, rows[i])
        return rows
    # Edge first: the specs with the fewest spare registers by the estimate are the likeliest to
    # spill, so a sweep cut short has checked those (the table is printed in drawn order).
    order = sorted(range(len(plans)), key=lambda i: (plans[i][0].consumer_regs - plans[i][0].consumer_regs_needed, i))
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(build_one, spec_fields(plans[i][0]), plans[i][1], cache_dir, neighbours): i for i in order}
        for f in cf.as_completed(futures):
            i = futures[f]
            try:
                rows[i] = Row(**f.result())
            except Exception as e:  # noqa: BLE001 - a worker died
                p = plans[i][0]
                rows[i] = Row(p.name, p.spec.canonical_dict(), p.consumer_regs_needed, p.consumer_regs, p.producer_regs,
                              error=f"worker failed: {e}")
            on_row and on_row(i, rows[i])
    return rows


def format_row(i: int, r: Row) -> str:
    if r.error:
        return f"{i:>4}  {r.name:<72} {r.estimate:>4} {r.budget:>4}  BUILD FAILED: {r.error}"
    spill = (f"{r.spill_st}/{r.spill_ld}" + (f" stack {r.stack}" if r.stack else "")
             + (f" combine {r.combine_spill}" if r.combine_spill else ""))
    near = "-" if not r.neighbour else f"n{r.neighbour} {r.neighbour_estimate} " + ("spills" if r.neighbour_spills else "FITS")
    return (f"{i:>4}  {r.name:<72} {r.estimate:>4} {r.budget:>4} {r.used or '?':>4} {r.launch:>4}  "
            f"{spill:<14} {f'{r.ldl}/{r.stl}':<7}  {near}" + ("  SPILLS" if r.spills else ""))


# est: the plan's registers per consumer thread; cap: its setmaxnreg count; used: 1 + the highest
# register in the SASS; ptx: ptxas's "Used N registers" (the launch cap); next: for a default
# block_n that only the estimate keeps from the next candidate, that candidate's estimate and ptxas
HEADER = (f"{'#':>4}  {'kernel':<72} {'est':>4} {'cap':>4} {'used':>4} {'ptx':>4}  {'spill B st/ld':<14} "
          f"{'LDL/STL':<7}  next")


def loose(rows: list) -> list:
    """Default block_n's whose next larger candidate the estimate refused although ptxas fits it."""
    return [r for r in rows if not r.error and r.neighbour and r.neighbour_spills is False]


def summary(rows: list) -> str:
    built = [r for r in rows if not r.error]
    spilled = [r for r in built if r.spills]
    fits = [r for r in built if not r.spills and r.used]
    errs = [r.estimate - r.used for r in fits]
    over = [r for r in spilled if r.estimate <= r.budget]
    probed = [r for r in built if r.neighbour]
    text = (f"{len(rows)} specs, {len(spilled)} spill ({len(over)} of them within the estimate's budget), "
            f"{len(rows) - len(built)} failed to build, {len(loose(rows))} of {len(probed)} register-bound defaults "
            f"could take the next block_n")
    if errs:
        text += (f"; estimate - SASS registers over the {len(fits)} spill-free specs: "
                 f"min {min(errs):+d}, max {max(errs):+d}, mean {sum(errs) / len(errs):+.1f}")
    # far from the cap ptxas spends registers freely, so the error that matters is at the edge
    edge = [r.estimate - r.used for r in fits if r.budget - r.estimate <= 8]
    if edge:
        text += (f"; over the {len(edge)} within 8 of their cap: min {min(edge):+d}, max {max(edge):+d}, "
                 f"mean {sum(edge) / len(edge):+.1f}")
    return text


# -- the backward (--backward): the three or four kernels of a spec's backward module ----------------
# Kernels with a register budget: the main kernel (2 MMA warpgroups at setmaxnreg 240) and the
# deterministic mode's dq kernel; the preprocess and postprocess kernels run at the launch count.
BACKWARD_PARTS = ("main", "dq")


def draw_backward(rng: random.Random) -> dict:
    """One backward-supported spec's fields (the forward's tile fields are the forward's business:
    the backward plan does not read them)."""
    f = dict(head_dim=rng.choice(HEAD_DIMS), dtype=rng.choice(("float16", "bfloat16")), causal=rng.random() < 0.5,
             gqa_group=rng.choice((1, 1, 2, 4, 8)))
    if rng.random() < 0.15:
        f["window"] = (rng.choice((-1, 0, 127, 511)), rng.choice((-1, 0, 64, 256)))
    if rng.random() < 0.2:
        f["softcap"] = rng.choice((15.0, 30.0, 50.0))
    if rng.random() < 0.15:
        f["alibi"] = True
    if rng.random() < 0.15:
        f["sinks"] = True
    if rng.random() < 0.2:
        f["head_dim_v"] = rng.choice(HEAD_DIMS)
    if rng.random() < 0.15:
        f["score_mod"] = rng.choice(SCORE_MODS)
    if rng.random() < 0.15:
        f["mask_mod"] = rng.choice(MASK_MODS)
    if rng.random() < 0.2:
        f["layout"] = "varlen"
    if rng.random() < 0.25:
        f["deterministic"] = True
    return f


def draw_backward_specs(n: int, seed: int) -> list:
    """`n` distinct specs whose backward the plan accepts, as (fields, BackwardPlan); each head dim's
    plain spec first (the register edges of the tile table), then the seeded draw."""
    from attngen.kernels.bwd.plan import plan_backward

    rng = random.Random(seed)
    out, seen, tries = [], set(), 0
    candidates = [dict(head_dim=hd) for hd in reversed(HEAD_DIMS)]
    while len(out) < n:
        fields = candidates.pop() if candidates else draw_backward(rng)
        tries += 1
        if tries > 100 * n:
            raise RuntimeError(f"only {len(out)} accepted backward specs in {tries} draws")
        try:
            bp = plan_backward(attngen.Spec(**fields))
        except SpecError:
            continue
        if bp.hash not in seen:
            seen.add(bp.hash)
            out.append((fields, bp))
    return out


@dataclasses.dataclass
class BwdRow:
    name: str  # the kernel: the module's name, + "_dq" for the dq kernel
    part: str
    estimate: int  # the plan's registers per MMA-warpgroup thread for this kernel
    budget: int  # its setmaxnreg count
    block_m: int
    columns: bool
    used: int | None = None  # SASS: 1 + highest register named
    launch: int | None = None  # ptxas "Used N registers"
    setmaxnreg: int | None = None  # USETMAXREG instructions in the SASS
    spill: int | None = None  # spills_of: spill + stack bytes + LDL/STL
    error: str | None = None
    probe: str = ""  # "" for the plan's own tile, else the refused neighbour it is ("m128", "keys")

    @property
    def spills(self) -> bool:
        return bool(self.spill)


def backward_rows(bp, results: dict, probe: str = "") -> list:
    rows = []
    for part in BACKWARD_PARTS:
        if part not in results:
            continue
        r = results[part].report
        est = bp.consumer_regs_needed if part == "main" else bp.dq_regs_needed
        rows.append(BwdRow(bp.name + ("" if part == "main" else f"_{part}"), part, est, bp.consumer_regs, bp.block_m,
                           bp.columns, used=sass_max_register(results[part].cubin_path), launch=r["registers"],
                           setmaxnreg=r["sass"].get("USETMAXREG", 0), spill=spills_of(r), probe=probe))
    return rows


def backward_neighbours(fields: dict, bp) -> list:
    """The tiles the estimate refused next to the plan's: 64 more Q rows, and for a column split the
    key split; each (label, BackwardPlan) planned with the estimate off (shared memory still binds)."""
    from attngen.kernels.bwd.plan import plan_backward

    near = []
    for label, kw in ((f"m{bp.block_m + hw.WGMMA_M}", dict(block_m=bp.block_m + hw.WGMMA_M, columns=bp.columns)),
                      ("keys", dict(block_m=bp.block_m, columns=False))):
        if label == "keys" and not bp.columns:
            continue
        try:
            near.append((label, plan_backward(attngen.Spec(**fields), check_registers=False, **kw)))
        except SpecError:
            pass
    return near


def build_one_backward(fields: dict, cache_dir, neighbours: bool = False) -> list:
    """Worker: plan and build one spec's backward module (and its refused neighbours); its kernels'
    rows as dicts (never raises)."""
    from attngen.build.nvcc import build_backward, one_line
    from attngen.kernels.bwd.plan import plan_backward

    bp = plan_backward(attngen.Spec(**fields))
    plans = [("", bp)] + (backward_neighbours(fields, bp) if neighbours else [])
    rows = []
    for probe, p in plans:
        try:
            rows += backward_rows(p, build_backward(p, cache_dir=cache_dir), probe)
        except Exception as e:  # noqa: BLE001 - one failed build is a row, not the end of the sweep
            rows.append(BwdRow(p.name, "main", p.consumer_regs_needed, p.consumer_regs, p.block_m, p.columns,
                               error=f"{type(e).__name__}: {one_line(e)}", probe=probe))
    return [dataclasses.asdict(r) for r in rows]


def run_backward(specs: list, jobs: int, cache_dir=None, on_rows=None, neighbours: bool = False) -> list:
    """Build every spec's backward, `jobs` at a time, the fewest spare registers first; rows per spec."""
    order = sorted(range(len(specs)), key=lambda i: (specs[i][1].consumer_regs - specs[i][1].consumer_regs_needed, i))
    out = [None] * len(specs)
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(build_one_backward, specs[i][0], cache_dir, neighbours): i for i in order}
        for f in cf.as_completed(futures):
            i = futures[f]
            try:
                out[i] = [BwdRow(**r) for r in f.result()]
            except Exception as e:  # noqa: BLE001 - a worker died
                bp = specs[i][1]
                out[i] = [BwdRow(bp.name, "main", bp.consumer_regs_needed, bp.consumer_regs, bp.block_m, bp.columns,
                                 error=f"worker failed: {e}")]
            on_rows and on_rows(i, out[i])
    return out


BWD_HEADER = f"{'#':>4}  {'kernel':<76} {'tile':<10} {'est':>4} {'cap':>4} {'used':>4} {'ptx':>4} {'maxnreg':>7}  spill"


def format_bwd_row(i: int, r: BwdRow) -> str:
    tile = f"m{r.block_m}" + (" cols" if r.columns else "") + (f" [{r.probe}]" if r.probe else "")
    head = f"{i:>4}  {r.name:<76} {tile:<10} {r.estimate:>4} {r.budget:>4}"
    if r.error:
        return f"{head}  BUILD FAILED: {r.error}"
    verdict = ("  SPILLS" if r.spills and not r.probe else "  spills (refused)" if r.spills else
               "  FITS (refused)" if r.probe else "")
    return f"{head} {r.used or '?':>4} {r.launch:>4} {r.setmaxnreg:>7}  {r.spill}{verdict}"


def summary_backward(rows: list) -> str:
    own = [r for r in rows if not r.probe]
    built = [r for r in own if not r.error]
    spilled = [r for r in built if r.spills]
    nomax = [r for r in built if not r.setmaxnreg]
    probes = [r for r in rows if r.probe and not r.error and r.part == "main"]
    text = (f"{len(built)} kernels with a register budget built ({sum(r.part == 'main' for r in built)} main, "
            f"{sum(r.part == 'dq' for r in built)} dq), {len(spilled)} spill, {len(nomax)} without setmaxnreg, "
            f"{len(own) - len(built)} failed; refused neighbours: {sum(r.spills for r in probes)} of {len(probes)} spill")
    for part in BACKWARD_PARTS:
        errs = [r.estimate - r.used for r in built if r.part == part and not r.spills and r.used]
        if errs:
            text += f"; {part} estimate - SASS: min {min(errs):+d}, max {max(errs):+d}, mean {sum(errs) / len(errs):+.1f}"
    # far from the cap ptxas spends registers freely: the error that matters is at the edge
    edge = [r.estimate - r.used for r in built if not r.spills and r.used and r.budget - r.estimate <= 8]
    if edge:
        text += f"; within 8 of the cap ({len(edge)}): min {min(edge):+d}, max {max(edge):+d}"
    return text


def main_backward(args) -> int:
    t0 = time.monotonic()
    specs = draw_backward_specs(args.n, args.seed)
    if args.list:
        for i, (_, bp) in enumerate(specs):
            print(f"{i:>4}  {bp.name:<76} m{bp.block_m}{' cols' if bp.columns else '':<5} {bp.consumer_regs_needed:>4} "
                  f"{bp.dq_regs_needed or '':>4} {bp.consumer_regs:>4}")
        return 0
    out = open(args.jsonl, "w") if args.jsonl else None
    print(BWD_HEADER, flush=True)

    def on_rows(i, rows):
        for r in rows:
            print(format_bwd_row(i, r), flush=True)
            if out:
                out.write(json.dumps({"i": i, "fields": specs[i][0], **dataclasses.asdict(r)}) + "\n")
                out.flush()

    per_spec = run_backward(specs, args.jobs, args.cache_dir, on_rows, neighbours=args.neighbours)
    rows = [r for rs in per_spec for r in rs]
    print(f"\n{len(specs)} specs in {time.monotonic() - t0:.0f} s: " + summary_backward(rows))
    bad = [r for r in rows if not r.probe and (r.error or r.spills or not r.setmaxnreg)]
    return 1 if bad or any(r.probe and r.part == "main" and not r.error and not r.spills for r in rows) else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=220, help="drawn specs (beside the reproducer)")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--jsonl", default=None, help="also write one JSON row per spec here")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--neighbours", action="store_true",
                    help="also build the next larger block_n of each register-bound default, the estimate off")
    ap.add_argument("--list", action="store_true", help="print the drawn kernels and their estimates, build nothing")
    ap.add_argument("--fp8", action="store_true", help="draw fp8 (float8_e4m3fn) forward specs only (docs/fp8.md)")
    ap.add_argument("--backward", action="store_true",
                    help="sweep backward modules instead (main and dq kernels; --neighbours: the refused larger tiles)")
    args = ap.parse_args(argv)
    if args.backward:
        return main_backward(args)

    t0 = time.monotonic()
    plans = draw_specs(args.n, args.seed, (hw.E4M3,) if args.fp8 else ("float16", "bfloat16"))
    if args.list:
        for i, (p, defaulted) in enumerate(plans):
            print(f"{i:>4}  {p.name:<72} {p.consumer_regs_needed:>4} {p.consumer_regs:>4}" + ("  (default block_n)" if defaulted else ""))
        return 0
    out = open(args.jsonl, "w") if args.jsonl else None
    print(HEADER, flush=True)

    def on_row(i, r):
        print(format_row(i, r), flush=True)
        if out:
            out.write(json.dumps({"i": i, **dataclasses.asdict(r)}) + "\n")
            out.flush()

    rows = run(plans, args.jobs, args.cache_dir, on_row, neighbours=args.neighbours)
    print(f"\nin order ({time.monotonic() - t0:.0f} s):\n{HEADER}")
    for i, r in enumerate(rows):
        print(format_row(i, r))
    print(summary(rows))
    return 1 if any(r.spills or r.error for r in rows) or loose(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
