"""`attngen tune`: search a spec's neighbourhood for the fastest kernel, and the table it fills.

1. Enumerate the neighbours of a spec: consumers 1/2/3, k_stages and v_stages 1-4,
   block_n in steps of 16, ping-pong on and off, both forms of the steady loop where they
   differ (steady_loop "one" and "split": some tiles masked, not all), and both schedulers
   ("single" and "persistent") where the spec takes both; head_dim, dtype, causal, gqa_group
   and aligned stay the user's.
2. Prune with the plan's budgets (registers, shared memory), then keep the most promising
   `max_candidates` (largest tiles first, then deeper pipelines: what the register and
   shared-memory budgets allow, FlashAttention-3's own preference; each schedule's one loop
   just before its split loop, so both forms of the best schedules are built and timed), a
   quarter of them the most promising persistent kernels where the spec takes them.
3. Build the survivors in parallel and prune again with the build report: no spills, no
   local memory, setmaxnreg applied.
4. On a GPU, time each survivor at one shape (the method of attngen.run.gputime) and write the
   winner to the tuned table, `attngen/tuned/h200.json`, keyed by head_dim, dtype, causal,
   gqa_group and a sequence-length bucket. Without a GPU (`dry_run`), stop after step 3.

`attngen.attention` reads the table to choose the schedule (consumers, stages, block_n,
ping-pong, steady loop) when the caller names none. An entry records the winner's scheduler too,
but the runtime does not apply it: the default stays "single" (docs/build.md). The backward,
which serves both schedulers, is not tuned: its plan derives its tiles from the spec. An empty table, or no entry for a key, means "use
the plan's defaults" and is never an error.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import json
import time
from pathlib import Path

from attngen.build.nvcc import build, worker_pool
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan, make_plan, splits_steady_loop
from attngen.spec import BLOCK_N_STEP, MAX_BLOCK_N, MAX_CONSUMERS, MAX_STAGES, SCHEDULERS, STEADY_LOOPS, Spec, SpecError
from attngen.run.tuning_table import SCHEDULE_FIELDS, TABLE, table_key

DEFAULT_TOKENS = 16384  # batch * seq_len of a tuning shape, as the benchmark's rows


@dataclasses.dataclass
class Candidate:
    plan: Plan
    report: dict | None = None
    rejected: str = ""  # why it was pruned after building ("" while it survives)
    seconds: float | None = None  # on a GPU: median launch time at the tuning shape
    tflops: float | None = None


def neighbours(spec: Spec) -> list[Spec]:
    """Every schedule of `spec` within the budgets (the plan decides)."""
    out = []
    block_ns = range(BLOCK_N_STEP, MAX_BLOCK_N + 1, BLOCK_N_STEP)
    loops = STEADY_LOOPS if splits_steady_loop(spec) else ("one",)  # elsewhere both forms are one kernel
    for c, ks, vs, bn, pp, loop, sched in itertools.product(range(1, MAX_CONSUMERS + 1), range(1, MAX_STAGES + 1),
                                                            range(1, MAX_STAGES + 1), block_ns, (True, False), loops,
                                                            SCHEDULERS):
        if pp and c < 2:
            continue
        try:  # a spec the persistent scheduler does not serve (serving layouts, block masks) is refused here
            candidate = Spec(**{**spec.to_dict(), "consumers": c, "k_stages": ks, "v_stages": vs, "block_n": bn,
                                "pingpong": pp if c >= 2 else False, "block_m": None, "steady_loop": loop,
                                "scheduler": sched})
            make_plan(candidate)
        except SpecError:  # over a register or shared-memory budget
            continue
        out.append(candidate)
    return out


def promise(spec: Spec) -> tuple:
    """Sort key, most promising first: big K/V tiles, then more consumers, then deeper rings, ping-pong on;
    of one schedule (ties in stage order, as enumerated), the single-tile kernel's default one loop first,
    then its split loop, then the persistent kernel's two (which is faster is the GPU's to say)."""
    return (-spec.block_n, -spec.consumers, -min(spec.k_stages, spec.v_stages), -(spec.k_stages + spec.v_stages),
            not spec.pingpong, spec.k_stages, spec.v_stages, spec.scheduler != "single", spec.steady_loop != "one")


PERSISTENT_SHARE = 4  # a quarter of the candidates (rounded down) are persistent kernels, where the spec takes them


def candidates(spec: Spec, max_candidates: int) -> list[Plan]:
    """The most promising `max_candidates` neighbours, a quarter of them persistent kernels: their
    producer's larger register share leaves the consumers smaller tiles, so in one ranking by tile
    size they would all fall behind the single-tile kernels and never be built."""
    ranked = sorted(neighbours(spec), key=promise)
    persistent = [s for s in ranked if s.scheduler == "persistent"][:max_candidates // PERSISTENT_SHARE]
    single = [s for s in ranked if s.scheduler == "single"][:max_candidates - len(persistent)]
    return [make_plan(s) for s in sorted(single + persistent, key=promise)]


def _build_report(plan: Plan, cache_dir) -> dict:
    return build(plan, cache_dir=cache_dir).report


def build_reject(report: dict) -> str:
    """Why a built candidate is pruned ("" when it is kept)."""
    if report["spill_store_bytes"] or report["spill_load_bytes"]:
        return f"spills {report['spill_store_bytes']} B"
    if report["stack_frame_bytes"] or report["sass"]["LDL"] or report["sass"]["STL"]:
        return "local memory"
    if not report["setmaxnreg_applied"]:
        return "setmaxnreg not applied"
    return ""


def build_all(plans: list[Plan], jobs: int, cache_dir=None, progress=print) -> list[Candidate]:
    """Build every candidate (in `jobs` processes) and prune with the build report."""
    out = {p.name: Candidate(p) for p in plans}
    t0 = time.perf_counter()
    finished = []

    def record(name, report=None, error=None):
        cand = out[name]
        cand.report = report
        cand.rejected = f"build failed: {error}" if error else build_reject(report)
        finished.append(name)
        # a cache hit says so: the seconds since the tune started are not this kernel's build time
        how = "cached" if report and report.get("cached") else f"{time.perf_counter() - t0:.0f} s"
        progress(f"  [{len(finished)}/{len(out)}] {name}: {cand.rejected or 'kept'} ({how})")

    if jobs > 1 and len(plans) > 1:
        with worker_pool(min(jobs, len(plans))) as pool:
            futures = {pool.submit(_build_report, p, cache_dir): p.name for p in plans}
            for f in cf.as_completed(futures):
                try:
                    record(futures[f], report=f.result())
                except Exception as e:  # one candidate that does not build costs only itself
                    record(futures[f], error=str(e).splitlines()[0][:200])
    else:
        for p in plans:
            try:
                record(p.name, report=_build_report(p, cache_dir))
            except Exception as e:
                record(p.name, error=str(e).splitlines()[0][:200])
    return list(out.values())


def tuning_shape(spec: Spec, seq_len: int, heads: int | None = None) -> Shape:
    """The benchmark's row shape at `seq_len`: 16k tokens, 2048 / head_dim query heads."""
    h = heads or max(spec.gqa_group, 2048 // spec.head_dim // spec.gqa_group * spec.gqa_group)
    return Shape(max(1, DEFAULT_TOKENS // seq_len), h, h // spec.gqa_group, seq_len, seq_len)


def time_on_gpu(cands: list[Candidate], shape: Shape, warmup: int = 10, reps: int = 30, progress=print) -> None:
    import torch

    from attngen.run.gputime import n_sets, time_launches
    from attngen.kernels.common.plan import tflops
    from attngen.run.checks import torch_dtype
    from attngen.run.forward import compile_kernel

    spec = cands[0].plan.spec
    dt = torch_dtype(spec.dtype)
    s = shape
    set_bytes = 2 * spec.head_dim * (2 * s.batch * s.q_len * s.heads + 2 * s.batch * s.kv_len * s.kv_heads)
    n = n_sets(set_bytes, torch.cuda.get_device_properties(0).L2_cache_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [(torch.randn(s.batch, s.q_len, s.heads, spec.head_dim, device="cuda", dtype=dt, generator=gen),
             torch.randn(s.batch, s.kv_len, s.kv_heads, spec.head_dim, device="cuda", dtype=dt, generator=gen),
             torch.randn(s.batch, s.kv_len, s.kv_heads, spec.head_dim, device="cuda", dtype=dt, generator=gen))
            for _ in range(n)]
    outs = [torch.empty_like(q) for q, _, _ in sets]
    for cand in cands:
        if cand.rejected:
            continue
        try:
            kernel = compile_kernel(cand.plan)
            cand.seconds, _ = time_launches(lambda i: kernel(*sets[i], out=outs[i], check=False), n, warmup, reps)
            cand.tflops = tflops(shape, spec.head_dim, spec.causal, cand.seconds)
            progress(f"  {cand.plan.name}: {cand.tflops:.0f} TFLOP/s")
        except Exception as e:
            cand.rejected = f"launch failed: {str(e).splitlines()[0][:200]}"
            progress(f"  {cand.plan.name}: {cand.rejected}")


def record_winner(spec: Spec, seq_len: int, winner: Candidate, device: str, path: Path = TABLE) -> str:
    """Write the winner into the tuned table under its key; returns the key."""
    data = json.loads(Path(path).read_text() or "{}") if Path(path).exists() else {}
    entries = data.setdefault("entries", {})
    key = table_key(spec, seq_len)
    entries[key] = {**{k: getattr(winner.plan.spec, k) for k in SCHEDULE_FIELDS}, "scheduler": winner.plan.spec.scheduler,
                    "kernel": winner.plan.name,
                    "tflops": round(winner.tflops, 1), "device": device, "date": time.strftime("%Y-%m-%d")}
    data["entries"] = dict(sorted(entries.items()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return key
