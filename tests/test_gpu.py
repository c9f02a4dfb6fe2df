"""Generated kernels on a Hopper GPU, against the fp64 reference. Skipped without a CUDA 9.0 device.

Every run writes into an output buffer poisoned with NaN, so an element the kernel
never wrote fails; the tolerance is FlashAttention's rule (attngen.reference.forward.check_close):
max|out - ref| <= 2 * max|lowprec - ref| + eps. Kernels are the presets in
examples/*.toml (globbed here) and the seed-parity static shape, so that
`python3 bench/bench_gpu.py --prebuild-only` builds every kernel these tests use.

    ATTNGEN_GPU_EXAMPLES=200 pytest -m gpu tests/test_gpu.py   # more hypothesis examples
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from attngen.run import forward, runtime
from attngen.kernels.common.plan import SEED_SHAPE, Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.emulator.driver import DESCALE_NAMES, check_output, variant_inputs
from attngen.hw import E4M3
from attngen.reference.forward import check_close, fa3_descale
from attngen.run.checks import check_written, out_torch_dtype, torch_dtype
from attngen.run.runtime import InputError
from attngen.spec import load
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY

ROOT = Path(__file__).resolve().parents[1]
# the dense presets (the serving ones take a ragged batch or a paged cache: tests/test_gpu_serving.py,
# tests/test_gpu_kv_cache_fp8.py and bench/gpu_smoke.py launch them)
PRESETS = {p.stem: p for p in sorted(ROOT.glob("examples/*.toml"))
           if not (lambda plan: plan.varlen or plan.page_size or plan.split_kv)(make_plan(load(p)))}
ODD_LENGTHS = [1, 2, 3, 63, 64, 65, 113, 127, 128, 129, 191, 192, 193, 203, 217, 239, 255, 256, 257, 799, 1023, 1024]
EXAMPLES = int(os.environ.get("ATTNGEN_GPU_EXAMPLES", "40"))


def spec_of(preset: str):
    return make_plan(load(PRESETS[preset])).spec  # resolved: block_m and block_n known


def inputs(spec, b, h, hkv, sq, skv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch_dtype(spec.dtype)

    def rnd(*shape):  # fresh random data per check: zeros would hide unwritten or misindexed tiles
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    dv = spec.head_dim_v or spec.head_dim
    return rnd(b, sq, h, spec.head_dim), rnd(b, skv, hkv, spec.head_dim), rnd(b, skv, hkv, dv)


def poisoned(q, spec=None):
    """A NaN-filled output: of the spec's out_dtype (an fp8 spec writes bfloat16 or float16)."""
    dtype = torch_dtype(spec.out_dtype) if spec is not None and spec.out_dtype else q.dtype
    return torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)


def descales_for(spec, batch, kv_heads, seed):
    """FA3's q/k/v_descale for an fp8 spec (float32 [batch, kv_heads], the CPU model's draw:
    reference.fa3_descale); none for a 16-bit spec."""
    if spec.dtype != E4M3:
        return {}
    rng = np.random.default_rng(seed)
    return {n: torch.from_numpy(fa3_descale(rng, batch, kv_heads)).cuda() for n in DESCALE_NAMES}


def run_and_check(kernel, q, k, v, scale=None, seed=0):
    """Variants (docs/variants.md): the call-time tensors come from variant_inputs (the CPU model's
    inputs), O has head_dim_v columns, and a spec with lse also has its LSE checked. `scale`: the
    run-time softmax scale, given to the kernel and the reference (None: 1/sqrt(head_dim))."""
    spec = kernel.spec
    shape = Shape(q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1])
    _, _, _, extra = variant_inputs(kernel.plan, shape.batch, shape.heads, shape.kv_heads, shape.q_len, shape.kv_len,
                                    seed)  # fp8: FA3's q/k/v_descale among them, drawn per (batch, KV head)
    extra = {n: torch.from_numpy(x).to(q.device) for n, x in extra.items()}
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=out_torch_dtype(kernel.plan), device=q.device)
    got = kernel(q, k, v, out=out, softmax_scale=scale, **extra)
    lse = None
    if spec.lse:
        got, lse = got
    torch.cuda.synchronize()
    assert got is out  # written in place: the poisoned buffer is what we inspect
    check_written(out)
    ok, text = check_output(spec, out, lse, q, k, v, extra, scale)  # fp8: FA3's clause and the twin's, each named
    assert ok, f"{kernel.name} B,H,HKV,SQ,SKV={shape} softmax_scale={scale}: {text}"
    return out


