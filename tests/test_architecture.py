"""The flow runs one way: no import cycles, no module importing a step above its own.

    version, hw, expr, tiles, toolchain  ->  spec, reference  ->  plan, reference_bwd  ->  render, tuning_table, serving  ->  lower, cache, inputs, render_bwd
                 ->  build | emulator | runtime | gputime  ->  tune | timeline | ops  ->  cli | flex | flash_attn_interface | distributed

ops (the torch custom ops) sits on runtime and the emulator, its two backends; only layers above
it (and the facade's attngen.attention, lazily) may import it.

Every `attngen` import in the package is read with `ast`, function-level imports included
(a lazy import is still a dependency). The package facade (attngen/__init__.py) and the
`python -m attngen` entry sit on top and are left out.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"

LAYERS = {
    "version": 0, "hw": 0, "expr": 0, "tiles": 0, "toolchain": 0,  # tiles: the mask and tile-range algebra (render, reference, backward)
    "spec": 1, "reference": 1,
    "plan": 2, "reference_bwd": 2,  # reference_bwd reads reference's forward and tolerance rule
    "render": 3, "tuning_table": 3, "serving": 3,
    "lower": 4, "cache": 4, "inputs": 4, "render_bwd": 4,  # render_bwd: the backward module, on render's pieces
    "build": 5, "emulator": 5, "runtime": 5, "gputime": 5,
    "tune": 6, "timeline": 6, "ops": 6,  # ops: the torch ops over runtime (CUDA) and the emulator (CPU)
    "cli_bwd": 6,  # the backward pass's commands and check verdicts, under cli
    "cli": 7, "flex": 7, "flash_attn_interface": 7,  # the front doors (docs/interfaces.md) over ops
    "distributed": 7,  # context parallelism (docs/distributed.md): ring and all-gather over the ops
}
TOP = {"attngen", "attngen.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """module -> the attngen modules it imports (an attribute import names its module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("attngen")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attngen"):
                for alias in node.names:  # `from attngen import hw` imports the module attngen.hw
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
        graph[name] = deps - {name}
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Upward imports, imports of the facade, and cycles."""
    found = []
    for mod, deps in graph.items():
        if mod in TOP:
            continue
        for dep in deps:
            if dep in TOP:
                found.append(f"{mod} imports the package facade {dep}")
            elif layer(mod) is None or layer(dep) is None:
                found.append(f"{mod} -> {dep}: a module with no layer (add it to LAYERS)")
            elif layer(dep) > layer(mod):
                found.append(f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)}): upward")
            elif layer(dep) == layer(mod) and dep.split(".")[1] != mod.split(".")[1]:
                found.append(f"{mod} imports {dep}: sideways, within layer {layer(mod)}")
    found += [f"cycle: {' -> '.join(c)}" for c in cycles({m: d for m, d in graph.items() if m not in TOP})]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge found by depth-first search."""
    seen, on_path, stack, out = set(), set(), [], []

    def visit(node):
        seen.add(node)
        on_path.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                out.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        on_path.discard(node)
        stack.pop()

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    return out


def test_the_package_imports_one_way():
    graph = package_imports()
    assert "attngen.hw" in graph and "attngen.emulator.driver" in graph  # the scan sees the package
    assert "attngen.plan" in graph["attngen.emulator.driver"]  # ... and function-level imports
    assert violations(graph) == []


def test_hw_imports_nothing_from_attngen():
    assert package_imports()["attngen.hw"] == set()


def test_the_tile_algebra_has_one_home_below_render_and_reference():
    graph = package_imports()
    assert graph["attngen.tiles"] == set()
    assert {"attngen.render", "attngen.reference", "attngen.plan"} <= {m for m, deps in graph.items() if "attngen.tiles" in deps}


@pytest.mark.parametrize("graph, expect", [
    ({"attngen.plan": {"attngen.render"}, "attngen.render": {"attngen.plan"}}, ["upward", "cycle: "]),
    ({"attngen.spec": {"attngen.plan"}}, ["upward"]),
    ({"attngen.spec": {"attngen.reference"}}, ["sideways"]),
    ({"attngen.build": {"attngen"}}, ["facade"]),
    ({"attngen.newstep": {"attngen.hw"}}, ["no layer"]),
    ({"attngen.emulator.a": {"attngen.emulator.b"}, "attngen.emulator.b": {"attngen.emulator.a"}}, ["cycle: "]),
])
def test_the_checker_catches_each_kind_of_violation(graph, expect):
    found = violations(graph)
    for word in expect:
        assert any(word in v for v in found), (word, found)
