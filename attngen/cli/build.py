"""`attngen build` and `precompile`: lower and compile kernels, report resources, fill the runtime's cache."""

from __future__ import annotations

import functools
import json
import sys

from attngen.build.nvcc import smem_as_planned
from attngen.cli.common import check_dir_option, check_positive, plan_of
from attngen.cli.generate import preset_files
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError
from attngen.spec import SpecError, load


def cmd_build(args) -> int:
    from attngen.build.nvcc import Progress, build, build_many, format_report, format_summary
    from attngen.cli.timeline import check_output_file

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
            rows = [o.report if o.error is None else {"spec": o.label, "error": o.error} for o in outcomes]
            print(json.dumps(rows, indent=2, sort_keys=True))
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


def _precompile_one(plan, cache_dir, backward: bool) -> tuple[list, str | None]:
    """Precompile a plan's kernel and, with --backward, what training with it loads too (the forward
    with its LSE and the backward module: runtime.precompile_training). Returns the entries done and,
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


def build_verdicts(report: dict, fp8: bool = False, smem_slack: int = 0) -> list:
    """(ok, what) pairs: the resource promises every generated kernel must keep. An fp8 kernel's
    GEMMs must be e4m3 wgmma (QGMMA, P from shared memory) and none mma.sync (HMMA: the fallback)."""
    sass = report["sass"]
    if fp8:
        gemms = (sass.get("QGMMA_E4M3", 0) > 0 and sass.get("QGMMA", 0) == sass.get("QGMMA_E4M3", 0)
                 and sass.get("HMMA", 0) == 0 and sass["HGMMA"] == 0, "both GEMMs e4m3 wgmma (QGMMA), no HMMA fallback")
    else:
        gemms = (sass["HGMMA"] > 0 and sass["HGMMA_A_FROM_REGISTERS"] > 0, "wgmma (HGMMA) with P from registers")
    return [
        (report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0, "no register spills"),
        (report["stack_frame_bytes"] == 0 and sass["LDL"] == 0 and sass["STL"] == 0, "no local memory"),
        gemms,
        (report["setmaxnreg_applied"], "setmaxnreg applied"),
        (smem_as_planned(report, smem_slack), "shared memory as planned"),
    ]
