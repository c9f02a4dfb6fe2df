"""The hand-written seed kernel, extracted at run time from the seed notes (never committed).

The notes (../shared/seeds/fa3-tilelang-notes.md beside the checkout) carry the seed's
TileLang FA3 kernel as plain text, from its module docstring to `return main`. The
benchmarks compare the generated kernel with it at the same shape in the same run, so it
is cut out here into a git-ignored folder (.seed/ by default) that a device call can carry.

    python bench/seed_kernel.py                      # writes .seed/seed_fa3.py
    python bench/seed_kernel.py --notes PATH --out DIR
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT.parent / "shared" / "seeds" / "fa3-tilelang-notes.md"
FIRST = '"""Faithful FlashInfer FA3 port'  # the kernel module's docstring opens it
LAST = "    return main"  # ...and the jit function's return closes it
FUNCTION = "fa3_prefill"  # fa3_prefill(B, H, Hkv, Sq, Skv, D, dtype) -> a kernel taking Q, K, V, returning O


class SeedError(RuntimeError):
    pass


def extract(notes: Path = NOTES) -> str:
    """The seed kernel's source; raises SeedError naming what is missing."""
    try:
        lines = Path(notes).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SeedError(f"seed notes {notes}: {e.strerror or e}") from None
    start = next((i for i, line in enumerate(lines) if line.startswith(FIRST)), None)
    if start is None:
        raise SeedError(f"seed notes {notes}: no line starts with {FIRST!r}")
    end = next((i for i in range(start, len(lines)) if lines[i] == LAST), None)
    if end is None:
        raise SeedError(f"seed notes {notes}: no {LAST!r} after line {start + 1}")
    source = "\n".join(lines[start:end + 1]) + "\n"
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise SeedError(f"the seed kernel cut from {notes} does not parse: line {e.lineno}: {e.msg}") from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == FUNCTION for n in tree.body):
        raise SeedError(f"the seed kernel cut from {notes} defines no {FUNCTION}()")
    return source


def write(out_dir: Path, notes: Path = NOTES) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "seed_fa3.py"
    path.write_text(extract(notes))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notes", type=Path, default=NOTES, help="the seed notes (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / ".seed", help="folder to write seed_fa3.py into (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        print(write(args.out, args.notes))
    except SeedError as e:
        print(f"seed_kernel: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
