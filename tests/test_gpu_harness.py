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
    from attngen.kernels.fwd.render import render_source

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
    from attngen.kernels.common.plan import SEED_SHAPE
    from attngen.kernels.fwd.plan import make_plan
    from attngen.kernels.fwd.render import render_source

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
    from attngen.kernels.fwd.plan import make_plan
    from attngen.run.serving import check_serving
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


# -- the backward parts of the GPU check --------------------------------------------------------


def gpu_backward(monkeypatch, device="cpu"):
    """tests/test_gpu_backward.py as a module (its GPU mark does not apply here), on `device`."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_gpu_backward as module

    monkeypatch.setattr(module, "DEVICE", device)
    return module


def test_the_prebuild_covers_every_backward_preset_and_benchmark_row():
    """Every backward preset's module and the forward with lse that autograd runs before it, and
    each backward row's pair, are prebuild keys: the GPU tests and the benchmark only load them."""
    import attngen
    from attngen.cli.generate import BACKWARD_PRESETS
    from attngen.kernels.bwd.plan import plan_backward

    gpu = bench_module("bench_gpu")
    presets = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    keys = gpu.backward_preset_keys(presets)
    modules = {plan_backward(k[0]).name for k in keys if k[2] == gpu.BACKWARD}
    assert modules == {plan_backward(attngen.load_spec(ROOT / "examples" / f"{n}.toml")).name for n in BACKWARD_PRESETS}
    det = attngen.load_spec(ROOT / "examples" / "hd64_f16_gqa2_causal_sinks_deterministic.toml")
    assert (gpu.autograd_forward(det), None, None) in keys  # the op's forward, not the backward plan's
    rows = gpu.plan_backward_rows([1024, 16384], 16384)
    assert [r.shape.q_len for r in rows[:6]] == [16384] * 6  # the goal length first
    assert {(r.spec.head_dim, r.spec.causal, r.spec.dtype) for r in rows} == {
        (d, c, "float16") for d in (64, 128, 256) for c in (False, True)}
    for r in rows:
        fwd, bwd = r.kernel_keys
        assert bwd == (plan_backward(r.spec).spec, None, gpu.BACKWARD) and fwd[0].lse and fwd[2] is None
        assert r.gflop() == pytest.approx(2.5 * dataclasses.replace(r, backward=False).gflop())
        assert r.shape.batch * r.shape.q_len == 16384 and r.shape.heads * r.spec.head_dim == 2048


def test_the_gpu_backward_tests_cover_every_backward_preset(monkeypatch):
    from attngen.cli.generate import BACKWARD_PRESETS

    text = (ROOT / "tests" / "test_gpu_backward.py").read_text()
    assert "pytestmark = GPU_ONLY" in text
    assert "tests/test_gpu_backward.py" in (ROOT / "bench" / "gpu_check.sh").read_text()
    module = gpu_backward(monkeypatch)
    assert list(module.PRESETS) == list(BACKWARD_PRESETS) and module.DETERMINISTIC


class _NoCuda:
    """torch.cuda.device for CPU tensors: BackwardKernel.run enters it around its launches."""

    @staticmethod
    def device(_):
        import contextlib

        return contextlib.nullcontext()


def fake_backward(broken: str = ""):
    """A BackwardKernel of an MHA spec whose 'kernels' are torch functions writing what the real
    ones own (run's argument order), one of them `broken`: it leaves an element unwritten."""
    from attngen.kernels.bwd.plan import plan_backward
    from attngen.run.backward import BackwardKernel
    from attngen.spec import Spec

    bp = plan_backward(Spec(head_dim=64, causal=True))

    def preprocess(out, dout, lse, dlse, dpsum, lse2, dq_accum):
        dpsum.copy_((out.float() * dout.float()).sum(-1).transpose(1, 2) - dlse)
        lse2.copy_(lse)
        if broken != "preprocess":  # the preprocess zeroes the dQ accumulator the main kernel adds into
            dq_accum.zero_()

    def main(q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, scale):
        dq_accum.add_(q.float())
        dk.copy_(k)
        dv.copy_(v)
        if broken == "main":
            dk[0, -1, -1, -1] = float("nan")  # as if never written: the poisoned value left

    def postprocess(dq_accum, dq, scale):
        dq.copy_(dq_accum)

    return BackwardKernel(bp, {"preprocess": preprocess, "main": main, "postprocess": postprocess}, None, "test", 0.0)


