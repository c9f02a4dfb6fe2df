"""Build every preset for sm_90a (TileLang lowering + nvcc + cuobjdump) and check its resources;
the cache says when a report comes from it; several kernels build in worker processes."""

import io
import json
import time
from pathlib import Path

import pytest

import attngen
from attngen.build import nvcc as build_mod
from attngen import cli
from attngen.build.nvcc import Outcome, Progress, build, build_many, parse_ptxas
from attngen.build.lower import LowerError

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "examples").glob("*.toml"))


@pytest.fixture
def cache_dir(build_cache):
    return build_cache


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_builds_within_budget(preset, cache_dir):
    spec = attngen.load_spec(preset)
    r = build(spec, cache_dir=cache_dir).report
    assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
    assert r["stack_frame_bytes"] == 0, "local memory in use"
    assert r["sass"]["LDL"] == 0 and r["sass"]["STL"] == 0
    if spec.dtype == "float8_e4m3fn":  # both GEMMs fp8 wgmma from shared memory (docs/fp8.md), no HMMA fallback
        assert r["sass"]["QGMMA_E4M3"] > 0 and r["sass"]["HMMA"] == 0 and r["sass"]["HGMMA"] == 0
    else:
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HGMMA_A_FROM_REGISTERS"] > 0  # wgmma, with register-P
    assert r["setmaxnreg_applied"], "ptxas ignored setmaxnreg (C7508)"
    assert r["sass"]["USETMAXREG"] == spec.consumers + 1
    plan = attngen.make_plan(spec)
    assert r["sass"]["UTMALDG"] > 0
    # packed sequences and split partials are stored row by row (only the block's own rows), not by TMA
    assert (r["sass"]["UTMASTG"] > 0) == (not plan.varlen and not plan.split_kv)
    assert r["dynamic_smem_bytes"] == r["plan_smem_bytes"] == plan.smem_bytes
    if plan.split_kv:
        c = r["combine"]
        assert c["spill_store_bytes"] == c["spill_load_bytes"] == c["stack_frame_bytes"] == 0, c


def test_second_build_is_a_cache_hit_without_lowering(cache_dir, monkeypatch):
    spec = attngen.load_spec(ROOT / "examples" / "default.toml")
    first = build(spec, cache_dir=cache_dir)

    def no_lowering(*a, **k):
        raise AssertionError("a cached build must not lower again")

    monkeypatch.setattr(build_mod, "lower_source", no_lowering)
    t0 = time.perf_counter()
    second = build(spec, cache_dir=cache_dir)
    print(f"warm build: {time.perf_counter() - t0:.3f} s")
    assert second.cached and second.report["cached"] is True
    assert {k: v for k, v in second.report.items() if k != "cached"} == {k: v for k, v in first.report.items() if k != "cached"}
    assert second.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not list(Path(cache_dir).glob(".*-*/")), "no half-written entries left behind"


def test_one_spec_with_a_different_source_is_a_cache_miss(cache_dir):
    """The key hashes the emitted source: the same spec (same kernel name) specialized to a static shape
    emits other text, so it must build its own entry, not get the dynamic kernel's cubin."""
    spec = attngen.load_spec(ROOT / "examples" / "default.toml")
    static = attngen.make_plan(spec, attngen.Shape(1, 2, 2, 256, 384))
    dynamic = build(spec, cache_dir=cache_dir)
    assert static.name == dynamic.report["kernel"]  # one name: only the source tells the two apart
    fixed = build(static, cache_dir=cache_dir)
    assert fixed.report["shape"] == str(static.shape) and dynamic.report["shape"] == "dynamic"
    assert fixed.report["cache_key"] != dynamic.report["cache_key"]
    assert fixed.cubin_path != dynamic.cubin_path
    assert fixed.cuda_source != dynamic.cuda_source and "384" in fixed.cuda_source


def test_ptxas_parser_sees_spills_and_ignored_setmaxnreg():
    text = (
        "ptxas info    : Compiling entry function 'k_kernel' for 'sm_90a'\n"
        "ptxas info    : Function properties for k_kernel\n"
        "    40 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
        "ptxas info    : (C7508) Potential Performance Loss: setmaxnreg ignored; unable to determine register count at entry\n"
    )
    r = parse_ptxas(text, "k_kernel")
    assert r == {
        "registers": 255, "stack_frame_bytes": 40, "spill_store_bytes": 24, "spill_load_bytes": 16,
        "static_smem_bytes": 1024, "setmaxnreg_ignored": True,
    }


