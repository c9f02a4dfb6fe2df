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
    assert path.parent == tmp_path and path.read_text() == attngen.render(attngen.load_spec(DEFAULT))


def test_show_prints_the_emitted_source(capsys):
    assert main(["show", str(DEFAULT)]) == 0
    assert capsys.readouterr().out == attngen.render(attngen.load_spec(DEFAULT))


def test_diff_shows_only_what_differs(capsys):
    assert main(["diff", str(DEFAULT), str(ROOT / "examples" / "seed_parity.toml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py")
    assert "\n HEAD_DIM = 128\n" in out  # shared lines are context, not changes
    assert "+# kernel:    fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128_aligned" in out
    assert "-                acc_s[i, j] = T.if_then_else(q0 + row0 + i + causal_offset >= k * BLOCK_N + j and k * BLOCK_N + j < kv_len" in out


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
