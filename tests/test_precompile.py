"""`attngen precompile`: the GPU runtime's kernels built ahead of the first call, into a cache that
can be copied elsewhere and still hit (docs/build.md, "Kernels before the first call").

Without a GPU nothing is launched, but everything before a launch is real: a child process
precompiles (TileLang's lowering and nvcc, counted), the cache folder is copied and the original
removed, and a second child pointed at the copy by $ATTNGEN_CACHE gets its kernel from
`compile_kernel` with every lowering and nvcc entry point counted, and every compiler process
(tests/compile_count.py).
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attngen.run import entries, forward
from attngen.build.cache import RUNTIME
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import as_plan
from attngen.cli import main
from attngen.spec import Spec
from compile_count import child_env
from gpu_marks import NEEDS_TOOLKIT

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

CHILD = textwrap.dedent(
    """
    import json, sys

    from compile_count import count_compiles

    calls = count_compiles()
    import torch
    from attngen.run import forward, runtime

    q = torch.zeros(1, 256, 2, 64, dtype=torch.float16)
    k = torch.zeros(1, 256, 2, 64, dtype=torch.float16)
    spec = runtime.spec_for(q, k, causal=True)  # the spec attngen.attention picks for these tensors
    if sys.argv[1] == "precompile":
        done = forward.precompile(spec)
        print(json.dumps({"calls": calls, "path": str(done.path), "cached": done.cached}))
    else:
        kernel = forward.compile_kernel(spec)
        print(json.dumps({"calls": calls, "path": kernel.cache_path, "origin": kernel.origin,
                          "seconds": kernel.compile_seconds}))
    """
)


def child(mode: str, cache: Path, tilelang_cache: Path) -> dict:
    env = child_env(ATTNGEN_CACHE=str(cache), TILELANG_CACHE_DIR=str(tilelang_cache))
    run = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@NEEDS_TOOLKIT
def test_a_copied_precompiled_cache_is_hit_with_no_lowering_and_no_nvcc(tmp_path):
    built_in, shipped = tmp_path / "built", tmp_path / "elsewhere" / "cache"
    cold = child("precompile", built_in, tmp_path / "tilelang-1")
    # the counters see a real build: lowering, and nvcc started as a process
    assert {"tilelang.engine.lower.lower_with_context", "process nvcc"} <= set(cold["calls"]), cold["calls"]
    assert not cold["cached"] and cold["path"].startswith(str(built_in / RUNTIME))
    entry = Path(cold["path"]).relative_to(built_in)
    assert child("precompile", built_in, tmp_path / "tilelang-1")["cached"]  # a second precompile finds it

    shutil.copytree(built_in, shipped)
    shutil.rmtree(built_in)  # nothing may point back at the folder it was built in
    for f in (shipped / entry).rglob("*"):
        if f.is_file():
            assert str(built_in).encode() not in f.read_bytes(), f"{f.name} stores the absolute build path"
    warm = child("load", shipped, tmp_path / "tilelang-2")  # an empty TileLang cache: only the copy can serve it
    assert warm["calls"] == [], warm["calls"]
    assert warm["origin"] == "disk" and Path(warm["path"]) == shipped / entry, warm
    print(f"precompiled kernel loaded from the copied cache in {warm['seconds']:.2f} s")


def test_the_runtime_key_needs_no_toolkit_and_starts_no_process(monkeypatch):
    """A deployment that ships a precompiled cache may have no nvcc at all: finding the entry must not ask for one."""
    from attngen.build import toolchain

    def no_toolkit():
        raise toolchain.ToolchainError("no CUDA toolkit here")

    monkeypatch.setattr(toolchain, "current", no_toolkit)
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda *a, **k: pytest.fail("started a process"))
    spec = Spec(head_dim=64, causal=True)
    a = entries.runtime_entry(as_plan(spec), cache_dir="/shipped")
    b = entries.runtime_entry(as_plan(Spec(head_dim=64, causal=False)), cache_dir="/shipped")
    assert a.parent == Path("/shipped") / RUNTIME and a.name.startswith(as_plan(spec).name + "-") and a != b
    static = entries.runtime_entry(as_plan(spec, Shape(1, 2, 2, 256, 256)), cache_dir="/shipped")
    assert static.name.startswith(as_plan(spec).name + "_static-") and static != a
    monkeypatch.setenv("ATTNGEN_CACHE", "/elsewhere")
    assert entries.runtime_entry(as_plan(spec)) == Path("/elsewhere") / RUNTIME / a.name


def fake_precompile(built: list, fail: str | None = None):
    """precompile without TileLang: records the plans, 'builds' each once per cache folder."""
    def precompile(plan, shape=None, *, cache_dir=None):
        if fail and fail in plan.name:
            raise RuntimeError("TileLang could not lower it\n(the rest of a long message)")
        entry = entries.runtime_entry(plan, cache_dir=cache_dir)
        cached = entry.exists()
        entry.mkdir(parents=True, exist_ok=True)
        built.append(plan.name)
        return entries.Precompiled(entry, cached, 0.0 if cached else 12.5)
    return precompile


def test_cli_precompiles_each_spec_with_progress_then_finds_them(tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(forward, "precompile", fake_precompile(built))
    specs = [str(EXAMPLES / "default.toml"), str(EXAMPLES / "hd64_bf16_alibi.toml")]
    assert main(["precompile", *specs, "-j", "1", "--cache-dir", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    progress = cap.err.splitlines()
    assert len(progress) == 2 and progress[0].startswith("[1/2] ok fa3_fwd_hd128_f16_causal") and "built in 12.5 s" in progress[0]
    assert "registers" not in cap.err
    assert f"2 of 2 kernel(s) ready in {tmp_path / RUNTIME} (at run time: ATTNGEN_CACHE={tmp_path})" in cap.out
    assert main(["precompile", *specs, "-j", "1", "--cache-dir", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert all(line.endswith("from cache") for line in cap.err.splitlines()), cap.err
    assert cap.out.count("was there") == 2


def test_cli_precompile_presets_and_one_line_errors(tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(forward, "precompile", fake_precompile(built, fail="hd96"))
    rc = main(["precompile", "--presets", "-j", "1", "--cache-dir", str(tmp_path)])
    cap = capsys.readouterr()
    presets = sorted(EXAMPLES.glob("*.toml"))
    assert rc == 1 and len(built) == len(presets) - 1  # the one that fails costs only itself
    (failed,) = [line for line in cap.err.splitlines() if "FAILED" in line]
    assert failed.endswith("hd96_bf16_gqa2.toml: TileLang could not lower it")
    assert f"{len(presets) - 1} of {len(presets)} kernel(s) ready" in cap.out
    for argv, fragment in ((["precompile"], "one or more spec files, or --presets"),
                           (["precompile", str(EXAMPLES / "default.toml"), "--shape", "1,2"], "shape"),
                           (["precompile", str(EXAMPLES / "default.toml"), "-j", "0"], "--jobs = 0"),
                           (["precompile", str(EXAMPLES / "default.toml"), "--cache-dir", str(EXAMPLES / "default.toml")],
                            "it is a file")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("attngen: error: ") and fragment in err[0], err
    assert main(["precompile", str(tmp_path / "missing.toml"), "-j", "1", "--cache-dir", str(tmp_path)]) == 2
    assert "no such spec file" in capsys.readouterr().err


def test_cli_precompile_of_one_spec_runs_here_and_fails_in_one_line(tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(forward, "precompile", fake_precompile(built, fail="hd96"))
    assert main(["precompile", str(EXAMPLES / "default.toml"), "--cache-dir", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out.splitlines()[0].startswith("precompiling fa3_fwd_hd128_f16_causal")
    assert "built in 12.5 s" in cap.out and f"ATTNGEN_CACHE={tmp_path}" in cap.out
    assert main(["precompile", str(EXAMPLES / "hd96_bf16_gqa2.toml"), "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["attngen: error: precompiling fa3_fwd_hd96_bf16_causal_g2_c2_k2v2_m128n128 failed: TileLang could not lower it"]
    casual = tmp_path / "casual.toml"
    casual.write_text("casual = true\n")
    assert main(["precompile", str(casual)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "did you mean `causal`" in err[0]
