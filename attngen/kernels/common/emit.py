"""Templates in, TileLang text out: the Jinja environment over templates/<family>/, template
errors shown with numbered lines, the parameter-line helper every family's kernels use, and the
atomic write that leaves an unchanged file alone.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import tempfile
import traceback
from pathlib import Path

import jinja2




class TemplateError(RuntimeError):
    """A template bug (not a user error): shown with the template's numbered lines."""


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(_template_source)
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def load_template(name: str) -> str:
    """A template's source by its name under templates/ (e.g. "fwd/fa3_fwd.py.j2")."""
    # A source checkout's own templates/ first: an editable install elsewhere (another
    # worktree, the GPU machine's PYTHONPATH copy) must not lend this checkout its templates.
    beside = Path(__file__).resolve().parents[3] / "templates" / name
    if beside.is_file():
        return beside.read_text()
    return importlib.resources.files("attngen.templates").joinpath(name).read_text()  # installed wheel


def _template_source(name: str):
    # (source, filename, uptodate): the filename makes Jinja put template line numbers in tracebacks
    return load_template(name), name, lambda: True


def tensor_param(name: str, shape: list, dtype: str, comment: str = "") -> str:
    return f"{name}: T.Tensor([{', '.join(shape)}], {dtype})," + (f"  # {comment}" if comment else "")


def render_template(name: str, context: dict) -> str:
    """One of templates/ rendered with its context; Jinja's errors name the template and line.
    The context's names are the template header's "Receives:" list: tests/test_template_contract.py
    checks that (contract.py), not this hot path."""
    try:
        return environment().get_template(name).render(**context)
    except jinja2.TemplateError as e:  # a bug in attngen, never the user's input
        raise TemplateError(_numbered(name, e)) from e


def _numbered(name: str, err: jinja2.TemplateError) -> str:
    lineno = getattr(err, "lineno", None)
    if lineno is None:  # errors raised while rendering carry the line in the traceback
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == name]
        lineno = frames[-1].lineno if frames else None
    text = load_template(name).splitlines()
    lo, hi = (max(0, lineno - 4), min(len(text), lineno + 3)) if lineno else (0, 0)
    shown = "\n".join(f"{'>' if i + 1 == lineno else ' '}{i + 1:5d} | {text[i]}" for i in range(lo, hi))
    return f"{name}:{lineno}: {err}\n{shown}"


def write_if_different(path: Path, text: str) -> bool:
    """Atomic write that leaves the file (and its mtime) alone when the content is unchanged."""
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True
