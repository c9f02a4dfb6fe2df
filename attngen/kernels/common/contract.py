"""A template's contract: the top-level names it receives, declared in its header comment.

Each template's first comment block lists what it receives, one name a line:

    Receives (where the context is built):
      kernel: ForwardNumbers — the plan's numbers (attngen.kernels.fwd.render.ForwardNumbers)
      n_tiles: str — TileLang expression: K tiles this block visits
      split_first: str, when split_kv — passed exactly when the context's split_kv is true

`declared(name)` reads those lines; `used(name)` asks Jinja which names the template reads
and does not define itself; `contract_errors(name, context)` compares both with a context.
tests/test_template_contract.py holds every template to it for a set of plans: a check in a
test, not at render time, so that rendering (the cache's hot path, run for every spec) parses
no template twice and a doc typo can never fail a user's call.
"""

from __future__ import annotations

import functools
import re

from jinja2 import meta, nodes

from attngen.kernels.common.emit import load_template, environment

TEMPLATES = ("fwd/fa3_fwd.py.j2", "combine/fa3_combine.py.j2", "bwd/fa3_bwd.py.j2", "bwd/fa3_bwd_dq.py.j2",
             "append/fa3_kv_append.py.j2")

# "  name: Type — what it is"; the type is any text without the dash
_DECLARED = re.compile(r"^\s+([A-Za-z_]\w*): ([^—\n]+?) — \S")


def _header(source: str) -> str:
    match = re.match(r"\s*\{#-?(.*?)-?#\}", source, re.DOTALL)
    if not match:
        raise ValueError("the template has no header comment")
    return match.group(1)


def declared_in(source: str) -> dict[str, str]:
    """{name: type} from the "Receives:" section of a template's header comment."""
    header = _header(source)
    marker = re.search(r"^\s*Receives\b.*:$", header, re.MULTILINE)
    if not marker:
        raise ValueError('the template header has no "Receives:" section')
    section = header[marker.end():]
    names: dict[str, str] = {}
    for line in section.splitlines():
        match = _DECLARED.match(line)
        if match:
            if match.group(1) in names:
                raise ValueError(f"{match.group(1)} is declared twice")
            names[match.group(1)] = match.group(2).strip()
    return names


def _defined_in(ast: nodes.Template) -> set[str]:
    """Macros and `set` names of an including template: the included one reads them as if passed."""
    return {n.name for n in ast.find_all(nodes.Macro)} | {
        t.name for a in ast.find_all(nodes.Assign) for t in a.find_all(nodes.Name)}


def used_in(source: str) -> set[str]:
    """Names the template source reads and does not define (includes not followed). Jinja counts a
    block `set` made inside an if-branch as a read from the context: it is the template's own."""
    ast = environment().parse(source)
    return set(meta.find_undeclared_variables(ast)) - {b.target.name for b in ast.find_all(nodes.AssignBlock)}


@functools.cache
def includes(name: str) -> tuple[str, ...]:
    """The templates `name` includes, by name (Jinja's include targets: literal strings here)."""
    found = meta.find_referenced_templates(environment().parse(load_template(name)))
    return tuple(t for t in found if t is not None)


@functools.cache
def declared(name: str) -> dict[str, str]:
    return declared_in(load_template(name))


@functools.cache
def used(name: str) -> frozenset[str]:
    """Names template `name` itself reads; an included template's reads of names its includer
    defines (a macro) are not its own inputs."""
    own = used_in(load_template(name))
    for parent in _includers(name):
        own -= _defined_in(environment().parse(load_template(parent)))
    return frozenset(own)


def _includers(name: str) -> list[str]:
    return [t for t in TEMPLATES if name in includes(t)]


def condition(kind: str) -> str | None:
    """"str, when split_kv" -> "split_kv": the name is passed exactly when that name is true."""
    match = re.search(r",\s*when (\w+(?:\.\w+)*)$", kind)
    return match.group(1) if match else None


def flag_value(context: dict, flag: str):
    """A condition's value in a context: a passed name, or an attribute of one (layout.split_kv)."""
    head, *attrs = flag.split(".")
    value = context.get(head)
    for a in attrs:
        value = getattr(value, a, None)
    return value


def contract_errors(name: str, context: dict) -> list[str]:
    """What breaks the contract of rendering template `name` with `context` (empty: none).

    Each file (`name` and the files it includes) must use exactly what its header declares. The
    context must pass every declared name, except that one declared "T, when flag" is passed
    exactly when context[flag] is true (a conditional include, a split-only expression); and
    nothing else."""
    errors = []
    due: dict[str, str | None] = {}
    for f in [name, *includes(name)]:
        doc, reads = declared(f), used(f)
        errors += [f"{f}: uses {n!r}, not declared in its header" for n in sorted(reads - set(doc))]
        errors += [f"{f}: declares {n!r}, never used" for n in sorted(set(doc) - reads)]
        for n, kind in doc.items():  # declared unconditionally anywhere: always due
            due[n] = condition(kind) if due.get(n, "") is not None else None
    passed = set(context)
    for n, flag in sorted(due.items()):
        if flag is None or flag_value(context, flag):
            if n not in passed:
                errors.append(f"{name}: declares {n!r}, not passed" + (f" ({flag} is true)" if flag else ""))
        elif n in passed:
            errors.append(f"{name}: passed {n!r} although {flag} is false")
    errors += [f"{name}: passed {n!r}, declared by no template it renders" for n in sorted(passed - set(due))]
    return errors
