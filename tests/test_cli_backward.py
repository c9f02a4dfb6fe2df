"""The backward pass on the command line: --backward on show, generate, build and emulate, check's
backward half, the backward goldens (generate --presets), and one-line errors for bad input."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.cli import backward as cli_bwd
from attngen.cli import main
from attngen.cli.generate import BACKWARD_PRESETS
from attngen.kernels.bwd.render import render_backward_source

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "examples" / "default.toml"
SINKS = ROOT / "examples" / "hd128_bf16_gqa8_sinks.toml"
PAGED = ROOT / "examples" / "paged_decode_hd128_bf16_gqa8_splits.toml"


def run_main(capsys, *argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err, rc, *fragments):
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("attngen: error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def verdict_lines(out):
    return [line for line in out.splitlines() if line.startswith(("PASS  ", "FAIL  "))]


# -- show and generate -------------------------------------------------------------------------------------
def test_show_backward_prints_the_backward_module(capsys):
    rc, out, _ = run_main(capsys, "show", "--backward", DEFAULT)
    assert rc == 0 and out == render_backward_source(attngen.load_spec(DEFAULT))
    assert "def build_preprocess_kernel" in out and "def build_postprocess_kernel" in out
    assert out != attngen.render_source(attngen.load_spec(DEFAULT))


def test_generate_writes_one_pass_per_call(tmp_path, capsys):
    rc, out, _ = run_main(capsys, "generate", DEFAULT, "-o", tmp_path)
    assert rc == 0 and [Path(p).name for p in out.split()] == ["fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py"]
    rc, out, _ = run_main(capsys, "generate", "--backward", DEFAULT, "-o", tmp_path)
    path = Path(out.strip())
    assert rc == 0 and path.name == "fa3_bwd_hd128_f16_causal_g1_c2_q2_m64n128.py"
    assert path.read_text() == render_backward_source(attngen.load_spec(DEFAULT))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py"])


def test_generate_presets_writes_exactly_the_goldens(tmp_path, capsys):
    rc, out, _ = run_main(capsys, "generate", "--presets", "-o", tmp_path)
    assert rc == 0
    written = {Path(p).name for p in out.split()}
    golden = {p.name for p in (ROOT / "generated").glob("*.py")}
    assert written == golden == {p.name for p in tmp_path.iterdir()}
    for name in golden:
        assert (tmp_path / name).read_bytes() == (ROOT / "generated" / name).read_bytes(), name
    assert len([n for n in written if n.startswith("fa3_bwd_")]) == len(BACKWARD_PRESETS)
    rc, out, _ = run_main(capsys, "generate", "--presets", "--backward", "-o", tmp_path / "bwd")
    assert rc == 0 and {Path(p).name for p in out.split()} == {n for n in golden if n.startswith("fa3_bwd_")}


@pytest.mark.parametrize("argv, fragments", [
    (["generate"], ["SPEC = none", "--presets"]),
    (["generate", "--presets", str(DEFAULT)], ["--presets = ", "no spec file beside it"]),
    (["generate", "--backward", str(PAGED)], ["`paged_kv` = true", "inference layout"]),
    (["show", "--backward", str(ROOT / "examples" / "varlen_paged_hd64_f16.toml")], ["`paged_kv` = true"]),
    (["build", "--backward", str(DEFAULT), str(SINKS)], ["--backward = 2 spec files", "one spec file"]),
    (["build", "--backward", str(DEFAULT), "--cuda", "k.cu"], ["--cuda = k.cu", "drop --backward"]),
    (["emulate", "--backward", str(PAGED)], ["`paged_kv` = true"]),
    (["emulate", "--backward", str(DEFAULT), "--q-len", "0"], ["--q-len = 0", "positive integer"]),
    (["emulate", "--backward", str(DEFAULT), "--seed", "-1"], ["--seed = -1"]),
    (["emulate", "--backward", str(DEFAULT), "--source", "/no/such/file.py"], ["--source = /no/such/file.py", "readable file"]),
    (["emulate", "--backward", str(DEFAULT), "--softmax-scale", "-1"], ["--softmax-scale = -1"]),
])
def test_bad_input_is_one_line_and_no_work(argv, fragments, capsys, monkeypatch, tmp_path):
    def no_work(*a, **k):
        raise AssertionError("did work before rejecting the input")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("attngen.build.nvcc.build_backward", no_work)
    monkeypatch.setattr("attngen.emulator.driver.random_inputs", no_work)
    monkeypatch.setattr("attngen.kernels.bwd.render.write_if_different", no_work)
    rc, out, err = run_main(capsys, *argv)
    one_line_error(err, rc, *fragments)
    assert out == ""


def test_split_kv_is_refused_in_one_line(tmp_path, capsys):
    spec = tmp_path / "split.toml"
    spec.write_text("head_dim = 128\nsplits = 2\n")
    rc, out, err = run_main(capsys, "emulate", "--backward", spec)
    one_line_error(err, rc, "`splits` = 2", "split-KV is an inference layout")


def test_the_real_command_gives_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "attngen", "emulate", "--backward", str(PAGED)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


# -- emulate --backward ------------------------------------------------------------------------------------
def grad_lines(out):
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("  d")}


def test_emulate_backward_passes_every_gradient(capsys):
    rc, out, err = run_main(capsys, "emulate", "--backward", SINKS, "--q-len", "70", "--kv-len", "45", "--policy", "producer-first")
    assert rc == 0, out + err
    lines = grad_lines(out)
    assert set(lines) == {"dq", "dk", "dv", "dsinks"} and all(line.endswith(": PASS") for line in lines.values()), lines
    assert "fa3_bwd_hd128_bf16_causal_g8_c2_q2_m64n128_sinks (rendered)" in out and "TMA reduce-adds" in out


def test_emulate_backward_without_sinks_has_three_gradients(capsys):
    rc, out, _ = run_main(capsys, "emulate", "--backward", DEFAULT, "--q-len", "33", "--kv-len", "150", "--softmax-scale", "0.2")
    assert rc == 0 and set(grad_lines(out)) == {"dq", "dk", "dv"} and "softmax scale 0.2" in out


VARLEN = ROOT / "examples" / "varlen_hd128_bf16_causal.toml"


def test_emulate_backward_of_a_varlen_batch_checks_each_sequence(tmp_path, capsys):
    rc, out, _ = run_main(capsys, "emulate", "--backward", VARLEN, "--q-len", "70", "--kv-len", "90")
    assert rc == 0 and "4 sequences (q [70, 1, 36, 0], kv [90, 31, 5, 9])" in out
    assert set(grad_lines(out)) == {"dq", "dk", "dv"} and all(x.endswith(": PASS") for x in grad_lines(out).values())
    path = broken_source(tmp_path, "(acc_dp[i, j] - dPsum_shared[stage, j])", "acc_dp[i, j]", VARLEN)
    rc, out, _ = run_main(capsys, "emulate", "--backward", VARLEN, "--q-len", "70", "--kv-len", "90", "--source", path)
    assert rc == 1 and any(x.endswith(": FAIL") for x in grad_lines(out).values()), out


def test_varlen_checks_fail_a_wrong_sequence():
    """The per-sequence checker itself: the twin passes, one sequence's dv shifted fails."""
    bp = cli_bwd.plan_backward(attngen.load_spec(VARLEN))
    q, k, v, dout, tensors, packing = cli_bwd.draw_inputs(bp, 1, 2, 2, 40, 50, seed=1)
    from attngen.reference.backward import attention_grad_varlen

    cq, ck = packing["cu_seqlens_q"], packing["cu_seqlens_k"]
    low = attention_grad_varlen(q, k, v, dout, cq, ck, True, lowprec="bfloat16")._asdict()
    checks = cli_bwd.varlen_checks(low, q, k, v, dout, packing, bp.spec, None, {})
    assert all(c.ok for c in checks.values()), checks
    wrong = dict(low, dv=low["dv"].copy())
    wrong["dv"][ck[1]:ck[2]] *= 1.5  # the second sequence's keys
    assert not cli_bwd.varlen_checks(wrong, q, k, v, dout, packing, bp.spec, None, {})["dv"].ok


