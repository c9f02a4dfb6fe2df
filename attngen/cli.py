"""`attngen` command line: generate, show, diff, build, emulate.

Every user error (a bad spec, a bad shape, a missing file) is printed as one
line naming the field, the value and what would be valid, with exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys

from attngen.plan import Shape
from attngen.render import generate, render
from attngen.spec import SpecError, load


def cmd_generate(args) -> int:
    spec = load(args.spec)
    print(generate(spec, args.output))
    return 0


def cmd_show(args) -> int:
    sys.stdout.write(render(load(args.spec)))
    return 0


def cmd_diff(args) -> int:
    a, b = load(args.a), load(args.b)
    lines = difflib.unified_diff(
        render(a).splitlines(True), render(b).splitlines(True), fromfile=f"{a.name}.py", tofile=f"{b.name}.py"
    )
    sys.stdout.writelines(lines)
    return 0


def cmd_build(args) -> int:
    from attngen.build import build, format_report

    spec = load(args.spec)
    shape = Shape.parse(args.shape) if args.shape else None
    result = build(spec, shape=shape, cache_dir=args.cache_dir)
    if args.cuda:
        with open(args.cuda, "w") as f:
            f.write(result.cuda_source)
    report = result.report
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0


def cmd_emulate(args) -> int:
    from attngen.emulator import command

    return command(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attngen", description="FlashAttention-3 forward kernels for Hopper, from a spec.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write the emitted kernel source and print its path")
    g.add_argument("spec", help="spec TOML file")
    g.add_argument("-o", "--output", default="generated", help="output directory (default: generated/)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("show", help="print the emitted kernel source")
    s.add_argument("spec")
    s.set_defaults(func=cmd_show)

    d = sub.add_parser("diff", help="unified diff of two emitted sources")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(func=cmd_diff)

    b = sub.add_parser("build", help="lower for sm_90a, compile to a cubin with nvcc, report resources")
    b.add_argument("spec")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.add_argument("--shape", help="specialize to a static shape B,H,HKV,SQ,SKV")
    b.add_argument("--cuda", metavar="FILE", help="also write the lowered CUDA source to FILE")
    b.add_argument("--cache-dir", default=None, help="build cache (default: $ATTNGEN_CACHE or ~/.cache/attngen)")
    b.set_defaults(func=cmd_build)

    e = sub.add_parser("emulate", help="run the emitted kernel on the CPU model and compare with the fp64 reference")
    e.add_argument("spec")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--heads", type=int, default=None, help="query heads (default: kv-heads * gqa_group)")
    e.add_argument("--kv-heads", type=int, default=1)
    e.add_argument("--q-len", type=int, default=128)
    e.add_argument("--kv-len", type=int, default=128)
    e.add_argument("--seed", type=int, default=0, help="scheduler and input seed")
    e.add_argument("--policy", default="random", help="agent scheduling policy")
    e.add_argument("--source", metavar="FILE", help="emulate this (hand-edited) emitted file instead of rendering the spec")
    e.set_defaults(func=cmd_emulate)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
