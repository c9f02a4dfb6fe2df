"""`attngen tune`: search a spec's schedules, build and prune here, time and record on an sm_90 GPU."""

from __future__ import annotations

from attngen.cli.common import check_dir_option, check_positive
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import SpecError, load, serving_field


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