# -- every preset, a few shapes each ----------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_matches_reference(preset):
    spec = spec_of(preset)
    kernel = forward.compile_kernel(spec)
    hkv = 1 if spec.gqa_group >= 4 else 2  # at most 8 query heads: the fp64 reference runs on the CPU
    h = hkv * spec.gqa_group
    if spec.aligned:
        shapes = [(spec.block_m * 4, spec.block_n * 8), (spec.block_m * 8, spec.block_n * 2)]
    else:
        shapes = [(1024, 1024), (777, 1100), (1100, 777)]
    for i, (sq, skv) in enumerate(shapes):
        run_and_check(kernel, *inputs(spec, 2, h, hkv, sq, skv, seed=i), seed=i)


@pytest.mark.parametrize("preset", ["default", "hd64_f16_full_nopp", "hd128_f16_causal_window_softcap_lse", "hd64_bf16_alibi",
                                    "hd128_f16_relbias_score_mod", "hd128_bf16_gqa8_sinks"])
def test_one_kernel_serves_every_softmax_scale(preset):
    spec = spec_of(preset)
    kernel = forward.compile_kernel(spec)
    hkv = 1 if spec.gqa_group >= 4 else 2
    q, k, v = inputs(spec, 1, hkv * spec.gqa_group, hkv, 777, 1100, seed=7)
    for scale in (None, 1.0, 0.01, 0.3):
        run_and_check(kernel, q, k, v, scale=scale)
    assert forward.compile_kernel(spec) is kernel  # no rebuild per scale


def test_seed_parity_static_shape():
    spec = spec_of("seed_parity")
    kernel = forward.compile_kernel(spec, SEED_SHAPE)
    s = SEED_SHAPE
    run_and_check(kernel, *inputs(spec, s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, seed=7))
    q, k, v = inputs(spec, 1, 8, 8, 512, 1024, seed=8)
    with pytest.raises(InputError, match="static shape"):  # a static kernel takes its shape only
        kernel(q, k, v)


# -- hypothesis over shapes --------------------------------------------------------------------