def broken_source(tmp_path, old, new, spec=DEFAULT):
    text = render_backward_source(attngen.load_spec(spec))
    assert old in text
    path = tmp_path / "broken.py"
    path.write_text(text.replace(old, new, 1))
    return path


def test_a_hand_broken_backward_source_fails(tmp_path, capsys):
    path = broken_source(tmp_path, "(acc_dp[i, j] - dPsum_shared[stage, j])", "acc_dp[i, j]")  # dPsum not subtracted
    rc, out, _ = run_main(capsys, "emulate", "--backward", DEFAULT, "--q-len", "100", "--kv-len", "150", "--source", path)
    assert rc == 1 and f"--source {path}" in out
    assert any(line.endswith(": FAIL") for line in grad_lines(out).values()), out
    # the same file unbroken passes: the failure is the edit's
    good = tmp_path / "good.py"
    good.write_text(render_backward_source(attngen.load_spec(DEFAULT)))
    rc, out, _ = run_main(capsys, "emulate", "--backward", DEFAULT, "--q-len", "100", "--kv-len", "150", "--source", good)
    assert rc == 0, out


def test_a_backward_source_with_a_race_exits_1_with_the_report(tmp_path, capsys):
    old = "T.atomic_add(dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :], dQ_shared[g, :, :], use_tma=True)"
    path = broken_source(tmp_path, old, "T.copy(dQ_shared[g, :, :], dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :])")
    rc, out, _ = run_main(capsys, "emulate", "--backward", DEFAULT, "--q-len", "100", "--kv-len", "150", "--source", path)
    assert rc == 1 and "dQ_accum" in out and not grad_lines(out)


