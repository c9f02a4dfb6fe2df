"""`attngen generate`, `show` and `diff`: the emitted sources; the presets (the goldens)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from attngen.cli.common import check_dir_option, plan_of
from attngen.kernels.fwd.render import generate, render_source
from attngen.reference.forward import InputError


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
