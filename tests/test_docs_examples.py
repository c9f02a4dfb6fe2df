"""Every ```python block of README.md and docs/*.md runs on the CPU, or says why not.

A block that cannot run here carries an HTML comment `<!-- not run: REASON -->` on the line
before its fence, and BLOCKS counts, per file, the blocks run and the blocks marked: a marker
added (or a block removed) without updating BLOCKS fails, so no block is skipped silently. The
blocks of one file run in order in one namespace, as a reader would type them, in a scratch
directory (a snippet that saves a file writes it there). CPU tensors run the emitted kernels on
the CPU model, so the snippets use small shapes.
"""

import linecache
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\s*$")

# file: (blocks run, blocks marked not run)
BLOCKS = {
    "docs/distributed.md": (0, 1),
    "docs/emulator.md": (1, 1),
    "docs/gpu.md": (0, 1),
    "docs/interfaces.md": (2, 0),
    "docs/reading-a-generated-kernel.md": (0, 8),
    "docs/serving.md": (0, 1),
    "docs/torch.md": (3, 0),
    "docs/variants.md": (1, 0),
}


def doc_files() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list:
    """(line, code, reason it is not run or None) of each ```python block."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = NOT_RUN.search(before)
        found.append((text.count("\n", 0, m.start()) + 1, m.group(1), marked.group(1) if marked else None))
    return found


def test_every_block_is_run_or_marked_and_counted():
    counts = {}
    for path in doc_files():
        blocks = python_blocks(path)
        if blocks:
            counts[str(path.relative_to(ROOT))] = (sum(r is None for _, _, r in blocks),
                                                   sum(r is not None for _, _, r in blocks))
    assert counts == BLOCKS


@pytest.mark.parametrize("name", sorted(n for n, (run, _) in BLOCKS.items() if run))
def test_the_docs_python_blocks_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for line, code, reason in python_blocks(ROOT / name):
        if reason is None:
            where = f"{name}:{line}"
            linecache.cache[where] = (len(code), None, code.splitlines(True), where)  # flex reads a mod's source
            try:
                exec(compile(code, where, "exec"), namespace)
            except Exception as e:  # the block and its first line of error, not a traceback into attngen
                pytest.fail(f"{name}:{line}: {type(e).__name__}: {e}")
