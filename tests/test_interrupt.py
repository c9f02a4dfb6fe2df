"""Ctrl-C during `attngen build -j`, `attngen tune` and `attngen precompile -j`: every worker stops, one line, exit 130.

The command runs as a real subprocess in its own session, and SIGINT goes to its whole process
group, as a terminal's Ctrl-C does. Only the build itself is a stand-in (a worker process that
starts a child meant to run for a minute, as nvcc would), installed by the driver script's top
level: spawned workers re-import the parent's main script, so they build with the stand-in too.
The interrupt path (worker pool, signal handling, exit code) is the real one.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys

    import attngen.build.nvcc
    import attngen.run.forward
    import attngen.run.tune


    def slow_build(*args, **kwargs):
        # a stand-in for lowering + nvcc: a child process that runs for a minute
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(os.environ["ATTNGEN_TEST_PIDS"], f"{os.getpid()}-{child.pid}"), "w").close()
        child.wait()
        raise RuntimeError("the slow build ran to its end: it was not interrupted")


    attngen.build.nvcc.build = slow_build
    attngen.run.tune._build_report = slow_build
    attngen.run.forward.precompile = slow_build

    if __name__ == "__main__":
        from attngen.cli import main

        sys.exit(main(sys.argv[1:]))
    """
)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent to reap it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("argv", [
    ["build", "-j", "2", *(str(EXAMPLES / n) for n in ("default.toml", "hd64_bf16_alibi.toml", "hd96_bf16_gqa2.toml",
                                                     "hd192_f16_full.toml"))],
    ["tune", str(EXAMPLES / "default.toml"), "--dry-run", "-j", "2", "--max-candidates", "4"],
    ["precompile", "-j", "2", "--presets"],
], ids=["build", "tune", "precompile"])
def test_ctrl_c_stops_every_worker_and_exits_130_with_one_line(argv, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, ATTNGEN_TEST_PIDS=str(pids), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(driver), *argv, "--cache-dir", str(tmp_path / "cache")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # two spawned workers import attngen on a busy machine
        while len(list(pids.iterdir())) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the two workers never started building"
            time.sleep(0.2)
        started = sorted(p.name for p in pids.iterdir())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert err.splitlines() == ["attngen: interrupted"], err[-3000:]
    # no build started after the interrupt, and none is left running: neither a worker nor its "nvcc"
    deadline = time.monotonic() + 5
    running = [int(pid) for name in started for pid in name.split("-")]
    while any(alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in running if alive(pid)], "processes still running after the interrupt"
    assert sorted(p.name for p in pids.iterdir()) == started, "a worker started another build after the interrupt"
