"""The command line: outputs, and one-line errors (never a traceback) for bad input."""

import subprocess
import sys
from pathlib import Path

import attngen
from attngen.cli import main

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "examples" / "default.toml"


def test_generate_writes_and_prints_path(tmp_path, capsys):
    assert main(["generate", str(DEFAULT), "-o", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path and path.read_text() == attngen.render_source(attngen.load_spec(DEFAULT))


def test_show_prints_the_emitted_source(capsys):
    assert main(["show", str(DEFAULT)]) == 0
    assert capsys.readouterr().out == attngen.render_source(attngen.load_spec(DEFAULT))


def test_diff_shows_only_what_differs(capsys, tmp_path):
    full = tmp_path / "full.toml"
    full.write_text("head_dim = 128\ncausal = false\n")
    assert main(["diff", str(DEFAULT), str(full)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py\n+++ fa3_fwd_hd128_f16_full_g1_c2_k2v2_m128n128.py")
    assert "\n HEAD_DIM = 128\n" in out  # shared lines are context, not changes
    assert "\n-                acc_s[i, j] = T.if_then_else(q0 + row0 + i + causal_offset >= k * BLOCK_N + j, " in out
    assert "\n+                acc_s[i, j] = T.if_then_else(k * BLOCK_N + j < kv_len, " in out


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "attngen.cli", *args], capture_output=True, text=True)


def test_bad_spec_is_one_line_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("head_dim = 100\ncausal = true\n")
    proc = run_cli("show", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "attngen: error: spec field `head_dim` = 100: expected one of 64, 96, 128, 192, 256"


def test_unknown_key_and_bad_shape_are_clean_errors(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text("head_dim = 128\nk_stage = 2\n")
    proc = run_cli("generate", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "did you mean `k_stages`" in proc.stderr
    proc = run_cli("build", str(DEFAULT), "--shape", "1,2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "B,H,HKV,SQ,SKV" in proc.stderr
    proc = run_cli("build", str(DEFAULT), "--shape", "1,3,2,128,128")
    assert proc.returncode == 2 and "shape.heads" in proc.stderr


def test_missing_nvcc_is_a_clean_error(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "attngen.cli", "build", str(DEFAULT), "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "nvcc not found on PATH" in proc.stderr


def test_unwritable_cuda_path_is_a_clean_error(tmp_path, build_cache):
    proc = run_cli("build", str(DEFAULT), "--cache-dir", str(build_cache), "--cuda", str(tmp_path / "no" / "such" / "dir" / "k.cu"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "No such file" in proc.stderr


def verdict_lines(out):
    return [line for line in out.splitlines() if line.startswith(("PASS  ", "FAIL  "))]


def test_check_passes_the_default_spec(tmp_path, capsys, build_cache):
    assert main(["check", str(DEFAULT), "-o", str(tmp_path), "--cache-dir", str(build_cache)]) == 0
    out = capsys.readouterr().out
    lines = verdict_lines(out)
    assert len(lines) == 6 and all(line.startswith("PASS") for line in lines) and "all checks passed" in out


def test_check_fails_when_the_cpu_model_disagrees(tmp_path, capsys, monkeypatch, build_cache):
    import attngen.emulator as emulator

    real = emulator.emulate_stats

    def off_by_a_little(*args, **kwargs):
        out, stats = real(*args, **kwargs)
        out[0, -1, 0, :] += 0.05  # one row wrong by more than the tolerance allows
        return out, stats

    monkeypatch.setattr(emulator, "emulate_stats", off_by_a_little)
    assert main(["check", str(DEFAULT), "-o", str(tmp_path), "--cache-dir", str(build_cache)]) == 1
    out = capsys.readouterr().out
    failed = [line for line in verdict_lines(out) if line.startswith("FAIL")]
    assert failed and failed[0].startswith("FAIL  CPU model vs fp64 reference") and "1 check(s) failed" in out


def test_build_verdicts_flag_each_broken_promise():
    from attngen.cli import build_verdicts

    good = {"spill_store_bytes": 0, "spill_load_bytes": 0, "stack_frame_bytes": 0, "setmaxnreg_applied": True,
            "dynamic_smem_bytes": 1024, "plan_smem_bytes": 1024,
            "sass": {"HGMMA": 8, "HGMMA_A_FROM_REGISTERS": 4, "LDL": 0, "STL": 0}}
    assert all(ok for ok, _ in build_verdicts(good))
    broken = [
        {"spill_store_bytes": 8}, {"stack_frame_bytes": 16}, {"setmaxnreg_applied": False},
        {"dynamic_smem_bytes": 2048}, {"sass": {**good["sass"], "HGMMA_A_FROM_REGISTERS": 0}},
        {"sass": {**good["sass"], "LDL": 3}},
    ]
    for change in broken:
        assert sum(not ok for ok, _ in build_verdicts({**good, **change})) == 1, change