@pytest.mark.parametrize("broken, unwritten", [("", None), ("main", 1), ("preprocess", 0)])
def test_poisoned_backward_buffers_show_an_unwritten_element(monkeypatch, broken, unwritten):
    """The GPU test's PoisonedTorch fills what BackwardKernel.run leaves uninitialised (dk and dv
    here, and the dQ accumulator) with NaN: an element no kernel writes shows up in a gradient."""
    import torch

    from attngen.run import backward, checks

    module = gpu_backward(monkeypatch)

    class CpuPoisoned(module.PoisonedTorch):
        cuda = _NoCuda

    monkeypatch.setattr(backward, "_torch", lambda: CpuPoisoned(torch))
    g = torch.Generator().manual_seed(0)
    q, k, v, out, dout = (torch.randn(1, 20, 2, 64, generator=g).half() for _ in range(5))
    lse = torch.randn(1, 2, 20, generator=g)
    grads = fake_backward(broken).run(q, k, v, out, lse, dout, softmax_scale=0.125)
    bad = [i for i, t in enumerate(grads) if torch.isnan(t).any()]
    assert bad == ([] if unwritten is None else [unwritten])
    if unwritten is not None:
        with pytest.raises(AssertionError, match="NaN"):
            checks.check_written(grads[unwritten])


def test_gpu_backward_checks_pass_the_emitted_kernels_on_the_cpu_model_and_catch_a_wrong_gradient(monkeypatch):
    """The GPU test's own path (inputs, attngen.attention + out.backward, the fp64 check) with CPU
    tensors, where the same emitted kernels run on the CPU model; a perturbed dq fails the check."""
    import attngen

    module = gpu_backward(monkeypatch)
    for preset in module.BACKWARD_PRESETS:  # tiny shapes: a few seconds in all on the CPU model
        spec = attngen.load_spec(module.PRESETS[preset])
        drawn, leaves, named, keywords, dout = module.cuda_inputs(spec, 1, 9, 14, seed=3)
        grads = module.op_grads(spec, leaves, named, keywords, dout)
        assert not module.reference_failures(spec, drawn, grads), preset
        wrong = dict(grads, dq=grads["dq"] * 1.05)
        assert "dq" in module.reference_failures(spec, drawn, wrong), preset


@pytest.mark.parametrize("poison", [False, True])
def test_the_smoke_stage_runs_a_backward_presets_backward_and_fails_a_nan_gradient(poison):
    """gpu_smoke.backward_once through the op on CPU tensors (the CPU model): ok on real inputs; a
    NaN in q reaches every gradient and fails the check."""
    import torch

    import attngen

    spec = attngen.load_spec(ROOT / "examples" / "hd64_f16_gqa2_causal_sinks_deterministic.toml")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 4, 64, generator=g).half()
    k, v = (torch.randn(1, 14, 2, 64, generator=g).half() for _ in range(2))
    if poison:
        q[0, 3, 1, 5] = float("nan")
        with pytest.raises(AssertionError, match="NaN"):
            smoke.backward_once(spec, q, k, v)
    else:
        assert smoke.backward_once(spec, q, k, v) == "backward ok (every gradient finite: dq, dk, dv, dsinks)"


# -- the fp8 and persistent parts of the GPU check (issues 29 and 30) ----------------------------------


