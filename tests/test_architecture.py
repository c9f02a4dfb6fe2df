"""The flow runs one way: no import cycles, no module importing a step above its own.

A module's step is its folder's (the longest key of LAYERS that prefixes its name under attngen):

    version, hw, expr, tiles  ->  spec  ->  reference  ->  kernels.common  ->  kernels.combine
      ->  kernels.fwd, kernels.append  ->  kernels.bwd  ->  build  ->  run  ->  emulator
      ->  timeline, interfaces  ->  cli

Within a folder modules may import one another (cycles are still refused). A kernel family
(kernels/<family>/) imports the shared pieces (kernels/common/) and the families below it: the
forward includes the combine kernel; the backward derives its plan from the forward's.
interfaces/ (the torch ops, the Flex and FlashAttention-3 doors, context parallelism) sits on
run/ (CUDA) and the emulator (CPU), its two backends.

Every `attngen` import in the package is read with `ast`, function-level imports included
(a lazy import is still a dependency). The package facade (attngen/__init__.py), the
`python -m attngen` entry and the public addresses of the doors (attngen.ops,
attngen.flash_attn_interface, attngen.distributed: each the same module object as its
interfaces/ module) sit on top and are left out.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"

LAYERS = {
    "version": 0, "hw": 0, "expr": 0, "tiles": 0,  # tiles: the mask and tile-range algebra (kernels, reference)
    "spec": 1,
    "reference": 2,  # the fp64 oracle and the tolerance rule, both passes
    "kernels.common": 3,  # what every kernel family shares: plan records, layouts, emit
    "kernels.combine": 4,
    "kernels.fwd": 5, "kernels.append": 5,
    "kernels.bwd": 6,  # the backward's plan derives from the forward's
    "build": 7,  # toolchain, lowering, the content-keyed cache, nvcc
    "run": 8,  # the GPU runtime, call checks, serving ABI, tuning
    "emulator": 9,  # the CPU model (reads run's call checks)
    "timeline": 10, "interfaces": 10,
    "cli": 11,
}
TOP = {"attngen", "attngen.__main__", "attngen.ops", "attngen.flash_attn_interface", "attngen.distributed"}

# A module over this many lines holds more than one concern: split it (issue 26). The CPU model
# (attngen/emulator/) is left out: its interpreter, memory and hazard models are each one concern.
MAX_LINES = 600


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


def folder(module: str) -> str | None:
    """The longest LAYERS key that prefixes the module's name under attngen."""
    rest = module.split(".", 1)[1] if "." in module else ""
    keys = [k for k in LAYERS if rest == k or rest.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def layer(module: str) -> int | None:
    key = folder(module)
    return None if key is None else LAYERS[key]


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
            elif layer(dep) == layer(mod) and folder(dep) != folder(mod):
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
    assert "attngen.kernels.fwd.plan" in graph["attngen.emulator.driver"]  # ... and function-level imports
    assert violations(graph) == []


def test_hw_imports_nothing_from_attngen():
    assert package_imports()["attngen.hw"] == set()


def test_the_tile_algebra_has_one_home_below_render_and_reference():
    graph = package_imports()
    assert graph["attngen.tiles"] == set()
    users = {m for m, deps in graph.items() if "attngen.tiles" in deps}
    assert {"attngen.kernels.fwd.render", "attngen.reference.forward", "attngen.kernels.fwd.plan"} <= users


@pytest.mark.parametrize("graph, expect", [
    ({"attngen.kernels.common.plan": {"attngen.kernels.fwd.render"}, "attngen.kernels.fwd.render": {"attngen.kernels.common.plan"}},
     ["upward", "cycle: "]),
    ({"attngen.kernels.fwd.plan": {"attngen.kernels.fwd.render"}, "attngen.kernels.fwd.render": {"attngen.kernels.fwd.plan"}}, ["cycle: "]),
    ({"attngen.spec": {"attngen.kernels.fwd.plan"}}, ["upward"]),
    ({"attngen.kernels.fwd.render": {"attngen.kernels.append.render"}}, ["sideways"]),
    ({"attngen.build.nvcc": {"attngen"}}, ["facade"]),
    ({"attngen.newstep": {"attngen.hw"}}, ["no layer"]),
    ({"attngen.emulator.a": {"attngen.emulator.b"}, "attngen.emulator.b": {"attngen.emulator.a"}}, ["cycle: "]),
])
def test_the_checker_catches_each_kind_of_violation(graph, expect):
    found = violations(graph)
    for word in expect:
        assert any(word in v for v in found), (word, found)


def long_modules(root: Path) -> dict[str, int]:
    """Modules under root (attngen/emulator/ left out) longer than MAX_LINES: path -> lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if not name.startswith("emulator/") and lines > MAX_LINES:
            found[name] = lines
    return found


def test_no_module_outside_the_emulator_is_over_600_lines():
    assert long_modules(PACKAGE) == {}


def test_the_length_check_sees_a_long_module_but_not_the_emulator(tmp_path):
    for name, lines in (("run/long.py", MAX_LINES + 1), ("run/full.py", MAX_LINES), ("emulator/tlang.py", 900)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n" * lines)
    assert long_modules(tmp_path) == {"run/long.py": MAX_LINES + 1}
