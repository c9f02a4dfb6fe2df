"""The README opens with exactly two commands, and CI runs the second one verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("# attngen\n\n```bash\n")
    main_job, tests = readme_commands()
    assert "attngen check examples/default.toml" in main_job
    assert tests.endswith("python -m pytest")


def ci_lines():
    """.ci/run's commands: its lines less blanks and comments."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    assert readme_commands()[1] in ci_lines()


def test_ci_runs_it_in_a_fresh_venv_with_nothing_pinned_and_empty_caches():
    """What a user on a fresh clone gets: the machine's Python keeps the torch it has, so the test
    command runs in a new venv; no constraints file, so pip picks today's releases within
    pyproject.toml's ranges; kernel caches that start empty."""
    lines = ci_lines()
    test = len(lines) - 1
    venv = next(i for i, line in enumerate(lines) if line.startswith("python -m venv "))
    folder = lines[venv].split()[-1].strip("\"'")
    assert any(line.startswith("source ") and f"{folder}/bin/activate" in line for line in lines[venv + 1:test])
    assert "mktemp -d" in " ".join(lines[:venv])  # a new folder each run
    assert not [line for line in lines if "constraint" in line.lower() or " -c " in f" {line} "], lines
    assert not (ROOT / ".ci" / "constraints.txt").exists()
    exported = " ".join(line for line in lines[venv:test] if line.startswith("export "))
    assert all(f"{cache}=" in exported for cache in ("ATTNGEN_CACHE", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"))


def test_every_package_ships_in_the_wheel():
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "attngen").rglob("__init__.py")}
    on_disk.add("attngen.templates")  # templates/ ships as attngen.templates (package-dir mapping)
    assert on_disk == declared


def test_ci_installs_chromium_before_the_tests_and_ends_with_the_test_command():
    lines = ci_lines()
    assert lines[-1] == readme_commands()[1]
    install = next(i for i, line in enumerate(lines) if "apt-get install" in line and "chromium" in line)
    assert install < len(lines) - 1
    assert any("command -v chromium" in line for line in lines[:install])  # only when it is missing


def test_the_readme_says_how_a_machine_without_a_gpu_installs_torchs_cpu_build():
    """Issue 25: a CPU machine need not install CUDA's libraries; the README says so after its commands."""
    text = (ROOT / "README.md").read_text()
    after = text.split("```", 2)[2].split("\n## ", 1)[0]  # the text between the two commands and the first section
    assert "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu" in after


def test_the_module_table_lists_every_module_once():
    """Issue 25: render_bwd was listed twice and five modules not at all. Issue 26: the table names
    every package folder, nested ones included (kernels/fwd, ...), each template family's folder and
    every top-level module, so it stays true when a folder's files split."""
    import re

    text = (ROOT / "README.md").read_text()
    table = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `attngen/")]
    named = [m for cell in table for m in re.findall(r"`attngen/([\w/]+?)(?:\.py)?/?`", cell)]
    modules = {p.stem for p in (ROOT / "attngen").glob("*.py") if not p.stem.startswith("__")}
    packages = {p.parent.relative_to(ROOT / "attngen").as_posix() for p in (ROOT / "attngen").glob("*/**/__init__.py")}
    families = {p.name for p in (ROOT / "templates").iterdir() if p.is_dir() and list(p.glob("*.j2"))}
    assert "kernels/fwd" in packages and "fwd" in families  # the scan sees the nested folders
    assert sorted(named) == sorted(set(named)), "a module listed twice"
    assert modules | packages <= set(named), "a module or package folder the table does not name"
    template_folders = {m for cell in table for m in re.findall(r"`templates/(\w+)/`", cell)}
    assert families <= template_folders, "a template family the table does not name"