@pytest.mark.parametrize("preset", ["hd64_e4m3_causal", "hd64_bf16_alibi", "default"])
def test_the_smoke_stage_gives_a_dense_preset_its_inputs_and_rule(preset):
    """gpu_smoke.dense_inputs (on CPU tensors) hands the emitted kernel every call-time tensor it takes
    (fp8: e4m3 q, k, v and FA3's descales, float32 [batch, kv_heads]; ALiBi's slopes); on the CPU model its
    output passes the rule check_output applies on the GPU (fp8's, with its twin), which fails the output
    x 1.05 and, for fp8, a q_descale ignored."""
    import numpy as np
    import torch

    import attngen
    from attngen.emulator.driver import check_output
    from attngen.reference.forward import to_numpy

    plan = attngen.make_plan(attngen.load_spec(ROOT / "examples" / f"{preset}.toml"))
    q, k, v, tensors = smoke.dense_inputs(plan, "cpu")
    b, hkv, sq, skv = smoke.SHAPE
    assert q.dtype == getattr(torch, plan.spec.dtype) and q.shape == (b, sq, hkv * plan.spec.gqa_group, plan.spec.head_dim)
    assert k.shape == v.shape == (b, skv, hkv, plan.spec.head_dim)
    assert {n for n in tensors} == {t.name for t in plan.extra if not t.output}
    if plan.fp8:
        assert all(tensors[n].dtype == torch.float32 and tensors[n].shape == (b, hkv)
                   for n in ("q_descale", "k_descale", "v_descale"))
    got = attngen.emulate(plan, *(to_numpy(x) for x in (q, k, v)), **{n: to_numpy(t) for n, t in tensors.items()})
    out, lse = got if plan.spec.lse else (got, None)
    assert check_output(plan.spec, out, lse, q, k, v, tensors)[0]
    assert not check_output(plan.spec, np.asarray(out) * 1.05, lse, q, k, v, tensors)[0]
    if plan.fp8:
        ignored = dict(tensors, q_descale=torch.ones_like(tensors["q_descale"]))
        assert not check_output(plan.spec, out, lse, q, k, v, ignored)[0]


def test_the_smoke_stage_quantizes_an_fp8_kv_cache_with_a_descale_per_page():
    import numpy as np

    from attngen.kernels.fwd.plan import make_plan
    from attngen.reference.forward import round_to
    from attngen.reference.serving import random_serving_inputs
    from attngen.spec import load

    plan = make_plan(load(ROOT / "examples" / "paged_decode_hd128_bf16_kv8_gqa8_splits.toml"))
    spec = plan.spec
    x = random_serving_inputs(spec.layout, True, plan.page_size, spec.dtype, 128, None, [1, 1], [300, 77], 16, 2, seed=0)
    k8, v8, k_ref, v_ref, descales = smoke.kv_cache(spec, x)
    pages = x.k.shape[0]
    assert {n: d.shape for n, d in descales.items()} == {"k_descale": (pages, 2), "v_descale": (pages, 2)}
    assert np.array_equal(round_to(k8, spec.kv_dtype), k8) and np.array_equal(round_to(v8, spec.kv_dtype), v8)  # e4m3 values
    assert np.allclose(k_ref, k8 * descales["k_descale"][:, None, :, None])  # the reference reads them dequantized
    assert not np.array_equal(k_ref, k8)
    sixteen = make_plan(load(ROOT / "examples" / "paged_decode_hd128_bf16_gqa8_splits.toml")).spec
    assert smoke.kv_cache(sixteen, x)[4] == {} and smoke.kv_cache(sixteen, x)[0] is x.k


