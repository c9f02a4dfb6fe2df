"""generated/ holds each preset's emitted kernel, and each backward preset's backward module
(attngen.cli.generate.BACKWARD_PRESETS); regenerating must be byte-identical."""

import importlib
from pathlib import Path

import pytest

import attngen
from attngen.cli.generate import BACKWARD_PRESETS
from attngen.kernels.common.emit import write_if_different
from attngen.kernels.fwd.render import generate
from attngen.kernels.bwd.render import as_backward_plan, generate_backward

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "examples").glob("*.toml"))
BACKWARD = [ROOT / "examples" / f"{name}.toml" for name in BACKWARD_PRESETS]


def test_there_are_enough_presets():
    specs = [attngen.load_spec(p) for p in PRESETS]
    assert len(specs) >= 6
    assert {64, 128, 256} <= {s.head_dim for s in specs}
    assert {"float16", "bfloat16", "float8_e4m3fn"} == {s.dtype for s in specs}
    assert any(s.kv_dtype == "float8_e4m3fn" for s in specs)  # an fp8 KV cache beside 16-bit queries
    assert {True, False} == {s.causal for s in specs}
    assert {1, 2, 3} == {s.consumers for s in specs}
    assert {1, 2, 3} <= {s.k_stages for s in specs} | {s.v_stages for s in specs}
    assert any(s.gqa_group == 1 for s in specs) and any(s.gqa_group > 1 for s in specs)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_generated_file_is_byte_identical(preset, tmp_path):
    spec = attngen.load_spec(preset)
    fresh = generate(spec, tmp_path)
    golden = ROOT / "generated" / fresh.name
    assert golden.exists(), f"generated/{fresh.name} is missing: run `attngen generate {preset.relative_to(ROOT)}`"
    assert golden.read_bytes() == fresh.read_bytes(), f"generated/{fresh.name} drifted from the generator: regenerate it"


@pytest.mark.parametrize("preset", BACKWARD, ids=lambda p: p.stem)
def test_generated_backward_module_is_byte_identical(preset, tmp_path):
    fresh = generate_backward(attngen.load_spec(preset), tmp_path)
    golden = ROOT / "generated" / fresh.name
    assert golden.exists(), f"generated/{fresh.name} is missing: run `attngen generate --backward {preset.relative_to(ROOT)}`"
    assert golden.read_bytes() == fresh.read_bytes(), f"generated/{fresh.name} drifted from the generator: regenerate it"


def test_the_backward_presets_cover_the_backward_features():
    plans = [as_backward_plan(attngen.load_spec(p)) for p in BACKWARD]
    specs = [bp.spec for bp in plans]
    assert {64, 128} <= {s.head_dim for s in specs} and {True, False} == {s.causal for s in specs}
    assert {"float16", "bfloat16"} == {s.dtype for s in specs}
    assert any(bp.kv_accum for bp in plans)  # GQA: dK/dV accumulators and their postprocess
    assert any(s.gqa_group > 1 and s.deterministic and s.sinks for s in specs)  # the dq and dsinks kernels, GQA heads in one CTA
    assert any(s.sinks for s in specs) and any(s.softcap for s in specs) and any(s.window != (-1, -1) for s in specs)
    assert any(s.score_mod.strip() for s in specs)  # the symbolic derivative
    assert any(bp.forward.head_dim_v != s.head_dim for bp, s in zip(plans, specs))  # head_dim_v 128 of head_dim 192
    assert any(s.layout == "varlen" for s in specs)
    assert len({bp.name for bp in plans}) == len(plans)  # one golden each


def test_no_stale_generated_files():
    expected = {attngen.make_plan(attngen.load_spec(p)).name + ".py" for p in PRESETS}
    expected |= {as_backward_plan(attngen.load_spec(p)).name + ".py" for p in BACKWARD}
    present = {p.name for p in (ROOT / "generated").glob("*.py")}
    assert present == expected


def test_rendering_is_deterministic():
    spec = attngen.Spec(causal=True, gqa_group=2)
    assert attngen.render_source(spec) == attngen.render_source(attngen.Spec(causal=True, gqa_group=2))


def test_write_if_different_keeps_mtime(tmp_path):
    path = tmp_path / "k.py"
    assert write_if_different(path, "x = 1\n") is True
    before = path.stat().st_mtime_ns
    assert write_if_different(path, "x = 1\n") is False
    assert path.stat().st_mtime_ns == before
    assert write_if_different(path, "x = 2\n") is True and path.read_text() == "x = 2\n"


def test_template_bug_is_shown_with_numbered_lines(monkeypatch):
    render_mod = importlib.import_module("attngen.kernels.common.emit")

    broken = "line one\n{{ kernel.name }}\n{{ no_such_parameter }}\nline four\n"
    monkeypatch.setattr(render_mod, "load_template", lambda name: broken)
    render_mod.environment.cache_clear()
    try:
        with pytest.raises(render_mod.TemplateError) as info:
            attngen.render_source(attngen.Spec())
    finally:
        render_mod.environment.cache_clear()
    message = str(info.value)
    assert "fa3_fwd.py.j2:3" in message and "no_such_parameter" in message
    assert ">    3 | {{ no_such_parameter }}" in message


def test_template_found_in_a_source_checkout_without_install(monkeypatch):
    render_mod = importlib.import_module("attngen.kernels.common.emit")

    def not_installed(package):
        raise ModuleNotFoundError(package)

    monkeypatch.setattr(render_mod.importlib.resources, "files", not_installed)
    assert render_mod.load_template("fwd/fa3_fwd.py.j2") == (ROOT / "templates" / "fwd" / "fa3_fwd.py.j2").read_text()
