"""The architecture's figures for a checkout of attngen: modules, folders, lines, the import graph.

    python bench/architecture_counts.py [ROOT] [--top N]
    python bench/architecture_counts.py --history REV     the files each variant's commits touched

ROOT (default: this checkout) may be any commit's tree, e.g. `git worktree add /tmp/before 5c555b5`.
The import graph and its rule are that tree's own: its tests/test_architecture.py is loaded and
pointed at ROOT/attngen, so an old tree is judged by the layers it declared. Nothing is imported
from attngen; the files are read as text. docs/architecture.md records the figures.
"""

import argparse
import collections
import importlib.util
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def architecture_test(root: Path):
    """ROOT's tests/test_architecture.py, its PACKAGE pointed at ROOT/attngen."""
    spec = importlib.util.spec_from_file_location("tree_architecture", root / "tests" / "test_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PACKAGE = root / "attngen"
    return module


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def import_depth(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's longest chain of imports down to a module that imports none (0); cycles cut."""
    depth: dict[str, int] = {}

    def visit(node, path):
        if node not in depth:
            below = [visit(dep, path | {node}) for dep in graph.get(node, ()) if dep not in path | {node}]
            depth[node] = 1 + max(below) if below else 0
        return depth[node]

    for node in sorted(graph):
        visit(node, frozenset())
    return depth


# A feature's commits: those up to REV whose message names it (git log -i -E --grep), merges
# included; what they touched: the package and its templates (no tests, docs, bench or goldens).
FEATURES = {"softcap": "softcap", "ALiBi": "alibi", "sinks": "sink", "window": "window", "block mask": "block.mask"}
PACKAGE_PATHS = ("attngen", "templates")


def git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def feature_history(rev: str, top: int) -> None:
    print("| feature (message matches) | commits | files touched | most touched (commits) |")
    print("| --- | --- | --- | --- |")
    for feature, pattern in FEATURES.items():
        commits = git("log", "--format=%h", "-i", "-E", f"--grep={pattern}", rev, "--", *PACKAGE_PATHS)
        touched = collections.Counter(path for c in commits
                                      for path in git("show", "--format=", "--name-only", c, "--", *PACKAGE_PATHS))
        most = ", ".join(f"{path} {n}" for path, n in touched.most_common(top))
        print(f"| {feature} (`{pattern}`) | {len(commits)} | {len(touched)} | {most} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=HERE)
    ap.add_argument("--top", type=int, default=8, help="how many of the longest modules (or most touched files) to list")
    ap.add_argument("--history", metavar="REV", help="instead: the files each variant's commits up to REV touched")
    args = ap.parse_args(argv)
    if args.history:
        return feature_history(args.history, args.top)
    root = args.root.resolve()
    package = root / "attngen"
    modules = sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    folders = sorted({p.parent for p in modules if p.parent != package})
    templates = sorted((root / "templates").rglob("*.j2"))
    sizes = sorted(((lines(p), p.relative_to(root).as_posix()) for p in modules), reverse=True)
    arch = architecture_test(root)
    graph = arch.package_imports()
    inner = {m: d for m, d in graph.items() if m not in arch.TOP}
    found = arch.violations(graph)
    depth = import_depth(inner)

    print(f"tree: {root}")
    print(f"python modules under attngen/: {len(modules)} ({sum(n for n, _ in sizes)} lines), "
          f"in {len(folders)} folders below attngen/")
    for folder in folders:
        inside = [n for n, name in sizes if Path(name).parent == folder.relative_to(root)]
        print(f"  {folder.relative_to(root).as_posix()}/: {len(inside)} modules, {sum(inside)} lines")
    print(f"templates: {len(templates)} ({sum(lines(p) for p in templates)} lines)")
    print("longest modules: " + ", ".join(f"{name} {n}" for n, name in sizes[:args.top]))
    print(f"modules over 500 lines: {sum(n > 500 for n, _ in sizes)}")
    print(f"import graph: {len(inner)} modules (facade and public aliases left out), "
          f"{sum(len(d) for d in inner.values())} edges")
    print(f"layers the tree declares (tests/test_architecture.py LAYERS): {len(set(arch.LAYERS.values()))}")
    print(f"longest import chain: {max(depth.values()) + 1} modules")
    print(f"cycles: {sum(v.startswith('cycle: ') for v in found)}")
    print(f"upward or sideways imports: {sum(('upward' in v) or ('sideways' in v) for v in found)}")
    for v in found:
        print(f"  {v}")


if __name__ == "__main__":
    sys.exit(main())
