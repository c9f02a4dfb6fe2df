"""Build every preset for sm_90a (TileLang lowering + nvcc + cuobjdump) and check its resources."""

import time
from pathlib import Path

import pytest

import attngen
from attngen import build as build_mod
from attngen.build import build, parse_ptxas

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
    assert r["sass"]["HGMMA"] > 0 and r["sass"]["HGMMA_A_FROM_REGISTERS"] > 0  # wgmma, with register-P
    assert r["setmaxnreg_applied"], "ptxas ignored setmaxnreg (C7508)"
    assert r["sass"]["USETMAXREG"] == spec.consumers + 1
    assert r["sass"]["UTMALDG"] > 0 and r["sass"]["UTMASTG"] > 0
    assert r["dynamic_smem_bytes"] == r["plan_smem_bytes"] == attngen.make_plan(spec).smem_bytes


def test_second_build_is_a_cache_hit_without_lowering(cache_dir, monkeypatch):
    spec = attngen.load_spec(ROOT / "examples" / "default.toml")
    first = build(spec, cache_dir=cache_dir)

    def no_lowering(*a, **k):
        raise AssertionError("a cached build must not lower again")

    monkeypatch.setattr(build_mod, "lower_source", no_lowering)
    t0 = time.perf_counter()
    second = build(spec, cache_dir=cache_dir)
    print(f"warm build: {time.perf_counter() - t0:.3f} s")
    assert second.cached and second.report == first.report
    assert second.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not list(Path(cache_dir).glob(".*-*/")), "no half-written entries left behind"


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
