"""`attngen tune` without a GPU: the neighbourhood, the pruning, the dry run, and the tuned table."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attngen.run import runtime
from attngen.run import tune
from attngen.run import tuning_table
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec

ROOT = Path(__file__).resolve().parent.parent
GOOD_REPORT = {"spill_store_bytes": 0, "spill_load_bytes": 0, "stack_frame_bytes": 0, "setmaxnreg_applied": True,
               "registers": 168, "dynamic_smem_bytes": 1024, "sass": {"LDL": 0, "STL": 0}}


def test_neighbours_vary_only_the_schedule_and_stay_within_budgets():
    spec = Spec(head_dim=128, dtype="bfloat16", causal=True, gqa_group=4)
    found = tune.neighbours(spec)
    assert len(found) > 50
    for s in found:
        plan = make_plan(s)  # every neighbour passes the plan's budgets
        assert (s.head_dim, s.dtype, s.causal, s.gqa_group) == (128, "bfloat16", True, 4)
        assert plan.consumer_regs_needed <= plan.consumer_regs
    axes = {f: {getattr(s, f) for s in found} for f in tuning_table.SCHEDULE_FIELDS}
    assert axes["consumers"] == {1, 2, 3} and axes["pingpong"] == {True, False}
    assert {1, 4} <= axes["k_stages"] and {1, 4} <= axes["v_stages"] and all(bn % 16 == 0 for bn in axes["block_n"])
    # hd256 cannot have 3 consumers (registers): the budgets, not the enumeration, rule it out
    assert 3 not in {s.consumers for s in tune.neighbours(Spec(head_dim=256))}


def test_candidates_are_the_most_promising_first():
    plans = tune.candidates(Spec(head_dim=64), 5)
    assert len(plans) == 5
    keys = [tune.promise(p.spec) for p in plans]
    assert keys == sorted(keys)
    assert plans[0].spec.block_n == max(s.block_n for s in tune.neighbours(Spec(head_dim=64)))


def test_tune_explores_both_steady_loop_forms_where_they_differ():
    causal = tune.neighbours(Spec(head_dim=64, causal=True))
    assert {s.steady_loop for s in causal} == {"one", "split"}
    one = {dataclasses.replace(s, steady_loop="split") for s in causal if s.steady_loop == "one"}
    assert one == {s for s in causal if s.steady_loop == "split"}  # every schedule in both forms
    # the two most promising candidates: the best schedule, the default one loop first, then its split loop
    first, second = tune.candidates(Spec(head_dim=64, causal=True), 2)
    assert dataclasses.replace(first.spec, steady_loop="split") == second.spec
    assert (first.spec.steady_loop, second.spec.steady_loop) == ("one", "split") and first.name != second.name
    # no masked tile (aligned, not causal), or every tile masked (mask_mod): one kernel, one form
    for spec in (Spec(head_dim=64, aligned=True), Spec(head_dim=64, mask_mod="kv_idx <= q_idx")):
        assert {s.steady_loop for s in tune.neighbours(spec)} == {"one"}


def test_the_tuned_table_chooses_the_loop_form(tmp_path, monkeypatch):
    q = torch.zeros(1, 3000, 8, 128, dtype=torch.float16)
    k = torch.zeros(1, 3000, 2, 128, dtype=torch.float16)
    key = tuning_table.table_key(Spec(head_dim=128, causal=True, gqa_group=4), 3000)
    monkeypatch.setattr(tuning_table, "TABLE", write_table(tmp_path / "t.json", {key: {"block_n": 128, "steady_loop": "split"}}))
    assert runtime.spec_for(q, k, causal=True).steady_loop == "split"
    assert runtime.spec_for(q, k, causal=True, steady_loop="one").steady_loop == "one"  # named: the table stays out


@pytest.mark.parametrize("change, why", [
    ({"spill_store_bytes": 8}, "spills"), ({"stack_frame_bytes": 16}, "local memory"),
    ({"sass": {"LDL": 2, "STL": 0}}, "local memory"), ({"setmaxnreg_applied": False}, "setmaxnreg"),
])
def test_build_report_prunes_each_broken_promise(change, why):
    assert tune.build_reject(GOOD_REPORT) == ""
    assert why in tune.build_reject({**GOOD_REPORT, **change})


def test_build_all_keeps_going_past_a_failed_build(monkeypatch):
    plans = tune.candidates(Spec(head_dim=64), 3)

    def fake_build(plan, cache_dir):
        if plan is plans[1]:
            raise RuntimeError("nvcc exploded\nmore")
        return {**GOOD_REPORT, "spill_store_bytes": 4} if plan is plans[2] else GOOD_REPORT

    monkeypatch.setattr(tune, "_build_report", fake_build)
    lines = []
    cands = tune.build_all(plans, jobs=1, progress=lines.append)
    assert [c.rejected for c in cands] == ["", "build failed: nvcc exploded", "spills 4 B"]
    assert len(lines) == 3 and lines[-1].startswith("  [3/3]")


def test_a_rerun_reports_cache_hits_as_cached_not_as_seconds_since_the_start(monkeypatch):
    plans = tune.candidates(Spec(head_dim=64), 2)
    clock = iter([0.0, 14.0, 28.0])  # the tune's start, then readings as candidates finish
    monkeypatch.setattr(tune.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(tune, "_build_report", lambda plan, cache_dir: {**GOOD_REPORT, "cached": plan is plans[0]})
    lines = []
    tune.build_all(plans, jobs=1, progress=lines.append)
    assert lines[0].endswith(": kept (cached)"), lines
    assert lines[1].endswith(": kept (14 s)"), lines


def write_table(path, entries):
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_the_tuned_table_chooses_the_schedule_only_when_the_caller_names_none(tmp_path, monkeypatch):
    q = torch.zeros(1, 3000, 8, 128, dtype=torch.float16)
    k = torch.zeros(1, 3000, 2, 128, dtype=torch.float16)
    base = Spec(head_dim=128, causal=True, gqa_group=4)
    key = tuning_table.table_key(base, 3000)
    assert key == "hd128_f16_causal_g4_s4096"
    table = write_table(tmp_path / "t.json", {key: {"consumers": 1, "k_stages": 2, "v_stages": 2, "block_n": 160,
                                                   "pingpong": False, "tflops": 1.0}})
    monkeypatch.setattr(tuning_table, "TABLE", table)
    spec = runtime.spec_for(q, k, causal=True)
    assert (spec.consumers, spec.k_stages, spec.v_stages, spec.block_n, spec.pingpong) == (1, 2, 2, 160, False)
    named = runtime.spec_for(q, k, causal=True, consumers=2)  # a schedule field named: the table stays out
    assert named.consumers == 2 and named.block_n is None
    other = runtime.spec_for(q[:, :100], k[:, :100], causal=True)  # another length bucket: no entry, defaults
    assert other.block_n is None


@pytest.mark.parametrize("content", ["", "{}", '{"entries": {}}', "not json", '{"entries": []}', "[1, 2]"])
def test_an_empty_or_broken_table_means_defaults(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    assert tuning_table.tuned_fields(Spec(), 1024, path) == {}
    assert tuning_table.tuned_fields(Spec(), 1024, tmp_path / "missing.json") == {}


def test_a_stale_entry_over_the_budget_is_ignored(tmp_path):
    key = tuning_table.table_key(Spec(head_dim=256), 8192)
    path = write_table(tmp_path / "t.json", {key: {"consumers": 3, "block_n": 128}})  # hd256 cannot have 3 consumers
    assert tuning_table.tuned_fields(Spec(head_dim=256), 8192, path) == {}


def test_record_winner_round_trips(tmp_path):
    path = tmp_path / "t.json"
    plan = make_plan(Spec(head_dim=64, consumers=3, k_stages=3, v_stages=3))
    winner = tune.Candidate(plan, report=GOOD_REPORT, tflops=512.34)
    key = tune.record_winner(Spec(head_dim=64), 16384, winner, "NVIDIA H200", path=path)
    entry = json.loads(path.read_text())["entries"][key]
    assert entry["tflops"] == 512.3 and entry["kernel"] == plan.name
    assert tuning_table.tuned_fields(Spec(head_dim=64), 16000, path) == {f: getattr(plan.spec, f) for f in tuning_table.SCHEDULE_FIELDS}


def test_the_shipped_table_loads():
    assert isinstance(tuning_table.load_table(), dict)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "attngen.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_tune_without_a_gpu_asks_for_dry_run():
    proc = run_cli("tune", "examples/default.toml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--dry-run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_tune_dry_run_builds_and_lists_candidates(build_cache):
    proc = run_cli("tune", "examples/hd64_f16_full_nopp.toml", "--dry-run", "--max-candidates", "1", "-j", "1",
                   "--cache-dir", str(build_cache))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "[1/1]" in out and "1 of 1 candidates kept" in out and "the table is unchanged" in out
    row = [line for line in out.splitlines() if line.startswith("fa3_fwd_hd64_f16_full")]
    assert len(row) == 1 and row[0].split()[2] == "0"  # registers, then 0 spill bytes


def test_the_table_is_parsed_once_per_change_not_per_call(tmp_path, monkeypatch):
    path = write_table(tmp_path / "t.json", {"k": {"consumers": 1}})
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(self), real(self, *a, **k))[1])
    for _ in range(5):
        assert tuning_table.load_table(path) == {"k": {"consumers": 1}}
    assert len(reads) == 1
    import os
    write_table(path, {"k": {"consumers": 2}})
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a new mtime: parsed again
    assert tuning_table.load_table(path) == {"k": {"consumers": 2}} and len(reads) == 2
