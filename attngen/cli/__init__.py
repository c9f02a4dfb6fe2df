"""`attngen` command line: generate, show, diff, build, precompile, check, tune, emulate, timeline.

`--backward` on show, generate, build and emulate selects the spec's backward module
(attngen/cli_bwd.py); `check` runs both passes.

Every user error (a bad spec, a bad shape or option, a missing file, a run too big for
memory) is printed as one line, `attngen: error: ...`, naming the field or option, the
value and what would be valid, with exit code 2; argparse's own errors (an unknown option,
a missing value) are one such line too. Every option of a command is checked before the
command does any work. Exit 1: the toolchain or the file system refused, or a check failed.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import sys
from pathlib import Path

from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import generate, render_source
from attngen.reference.forward import InputError, check_scale
from attngen.spec import SpecError, load, serving_field
from attngen.version import __version__


def plan_of(path: str, shape: Shape | None = None):
    """Each command plans its spec once and passes the plan down."""
    return make_plan(load(path), shape)


def check_dir_option(option: str, path: str | None) -> None:
    """A directory the command will create or write into must not be an existing file."""
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise InputError(option, path, "a directory (to create or write into), but it is a file")


def check_positive(args, *options: str) -> None:
    """Integer options that must be at least 1 (argparse has already made them ints)."""
    for option in options:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            raise InputError(option, value, "a positive integer")


def cmd_generate(args) -> int:
    from attngen.kernels.bwd.render import generate_backward

    check_dir_option("--output", args.output)
    if args.presets:  # the goldens: every preset's forward kernel, each backward preset's backward module
        if args.spec is not None:
            raise InputError("--presets", args.spec, "no spec file beside it (it writes every preset)")
        jobs = [] if args.backward else [(path, False) for path in preset_files()]
        jobs += [(path, True) for path in backward_preset_files()]
    elif args.spec is None:
        raise InputError("SPEC", "none", "a spec file, or --presets")
    else:
        jobs = [(args.spec, args.backward)]
    plans = [(plan_of(path), backward) for path, backward in jobs]  # every spec checked before a file is written
    for plan, backward in plans:
        print(generate_backward(plan, args.output) if backward else generate(plan, args.output))
    return 0


def cmd_show(args) -> int:
    from attngen.kernels.bwd.render import render_backward_source

    plan = plan_of(args.spec)
    sys.stdout.write(render_backward_source(plan) if args.backward else render_source(plan))
    return 0


def cmd_diff(args) -> int:
    a, b = plan_of(args.a), plan_of(args.b)
    lines = difflib.unified_diff(
        render_source(a).splitlines(True), render_source(b).splitlines(True), fromfile=f"{a.name}.py", tofile=f"{b.name}.py"
    )
    sys.stdout.writelines(lines)
    return 0


def cmd_build(args) -> int:
    from attngen.build.nvcc import Progress, build, build_many, format_report, format_summary
    from attngen.timeline.command import check_output_file

    check_dir_option("--cache-dir", args.cache_dir)
    check_positive(args, "--jobs")
    if args.cuda:
        check_output_file("--cuda", args.cuda)
    shape = Shape.parse(args.shape) if args.shape else None  # a bad shape is one error, not one per kernel
    if args.backward:
        from attngen.cli import backward as cli_bwd

        if args.cuda:
            raise InputError("--cuda", args.cuda, "the forward kernel's CUDA only (drop --backward)")
        return cli_bwd.build_command(make_plan(load(cli_bwd.only_one_spec(args.spec)), shape), args)
    if len(args.spec) > 1:  # several kernels: worker processes, progress on stderr, one row each
        if args.cuda:
            raise InputError("--cuda", args.cuda, "one spec file to write the CUDA of (it was given several)")
        outcomes = build_many(args.spec, shape=args.shape, cache_dir=args.cache_dir, jobs=args.jobs, progress=Progress(sys.stderr))
        if args.json:
            print(json.dumps([o.report if o.error is None else {"spec": o.label, "error": o.error} for o in outcomes], indent=2, sort_keys=True))
        else:
            print(format_summary(outcomes))
        return 2 if any(o.user_error for o in outcomes) else 1 if any(o.error for o in outcomes) else 0
    result = build(plan_of(args.spec[0], shape), cache_dir=args.cache_dir)
    if args.cuda:
        with open(args.cuda, "w") as f:
            f.write(result.cuda_source)
    report = result.report
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0


PRESETS = Path(__file__).resolve().parents[2] / "examples"  # the presets: the source tree's examples/*.toml


def preset_files() -> list:
    """`--presets`: every preset spec file (InputError when the package runs without its source tree)."""
    found = sorted(PRESETS.glob("*.toml"))
    if not found:
        raise InputError("--presets", str(PRESETS), "a source checkout's examples/*.toml (the presets are not "
                         "installed with the package): pass the spec files instead")
    return [str(p) for p in found]


# The backward presets: generated/ also holds their backward module (docs/backward.md, "Presets").
# Chosen to cover the backward's features: hd128 causal (the default), hd64 without a mask, GQA
# with sinks (dK/dV accumulators, dsinks), window + softcap, a score_mod (its symbolic
# derivative), deterministic GQA with sinks (the dq and dsinks kernels), head_dim 192 with head_dim_v 128 (the column
# split) and a varlen batch (packed training).
BACKWARD_PRESETS = ("default", "hd64_f16_full_nopp", "hd128_bf16_gqa8_sinks", "hd128_f16_causal_window_softcap_lse",
                    "hd128_f16_relbias_score_mod", "hd64_f16_gqa2_causal_sinks_deterministic", "hd192_dv128_bf16_causal",
                    "varlen_hd128_bf16_causal")


def backward_preset_files() -> list:
    found = {Path(p).stem: p for p in preset_files()}
    return [found[name] for name in BACKWARD_PRESETS]


def _precompile_one(plan, cache_dir, backward: bool) -> tuple[list, str | None]:
    """Precompile a plan's kernel and, with --backward, what training with it loads too (the forward
    with its LSE and the backward module: backward.precompile_training). Returns the entries done and,
    for a spec the backward refuses, that one line (the forward is still precompiled)."""
    from attngen.run.backward import precompile_training
    from attngen.run.forward import precompile

    done = [precompile(plan, cache_dir=cache_dir)]
    if not backward:
        return done, None
    try:
        return done + precompile_training(plan.spec, plan.shape, cache_dir=cache_dir), None
    except SpecError as e:
        return done, f"backward: not precompiled: {e}"


def _precompile_job(path: str, shape: str | None, cache_dir, backward: bool = False):
    """One spec of `attngen precompile` (run in a worker process): never raises."""
    from attngen.build.nvcc import Outcome, one_line

    label = path if shape is None else f"{path} --shape {shape}"
    try:
        plan = make_plan(load(path), Shape.parse(shape) if shape else None)
        done, note = _precompile_one(plan, cache_dir, backward)
    except SpecError as e:
        return Outcome(label, error=one_line(e), user_error=True)
    except Exception as e:  # noqa: BLE001 - reported per kernel, one line
        return Outcome(label, error=one_line(e))
    report = {"kernel": plan.name, "cached": all(d.cached for d in done),
              "seconds": {"precompile": round(sum(d.seconds for d in done), 1)},
              "entry": ", ".join(d.path.name for d in done), "note": note}
    return Outcome(label, report=report)


def cmd_precompile(args) -> int:
    """Fill the runtime's kernel cache ahead of the first call (docs/build.md, "Kernels before the first call")."""
    from attngen.build.nvcc import Progress, build_many
    from attngen.build.cache import RUNTIME, cache_root

    check_dir_option("--cache-dir", args.cache_dir)
    check_positive(args, "--jobs")
    specs = list(args.spec) + (preset_files() if args.presets else [])
    if not specs:
        raise InputError("SPEC", "none", "one or more spec files, or --presets")
    shape = Shape.parse(args.shape) if args.shape else None  # a bad shape is one error, not one per kernel
    where = cache_root(args.cache_dir) / RUNTIME
    hint = "" if args.cache_dir is None else f" (at run time: ATTNGEN_CACHE={cache_root(args.cache_dir)})"
    if len(specs) == 1:  # in this process, like `attngen build` of one spec: a bad spec is one error line
        from attngen.build.nvcc import BuildError, one_line

        plan = plan_of(specs[0], shape)
        what = " and what training loads (--backward)" if args.backward else ""
        print(f"precompiling {plan.name}{what} into {where} (TileLang's lowering and nvcc: tens of seconds)", flush=True)
        try:
            done, note = _precompile_one(plan, args.cache_dir, args.backward)
        except (BuildError, OSError):
            raise
        except Exception as e:  # TileLang and TVM raise many types: one line, exit 1
            raise BuildError(f"precompiling {plan.name} failed: {one_line(e)}") from None
        for d in done:
            how = "was there already" if d.cached else f"built in {d.seconds:.1f} s"
            print(f"{d.path.name}  {how}{hint}")
        if note:
            print(note)
        return 0
    job = functools.partial(_precompile_job, backward=args.backward)
    outcomes = build_many(specs, shape=args.shape, cache_dir=args.cache_dir, jobs=args.jobs, progress=Progress(sys.stderr),
                          job=job)
    for o in outcomes:
        if o.error is None:
            r = o.report
            how = "was there" if r["cached"] else f"built in {r['seconds']['precompile']} s"
            print(f"{r['entry']}  {how}  ({o.label})" + (f"; {r['note']}" if r["note"] else ""))
    done = [o for o in outcomes if o.error is None]
    print(f"{len(done)} of {len(outcomes)} kernel(s) ready in {where}{hint}")
    return 2 if any(o.user_error for o in outcomes) else 1 if any(o.error for o in outcomes) else 0