def test_a_cache_hit_says_so_in_text_and_json(cache_dir, capsys):
    spec_file = str(ROOT / "examples" / "default.toml")
    build(attngen.load_spec(spec_file), cache_dir=cache_dir)  # make sure the entry exists
    assert cli.main(["build", spec_file, "--cache-dir", str(cache_dir)]) == 0
    text = capsys.readouterr().out
    assert "from cache (built in" in text and "toolchain" in text
    assert cli.main(["build", spec_file, "--json", "--cache-dir", str(cache_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cached"] is True
    assert set(report["toolchain"]) >= {"kind", "nvcc", "version"} and report["toolchain"]["kind"] in ("system", "pip")
    assert set(report["seconds"]) == {"import", "lower", "nvcc"}


def test_a_fresh_build_reports_its_own_seconds():
    r = {"seconds": {"import": 3.5, "lower": 12.6, "nvcc": 7.9}, "cached": False}
    assert build_mod.format_build(r) == "import 3.5 s, lower 12.6 s, nvcc 7.9 s"
    r["cached"], r["built_at"] = True, "2026-11-30T02:12:49Z"
    assert build_mod.format_build(r) == "from cache (built in 24.0 s on 2026-11-30 02:12:49 UTC: import 3.5 s, lower 12.6 s, nvcc 7.9 s)"


def test_one_failing_kernel_keeps_the_others(cache_dir, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("head_dim = 100\n")
    good = ROOT / "examples" / "default.toml"
    build(attngen.load_spec(good), cache_dir=cache_dir)
    seen = []
    outcomes = build_many([bad, good], cache_dir=cache_dir, jobs=1, progress=lambda d, t, o: seen.append((d, t)))
    assert outcomes[0].error and outcomes[0].user_error and "\n" not in outcomes[0].error and "head_dim" in outcomes[0].error
    assert outcomes[1].error is None and outcomes[1].report["kernel"] == attngen.make_plan(attngen.load_spec(good)).name
    assert seen == [(1, 2), (2, 2)]

    def broken(*a, **k):
        raise LowerError("TileLang could not lower x: ValueError: line one\nline two")

    monkeypatch.setattr(build_mod, "lower_source", broken)
    fresh = tmp_path / "fresh-cache"
    outcomes = build_many([good], cache_dir=fresh, jobs=1)
    assert outcomes[0].error == "TileLang could not lower x: ValueError: line one" and not outcomes[0].user_error


def test_cli_builds_several_in_worker_processes(cache_dir, tmp_path, capsys):
    """-j 2: spawned workers (cache hits here), one plain progress line per kernel on a non-terminal stderr,
    one row each on stdout, exit 2 for the bad spec while the good ones still report."""
    good = [ROOT / "examples" / "default.toml", ROOT / "examples" / "seed_parity.toml"]
    for g in good:
        build(attngen.load_spec(g), cache_dir=cache_dir)
    bad = tmp_path / "bad.toml"
    bad.write_text("consumers = 9\n")
    argv = ["build", *map(str, good), str(bad), "-j", "2", "--cache-dir", str(cache_dir)]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 3 and all(line.startswith(("[1/3] ", "[2/3] ", "[3/3] ")) for line in lines), captured.err
    assert "\r" not in captured.err
    assert sum("FAILED" in line for line in lines) == 1
    assert captured.out.count("FAILED") == 1 and all(attngen.make_plan(attngen.load_spec(g)).name in captured.out for g in good)


def test_cli_json_for_several_is_a_list(cache_dir, capsys):
    good = [ROOT / "examples" / "default.toml", ROOT / "examples" / "seed_parity.toml"]
    for g in good:
        build(attngen.load_spec(g), cache_dir=cache_dir)
    assert cli.main(["build", *map(str, good), "-j", "1", "--json", "--cache-dir", str(cache_dir)]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["kernel"] for r in reports] == [attngen.make_plan(attngen.load_spec(g)).name for g in good]
    assert all(r["cached"] for r in reports)


def test_progress_bar_on_a_terminal_plain_lines_elsewhere():
    ok = Outcome("a.toml", report={"kernel": "k", "registers": 168, "cached": True, "seconds": {"lower": 1, "nvcc": 1}})
    bad = Outcome("b.toml", error="nvcc failed")
    tty = io.StringIO()
    p = Progress(tty, tty=True, width=10)
    p(0, 2, None)
    p(1, 2, ok)
    p(2, 2, bad)
    out = tty.getvalue()
    assert "\r" in out and "[#####-----] 1/2" in out and "[##########] 2/2 done, 1 cached, 1 failed" in out
    plain = io.StringIO()
    p = Progress(plain, tty=False)
    p(0, 2, None)
    p(1, 2, ok)
    p(2, 2, bad)
    assert plain.getvalue() == "[1/2] ok k (a.toml): 168 registers, from cache\n[2/2] FAILED b.toml: nvcc failed\n"
