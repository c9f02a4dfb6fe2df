"""Finding the CUDA toolkit: CUDA_HOME, then nvcc on PATH, then the pip wheels; and no toolkit at all.

The slow test hides the system toolkit (PATH holds only python and gcc, CUDA_HOME unset) and
builds a kernel with the nvidia-cuda-nvcc wheels, as on a machine with Python and pip alone.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attngen.build import nvcc as build_mod
from attngen import cli
from attngen.build import toolchain

ROOT = Path(__file__).resolve().parent.parent


def fake_toolkit(root: Path, release: str) -> Path:
    """A folder laid out like a toolkit whose bin/nvcc is a script answering --version and --dryrun."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *--dryrun*) echo "#$ TOP={root}/bin/.." >&2;; '
        f'*) echo "Cuda compilation tools, release {release.rsplit(".", 1)[0]}, V{release}";; esac\n'
    )
    nvcc.chmod(0o755)
    return root


@pytest.fixture
def kits(tmp_path):
    return (fake_toolkit(tmp_path / "home", "12.8.93"), fake_toolkit(tmp_path / "onpath", "12.9.41"),
            fake_toolkit(tmp_path / "pip", "13.0.88"))


def test_cuda_home_comes_first(kits):
    home, onpath, pip = kits
    tc = toolchain.find({"CUDA_HOME": str(home), "PATH": str(onpath / "bin")}, pip_home=pip)
    assert (tc.kind, tc.found_by, tc.nvcc, tc.version) == ("system", "CUDA_HOME", str(home / "bin" / "nvcc"), "12.8.93")


def test_nvcc_on_path_before_the_wheels(kits):
    _, onpath, pip = kits
    tc = toolchain.find({"PATH": str(onpath / "bin")}, pip_home=pip)
    assert (tc.kind, tc.found_by, tc.version) == ("system", "PATH", "12.9.41")
    assert Path(tc.cuda_home) == onpath  # from nvcc's own dry run, not guessed from the PATH entry


def test_the_wheels_when_nothing_else(kits, tmp_path):
    _, _, pip = kits
    tc = toolchain.find({"PATH": str(tmp_path)}, pip_home=pip)
    assert (tc.kind, tc.found_by, tc.nvcc, tc.version) == ("pip", "pip", str(pip / "bin" / "nvcc"), "13.0.88")
    assert tc.describe() == {"kind": "pip", "found_by": "pip", "nvcc": str(pip / "bin" / "nvcc"), "version": "13.0.88",
                             "cuda_home": str(pip)}
    # CUDA_HOME pointing at the wheels' folder (as hand_to_tilelang sets it) is still the pip toolkit
    assert toolchain.find({"CUDA_HOME": str(pip), "PATH": ""}, pip_home=pip).kind == "pip"


def test_no_toolkit_names_what_to_install(tmp_path):
    with pytest.raises(toolchain.ToolchainError) as e:
        toolchain.find({"PATH": str(tmp_path)}, pip_home=False)
    msg = str(e.value)
    assert "\n" not in msg and "nvidia-cuda-nvcc" in msg and "pip install" in msg


def test_cuda_home_without_nvcc_is_an_error(tmp_path, kits):
    _, onpath, _ = kits
    with pytest.raises(toolchain.ToolchainError, match="CUDA_HOME=.* holds no bin/nvcc"):
        toolchain.find({"CUDA_HOME": str(tmp_path / "nothing"), "PATH": str(onpath / "bin")})


@pytest.fixture
def no_toolkit(monkeypatch, tmp_path):
    """This process sees no toolkit: empty PATH, no CUDA_HOME, no wheel."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "pip_cuda_home", lambda: None)
    toolchain.current.cache_clear()
    build_mod.tool_versions.cache_clear()
    yield
    toolchain.current.cache_clear()
    build_mod.tool_versions.cache_clear()


@pytest.mark.parametrize("command", ["build", "check"])
def test_cli_without_any_toolkit_says_one_line(no_toolkit, capsys, tmp_path, command):
    argv = [command, str(ROOT / "examples" / "default.toml"), "--cache-dir", str(tmp_path / "cache")]
    if command == "check":
        argv += ["-o", str(tmp_path / "gen")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("attngen: error: no CUDA toolkit") and err.count("\n") == 1, err
    assert "pip install" in err and "Traceback" not in err


def hidden_env(tmp_path: Path) -> dict:
    """The environment of a machine with Python, gcc and the pip wheels only: PATH holds links to
    python and gcc alone, CUDA_HOME and CUDA_PATH are unset."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    import shutil

    for tool in ("gcc", "cc"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(bin_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_hidden_toolkit_hands_the_wheels_to_tilelang(tmp_path):
    """TileLang (the runtime's tilelang.compile) runs the same pip nvcc as attngen build."""
    code = ("import attngen.build.lower, tilelang.contrib.nvcc as n; from attngen.build import toolchain; "
            "print(n.get_nvcc_compiler()); print(toolchain.current().nvcc); print(toolchain.current().kind)")
    proc = subprocess.run([sys.executable, "-c", code], env=hidden_env(tmp_path), capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tilelang_nvcc, ours, kind = proc.stdout.split()[-3:]
    assert kind == "pip" and tilelang_nvcc == ours
    assert Path(ours).resolve() == (toolchain.pip_cuda_home() / "bin" / "nvcc").resolve()


@pytest.mark.slow
def test_build_with_the_system_toolkit_hidden_uses_the_wheels(tmp_path):
    """A real cold build (lowering, nvcc, ptxas, cuobjdump) with only the pip toolkit visible."""
    pip_home = toolchain.pip_cuda_home()
    assert pip_home is not None, "the nvidia-cuda-nvcc wheel is a dependency: `pip install -e .` installs it"
    preset = ROOT / "examples" / "hd64_f16_full_nopp.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "attngen.cli", "build", str(preset), "--json", "--cache-dir", str(tmp_path / "cache")],
        env=hidden_env(tmp_path), capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    tc = report["toolchain"]
    assert tc["kind"] == "pip" and Path(tc["nvcc"]).resolve().is_relative_to(pip_home.resolve()), tc
    assert tc["version"].startswith("13.0.")
    assert report["cached"] is False
    assert report["registers"] and report["spill_store_bytes"] == 0 and report["sass"]["HGMMA"] > 0
    print(f"hidden-toolkit build: {report['kernel']} with pip nvcc {tc['version']}, seconds {report['seconds']}")