@st.composite
def problems(draw):
    preset = draw(st.sampled_from(sorted(PRESETS)))
    spec = spec_of(preset)
    if spec.aligned:
        sq = spec.block_m * draw(st.integers(1, 8))
        skv = spec.block_n * draw(st.integers(1, 8))
    else:
        length = st.one_of(st.sampled_from(ODD_LENGTHS), st.integers(1, 1100))
        sq, skv = draw(length), draw(length)
    hkv = draw(st.integers(1, max(1, min(3, 16 // spec.gqa_group))))  # <= 24 query heads: the reference is numpy
    return {"preset": preset, "b": draw(st.integers(1, 2)), "hkv": hkv, "sq": sq, "skv": skv,
            "seed": draw(st.integers(0, 2**31 - 1))}


def canonical(preset, sq, skv, b=1, hkv=2):
    return example(p={"preset": preset, "b": b, "hkv": hkv, "sq": sq, "skv": skv, "seed": sq * 7919 + skv})


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@canonical("default", 1, 1)
@canonical("default", 113, 203)
@canonical("default", 128, 217)
@canonical("default", 239, 1)  # Sq > Skv, causal: the first 238 rows see no key and must be 0
@canonical("default", 799, 3)
@canonical("default", 1023, 1024)
@canonical("default", 1024, 1023)
@canonical("hd128_bf16_mqa8_c1", 113, 203, hkv=1)  # MQA
@canonical("hd64_bf16_gqa4_c3", 1024, 1023)  # GQA, 3 consumers
@canonical("hd96_bf16_gqa2", 239, 1)
@canonical("hd64_f16_full_nopp", 1, 1100)
@canonical("hd128_e4m3_full", 1023, 1024)  # fp8 (docs/fp8.md): descales drawn, the fp8 rule
@canonical("hd64_e4m3_causal", 239, 1)
@canonical("hd256_e4m3_causal", 113, 203)
@given(p=problems())
def test_shapes_match_reference(p):
    if p["preset"] not in PRESETS:  # an @example naming a preset that has since been renamed
        pytest.skip(f"no preset {p['preset']}")
    spec = spec_of(p["preset"])
    kernel = forward.compile_kernel(spec)
    h = p["hkv"] * spec.gqa_group
    run_and_check(kernel, *inputs(spec, p["b"], h, p["hkv"], p["sq"], p["skv"], p["seed"]), seed=p["seed"] % 2**20)


# -- the same inputs give the same bits: a race shows as a moving result -------------------------


@pytest.mark.parametrize("preset", ["default", "hd64_f16_full_nopp", "hd128_bf16_mqa8_c1", "hd64_bf16_gqa4_c3", "hd256_f16_causal_c2",
                                    "hd128_e4m3_full"])
def test_repeated_runs_bit_identical(preset):
    if preset not in PRESETS:
        pytest.skip(f"no preset {preset}")
    spec = spec_of(preset)
    kernel = forward.compile_kernel(spec)
    h = 16 if spec.gqa_group <= 16 else spec.gqa_group
    q, k, v = inputs(spec, 2, h, h // spec.gqa_group, 2047 if not spec.aligned else 2048, 2049 if not spec.aligned else 2048, seed=11)
    # every element written; correctness at this size is left to the tests above (the
    # fp64 reference runs on the CPU and would take minutes here)
    descales = descales_for(spec, 2, h // spec.gqa_group, seed=11)
    first = kernel(q, k, v, out=poisoned(q, spec), **descales)
    torch.cuda.synchronize()
    check_written(first)
    bits = first.view(torch.int16)
    for run in range(8):
        again = kernel(q, k, v, out=poisoned(q, spec), **descales)
        torch.cuda.synchronize()
        differ = int((again.view(torch.int16) != bits).sum())
        assert differ == 0, f"{kernel.name}: run {run + 1} differs from run 0 in {differ} elements (a race?)"


# -- the PyTorch entry point ---------------------------------------------------------------------


def test_attention_picks_the_preset_spec_and_memoizes():
    spec = spec_of("default")  # hd128, float16, causal, MHA, 2 consumers, 2+2 stages: the defaults
    q, k, v = inputs(spec, 2, 4, 4, 300, 500, seed=3)
    out = runtime.attention(q, k, v, causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert forward.compile_kernel(runtime.spec_for(q, k, causal=True)) is forward.compile_kernel(spec)
    assert check_close(out, q, k, v, True, dtype=spec.dtype).ok

    gqa = spec_of("hd64_bf16_gqa4_c3")
    q, k, v = inputs(gqa, 1, 8, 2, 333, 444, seed=4)
    buf = poisoned(q)
    out = runtime.attention(q, k, v, causal=gqa.causal, consumers=3, k_stages=3, v_stages=3, out=buf)
    torch.cuda.synchronize()
    assert out is buf
    check_written(out)
    assert check_close(out, q, k, v, gqa.causal, dtype=gqa.dtype).ok


def test_bad_inputs_rejected_on_the_gpu_before_launch():
    spec = spec_of("default")
    kernel = forward.compile_kernel(spec)
    q, k, v = inputs(spec, 1, 4, 4, 256, 256, seed=5)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    with pytest.raises(InputError, match=r"q.data_ptr\(\).*16-byte aligned"):
        kernel(flat[1:1 + q.numel()].view(q.shape), k, v)
    qkv = torch.stack([q, k, v], dim=2)  # [B, S, 3, H, D]: q, k, v as strided views
    with pytest.raises(InputError, match=r"q.stride\(\).*contiguous"):
        kernel(*qkv.unbind(2))
    with pytest.raises(InputError, match=r"q.dtype"):
        kernel(q.bfloat16(), k, v)
    with pytest.raises(InputError, match=r"k.device"):
        kernel(q, k.cpu(), v)
    with pytest.raises(InputError, match="overlapping q"):
        kernel(q, k, v, out=q)