def build_verdicts(report: dict) -> list:
    """(ok, what) pairs: the resource promises every generated kernel must keep."""
    sass = report["sass"]
    return [
        (report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0, "no register spills"),
        (report["stack_frame_bytes"] == 0 and sass["LDL"] == 0 and sass["STL"] == 0, "no local memory"),
        (sass["HGMMA"] > 0 and sass["HGMMA_A_FROM_REGISTERS"] > 0, "wgmma (HGMMA) with P from registers"),
        (report["setmaxnreg_applied"], "setmaxnreg applied"),
        (report["dynamic_smem_bytes"] == report["plan_smem_bytes"], "shared memory as planned"),
    ]


def cmd_check(args) -> int:
    """The main job: generate, build, and run the kernel on the CPU model against the fp64 reference;
    then the same for the backward kernels, where the backward supports the spec."""
    from attngen.cli import backward as cli_bwd
    from attngen.build.nvcc import build, format_report

    check_dir_option("--output", args.output)
    check_dir_option("--cache-dir", args.cache_dir)
    plan = plan_of(args.spec)
    check_run_args(plan, args)  # the CPU run's options, before generating or building anything
    rounded = rounding_note(plan, args)
    if rounded:
        print(rounded)
    bp, refused = cli_bwd.backward_plan_or_reason(plan)
    print(f"generated  {generate(plan, args.output)}")
    result = build(plan, cache_dir=args.cache_dir)
    print(format_report(result.report))
    verdicts = build_verdicts(result.report)
    verdicts.append(emulate_verdict(plan, args))
    if bp is None:
        print(f"backward: not generated for this spec ({refused}); the forward is checked alone")
    else:
        heads, kv_heads, q_len, kv_len = run_shape(plan, args)
        verdicts += cli_bwd.check_verdicts(bp, (heads, kv_heads, q_len, kv_len), args)
    for ok, what in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    failed = sum(not ok for ok, _ in verdicts)
    print(f"{plan.name}: {'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return 1 if failed else 0


def run_shape(plan, args) -> tuple:
    """The CPU run of `check`: (heads, kv_heads, q_len, kv_len), lengths rounded up to tiles when aligned."""
    spec = plan.spec
    q_len, kv_len = args.q_len, args.kv_len
    if spec.aligned and q_len > 0 and kv_len > 0:  # an aligned kernel is only defined on tile multiples
        q_len = -(-q_len // spec.block_m) * spec.block_m
        kv_len = -(-kv_len // spec.block_n) * spec.block_n
    return 2 * spec.gqa_group, 2, q_len, kv_len


def rounding_note(plan, args) -> str:
    """What run_shape rounded, said once ("" when nothing was): an aligned kernel runs whole tiles only."""
    _, _, q_len, kv_len = run_shape(plan, args)
    spec = plan.spec
    changed = [f"{option} {given} -> {used} (a multiple of {tile} = {size})" for option, given, used, tile, size in
               (("--q-len", args.q_len, q_len, "block_m", spec.block_m), ("--kv-len", args.kv_len, kv_len, "block_n", spec.block_n))
               if given != used]
    return f"aligned spec: the CPU runs round up {', '.join(changed)}" if changed else ""


def check_run_args(plan, args) -> None:
    from attngen.emulator import check_run

    heads, kv_heads, q_len, kv_len = run_shape(plan, args)
    check_run(plan.spec, Shape(1, heads, kv_heads, q_len, kv_len), args.seed,
              {"q_len": ("--q-len", 200), "kv_len": ("--kv-len", 333)})
    check_scale(args.softmax_scale, plan.spec.head_dim, "--softmax-scale")


def emulate_verdict(plan, args) -> tuple:
    """Run the emitted kernel on the CPU model at one odd shape and compare with the fp64 reference."""
    from attngen import emulator
    from attngen.emulator import EmulationError
    from attngen.emulator.driver import check_emulated, run_shape_text

    heads, kv_heads, q_len, kv_len = run_shape(plan, args)
    what = f"CPU model vs fp64 reference ({run_shape_text(plan, 1, heads, kv_heads, q_len, kv_len)}, seed {args.seed})"
    if args.softmax_scale is not None:
        what = f"{what[:-1]}, softmax scale {args.softmax_scale!r})"
    try:  # variant inputs (v of head_dim_v, call-time tensors) and the LSE check where the spec has lse
        ok, text, stats = check_emulated(plan, 1, heads, kv_heads, q_len, kv_len, seed=args.seed, run=emulator.emulate_stats,
                                         softmax_scale=args.softmax_scale)
    except EmulationError as e:
        print(e.report)
        return False, what
    return ok, f"{what}: {text}, {stats.seconds:.1f} s"


def cmd_tune(args) -> int:
    """Search the spec's schedules: build and prune on any machine, time and record on a GPU."""
    from attngen.run import tune
    from attngen.run.tuning_table import TABLE

    check_positive(args, "--seq-len", "--max-candidates", "--jobs")
    check_dir_option("--cache-dir", args.cache_dir)
    user_spec = load(args.spec)
    base = make_plan(user_spec).spec
    if base.layout != "bshd" or base.paged_kv or base.splits != 1:
        raise SpecError(*serving_field(base), "tune times bshd, dense, unsplit kernels; tune the same spec without "
                        "layout, paged_kv and splits (their schedule carries over)")
    shape = Shape.parse(args.shape) if args.shape else tune.tuning_shape(base, args.seq_len)
    make_plan(user_spec, shape)  # a bad shape is a SpecError before any build
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            raise SpecError("--dry-run", False, "timing needs a compute capability 9.0 GPU; "
                            "pass --dry-run to build and list the candidates without one")
    plans = tune.candidates(user_spec, args.max_candidates)
    print(f"tune {base.head_dim} {base.dtype} {'causal' if base.causal else 'full'} g{base.gqa_group}: "
          f"{len(tune.neighbours(user_spec))} schedules within the budgets, building the {len(plans)} most promising "
          f"with {args.jobs} job(s)", flush=True)
    cands = tune.build_all(plans, args.jobs, cache_dir=args.cache_dir, progress=lambda line: print(line, flush=True))
    if not args.dry_run:
        tune.time_on_gpu(cands, shape, progress=lambda line: print(line, flush=True))
    print(f"\n{'kernel':52} {'regs':>4} {'spill B':>7} {'smem B':>7}  verdict")
    for c in sorted(cands, key=lambda c: -(c.tflops or 0)):
        r = c.report or {}
        verdict = c.rejected or (f"{c.tflops:.0f} TFLOP/s" if c.tflops else "kept")
        print(f"{c.plan.name:52} {r.get('registers', '-'):>4} {r.get('spill_store_bytes', '-'):>7} "
              f"{r.get('dynamic_smem_bytes', '-'):>7}  {verdict}")
    kept = [c for c in cands if not c.rejected]
    if args.dry_run:
        print(f"{len(kept)} of {len(cands)} candidates kept (dry run: nothing timed, the table is unchanged)")
        return 0 if kept else 1
    timed = [c for c in kept if c.tflops]
    if not timed:
        print("no candidate could be timed; the table is unchanged")
        return 1
    best = max(timed, key=lambda c: c.tflops)
    device = torch.cuda.get_device_name()
    key = tune.record_winner(base, shape.kv_len, best, device, path=args.table or TABLE)
    print(f"winner for {key}: {best.plan.name} at {best.tflops:.0f} TFLOP/s, written to {args.table or TABLE}")
    return 0


def cmd_emulate(args) -> int:
    from attngen.emulator import command

    if args.backward:
        from attngen.cli import backward as cli_bwd

        return cli_bwd.emulate_command(args, plan_of(args.spec))
    return command(args, plan_of(args.spec))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each default, except where there is none to show or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error: `attngen: error: ...` and exit 2."""

    def error(self, message):
        self.exit(2, f"attngen: error: {message} (see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    from attngen.emulator import POLICIES

    fmt = HelpFormatter
    p = Parser(prog="attngen", description="FlashAttention-3 forward and backward kernels for Hopper, from a spec.",
               formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"attngen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=lambda **kw: Parser(formatter_class=fmt, **kw))

    g = sub.add_parser("generate", help="write the emitted kernel source and print its path")
    g.add_argument("spec", nargs="?", help="spec TOML file")
    g.add_argument("-o", "--output", default="generated", help="output directory")
    g.add_argument("--backward", action="store_true", help="write the spec's backward module (fa3_bwd_<name>.py: preprocess, "
                   "main and postprocess kernels, docs/backward.md) instead of its forward kernel")
    g.add_argument("--presets", action="store_true", help="write every golden instead of one spec: each preset's forward "
                   "kernel (examples/*.toml) and each backward preset's backward module (with --backward: those only)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("show", help="print the emitted kernel source")
    s.add_argument("spec", help="spec TOML file")
    s.add_argument("--backward", action="store_true", help="print the spec's backward module instead of its forward kernel")
    s.set_defaults(func=cmd_show)

    d = sub.add_parser("diff", help="unified diff of two emitted sources")
    d.add_argument("a", help="first spec TOML file")
    d.add_argument("b", help="second spec TOML file")
    d.set_defaults(func=cmd_diff)

    b = sub.add_parser("build", help="lower for sm_90a, compile to a cubin with nvcc, report resources")
    b.add_argument("spec", nargs="+", help="spec TOML file(s); several build in parallel (-j)")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="kernels built at once (default: the CPU count)")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.add_argument("--shape", help="specialize to a static shape B,H,HKV,SQ,SKV (default: dynamic shapes)")
    b.add_argument("--cuda", metavar="FILE", help="also write the lowered CUDA source to FILE")
    b.add_argument("--cache-dir", default=None, help="build cache directory (default: $ATTNGEN_CACHE or ~/.cache/attngen)")
    b.add_argument("--backward", action="store_true", help="build every kernel of one spec's backward module instead of "
                   "its forward kernel: one row each (registers, spills, local and shared memory, setmaxnreg)")
    b.set_defaults(func=cmd_build)

    pc = sub.add_parser("precompile", help="fill the GPU runtime's kernel cache ahead of the first call (no GPU needed)")
    pc.add_argument("spec", nargs="*", help="spec TOML file(s); several build in parallel (-j)")
    pc.add_argument("--presets", action="store_true", help="also every preset (the source tree's examples/*.toml)")
    pc.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="kernels built at once (default: the CPU count)")
    pc.add_argument("--shape", help="specialize to a static shape B,H,HKV,SQ,SKV (default: dynamic shapes)")
    pc.add_argument("--cache-dir", default=None, help="cache directory to fill; point $ATTNGEN_CACHE at it at run time "
                    "(default: $ATTNGEN_CACHE or ~/.cache/attngen)")
    pc.add_argument("--backward", action="store_true", help="also what training loads: the forward with its LSE and "
                    "the backward module (docs/backward.md)")
    pc.set_defaults(func=cmd_precompile)

    c = sub.add_parser("check", help="generate, build and emulate a kernel and, where the backward supports the spec, "
                       "its backward kernels; one verdict (the main job)",
                       description="Generate, build and run on the CPU model the spec's forward kernel and, where the backward "
                       "supports the spec, its backward kernels (docs/backward.md): each must build for sm_90a with 0 spills "
                       "(setmaxnreg applied in the warp-specialised ones) and match the fp64 reference (the gradients under "
                       "FlashAttention-3's rule); a spec the backward refuses (paged KV, split-KV, ...) is said so in one line.")
    c.add_argument("spec", help="spec TOML file")
    c.add_argument("-o", "--output", default="generated", help="where the emitted kernel is written")
    c.add_argument("--cache-dir", default=None, help="build cache directory (default: $ATTNGEN_CACHE or ~/.cache/attngen)")
    c.add_argument("--q-len", type=int, default=200, help="query length of the CPU runs (not a tile multiple)")
    c.add_argument("--kv-len", type=int, default=333, help="key length of the CPU runs")
    c.add_argument("--seed", type=int, default=0, help="input and scheduler seed of the CPU run (>= 0)")
    c.add_argument("--softmax-scale", type=float, default=None,
                   help="the run-time softmax scale of the CPU run (default: 1/sqrt(head_dim))")
    c.set_defaults(func=cmd_check)

    t = sub.add_parser("tune", help="search the spec's schedules: build and prune here, time and record on an sm_90 GPU")
    t.add_argument("spec", help="spec TOML file (its head_dim, dtype, causal and gqa_group are kept)")
    t.add_argument("--seq-len", type=int, default=8192, help="tune at this sequence length (default: 8192)")
    t.add_argument("--shape", help="tune at this shape B,H,HKV,SQ,SKV instead (default: 16k tokens at --seq-len)")
    t.add_argument("--dry-run", action="store_true", help="no GPU: build the candidates and list their reports")
    t.add_argument("--max-candidates", type=int, default=16, help="build at most this many candidates; a schedule's one-loop and split-loop forms are two (default: 16)")
    t.add_argument("-j", "--jobs", type=int, default=2, help="parallel builds (default: 2)")
    t.add_argument("--cache-dir", default=None, help="build cache (default: $ATTNGEN_CACHE or ~/.cache/attngen)")
    t.add_argument("--table", default=None, help="tuned table to update (default: the package's attngen/tuned/h200.json)")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser("emulate", help="run the emitted kernel on the CPU model and compare with the fp64 reference")
    e.add_argument("spec", help="spec TOML file")
    e.add_argument("--batch", type=int, default=1, help="batch size")
    e.add_argument("--heads", type=int, default=None, help="query heads (default: kv-heads * gqa_group)")
    e.add_argument("--kv-heads", type=int, default=1, help="KV heads")
    e.add_argument("--q-len", type=int, default=128, help="query length")
    e.add_argument("--kv-len", type=int, default=128, help="key length")
    e.add_argument("--seed", type=int, default=0, help="scheduler and input seed (>= 0)")
    e.add_argument("--policy", default="random", choices=POLICIES, help="agent scheduling policy")
    e.add_argument("--source", metavar="FILE", help="emulate this (hand-edited) emitted file instead of rendering the spec; "
                   "FILE is executed as Python with your privileges (like `python FILE`): only pass files you trust")
    e.add_argument("--softmax-scale", type=float, default=None,
                   help="the run-time softmax scale passed to the kernel and the reference (default: 1/sqrt(head_dim))")
    e.add_argument("--backward", action="store_true", help="run the spec's backward kernels (after its forward) and compare "
                   "dq, dk, dv (and dsinks) with the fp64 gradients; --source is then the backward module")
    e.set_defaults(func=cmd_emulate)

    from attngen.timeline.command import add_subcommand  # `attngen timeline` (docs/timeline.md)

    add_subcommand(sub)
    return p


def main(argv=None) -> int:
    from attngen.build.nvcc import BuildError
    from attngen.build.lower import LowerError
    from attngen.build.toolchain import ToolchainError

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: build workers are already stopped (build.worker_pool); no traceback
        print(("\r\033[K" if sys.stderr.isatty() else "") + "attngen: interrupted", file=sys.stderr)
        return 130
    except (SpecError, InputError) as e:  # the user's input: fix the spec, the shape or the option
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2
    except (BuildError, LowerError, ToolchainError, OSError) as e:  # the toolchain or the file system said no
        print(f"attngen: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
