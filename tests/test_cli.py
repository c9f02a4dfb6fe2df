"""The command line: outputs, and one-line errors (never a traceback) for bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "\n-                    acc_s[i, j] = T.if_then_else(i + diag >= j, " in out
    assert "\n+                    acc_s[i, j] = T.if_then_else(k * BLOCK_N + j < kv_len, " in out


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "attngen.cli", *args], capture_output=True, text=True)


def test_bad_spec_is_one_line_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("head_dim = 100\ncausal = true\n")
    proc = run_cli("show", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "attngen: error: spec field `head_dim` = 100: expected one of 64, 96, 128, 192, 256"


def test_an_oversized_expression_is_one_line_not_a_recursion_error(tmp_path):
    # issue 21: 1000 chained terms gave a RecursionError traceback
    bad = tmp_path / "long.toml"
    bad.write_text('score_mod = "score' + " + 1" * 1000 + '"\n')
    proc = run_cli("show", str(bad))
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-500:]
    assert proc.stderr.startswith("attngen: error: spec field `score_mod`") and "at most 1000" in proc.stderr


def test_unknown_key_and_bad_shape_are_clean_errors(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text("head_dim = 128\nk_stage = 2\n")
    proc = run_cli("generate", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "did you mean `k_stages`" in proc.stderr
    proc = run_cli("build", str(DEFAULT), "--shape", "1,2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "B,H,HKV,SQ,SKV" in proc.stderr
    proc = run_cli("build", str(DEFAULT), "--shape", "1,3,2,128,128")
    assert proc.returncode == 2 and "shape.heads" in proc.stderr


def test_unusable_toolkit_is_a_clean_error(tmp_path):
    # (no toolkit at all, and the pip wheels' build: tests/test_toolchain.py)
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path), "CUDA_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "attngen.cli", "build", str(DEFAULT), "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert f"CUDA_HOME={tmp_path} holds no bin/nvcc" in proc.stderr


def test_unwritable_cuda_path_is_a_clean_error(tmp_path, build_cache):
    proc = run_cli("build", str(DEFAULT), "--cache-dir", str(build_cache), "--cuda", str(tmp_path / "no" / "such" / "dir" / "k.cu"))
    # checked before the build: one line naming the option and the missing directory, not a raw [Errno 2]
    one_line_error(proc.stderr, proc.returncode, "--cuda", "no/such/dir/k.cu", "does not exist")
    assert "Errno" not in proc.stderr


def verdict_lines(out):
    return [line for line in out.splitlines() if line.startswith(("PASS  ", "FAIL  "))]


def test_check_passes_the_default_spec(tmp_path, capsys, build_cache):
    assert main(["check", str(DEFAULT), "-o", str(tmp_path), "--cache-dir", str(build_cache)]) == 0
    out = capsys.readouterr().out
    lines = verdict_lines(out)
    # 6 of the forward kernel, and the backward's: preprocess, main, postprocess kernels and the gradients
    assert len(lines) == 10 and all(line.startswith("PASS") for line in lines) and "all checks passed" in out


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
    from attngen.cli.build import build_verdicts

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


def test_a_persistent_kernels_tile_slot_may_take_16_bytes_to_1_kib():
    """plan.smem_slack: the plan counts the slot's most; a build may use less by up to the slack, never more."""
    import attngen
    from attngen.build.nvcc import smem_as_planned
    from attngen.kernels.fwd.plan import make_plan

    plan = make_plan(attngen.Spec(causal=True, scheduler="persistent"))
    assert plan.smem_slack == 1024 - 16 and make_plan(attngen.Spec(causal=True)).smem_slack == 0
    rest = plan.smem_bytes - 1024
    for built, ok in [(rest + 1024, True), (rest + 16, True), (rest, False), (rest + 1040, False)]:
        assert smem_as_planned({"dynamic_smem_bytes": built, "plan_smem_bytes": plan.smem_bytes}, plan.smem_slack) == ok
    assert not smem_as_planned({"dynamic_smem_bytes": rest + 16, "plan_smem_bytes": plan.smem_bytes})  # no slack given