# -- build --backward and check --------------------------------------------------------------------------
GOOD = {"kernel": "k", "registers": 168, "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_frame_bytes": 0,
        "setmaxnreg_applied": True, "setmaxnreg_ignored": False, "dynamic_smem_bytes": 1024, "plan_smem_bytes": 1024,
        "sass": {"HGMMA": 8, "LDL": 0, "STL": 0}}


def test_kernel_verdicts_flag_each_broken_promise():
    assert cli_bwd.kernel_verdicts("main", GOOD)[0]
    plain = {**GOOD, "setmaxnreg_applied": False, "plan_smem_bytes": None, "dynamic_smem_bytes": None}
    assert cli_bwd.kernel_verdicts("postprocess", plain)[0]  # not warp-specialised: no setmaxnreg to apply
    for part, change in [("main", {"spill_store_bytes": 8}), ("preprocess", {"spill_load_bytes": 4}),
                         ("main", {"stack_frame_bytes": 16}), ("dq", {"sass": {**GOOD["sass"], "STL": 2}}),
                         ("main", {"setmaxnreg_applied": False}), ("dq", {"setmaxnreg_applied": False}),
                         ("preprocess", {"setmaxnreg_ignored": True}), ("main", {"dynamic_smem_bytes": 2048})]:
        ok, what = cli_bwd.kernel_verdicts(part, {**GOOD, **change})
        assert not ok, (part, change)
        assert what.startswith(f"backward {part} kernel k builds for sm_90a: ")
    dq = {**GOOD, "plan_smem_bytes": None}  # the dq kernel's plan comes from the BackwardPlan
    assert cli_bwd.kernel_verdicts("dq", dq, planned=1024)[0] and not cli_bwd.kernel_verdicts("dq", dq, planned=2048)[0]
    slot = {**GOOD, "dynamic_smem_bytes": 1024 - 1008}  # a persistent main kernel's tile slot placed in 16 B
    assert cli_bwd.kernel_verdicts("main", slot, slack=1008)[0] and not cli_bwd.kernel_verdicts("main", slot)[0]


def test_build_backward_reports_every_kernel(capsys, build_cache):
    rc, out, _ = run_main(capsys, "build", "--backward", DEFAULT, "--cache-dir", build_cache)
    assert rc == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert list(rows) == ["preprocess", "main", "postprocess"]
    assert rows["main"][1] == "fa3_bwd_hd128_f16_causal_g1_c2_q2_m64n128" and rows["main"][7] == "applied"
    assert all(r[3] == "0/0" for r in rows.values())  # no spills
    rc, out, _ = run_main(capsys, "build", "--backward", DEFAULT, "--cache-dir", build_cache, "--json")
    reports = json.loads(out)
    assert rc == 0 and list(reports) == ["preprocess", "main", "postprocess"]
    assert reports["main"]["plan_smem_bytes"] == reports["main"]["dynamic_smem_bytes"] > 0


