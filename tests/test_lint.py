"""The tree passes ruff under pyproject.toml's [tool.ruff] (pyflakes and pycodestyle, 140 columns,
Python 3.11 syntax), so the README's test command, and with it CI, lints every Python file."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=cwd, capture_output=True, text=True)


def test_the_tree_passes_ruff():
    result = ruff(".")
    assert result.returncode == 0, f"ruff check found (fix them; `python -m ruff check --fix` does some):\n{result.stdout}{result.stderr}"


def test_the_config_refuses_a_long_line_an_unused_import_and_python_312_syntax(tmp_path):
    """The configuration itself: a file breaking each rule the project relies on is refused."""
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n"
                       f"x = '{'a' * 140}'\n"
                       "y = {'k': 1}\n"
                       "z = f\"{y[\"k\"]}\"\n")  # quotes reused inside an f-string: Python 3.12 syntax
    result = ruff("--config", str(ROOT / "pyproject.toml"), str(planted), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for finding in ("F401", "E501", "Python 3.11"):
        assert finding in result.stdout, (finding, result.stdout)
