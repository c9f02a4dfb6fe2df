"""What the commands share: plan the spec once, check directory and integer options, and `emulate`'s
options (checked alike for the forward and, with --backward, the backward)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from attngen.emulator import POLICIES, EmulationError, check_run
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError, check_scale
from attngen.spec import load


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


def emulate_options(args, spec):
    """`attngen emulate`'s options, checked: (source text or None, its file name, query heads)."""
    heads = args.heads if args.heads is not None else args.kv_heads * spec.gqa_group
    options = {"batch": ("--batch", 1), "kv_heads": ("--kv-heads", 1), "heads": ("--heads", spec.gqa_group),
               "q_len": ("--q-len", 128), "kv_len": ("--kv-len", 128)}
    if args.heads is None:  # derived from --kv-heads: that is the option to change
        options["heads"] = ("--kv-heads", spec.gqa_group)
    check_run(spec, Shape(args.batch, heads, args.kv_heads, args.q_len, args.kv_len), args.seed, options)
    check_scale(getattr(args, "softmax_scale", None), spec.head_dim, "--softmax-scale")
    if args.policy not in POLICIES:
        raise InputError("--policy", args.policy, f"one of {', '.join(POLICIES)}")
    source, filename = None, None
    if args.source:
        try:
            source = Path(args.source).read_bytes().decode("utf-8")
        except IsADirectoryError:
            raise InputError("--source", args.source, "an emitted kernel file, not a directory") from None
        except UnicodeDecodeError as e:
            raise InputError("--source", args.source, f"an emitted kernel file (Python text); byte {e.start} is not UTF-8") from None
        except OSError as e:
            raise InputError("--source", args.source, f"a readable file ({e.strerror or e})") from None
        filename = str(args.source)
    return source, filename, heads


def emulated(run):
    """Run one CPU-model emulation for `emulate` (forward or --backward): (its result, None), or (None, the
    exit status) once why it stopped is printed: a hazard's or deadlock's report (1), or a --source the
    emulator cannot take, null bytes say (2)."""
    try:
        return run(), None
    except EmulationError as e:
        print(e.report)
        return None, 1
    except ValueError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return None, 2
