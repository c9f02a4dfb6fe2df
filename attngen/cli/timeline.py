"""`attngen timeline SPEC ...`: record on the CPU model, replay in cycles, write one HTML page."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from attngen.emulator import POLICIES
from attngen.timeline.html import chart_data, render_page
from attngen.timeline.latency import Latency, SourceInfo
from attngen.timeline.record import linear, record, unlinear
from attngen.timeline.replay import replay


def add_subcommand(sub):
    t = sub.add_parser("timeline", help="cycle timeline of one thread block as a self-contained HTML chart")
    t.add_argument("spec", help="spec TOML file")
    t.add_argument("--batch", type=int, default=1, help="batch size")
    t.add_argument("--kv-heads", type=int, default=1, help="KV heads (query heads: kv-heads * gqa_group)")
    t.add_argument("--q-len", type=int, default=1024, help="query length")
    t.add_argument("--kv-len", type=int, default=1024, help="key length")
    t.add_argument("--block", type=int, default=None, help="linear block index x + gx*(y + gy*z) (default: the slowest block)")
    t.add_argument("--compare", metavar="SPEC2", action="append", default=[], help="another spec, charted beside the first")
    t.add_argument("--gpu", action="store_true", help="also run a stamped build on the GPU and chart the measured times")
    t.add_argument("--latency", metavar="TOML", default=None, help="latency model (default: attngen/timeline/latency.toml)")
    t.add_argument("--seed", type=int, default=0, help="emulator schedule seed (the cycles do not depend on it)")
    t.add_argument("--policy", default="random", choices=POLICIES, help="emulator schedule policy")
    t.add_argument("--max-blocks", type=int, default=64, help="record at most this many blocks (sampled evenly)")
    t.add_argument("-o", "--output", default="timeline.html", help="the HTML file to write")
    t.set_defaults(func=command)


def check_output_file(option: str, path: str) -> None:
    """A file the command will write: not a directory, in a directory that exists (checked before any work,
    so a typo costs no emulation and gives one line, not the file system's raw [Errno 2])."""
    from attngen.reference.forward import InputError

    target = Path(path)
    if target.is_dir():
        raise InputError(option, path, "a file to write, but it is a directory")
    parent = target.parent
    if not parent.is_dir():
        why = "is a file" if parent.exists() else "does not exist"
        raise InputError(option, path, f"a file in an existing directory, but {parent} {why}")


def blocks_to_record(grid, chosen, limit) -> set:
    """The query blocks of head 0, batch 0 (every head and batch repeats their timing: no control flow
    depends on head, batch or data), sampled evenly beyond `limit`, plus the chosen block."""
    gx = grid[0]
    xs = range(gx) if gx <= limit else sorted({round(i * (gx - 1) / (limit - 1)) for i in range(limit)})
    picks = {(x, 0, 0) for x in xs}
    if chosen is not None:
        picks.add(chosen)
    return picks


def model_charts(plan, args, lat):
    """Record and replay one spec; return (chart for the chosen block, its Timeline, the Recording)."""
    from attngen.timeline.record import grid_of

    dims = {"q_len": args.q_len, "heads": args.kv_heads * plan.spec.gqa_group, "batch": args.batch}
    grid = grid_of(plan, dims)
    chosen = unlinear(args.block, grid) if args.block is not None else None
    rec = record(plan, batch=args.batch, kv_heads=args.kv_heads, q_len=args.q_len, kv_len=args.kv_len,
                 seed=args.seed, policy=args.policy, blocks=blocks_to_record(grid, chosen, args.max_blocks))
    src = SourceInfo(rec.source)
    timelines = {cta.index: replay(cta, lat, src) for cta in rec.ctas}
    blocks = [(i, tl.total) for i, tl in timelines.items()]
    if chosen is None:
        chosen = max(blocks, key=lambda b: (b[1], -linear(b[0], rec.grid)))[0]
    tl = timelines[chosen]
    shape = f"B={args.batch} H={args.kv_heads * plan.spec.gqa_group} HKV={args.kv_heads} Sq={args.q_len} Skv={args.kv_len}"
    note = (f"{len(rec.ctas)} block(s) emulated (head 0, batch 0: other heads and batches repeat "
            f"their timing); latency model {Path(lat.path).name}")
    data = chart_data(tl, title=plan.name, source_lines=rec.source.splitlines(), lat=lat, blocks=blocks, grid=rec.grid,
                      shape=shape, note=note)
    return data, tl, rec


def command(args) -> int:
    from attngen.emulator import EmulationError, check_run
    from attngen.kernels.common.plan import Shape
    from attngen.kernels.fwd.plan import make_plan
    from attngen.reference.forward import InputError
    from attngen.spec import SpecError, load, serving_field

    t0 = time.perf_counter()
    if args.gpu:
        from attngen.timeline.gpu import gpu_missing

        why = gpu_missing()
        if why:
            print(f"attngen: error: timeline --gpu needs an sm_90 GPU: {why}", file=sys.stderr)
            return 2
    lat = Latency.load(args.latency)
    plans = [make_plan(load(p)) for p in [args.spec] + list(args.compare)]
    for plan in plans:
        if plan.varlen or plan.page_size or plan.split_kv:
            raise SpecError(*serving_field(plan.spec), "the timeline models one bshd, dense, unsplit kernel; "
                            "chart the same spec without layout, paged_kv and splits")
        if plan.spec.kv_dtype is not None:
            raise SpecError("kv_dtype", plan.spec.kv_dtype, "the timeline's latency model has no cost for an fp8 cache's "
                            "dequantization (docs/fp8-kv-cache.md); chart the same spec without kv_dtype")
        if plan.spec.scheduler != "single":
            raise SpecError("scheduler", plan.spec.scheduler, "the timeline charts blocks one after another, and a "
                            "persistent kernel's run at once; chart the same spec with scheduler = \"single\"")
    if args.max_blocks < 1:
        raise InputError("--max-blocks", args.max_blocks, "a positive integer")
    check_output_file("--output", args.output)
    for plan in plans:  # sizes, seed and memory, before anything is emulated
        spec = plan.spec
        check_run(spec, Shape(args.batch, args.kv_heads * spec.gqa_group, args.kv_heads, args.q_len, args.kv_len), args.seed,
                  {"batch": ("--batch", 1), "kv_heads": ("--kv-heads", 1), "q_len": ("--q-len", 1024), "kv_len": ("--kv-len", 1024)})
    total_blocks = -(-args.q_len // plans[0].spec.block_m) * args.kv_heads * plans[0].spec.gqa_group * args.batch
    if args.block is not None and not 0 <= args.block < total_blocks:
        print(f"attngen: error: --block {args.block}: the grid has {total_blocks} blocks (0 .. {total_blocks - 1})", file=sys.stderr)
        return 2
    charts = []
    try:
        for plan in plans:
            data, tl, rec = model_charts(plan, args, lat)
            charts.append(data)
            if args.gpu:
                from attngen.timeline.gpu import measured_chart

                charts.append(measured_chart(plan, args, lat, rec, tl))
    except EmulationError as e:
        print(e.report)
        return 1
    except ValueError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2
    heading = "attngen timeline: " + " vs ".join(p.name for p in plans)
    page = render_page(charts, heading=heading)
    try:
        Path(args.output).write_text(page)
    except OSError as e:  # removed or made read-only while the emulator ran
        raise InputError("--output", args.output, f"a writable file ({e.strerror})") from None
    for c in charts:
        s = c["summary"]
        print(f"{c['title']} ({c['origin']}): block {tuple(c['block'])}, {s['cycles']:.0f} cycles, "
              f"tensor cores busy {100 * s['tensor_core_busy']:.1f}%, {s['cycles_per_tile']:.0f} cycles per KV tile")
        if c["measured"]:
            m = c["measured"]
            print(f"  model {m['model_cycles']:.0f} cycles vs measured {m['cycles']:.0f} cycles; stamps cost {m['overhead']}")
    print(f"wrote {args.output} ({len(page) / 1024:.0f} KiB) in {time.perf_counter() - t0:.1f} s")
    return 0