def test_check_runs_both_passes(tmp_path, capsys, build_cache):
    rc, out, _ = run_main(capsys, "check", DEFAULT, "-o", tmp_path, "--cache-dir", build_cache)
    assert rc == 0, out
    backward = [line for line in verdict_lines(out) if line.startswith("PASS  backward ")]
    assert [line.split()[2] for line in backward] == ["preprocess", "main", "postprocess", "CPU"]
    assert "setmaxnreg applied" in backward[1] and "dq " in backward[3] and "dv " in backward[3]
    # the forward kernel is written; the backward module is built from its rendering, not written
    assert [p.name for p in tmp_path.iterdir()] == ["fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py"]
    assert "backward   fa3_bwd_hd128_f16_causal_g1_c2_q2_m64n128 (rendered" in out


def test_check_fails_when_the_backward_cpu_model_disagrees(tmp_path, capsys, monkeypatch, build_cache):
    import attngen.emulator as emulator

    real = emulator.emulate_backward

    def dk_off(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        dk[0, 3, 1, :] += 0.05  # one key's gradient wrong by more than the bound
        return dq, dk, dv

    monkeypatch.setattr(emulator, "emulate_backward", dk_off)
    rc, out, _ = run_main(capsys, "check", DEFAULT, "-o", tmp_path, "--cache-dir", build_cache)
    failed = [line for line in verdict_lines(out) if line.startswith("FAIL")]
    assert rc == 1 and len(failed) == 1 and failed[0].startswith("FAIL  backward CPU model vs fp64 gradients")
    assert "dk " in failed[0] and "FAIL" in failed[0][5:] and "1 check(s) failed" in out


def test_check_of_a_spec_the_backward_refuses_checks_the_forward(tmp_path, capsys, build_cache):
    rc, out, _ = run_main(capsys, "check", PAGED, "-o", tmp_path, "--cache-dir", build_cache)
    assert rc == 0, out
    refused = [line for line in out.splitlines() if line.startswith("backward: ")]
    assert len(refused) == 1 and "`paged_kv` = true" in refused[0]
    assert not [line for line in verdict_lines(out) if "backward" in line] and len(verdict_lines(out)) == 6
    assert [p.name.startswith("fa3_fwd_") for p in tmp_path.iterdir()] == [True]


def test_help_names_the_backward(capsys):
    for command in ("show", "generate", "build", "emulate", "check"):
        rc, out, _ = run_main(capsys, command, "--help")
        assert rc == 0 and "backward" in out, command


def test_precompile_backward_builds_what_training_loads_and_notes_a_refused_spec(monkeypatch, capsys, tmp_path):
    """`attngen precompile --backward`: the spec's kernel, then the forward with its LSE (what autograd
    runs) and the backward module; a spec the backward refuses keeps its forward and says so in one
    line (exit 0); without the flag nothing of the backward is built."""
    from attngen.run import backward, forward
    from attngen.kernels.bwd.plan import plan_backward
    from attngen.kernels.fwd.plan import Plan
    from attngen.run.entries import Precompiled
    from attngen.spec import load

    calls = []

    def fake(kind):
        def build(spec_or_plan, shape=None, *, cache_dir=None):
            spec = spec_or_plan.spec if isinstance(spec_or_plan, Plan) else spec_or_plan
            calls.append((kind, spec))
            return Precompiled(tmp_path / f"{kind}-{len(calls)}", False, 0.0)
        return build

    monkeypatch.setattr(forward, "precompile", fake("fwd"))
    monkeypatch.setattr(backward, "precompile_backward", fake("bwd"))
    default = str(ROOT / "examples" / "default.toml")
    rc, out, _ = run_main(capsys, "precompile", "--backward", default)
    assert rc == 0 and [k for k, _ in calls] == ["fwd", "fwd", "bwd"], calls
    spec = load(default)
    assert not calls[0][1].lse and calls[1][1].lse and calls[1][1] == dataclasses.replace(calls[0][1], lse=True)
    assert plan_backward(calls[2][1]).name == plan_backward(spec).name
    calls.clear()
    paged = str(ROOT / "examples" / "varlen_paged_hd64_f16.toml")
    rc, out, _ = run_main(capsys, "precompile", "--backward", paged)
    assert rc == 0 and [k for k, _ in calls] == ["fwd"] and "backward: not precompiled" in out and "paged_kv" in out
    calls.clear()
    rc, out, _ = run_main(capsys, "precompile", default)
    assert rc == 0 and [k for k, _ in calls] == ["fwd"]