# -- bad input: one line on stderr, exit 2, and no work done first ---------------------------------------
def one_line_error(proc_or_err, rc, *fragments):
    """The run exited `rc` with exactly one stderr line, `attngen: error: ...`, containing `fragments`."""
    lines = proc_or_err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("attngen: error: "), proc_or_err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def run_main(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("argv, fragments", [
    (["emulate", "{spec}", "--q-len", "-5"], ["--q-len = -5", "positive integer"]),
    (["emulate", "{spec}", "--kv-len", "0"], ["--kv-len = 0", "positive integer"]),
    (["emulate", "{spec}", "--kv-heads", "-1"], ["--kv-heads = -1", "positive integer"]),
    (["emulate", "{spec}", "--batch", "-2"], ["--batch = -2", "positive integer"]),
    (["emulate", "{spec}", "--heads", "0"], ["--heads = 0", "positive integer"]),
    (["emulate", "{spec}", "--seed", "-1"], ["--seed = -1", "non-negative integer"]),
    (["emulate", "{spec}", "--q-len", "1000000000"], ["--q-len = 1000000000", "int32"]),
    (["emulate", "{spec}", "--batch", "1000000000"], ["--batch = 1000000000", "at most 65535"]),
    (["emulate", "{spec}", "--q-len", "60000", "--kv-len", "60000"], ["--q-len = 60000", "GiB", "a smaller value"]),
    (["emulate", "{spec}", "--heads", "3"], ["--heads = 3", "kv_heads * gqa_group"]),
    (["emulate", "{spec}", "--policy", "fastest"], ["--policy", "invalid choice", "producer-first"]),
    (["emulate", "{spec}", "--q-len", "abc"], ["--q-len", "invalid int value"]),
    (["emulate", "{spec}", "--source", "{tmp}"], ["--source", "directory"]),
    (["emulate", "{spec}", "--source", "{latin1}"], ["--source", "not UTF-8"]),
    (["emulate", "{spec}", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["check", "{spec}", "--q-len", "0"], ["--q-len = 0"]),
    (["check", "{spec}", "--seed", "-1"], ["--seed = -1"]),
    (["check", "{spec}", "--kv-len", "3000000"], ["--kv-len = 3000000", "GiB"]),
    (["check", "{spec}", "--cache-dir", "{spec}"], ["--cache-dir", "it is a file"]),
    (["build", "{spec}", "--cache-dir", "{spec}"], ["--cache-dir", "it is a file"]),
    (["generate", "{spec}", "-o", "{spec}"], ["--output", "it is a file"]),
    (["build", "{spec}", "--shape", "1,1,70000,128,128"], ["shape.heads"]),
    (["build", "{spec}", "--shape", "70000,1,1,128,128"], ["shape.batch", "65535"]),
    (["build", "{spec}", "--shape", "1,1,1,3000000000,128"], ["int32"]),
    (["build", "{spec}", "--shape", "1,1,1,12345678901234567890123,128"], ["12345678901234567890123", "at most 2147483647"]),
    (["show", "{tmp}"], ["is a directory"]),
    (["show", "{latin1}"], ["not UTF-8"]),
    (["show", "{missing}"], ["no such spec file"]),
    (["emulate", "{casual}"], ["did you mean `causal`"]),
    (["emulate", "{aligned}", "--q-len", "70"], ["--q-len = 70: expected a multiple of block_m = 128 (aligned spec)"]),
    (["emulate", "{aligned}", "--kv-len", "300"], ["--kv-len = 300: expected a multiple of block_n = 128 (aligned spec)"]),
    ([], ["required: COMMAND"]),
    (["tune", "{spec}", "--dry-run", "--max-candidates", "0"], ["--max-candidates = 0", "positive integer"]),
    (["tune", "{spec}", "--dry-run", "-j", "-1"], ["--jobs = -1", "positive integer"]),
    (["tune", "{spec}", "--dry-run", "--seq-len", "0"], ["--seq-len = 0", "positive integer"]),
    (["tune", "{spec}", "--dry-run", "--cache-dir", "{spec}"], ["--cache-dir", "it is a file"]),
    (["timeline", "{spec}", "--q-len", "-3"], ["--q-len = -3", "positive integer"]),
    (["timeline", "{spec}", "--q-len", "60000", "--kv-len", "60000"], ["GiB", "a smaller value"]),
    (["timeline", "{spec}", "--seed", "-1"], ["--seed = -1"]),
    (["timeline", "{spec}", "--max-blocks", "0"], ["--max-blocks = 0"]),
    (["timeline", "{spec}", "--policy", "fastest"], ["--policy", "invalid choice"]),
    (["timeline", "{spec}", "-o", "{missing_dir}"], ["--output", "no/dir/x", "an existing directory", "does not exist"]),
    (["timeline", "{spec}", "-o", "{under_file}"], ["--output", "an existing directory", "is a file"]),
    (["timeline", "{spec}", "-o", "{tmp}"], ["--output", "it is a directory"]),
    (["build", "{spec}", "--cuda", "{missing_dir}"], ["--cuda", "no/dir/x", "does not exist"]),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(argv, fragments, tmp_path, capsys, monkeypatch):
    import attngen.build.nvcc
    import attngen.reference.forward

    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# caf\xe9\nhead_dim = 128\n".encode("latin-1"))
    casual = tmp_path / "casual.toml"
    casual.write_text("casual = true\n")
    paths = {"{spec}": str(DEFAULT), "{tmp}": str(tmp_path), "{latin1}": str(latin1), "{missing}": str(tmp_path / "no.toml"),
             "{casual}": str(casual), "{aligned}": str(ROOT / "examples" / "seed_parity.toml"),
             "{missing_dir}": str(tmp_path / "no" / "dir" / "x"), "{under_file}": str(DEFAULT / "x")}

    def no_work(*a, **k):
        raise AssertionError("did work before rejecting the input")

    monkeypatch.setattr(attngen.build.nvcc, "build", no_work)  # nothing built ...
    monkeypatch.setattr(attngen.reference.forward, "random_inputs", no_work)  # ... and no input drawn
    monkeypatch.setattr("attngen.emulator.driver.random_inputs", no_work)
    monkeypatch.setattr("attngen.cli.check.generate", no_work)  # ... and nothing generated
    monkeypatch.setattr("attngen.run.tune.build_all", no_work)  # ... no tuning candidate built
    monkeypatch.setattr("attngen.cli.timeline.model_charts", no_work)  # ... and no timeline emulated
    rc, out, err = run_main(capsys, *[paths.get(a, a) for a in argv])
    one_line_error(err, rc, *fragments)
    assert out == ""


def test_check_says_when_it_rounds_the_lengths_of_an_aligned_spec(capsys, monkeypatch):
    """An aligned kernel runs whole tiles only: check rounds --q-len/--kv-len up, and says so first."""
    class Generated(Exception):
        pass

    def stop(*a, **k):
        raise Generated

    monkeypatch.setattr("attngen.cli.check.generate", stop)
    with pytest.raises(Generated):
        main(["check", str(ROOT / "examples" / "seed_parity.toml"), "--q-len", "70", "--kv-len", "256"])
    assert capsys.readouterr().out == "aligned spec: the CPU runs round up --q-len 70 -> 128 (a multiple of block_m = 128)\n"
    with pytest.raises(Generated):  # nothing to round: nothing said
        main(["check", str(ROOT / "examples" / "seed_parity.toml"), "--q-len", "128", "--kv-len", "256"])
    assert capsys.readouterr().out == ""


def test_the_checker_of_one_line_errors_rejects_tracebacks_and_usage_blocks():
    with pytest.raises(AssertionError):
        one_line_error("Traceback (most recent call last):\n  ...\nValueError: x\n", 2)
    with pytest.raises(AssertionError):
        one_line_error("usage: attngen emulate [-h]\nattngen emulate: error: x\n", 2)
    with pytest.raises(AssertionError):
        one_line_error("attngen: error: x\n", 1)
    one_line_error("attngen: error: x\n", 2)


def test_subprocess_matches_in_process(tmp_path, capsys):
    """The real command (python -m attngen) prints what main() does in-process, with the same exit code."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfehead_dim = 128\n")
    for argv in (["emulate", str(DEFAULT), "--seed", "-1"], ["show", str(bad)], ["emulate", str(DEFAULT), "--nope"],
                 ["emulate", str(DEFAULT), "--q-len", "1", "--kv-len", "1"]):
        proc = subprocess.run([sys.executable, "-m", "attngen", *argv], capture_output=True, text=True)
        rc, out, err = run_main(capsys, *argv)
        assert (proc.returncode, proc.stderr) == (rc, err), argv
        assert "Traceback" not in proc.stderr
        assert proc.stdout.splitlines()[:1] == out.splitlines()[:1]  # timings differ after the first line


def test_help_shows_every_default_and_the_policy_choices(capsys):
    for command in ("generate", "build", "check", "emulate"):
        rc, out, _ = run_main(capsys, command, "--help")
        assert rc == 0
    rc, out, _ = run_main(capsys, "emulate", "--help")
    text = " ".join(out.split())
    for default in ("(default: 1)", "(default: 128)", "(default: 0)", "(default: random)", "{random,producer-first,consumers-first}"):
        assert default in text, default
    rc, out, _ = run_main(capsys, "check", "--help")
    text = " ".join(out.split())
    assert "(default: 200)" in text and "(default: 333)" in text and "(default: generated)" in text
    rc, out, _ = run_main(capsys, "--version")
    assert rc == 0 and out.strip() == f"attngen {attngen.__version__}"


def test_python_dash_m_attngen_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "attngen", "show", str(DEFAULT)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == attngen.render_source(attngen.load_spec(DEFAULT))


def test_emulate_and_check_run_a_dense_split_kv_spec_at_the_shape_the_flags_give(tmp_path, capsys):
    """issue 25: both crashed on a ragged batch a dense KV cannot hold, naming lengths nobody gave."""
    from argparse import Namespace

    from attngen.cli.check import emulate_verdict

    spec = tmp_path / "split.toml"
    spec.write_text("head_dim = 64\nsplits = 2\n")
    rc, out, err = run_main(capsys, "emulate", str(spec), "--batch", "2", "--q-len", "70", "--kv-len", "200")
    assert rc == 0 and err == "" and "B=2 H=1 HKV=1 Sq=70 Skv=200" in out and "2 sequences (q [70, 70], kv [200, 200]" in out
    ok, what = emulate_verdict(attngen.make_plan(attngen.load_spec(spec)),
                               Namespace(q_len=200, kv_len=333, seed=0, softmax_scale=None))
    assert ok and what.startswith("CPU model vs fp64 reference (B=1 H=2 HKV=2 Sq=200 Skv=333, seed 0): 1 sequence (q [200]"), what
    # a kernel whose sequences may differ runs a ragged batch built from the lengths, whatever --batch says
    varlen = tmp_path / "varlen.toml"
    varlen.write_text('head_dim = 64\nlayout = "varlen"\n')
    rc, out, _ = run_main(capsys, "emulate", str(varlen), "--batch", "3", "--q-len", "70", "--kv-len", "200")
    assert rc == 0 and "a ragged batch of 4 from Sq=70 Skv=200 (--batch 3 does not apply)" in out, out


def test_emulate_of_a_tiny_shape_runs(capsys):
    rc, out, err = run_main(capsys, "emulate", str(DEFAULT), "--q-len", "1", "--kv-len", "1", "--seed", "5")
    assert rc == 0 and err == "" and "PASS" in out


def test_help_and_docs_say_that_source_executes_the_file_as_python(capsys):
    """`--source FILE` runs FILE's statements (the CPU model execs it): the user is told, in --help and the docs."""
    rc, out, _ = run_main(capsys, "emulate", "--help")
    text = " ".join(out.split())
    assert rc == 0 and "executed as Python" in text and "only pass files you trust" in text
    doc = " ".join((Path(__file__).resolve().parent.parent / "docs" / "emulator.md").read_text().split())
    assert "`--source FILE`" in doc and "**executed as Python**" in doc
