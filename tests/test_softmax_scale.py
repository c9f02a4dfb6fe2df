"""The run-time softmax scale (issue 18): one kernel, every scale, on the CPU model.

Each preset's emitted kernel is run by the emulator at non-default scales and held to the fp64
reference at the same scale; a mutant that ignores the argument (the kernel using 1/sqrt(d)
whatever is passed, which is what every kernel did before the scale was a parameter) passes at
the default scale and must fail at every other one.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import attngen
from attngen.emulator import KernelError
from attngen.emulator.driver import Runtime, Stats, _prepare, check_emulated
from attngen.kernels.fwd.render import render_source
from attngen.kernels.common.variants import Variant

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PRESETS = {  # the variant each one stands for
    "plain": "hd64_f16_full_nopp.toml",
    "causal": "default.toml",
    "softcap, window, lse": "hd128_f16_causal_window_softcap_lse.toml",
    "alibi": "hd64_bf16_alibi.toml",
    "score_mod": "hd128_f16_relbias_score_mod.toml",
    "sinks, gqa": "hd128_bf16_gqa8_sinks.toml",
    "varlen": "varlen_hd128_bf16_causal.toml",
    "paged split-kv": "paged_decode_hd128_bf16_gqa8_splits.toml",
}
SCALES = [1.0, 0.01, 0.3]  # large (peaked rows), small (nearly uniform), and one that is no power of two
SHAPE = dict(q_len=130, kv_len=200)


def plan_of(name):
    return attngen.make_plan(attngen.load_spec(EXAMPLES / PRESETS[name]))


def check(plan, scale, source=None):
    g = plan.spec.gqa_group
    return check_emulated(plan, 1, 2 * g, 2, SHAPE["q_len"], SHAPE["kv_len"], seed=5, softmax_scale=scale, source=source)


def ignoring_the_scale(plan) -> str:
    """The emitted kernel with its consumers handed 1/sqrt(HEAD_DIM) in place of the run-time argument."""
    source = render_source(plan)
    mutant, n = re.subn(r"(\n\s+consumer\(.*), softmax_scale\)\n", r"\1, HEAD_DIM ** -0.5)\n", source)
    assert n == plan.spec.consumers, "the consumer calls changed shape: update the mutant"
    return mutant


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", list(PRESETS))
def test_a_non_default_scale_matches_the_reference_at_that_scale(name, scale):
    ok, text, _ = check(plan_of(name), scale)
    assert ok, f"{name} at scale {scale}: {text}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_kernel_that_ignores_the_scale_fails_every_other_scale(name):
    plan = plan_of(name)
    mutant = ignoring_the_scale(plan)
    ok, text, _ = check(plan, None, source=mutant)
    assert ok, f"the mutant is the default-scale kernel, so it passes there: {text}"
    for scale in SCALES:
        ok, text, _ = check(plan, scale, source=mutant)
        assert not ok, f"{name}: a kernel ignoring softmax_scale = {scale} passed: {text}"


def test_the_default_is_one_over_sqrt_head_dim_exactly():
    plan = plan_of("softcap, window, lse")
    q, k, v = attngen.reference.forward.random_inputs("float16", 128, 1, 2, 2, 70, 90, seed=2)
    out, lse = attngen.emulate(plan, q, k, v)
    for given in ({"softmax_scale": 128 ** -0.5}, {"scale": 128 ** -0.5}):
        o2, l2 = attngen.emulate(plan, q, k, v, **given)
        np.testing.assert_array_equal(out, o2)
        np.testing.assert_array_equal(lse, l2)
    o3, _ = attngen.emulate(plan, q, k, v, softmax_scale=0.3)
    assert np.abs(o3 - out).max() > 1e-2  # the argument reaches the kernel


def test_the_scale_is_the_last_parameter_a_float32_scalar():
    plan = plan_of("causal")
    source = render_source(plan)
    params = re.search(r"def fa3_fwd\w*\((.*?)\n    \):", source, re.S).group(1).strip().splitlines()
    assert params[-1].strip().startswith("softmax_scale: T.float32,")
    for baked in (repr(128 ** -0.5), repr(128 ** -0.5 * 1.4426950408889634), "SCALE_LOG2"):  # no compile-time scale
        assert baked not in source
    q, k, v = attngen.reference.forward.random_inputs("float16", 128, 1, 1, 1, 64, 64)
    inputs, dims, _ = _prepare(plan, q, k, v, softmax_scale=0.5)
    assert inputs[-1] == 0.5
    rt = Runtime(source, "<scale>", dims)
    with pytest.raises(KernelError, match="softmax_scale .*needs a float, got str"):
        rt.run(inputs[:-1] + ["0.5"], seed=0, policy="random", stats=Stats())


def test_the_cli_passes_the_scale_to_kernel_and_reference(tmp_path, capsys):
    from attngen.cli import main

    spec = str(EXAMPLES / PRESETS["causal"])
    mutant = tmp_path / "mutant.py"
    mutant.write_text(ignoring_the_scale(plan_of("causal")))
    args = ["emulate", spec, "--q-len", "100", "--kv-len", "150"]
    assert main(args + ["--softmax-scale", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "softmax scale 1.0" in out and "PASS" in out
    assert main(args + ["--source", str(mutant)]) == 0  # the mutant is right at the default...
    assert main(args + ["--source", str(mutant), "--softmax-scale", "1.0"]) == 1  # ...and wrong at any other scale
    assert "FAIL" in capsys.readouterr().out


def test_check_runs_the_cpu_model_at_the_scale_given(monkeypatch):
    import argparse

    import attngen.emulator as emulator
    from attngen.cli.check import emulate_verdict

    plan = plan_of("causal")
    real = emulator.emulate_stats
    monkeypatch.setattr(emulator, "emulate_stats", lambda *a, **kw: real(*a, **{**kw, "source": ignoring_the_scale(plan)}))
    args = argparse.Namespace(q_len=100, kv_len=150, seed=0, softmax_scale=None)
    assert emulate_verdict(plan, args)[0]
    ok, what = emulate_verdict(plan, argparse.Namespace(**{**vars(args), "softmax_scale": 0.01}))
    assert not ok and "softmax scale 0.01" in what


# -- rows that see no key, at scales above ln 2 ------------------------------------------------------
# The running max starts at a finite floor, not -inf, so a fully masked row never computes
# exp2(-inf - -inf). The floor must stay finite once scaled by scale_log2, which exceeds 1 for
# softmax_scale > ln 2: the lowest float itself would scale to -inf there (NaN rows).
LARGE_SCALES = [1.0, 8.0, 100.0]


def _no_nan_zero_rows(out, lse, empty_rows, lse_rows):
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN in out or lse"
    assert np.all(out[empty_rows] == 0), "a row that sees no key must give 0"
    assert np.all(np.isneginf(lse[lse_rows])), "a row that sees no key has LSE -inf"


@pytest.mark.parametrize("scale", LARGE_SCALES)
def test_causal_rows_that_see_no_key_give_zero_at_large_scales(scale):
    """causal, q_len > kv_len: the first q_len - kv_len rows see no key (bottom-right alignment)."""
    spec = attngen.Spec(causal=True, lse=True, head_dim=64)
    q, k, v = attngen.reference.forward.random_inputs("float16", 64, 1, 1, 1, 130, 40, seed=3)
    out, lse = attngen.emulate(spec, q, k, v, softmax_scale=scale)
    _no_nan_zero_rows(out, lse, (0, slice(0, 90)), (0, 0, slice(0, 90)))
    assert np.all(np.isfinite(lse[0, 0, 90:]))
    assert attngen.reference.forward.check_close(out, q, k, v, True, dtype="float16", scale=scale).ok
    assert attngen.reference.forward.check_lse(lse, q, k, v, True, dtype="float16", scale=scale).ok


@pytest.mark.parametrize("scale", LARGE_SCALES)
def test_an_empty_varlen_sequence_gives_zero_at_large_scales(scale):
    """varlen: sequence 0 has 50 query rows and no key; sequence 1 is ordinary."""
    spec = attngen.Spec(layout="varlen", causal=True, lse=True, head_dim=64)
    lq, lk = (50, 70), (0, 90)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((sum(lq), 2, 64)).astype(np.float32)
    k = rng.standard_normal((sum(lk), 2, 64)).astype(np.float32)
    v = rng.standard_normal((sum(lk), 2, 64)).astype(np.float32)
    cu_q = np.array([0, lq[0], sum(lq)], np.int32)
    cu_k = np.array([0, lk[0], sum(lk)], np.int32)
    out, lse = attngen.emulate(spec, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                               softmax_scale=scale)
    _no_nan_zero_rows(out, lse, slice(0, lq[0]), (slice(None), slice(0, lq[0])))
    q1, k1, v1 = (x[None, lo:] for x, lo in ((q, lq[0]), (k, lk[0]), (v, lk[0])))
    assert attngen.reference.forward.check_close(out[None, lq[0]:], q1, k1, v1, True, dtype="float16", scale=scale).ok
    assert attngen.reference.forward.check_lse(lse[None, :, lq[0]:], q1, k1, v1, True, dtype="float16", scale=scale).ok


def test_the_lowest_float_as_floor_is_nan_above_ln2():
    """The floor before it was scaled-safe (T.min_value alone, right only while scale_log2 <= 1):
    the emulated kernel gives NaN rows at softmax_scale 1.0 where the real one gives 0."""
    spec = attngen.Spec(causal=True, lse=True, head_dim=64)
    floor = Variant.of(attngen.make_plan(spec)).max_floor()
    source = render_source(spec)
    assert source.count(f"T.fill(m_cur, {floor})") == 1 and floor != "T.min_value(ACCUM)"
    mutant = source.replace(f"T.fill(m_cur, {floor})", "T.fill(m_cur, T.min_value(ACCUM))")
    q, k, v = attngen.reference.forward.random_inputs("float16", 64, 1, 1, 1, 130, 40, seed=3)
    out, lse = attngen.emulate(spec, q, k, v, softmax_scale=0.5, source=mutant)
    assert not np.isnan(out).any()  # below ln 2 the lowest float was enough
    out, lse = attngen.emulate(spec, q, k, v, softmax_scale=1.0, source=mutant)
    assert np.isnan(out[0, :90]).all() and np.isnan(lse[0, 0, :90]).all()
