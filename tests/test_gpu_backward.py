"""The backward kernels on a Hopper GPU, against reference.backward's fp64 gradients. Skipped without a
CUDA 9.0 device (tests/gpu_marks.py).

Every backward preset (cli.BACKWARD_PRESETS) through autograd (attngen.attention, out.backward)
on small shapes, odd lengths and GQA among them, each gradient under check_grads' rule; every
float buffer the runtime leaves uninitialised (torch.empty: dPsum, LSE2, the dQ accumulator, dq,
dk, dv, the forward's out and LSE) poisoned with NaN, so an element no kernel wrote fails; the
deterministic preset bit-identical over repeated runs; and the op's gradients equal to a direct
run of the forward kernel and BackwardKernel.run. `bench/bench_gpu.py --prebuild-only` builds
every kernel these tests launch (its backward_preset_keys), so they only load them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import attngen
from attngen.interfaces import op_arguments, ops
from attngen.run import backward, checks, forward
from attngen.cli.generate import BACKWARD_PRESETS
from attngen.cli.backward import draw_inputs, varlen_checks
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import default_scale, variant_of
from attngen.reference.backward import check_grads
from attngen.spec import load
from gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {name: ROOT / "examples" / f"{name}.toml" for name in BACKWARD_PRESETS}
DETERMINISTIC = [n for n in BACKWARD_PRESETS if load(PRESETS[n]).deterministic]
# fields attngen.attention derives from the tensors (test_ops_backward's list); the rest are keywords
DERIVED = ("head_dim", "dtype", "gqa_group", "head_dim_v", "alibi", "sinks", "layout", "paged_kv", "page_size", "lse")
SHAPES = [(1, 113, 203), (2, 257, 129), (1, 1, 77), (1, 128, 128)]  # batch, q_len, kv_len: odd, q > kv, one row, whole tiles
GRADS = ("dq", "dk", "dv", "dsinks")
DEVICE = "cuda"  # tests/test_gpu_harness.py runs the op path's checks with "cpu" (the CPU model)


class PoisonedTorch:
    """torch for attngen.run.runtime, with every floating torch.empty / empty_like filled with NaN: a
    kernel must overwrite each element it owns (zeros, which atomics add into, stay zeros)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args, **kwargs):
        return self._poison(self._real.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(self._real.empty_like(*args, **kwargs))


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(backward, "_torch", lambda: PoisonedTorch(torch))


def heads_of(spec) -> tuple[int, int]:
    kv_heads = 1 if spec.gqa_group > 2 else 2
    return spec.gqa_group * kv_heads, kv_heads


def cuda_inputs(spec, batch, q_len, kv_len, seed):
    """draw_inputs (the CPU check's inputs: variant tensors, varlen's ragged batch) on CUDA; q, k, v
    and sinks require grad, the other call-time tensors are constants."""
    bp = plan_backward(spec)
    h, hkv = heads_of(spec)
    q, k, v, dout, tensors, packing = draw_inputs(bp, batch, h, hkv, q_len, kv_len, seed)
    dt = getattr(torch, spec.dtype)
    leaves = [torch.from_numpy(np.asarray(t, np.float32)).to(DEVICE, dt).requires_grad_() for t in (q, k, v)]
    named = {n: torch.from_numpy(np.asarray(x)).to(DEVICE) for n, x in tensors.items()}
    if "sinks" in named:
        named["sinks"].requires_grad_()
    keywords = {n: torch.from_numpy(x).to(DEVICE) for n, x in packing.items()}
    if packing:
        keywords["max_seqlen_q"] = int(np.diff(packing["cu_seqlens_q"]).max())
    dout_t = torch.from_numpy(dout).to(DEVICE, dt)
    return (q, k, v, dout, tensors, packing), leaves, named, keywords, dout_t


def op_grads(spec, leaves, named, keywords, dout):
    """Gradients through attngen.attention and out.backward, as a user gets them."""
    for t in leaves + [x for x in named.values() if x.requires_grad]:
        t.grad = None
    kw = {n: x for n, x in spec.to_dict().items() if n not in DERIVED}
    out = attngen.attention(*leaves, **kw, **named, **keywords)
    out.backward(dout)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    grads = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if "sinks" in named:
        grads["dsinks"] = named["sinks"].grad
    args = ops.fwd_arguments(*leaves, **kw, **named, **keywords)[0]
    plan = op_arguments.resolve(*leaves, args[3], args[4:6], args[6], args[8], args[10], args[13])
    assert plan_backward(plan.spec).name == plan_backward(spec).name  # the preset's backward module (prebuilt)
    return grads


def direct_grads(spec, leaves, named, dout):
    """The forward kernel (with lse, as autograd runs it) and BackwardKernel.run, no torch op."""
    q, k, v = (t.detach() for t in leaves)
    consts = {n: x.detach() for n, x in named.items()}
    fwd = forward.compile_kernel(make_plan(dataclasses.replace(spec, lse=True)))
    out, lse = fwd(q, k, v, **consts)
    extra = [consts[t.name] for t in fwd.plan.extra if not t.output]
    grads = backward.compile_backward(spec).run(q, k, v, out, lse, dout, extra=extra, softmax_scale=default_scale(spec.head_dim))
    torch.cuda.synchronize()
    return dict(zip(GRADS, grads))


def reference_failures(spec, drawn, grads) -> dict:
    q, k, v, dout, tensors, packing = drawn
    got = {n: g.float().cpu().numpy() for n, g in grads.items()}
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    if packing:  # each packed sequence against its own fp64 gradients
        checks = varlen_checks(got, q, k, v, dout, packing, spec, None, variant)
    else:
        checks = check_grads(got, q, k, v, dout, spec.causal, dtype=spec.dtype, **variant)
    assert set(checks) == set(grads), (set(checks), set(grads))
    return {n: str(c) for n, c in checks.items() if not c.ok}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Sq{}_Skv{}".format(*s))
@pytest.mark.parametrize("preset", BACKWARD_PRESETS)
def test_backward_preset_matches_fp64_gradients_with_poisoned_buffers(preset, shape, poisoned):
    spec = load(PRESETS[preset])
    drawn, leaves, named, keywords, dout = cuda_inputs(spec, *shape, seed=sum(shape))
    grads = op_grads(spec, leaves, named, keywords, dout)
    for name, g in grads.items():
        assert g is not None, name
        checks.check_written(g)  # NaN: an element of a poisoned buffer no kernel wrote
    failures = reference_failures(spec, drawn, grads)
    assert not failures, f"{preset} B,Sq,Skv={shape}: {failures}"


@pytest.mark.parametrize("preset", DETERMINISTIC)
def test_deterministic_preset_is_bit_identical_over_runs(preset):
    spec = load(PRESETS[preset])
    _, leaves, named, _, dout = cuda_inputs(spec, 2, 1000, 1111, seed=5)
    first = direct_grads(spec, leaves, named, dout)
    for _ in range(10):
        again = direct_grads(spec, leaves, named, dout)
        assert all(torch.equal(first[n], again[n]) for n in first), [n for n in first if not torch.equal(first[n], again[n])]


@pytest.mark.parametrize("preset", [p for p in BACKWARD_PRESETS if load(PRESETS[p]).layout != "varlen"])
def test_autograd_through_attention_gives_the_direct_kernel_run(preset):
    """Bit-equal where the gradient's sum has one order (deterministic; dK/dV written by the main
    kernel without atomics); within a few fp16/bf16 rounding steps where float atomics add it."""
    spec = load(PRESETS[preset])
    _, leaves, named, keywords, dout = cuda_inputs(spec, 1, 333, 517, seed=11)
    via_op = op_grads(spec, leaves, named, keywords, dout)
    direct = direct_grads(spec, leaves, named, dout)
    assert set(via_op) == set(direct)
    bp = plan_backward(spec)
    for name in via_op:
        exact = bp.deterministic or (name in ("dk", "dv") and not bp.kv_accum)
        a, b = via_op[name].float(), direct[name].float()
        if exact:
            assert torch.equal(a, b), f"{name}: max |op - direct| = {(a - b).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item(), msg=name)
