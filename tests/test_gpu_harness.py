"""The GPU check's own machinery, on the CPU: the smoke stage's timeouts and the seed kernel's extraction."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


smoke = bench_module("gpu_smoke")
seed = bench_module("seed_kernel")


def child(code):
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("code, verdict", [
    ("print('LOADED (disk)'); print('ok (max |out - ref| = 1e-4)')", "ok: ok (max |out - ref| = 1e-4)"),
    ("print('LOADED (disk)'); import sys; print('AssertionError: NaN'); sys.exit(1)", "FAIL: AssertionError: NaN"),
    ("import time; print('LOADED (disk)', flush=True); time.sleep(30)", "HANG"),
    ("import time; time.sleep(30)", "SLOW LOAD"),
])
def test_smoke_child_verdicts(code, verdict):
    status = smoke.run_child(child(code), load_timeout=3, launch_timeout=1)
    assert status.startswith(verdict), status


def test_slow_loading_does_not_eat_the_launch_timeout():
    # loading takes 2 s (longer than the launch timeout), the launch itself is quick: ok, not HANG
    code = "import time; time.sleep(2); print('LOADED (compiled)', flush=True); print('ok (fine)')"
    assert smoke.run_child(child(code), load_timeout=10, launch_timeout=1).startswith("ok")


def test_the_benchmark_times_the_seed_configuration_in_both_loop_forms():
    """bench_gpu's A/B row: the same spec and shape, the seed's two copies of the steady loop
    (the preset's steady_loop = "split") and the default one loop, each emitted by the generator."""
    import attngen
    from attngen.render import render_source

    gpu = bench_module("bench_gpu")
    rows = gpu.plan([], [1024], 16384)
    split, one = rows[0], rows[1]
    assert split.spec == attngen.load_spec(ROOT / "examples" / "seed_parity.toml")
    assert dataclasses.replace(split.spec, steady_loop="one") == one.spec and split.shape == one.shape
    assert split.static and one.static and split.variant is None and one.variant is None
    assert split.kernel_key != one.kernel_key and split.kernel_name.endswith("_splitloop") and one.kernel_name.endswith("_aligned")
    two_copies, one_loop = render_source(split.spec, split.shape), render_source(one.spec, one.shape)
    assert "for k in T.serial(split, n_tiles):" in two_copies and "if k >= full_tiles:" not in two_copies
    assert "for k in T.serial(split, n_tiles):" not in one_loop and "if k >= full_tiles:" in one_loop


def test_a_text_variant_of_the_benchmark_renders_with_its_spec_fields():
    """build_time.py's variants that start from the two-loop text render it with steady_loop = "split"."""
    sys.path.insert(0, str(ROOT / "bench"))
    from build_time import render_variant, required_edits, variant_spec
    from attngen.plan import SEED_SHAPE, make_plan
    from attngen.render import render_source

    spec = bench_module("bench_gpu").SEED_SPEC
    one = dataclasses.replace(spec, steady_loop="one")
    source, applied = render_variant(one, SEED_SHAPE, "split-masked-loop")
    assert applied == required_edits("split-masked-loop") == 1 and source == render_source(spec, SEED_SHAPE)
    source, applied = render_variant(one, SEED_SHAPE, "row-sum-in-reduce")
    assert applied == required_edits("row-sum-in-reduce") and variant_spec(one, "row-sum-in-reduce") == spec
    assert "for k in T.serial(split, n_tiles):" in source and "row_sum_tile" not in source
    assert make_plan(spec).name in source
    # a spec-field edit that changes nothing (a loop with no masked tile) does not count as applied
    assert render_variant(dataclasses.replace(one, causal=False), SEED_SHAPE, "split-masked-loop")[1] == 0


def test_the_prebuild_covers_the_presets_the_smoke_stage_launches_but_the_benchmark_skips():
    gpu = bench_module("bench_gpu")
    presets = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    timed = {c.kernel_key for c in gpu.plan(presets, [1024], 16384)}
    every = gpu.preset_keys(presets)
    assert len(set(every)) == len(presets)
    skipped = [k for k in every if k not in timed]  # variant and serving presets: launched by gpu_smoke.py and the tests
    assert any(k[0].layout == "varlen" for k in skipped) and any(k[0].sinks for k in skipped)


def test_a_serving_benchmark_row_that_fails_costs_the_others_nothing(capsys):
    import types

    serve = bench_module("bench_serving")

    def measure(row):
        if row["n"] == 1:
            raise RuntimeError("non-finite output")
        return {"us": 10.0 * row["n"]}

    out = serve.each_row([{"n": 0}, {"n": 1}, {"n": 2}], types.SimpleNamespace(budget_s=1e9), measure)
    assert out == [{"n": 0, "us": 0.0}, {"n": 1, "error": "RuntimeError: non-finite output"}, {"n": 2, "us": 20.0}]
    assert capsys.readouterr().out.count("\n") == 3  # each row printed as it lands
    spent = serve.each_row([{"n": 0}], types.SimpleNamespace(budget_s=-1), measure)
    assert spent == [{"n": 0, "error": "time budget spent"}]


NOTES = ROOT.parent / "shared" / "seeds" / "fa3-tilelang-notes.md"


@pytest.mark.skipif(not NOTES.is_file(), reason="the seed notes live in ../shared beside the checkout")
def test_seed_kernel_is_cut_from_the_notes(tmp_path):
    path = seed.write(tmp_path, NOTES)
    text = path.read_text()
    assert text.startswith('"""Faithful FlashInfer FA3 port') and text.rstrip().endswith("return main")
    assert "def fa3_prefill(" in text and "```" not in text


@pytest.mark.parametrize("notes, why", [
    ("no kernel here\n", "no line starts with"),
    ('"""Faithful FlashInfer FA3 port\n"""\nx = 1\n', "no '    return main'"),
    ('"""Faithful FlashInfer FA3 port\n"""\ndef f(:\n    return main\n', "does not parse"),
    ('"""Faithful FlashInfer FA3 port\n"""\ndef other():\n    return main\n', "defines no fa3_prefill"),
])
def test_seed_extraction_names_what_is_missing(tmp_path, notes, why):
    path = tmp_path / "notes.md"
    path.write_text(notes)
    with pytest.raises(seed.SeedError, match=why):
        seed.extract(path)


def test_serving_benchmark_rows_fit_the_card_and_int32_and_pass_the_serving_checks():
    """bench_serving.py's decode rows: their byte counts, the limits that leave rows out, and each
    row's call as the benchmark makes it (meta caches: no memory) accepted by check_serving."""
    import torch

    from attngen import hw
    from attngen.plan import make_plan
    from attngen.serving import check_serving
    from attngen.spec import load

    serve = bench_module("bench_serving")
    rows = serve.decode_rows(24.0)
    got = {(r["batch"], r["kv_len"]) for r in rows}
    assert (1, 131072) in got and (64, 4096) in got
    assert (64, 131072) not in got and (32, 131072) not in got  # past int32 elements in one cache
    assert len(serve.decode_rows(1.0)) < len(rows)  # the size limit leaves rows out
    plan = make_plan(load(serve.DECODE_PRESET))
    for r in rows:
        kv = 2 * r["batch"] * r["kv_len"] * serve.KV_HEADS * 128 * 2
        assert r["bytes"] == kv + 2 * r["batch"] * 64 * 128 * 2
        assert r["batch"] * r["kv_len"] * serve.KV_HEADS * 128 <= hw.INT32_MAX
        q, kc, vc, bt, su = serve.decode_inputs(r, plan, "meta")
        assert kc.device == torch.device("meta") and bt.shape == (r["batch"], r["pages"])
        call = check_serving(plan, q, kc, vc, block_table=bt, seqused_k=su, num_splits="auto")
        assert call.num_splits >= 1 and (call.num_splits > 1) == (r["batch"] * serve.KV_HEADS < 0.8 * hw.SM_COUNT)