def test_the_benchmark_plans_the_fp8_and_persistent_rows_goals_first_and_checks_their_inputs():
    import torch

    gpu = bench_module("bench_gpu")
    pairs = gpu.bench_pairs
    presets = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    fp8 = pairs.fp8_rows(gpu.SEQLENS, 16384, gpu.heads_for)
    persistent = pairs.persistent_rows(16384, gpu.heads_for)
    others = gpu.plan(presets, gpu.SEQLENS, 16384)
    rows = pairs.forward_order(fp8 + persistent, others)
    assert len(rows) == len(fp8) + len(persistent) + len(others)
    goals = [(r.kind, r.spec.head_dim, r.spec.causal, r.shape.q_len) for r in rows[:4]]
    assert goals == [("fp8", 128, False, 16384), ("persistent", 128, True, 1024), ("persistent", 128, True, 4096),
                     ("persistent", 128, True, 16384)]
    assert all(r.goal for r in rows[:4]) and not any(getattr(r, "goal", False) for r in rows[4:])
    assert rows[4:8] == [r for r in persistent if not r.goal]  # "persistent >= single everywhere" before the rest
    assert {(r.spec.head_dim, r.spec.causal, r.shape.q_len) for r in fp8} == {
        (d, c, s) for d in (64, 128, 256) for c in (False, True) for s in gpu.SEQLENS}
    for r in fp8:
        assert r.spec.dtype == pairs.FP8 and r.baseline.dtype == "float16"
        assert (r.baseline.head_dim, r.baseline.causal) == (r.spec.head_dim, r.spec.causal)
        assert r.shape.batch * r.shape.q_len == 16384 and r.shape.heads * r.spec.head_dim == 2048
    for r in persistent:
        assert r.spec.scheduler == "persistent" and r.baseline.scheduler == "single"
        assert dataclasses.replace(r.spec, scheduler="single") == r.baseline  # the same spec otherwise
    (varlen,) = [r for r in persistent if r.lengths]
    assert sum(varlen.lengths) == 16384 and len(set(varlen.lengths)) == len(varlen.lengths)
    assert varlen.gflop() == pytest.approx(4 * varlen.shape.heads * 128 * sum(n * n for n in varlen.lengths) / 2 / 1e9)
    assert all(pairs.FP8 not in c.spec.dtype for c in others)  # fp8 presets: timed only in the fp8 rows
    keys = list(dict.fromkeys(k for c in rows + gpu.plan_backward_rows([1024], 16384) for k in c.kernel_keys))
    order = gpu.build_order(keys, rows)
    goal_keys = {k for r in rows[:4] for k in r.kernel_keys}  # fp8 and fp16 hd128; persistent and single hd128 causal
    assert len(goal_keys) == 4 and set(order[:4]) == goal_keys  # a cut-short build stage still has them
    assert order[4][2] == gpu.BACKWARD  # then the longest jobs
    for r in rows[:4] + [varlen]:  # the dry run's checks: meta tensors through the runtime's input checks
        pairs.check_planned(r)
    x = pairs.input_tensors(fp8[0], "meta", empty=True)
    assert x["q"].dtype == torch.float8_e4m3fn and x["q16"].dtype == torch.float16
    assert {n: tuple(t.shape) for n, t in x["keywords"].items()} == {n: (1, 16) for n in pairs.DESCALES}


def test_the_fp8_rows_dequantize_as_fa3_does():
    import torch

    pairs = bench_module("bench_pairs")
    t = torch.ones(1, 2, 4, 8)  # [batch, seq, heads, dim], 4 query heads over 2 KV heads
    d = torch.tensor([[2.0, 3.0]])
    got = pairs.dequantized(t, d, 2)
    assert got.dtype == torch.float16 and got[0, 0, :, 0].tolist() == [2.0, 2.0, 3.0, 3.0]


def test_the_gpu_check_prebuilds_and_runs_the_persistent_and_fp8_cache_tests():
    from attngen.kernels.bwd.plan import single_tile_twin
    from attngen.kernels.fwd.plan import make_plan

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "tests/test_gpu_persistent.py" in script and "tests/test_gpu_kv_cache_fp8.py" in script
    assert "--rows goals" in script and "--rows rest" in script
    gpu = bench_module("bench_gpu")
    keys = gpu.gpu_test_keys()
    names = {make_plan(k[0]).name for k in keys if k[2] is None}
    assert any(n.endswith("_persistent") for n in names) and any("_kv8" in n for n in names)
    # the persistent backward, plain, deterministic and varlen, and the single-tile twin of each one's tiles
    assert sum(k[2] == gpu.BACKWARD for k in keys) == sum(k[2] == gpu.TWIN for k in keys) == 3
    twins = {single_tile_twin(k[0]).name for k in keys if k[2] == gpu.TWIN}
    assert all("_cols" in n for n in twins if "hd128" in n)  # the persistent plan's column split, not the default tile
    sys.path.insert(0, str(ROOT / "tests"))
    import test_gpu_kv_cache_fp8 as kv8

    assert [spec.kv_dtype for spec, _ in kv8.KERNELS] == ["float8_e4m3fn"] * len(kv8.CASES)
