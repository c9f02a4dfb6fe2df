"""`attngen check`: generate, build and run on the CPU model, forward and backward; one verdict."""

from __future__ import annotations

from attngen.cli.build import build_verdicts
from attngen.cli.common import check_dir_option, plan_of
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.render import generate
from attngen.reference.forward import check_scale


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
    verdicts = build_verdicts(result.report, fp8=plan.fp8, smem_slack=plan.smem_slack)
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
