"""`attngen` command line: generate, show, diff, build, precompile, check, tune, emulate, timeline.

`--backward` on show, generate, build and emulate selects the spec's backward module
(attngen/cli/backward.py); `check` runs both passes.

Every user error (a bad spec, a bad shape or option, a missing file, a run too big for
memory) is printed as one line, `attngen: error: ...`, naming the field or option, the
value and what would be valid, with exit code 2; argparse's own errors (an unknown option,
a missing value) are one such line too. Every option of a command is checked before the
command does any work. Exit 1: the toolchain or the file system refused, or a check failed.
"""

from __future__ import annotations

import argparse
import os
import sys

from attngen.cli.build import cmd_build, cmd_precompile
from attngen.cli.check import cmd_check
from attngen.cli.emulate import cmd_emulate
from attngen.cli.generate import cmd_diff, cmd_generate, cmd_show
from attngen.cli.tune import cmd_tune
from attngen.reference.forward import InputError
from attngen.spec import SpecError
from attngen.version import __version__


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
    t.add_argument("--max-candidates", type=int, default=16,
                   help="build at most this many candidates; a schedule's one-loop and split-loop forms are two, "
                        "its single-tile and persistent kernels two more (default: 16)")
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

    from attngen.cli.timeline import add_subcommand  # `attngen timeline` (docs/timeline.md)

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
