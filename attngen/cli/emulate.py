"""`attngen emulate`: random inputs, one run of the emitted kernel on the CPU model, the error against
the fp64 reference (the emulator's library, attngen.emulator, does the work)."""

from __future__ import annotations

import sys

from attngen.cli.common import emulate_options, emulated, plan_of
from attngen.emulator.driver import check_emulated, run_shape_text
from attngen.reference.forward import InputError


def cmd_emulate(args) -> int:
    if args.backward:
        from attngen.cli import backward as cli_bwd

        return cli_bwd.emulate_command(args, plan_of(args.spec))
    return command(args, plan_of(args.spec))


def command(args, plan=None) -> int:
    """`attngen emulate`: random inputs, one emulation, the error against the reference.

    Every option is checked before an input is drawn; a bad one is one line on stderr and exit 2.
    """
    from attngen.kernels.fwd.plan import make_plan
    from attngen.spec import load

    plan = plan or make_plan(load(args.spec))
    try:
        source, filename, heads = emulate_options(args, plan.spec)
    except InputError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2
    shape = run_shape_text(plan, args.batch, heads, args.kv_heads, args.q_len, args.kv_len)
    scale = getattr(args, "softmax_scale", None)
    print(f"attngen emulate: {plan.name} ({'--source ' + filename if filename else 'rendered'}), {shape}, "
          f"seed {args.seed}, policy {args.policy}" + ("" if scale is None else f", softmax scale {scale!r}"))
    # variant inputs (v of head_dim_v, call-time tensors) and the LSE check where the spec has lse
    result, status = emulated(lambda: check_emulated(plan, args.batch, heads, args.kv_heads, args.q_len, args.kv_len,
                                                     seed=args.seed, policy=args.policy, source=source,
                                                     filename=filename, softmax_scale=scale))
    if result is None:
        return status
    ok, text, stats = result
    atomics = "".join(f", {n} {what}" for n, what in ((stats.atomics, "atomics"), (stats.reduce_adds, "TMA reduce-adds")) if n)
    print(f"  {stats.ctas} CTAs, {stats.handovers} scheduler hand-overs, {stats.wgmma} wgmma, "
          f"{stats.tma} TMA loads{atomics}, {stats.seconds:.2f} s")
    print(f"  {text} (bound = 2 x max|lowprec - ref| + ulp x max|ref|)")
    return 0 if ok else 1
