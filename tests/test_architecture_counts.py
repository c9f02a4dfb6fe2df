"""bench/architecture_counts.py, whose figures docs/architecture.md records, on a small planted tree
judged by this checkout's own tests/test_architecture.py."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def counts(tree: Path) -> dict[str, str]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "architecture_counts.py"), str(tree)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line and not line.startswith(" "))


def test_the_figures_of_a_planted_tree(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_architecture.py", tmp_path / "tests")
    package = tmp_path / "attngen"
    (package / "kernels" / "fwd").mkdir(parents=True)
    (package / "__init__.py").write_text("from attngen.spec import Spec\n")  # the facade: left out of the graph
    (package / "hw.py").write_text("X = 1\n")
    (package / "spec.py").write_text("from attngen import hw\n\n\ndef plan():\n    from attngen.kernels.fwd import plan\n")
    (package / "kernels" / "fwd" / "plan.py").write_text("import attngen.spec\nimport attngen.hw\n" + "# line\n" * 600)
    found = counts(tmp_path)
    assert found["python modules under attngen/"] == "4 (609 lines), in 1 folders below attngen/"  # kernels/fwd: kernels/ holds no module
    assert found["modules over 500 lines"] == "1"
    assert found["import graph"] == "3 modules (facade and public aliases left out), 4 edges"
    assert found["longest import chain"] == "3 modules"  # plan -> spec -> hw (the lazy import counts too)
    assert found["cycles"] == "1"  # spec <-> kernels.fwd.plan
    assert found["upward or sideways imports"] == "1"  # spec imports kernels.fwd.plan
