"""Input validation of attngen.run.runtime, on the CPU: every check a call makes before a launch.

Layout, dtype and shape checks run on CPU (or meta) tensors; the device check is
exercised through its injectable device type and capability. One test builds a
real kernel with nvcc (no GPU needed) to show the disk cache spares a second
process the build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attngen
from attngen.run import checks, entries, forward, inputs, runtime
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.run.checks import check_device, check_written
from attngen.run.inputs import check_tensors
from attngen.run.runtime import InputError, spec_for
from attngen.spec import Spec
from gpu_marks import NEEDS_TOOLKIT

SPEC = Spec()  # head_dim 128, float16, gqa_group 1, block 128 x 128
GQA = Spec(head_dim=64, dtype="bfloat16", gqa_group=4)
ALIGNED = Spec(aligned=True)  # block 128 x 128 once planned


def tensors(b=2, sq=5, skv=7, h=4, hkv=4, d=128, dtype=torch.float16, device="cpu"):
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k = torch.randn(b, skv, hkv, d, device=device).to(dtype)
    v = torch.randn(b, skv, hkv, d, device=device).to(dtype)
    return q, k, v


def raises(match_arg, *fragments):
    """pytest.raises for InputError whose message names `match_arg` and contains `fragments`."""

    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(InputError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.argument == match_arg, str(err)
            for f in fragments:
                assert f in str(err), f"{f!r} not in {str(err)!r}"
            return handled

    return _Ctx()


# -- what passes -----------------------------------------------------------------


def test_valid_inputs_pass_and_report_dims():
    q, k, v = tensors(b=2, sq=5, skv=7, h=4, hkv=4)
    assert check_tensors(SPEC, q, k, v) == (2, 4, 4, 5, 7)
    q, k, v = tensors(b=1, sq=3, skv=9, h=8, hkv=2, d=64, dtype=torch.bfloat16)
    assert check_tensors(GQA, q, k, v, torch.empty_like(q)) == (1, 8, 2, 3, 9)


# -- dtype, rank, head_dim -------------------------------------------------------


def test_dtype_mismatch_names_argument_and_expected_dtype():
    q, k, v = tensors()
    with raises("k.dtype", "torch.float32", "torch.float16", "float16"):
        check_tensors(SPEC, q, k.float(), v)
    with raises("q.dtype", "torch.bfloat16", "torch.float16"):
        check_tensors(SPEC, q.bfloat16(), k, v)


def test_out_dtype_and_shape_checked():
    q, k, v = tensors()
    with raises("out.dtype", "torch.float32"):
        check_tensors(SPEC, q, k, v, torch.empty(q.shape))
    with raises("out.shape", "[2, 4, 4, 128]", "[2, 5, 4, 128]"):
        check_tensors(SPEC, q, k, v, torch.empty(2, 4, 4, 128, dtype=torch.float16))


def test_rank_and_type():
    q, k, v = tensors()
    with raises("q.shape", "4 dimensions"):
        check_tensors(SPEC, q[0], k, v)
    with raises("v", "ndarray", "torch.Tensor"):
        check_tensors(SPEC, q, k, v.numpy())


def test_head_dim_must_match_spec():
    q, k, v = tensors(d=64)
    with raises("q.shape[3] (head_dim)", "= 64", "128"):
        check_tensors(SPEC, q, k, v)


# -- heads, batch, lengths ----------------------------------------------------------


def test_gqa_group_must_match_spec():
    q, k, v = tensors(h=8, hkv=2)
    with raises("q.shape[2] / k.shape[2] (gqa group)", "8/2 = 4", "1, the spec's gqa_group"):
        check_tensors(SPEC, q, k, v)


def test_heads_must_be_a_multiple_of_kv_heads():
    q, k, v = tensors(h=6, hkv=4, d=64, dtype=torch.bfloat16)
    with raises("q.shape[2] (heads)", "= 6", "multiple of k.shape[2] (kv_heads) = 4"):
        check_tensors(GQA, q, k, v)


def test_batch_and_kv_shapes_must_agree():
    q, k, v = tensors(b=2)
    with raises("k.shape[0] (batch)", "= 1", "2, the batch of q"):
        check_tensors(SPEC, q, k[:1], v[:1])
    with raises("v.shape", "[2, 6, 4, 128]", "[2, 7, 4, 128], the shape of k"):
        check_tensors(SPEC, q, k, v[:, :6].contiguous())


@pytest.mark.parametrize("which, label", [("q", "q.shape[1] (q_len)"), ("k", "k.shape[1] (kv_len)"), ("b", "q.shape[0] (batch)")])
def test_empty_dimensions_rejected(which, label):
    q, k, v = tensors()
    if which == "q":
        q = q[:, :0]
    elif which == "k":
        k, v = k[:, :0], v[:, :0]
    else:
        q, k, v = q[:0], k[:0], v[:0]
    with raises(label, "= 0", "at least 1"):
        check_tensors(SPEC, q, k, v)


def test_aligned_spec_needs_whole_tiles():
    q, k, v = tensors(sq=256, skv=384)
    assert check_tensors(ALIGNED, q, k, v)[3:] == (256, 384)
    q2, k2, v2 = tensors(sq=200, skv=384)
    with raises("q.shape[1] (q_len)", "= 200", "multiple of block_m = 128"):
        check_tensors(ALIGNED, q2, k2, v2)
    q3, k3, v3 = tensors(sq=256, skv=100)
    with raises("k.shape[1] (kv_len)", "= 100", "multiple of block_n = 128"):
        check_tensors(ALIGNED, q3, k3, v3)
    # the same lengths are fine for an unaligned spec (the kernel masks them)
    check_tensors(SPEC, q3, k3, v3)


def test_static_shape_must_match():
    q, k, v = tensors(b=1, sq=256, skv=256, h=8, hkv=8)
    check_tensors(ALIGNED, q, k, v, shape=Shape(1, 8, 8, 256, 256))
    with raises("shape (B,H,HKV,SQ,SKV)", "1,8,8,256,256", "1,8,8,1024,1024"):
        check_tensors(ALIGNED, q, k, v, shape=Shape(1, 8, 8, 1024, 1024))


def test_size_limits_on_meta_tensors():
    # meta tensors carry shapes and strides without memory: the int32 and grid limits
    big = torch.empty(1, 2**17, 128, 128, dtype=torch.float16, device="meta")  # 2**31 elements
    kv = torch.empty(1, 8, 128, 128, dtype=torch.float16, device="meta")
    with raises("q.numel()", str(2**31), "int32"):
        check_tensors(SPEC, big, kv, kv)
    q = torch.empty(65536, 1, 1, 128, dtype=torch.float16, device="meta")
    k = torch.empty(65536, 1, 1, 128, dtype=torch.float16, device="meta")
    with raises("q.shape[0] (batch)", "65536", "at most 65535"):
        check_tensors(SPEC, q, k, k)


# -- layout -----------------------------------------------------------------------


def test_last_dimension_must_be_contiguous():
    q, k, v = tensors()
    bad = torch.empty(2, 7, 4, 128, dtype=torch.float16).as_strided((2, 7, 4, 128), (7 * 4 * 128, 4 * 128, 1, 4))
    with raises("k.stride()", "(3584, 512, 1, 4)", "last dimension (head_dim) contiguous"):
        check_tensors(SPEC, q, bad, v)


def test_stride_not_a_multiple_of_16_bytes():
    q, k, v = tensors()
    storage = torch.zeros(2 * 3640, dtype=torch.float16)
    odd = storage.as_strided((2, 7, 4, 128), (3640, 520, 129, 1))  # heads 258 bytes apart
    with raises("v.stride(2)", "129", "multiple of 8 elements (16 bytes)", "TMA"):
        check_tensors(SPEC, q, k, odd)


def test_misaligned_base_pointer():
    q, k, v = tensors()
    flat = torch.zeros(q.numel() + 8, dtype=torch.float16)
    shifted = flat[1:1 + q.numel()].view(q.shape)  # contiguous, but 2 bytes past an aligned address
    assert shifted.is_contiguous()
    with raises("q.data_ptr()", "16-byte aligned", "TMA"):
        check_tensors(SPEC, shifted, k, v)


def test_strided_view_of_packed_qkv_needs_contiguous():
    # q, k, v sliced out of one [B, S, 3, H, D] projection: TMA could take it, the packed ABI cannot
    qkv = torch.randn(2, 7, 3, 4, 128).half()
    q, k, v = qkv.unbind(2)
    with raises("q.stride()", "(10752, 1536, 128, 1)", "contiguous", "(3584, 512, 128, 1)", ".contiguous()"):
        check_tensors(SPEC, q, k, v)
    check_tensors(SPEC, q.contiguous(), k.contiguous(), v.contiguous())


def test_out_must_not_overlap_inputs():
    q, k, v = tensors(skv=5)
    with raises("out", "overlapping q"):
        check_tensors(SPEC, q, k, v, q)
    with raises("out", "overlapping v"):
        check_tensors(SPEC, q, k, v, v)


# -- device ------------------------------------------------------------------------


def test_cpu_tensors_rejected_with_device_message():
    q, k, v = tensors()
    with raises("q.device", "cpu", "CUDA tensor", "compute capability 9.0"):
        check_device({"q": q, "k": k, "v": v})


def test_capability_must_be_9_0():
    q, k, v = tensors()
    ts = {"q": q, "k": k, "v": v}
    for cap in [(8, 0), (8, 9), (10, 0), (12, 0)]:
        with raises("q.device capability", f"{cap[0]}.{cap[1]}", "9.0", "sm_90a"):
            check_device(ts, device_type="cpu", capability_of=lambda d, cap=cap: cap)
    check_device(ts, device_type="cpu", capability_of=lambda d: (9, 0))  # the check can pass


def test_mixed_devices_rejected():
    q, k, v = tensors()
    with raises("k.device", "meta", "CPU tensor", "(q is on cpu)"):  # q's device named too (issue 25)
        check_device({"q": q, "k": k.to("meta"), "v": v}, device_type="cpu", capability_of=lambda d: (9, 0))


def test_kernel_call_validates_before_launch():
    launched = []
    kernel = forward.Kernel(plan=make_plan(SPEC), jit=lambda *a: launched.append(a), cache_path=None, origin="compiled",
                            compile_seconds=0.0)
    q, k, v = tensors()
    with raises("q.device", "cpu"):
        kernel(q, k, v)
    with raises("k.dtype"):
        kernel(q, k.float(), v)
    assert launched == []


def test_attention_checks_before_compiling(monkeypatch):
    monkeypatch.setattr(runtime, "compile_kernel", lambda *a, **k: pytest.fail("compiled before checking inputs"))
    q, k, v = tensors(h=8, hkv=2)
    with raises("q.device", "cpu"):
        runtime.attention(q, k, v, causal=True)
    q, k, v = tensors(sq=256, skv=7, h=8, hkv=2)
    with raises("k.shape[1] (kv_len)", "multiple of block_n"):
        runtime.attention(q, k, v, aligned=True)


# -- spec picked from tensors --------------------------------------------------------


def test_spec_for_reads_tensors_and_overrides():
    q, k, _ = tensors(h=8, hkv=2, d=64, dtype=torch.bfloat16)
    spec = spec_for(q, k, causal=True, consumers=3, k_stages=3)
    assert (spec.head_dim, spec.dtype, spec.gqa_group, spec.causal, spec.consumers, spec.k_stages) == (64, "bfloat16", 4, True, 3, 3)
    assert spec_for(*tensors()[:2]) == Spec()


def test_spec_for_rejects_unsupported_dtype_and_heads():
    q, k, _ = tensors()
    with raises("q.dtype", "torch.float32", "torch.float16, torch.bfloat16 or torch.float8_e4m3fn"):
        spec_for(q.float(), k)
    q, k, _ = tensors(h=6, hkv=4)
    with raises("q.shape[2] (heads)", "= 6", "multiple"):
        spec_for(q, k)


def test_check_written_finds_nan():
    out = torch.zeros(1, 3, 2, 4)
    check_written(out)
    out[0, 2, 1, 3] = float("nan")
    with pytest.raises(AssertionError, match=r"1 output element\(s\).*\[0, 2, 1, 3\]"):
        check_written(out)


# -- property: valid meta inputs pass; one corrupted field is named ----------------------


@st.composite
def problems(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    return dict(
        b=draw(st.integers(1, 4)), sq=draw(st.integers(1, 5000)), skv=draw(st.integers(1, 5000)),
        hkv=draw(st.integers(1, 4)), g=g, d=draw(st.sampled_from([64, 128, 256])),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
    )


def meta(shape, dtype):
    return torch.empty(*shape, dtype=checks.torch_dtype(dtype), device="meta")


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(p=problems(), mutation=st.sampled_from(["none", "dtype", "head_dim", "group", "batch", "v_len"]))
def test_property_one_mutation_one_named_error(p, mutation):
    spec = Spec(head_dim=p["d"], dtype=p["dtype"], gqa_group=p["g"])
    h = p["hkv"] * p["g"]
    q = meta((p["b"], p["sq"], h, p["d"]), p["dtype"])
    k = meta((p["b"], p["skv"], p["hkv"], p["d"]), p["dtype"])
    v = meta((p["b"], p["skv"], p["hkv"], p["d"]), p["dtype"])
    other = "bfloat16" if p["dtype"] == "float16" else "float16"
    expect = {
        "dtype": ("k", lambda: (q, meta(k.shape, other), v), "k.dtype"),
        "head_dim": ("q", lambda: (meta((*q.shape[:3], 96), p["dtype"]), k, v), "q.shape[3] (head_dim)"),
        "group": ("q", lambda: (meta((p["b"], p["sq"], h + p["hkv"], p["d"]), p["dtype"]), k, v), "q.shape[2] / k.shape[2] (gqa group)"),
        "batch": ("k", lambda: (q, meta((p["b"] + 1, *k.shape[1:]), p["dtype"]), meta((p["b"] + 1, *k.shape[1:]), p["dtype"])),
                  "k.shape[0] (batch)"),
        "v_len": ("v", lambda: (q, k, meta((p["b"], p["skv"] + 1, *v.shape[2:]), p["dtype"])), "v.shape"),
    }
    if mutation == "none":
        assert check_tensors(spec, q, k, v) == (p["b"], h, p["hkv"], p["sq"], p["skv"])
        return
    _, make, argument = expect[mutation]
    with pytest.raises(InputError) as info:
        check_tensors(spec, *make())
    assert info.value.argument == argument


# -- a real build: nvcc once, then a second process loads the runtime entry from the attngen cache ---

CHILD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.time()
    import torch
    from attngen.run.forward import compile_kernel
    from attngen.run.runtime import InputError
    from attngen.spec import Spec
    kernel = compile_kernel(Spec(head_dim=64, causal=True))
    again = compile_kernel(Spec(head_dim=64, causal=True))
    q = torch.zeros(1, 3, 2, 64, dtype=torch.float16)
    try:
        kernel(q, q, q)
        error = None
    except InputError as e:
        error = str(e)
    print(json.dumps({"origin": kernel.origin, "seconds": kernel.compile_seconds, "path": kernel.cache_path,
                      "memo": again is kernel, "error": error, "total": time.time() - t0}))
    """
)


@pytest.mark.slow
@NEEDS_TOOLKIT
def test_second_process_loads_from_disk_cache(tmp_path):
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tlcache"), ATTNGEN_CACHE=str(tmp_path / "cache"))

    def child():
        run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    cold, warm = child(), child()
    assert cold["origin"] == "compiled" and warm["origin"] == "disk", (cold, warm)
    assert cold["path"] == warm["path"] and cold["path"].startswith(str(tmp_path / "cache" / "runtime"))
    assert os.path.isfile(os.path.join(warm["path"], "main", "params.json"))
    # no timing here (a loaded machine made 10.7 s of 38.5 s fail a 1/4 ratio): that the warm load runs
    # no lowering and no nvcc is counted in tests/test_precompile.py
    assert cold["memo"] and warm["memo"]
    # a built kernel still checks its inputs before TileLang's stub sees them
    assert warm["error"] is not None and "q.device = cpu" in warm["error"]
    print(f"compile cold {cold['seconds']:.1f} s, warm (second process) {warm['seconds']:.2f} s")


# -- a kernel that does not build ------------------------------------------------------------


def test_failed_build_is_remembered_and_shown_as_a_tail(monkeypatch, tmp_path):
    calls = []

    def broken_build(plan, source=None):
        calls.append(plan.name)
        raise RuntimeError("TileLang error\n" + "// CUDA source line\n" * 5000 + "the real cause: ptxas died")

    monkeypatch.setattr(forward, "_build", broken_build)
    monkeypatch.setattr(forward, "_failed", {})
    monkeypatch.setenv("ATTNGEN_LOG_DIR", str(tmp_path))
    spec = Spec(head_dim=96, consumers=1)
    for _ in range(2):
        with pytest.raises(entries.KernelBuildError) as info:
            forward.compile_kernel(spec)
        message = str(info.value)
        assert "the real cause: ptxas died" in message and len(message) < entries.ERROR_TAIL + 400
        assert str(tmp_path) in message
    assert len(calls) == 1  # the second call did not build again
    (log,) = tmp_path.glob("*.log")
    assert log.read_text().count("// CUDA source line") == 5000  # the whole error is kept on disk


def test_an_edited_source_is_built_and_memoized_apart_from_the_emitted_one(monkeypatch):
    built = []

    def fake_build(plan, source=None):
        built.append(source)
        return ("kernel", source)

    monkeypatch.setattr(forward, "_build", fake_build)
    monkeypatch.setattr(forward, "_memo", {})
    spec = Spec(head_dim=96, consumers=1)
    assert forward.compile_kernel(spec) == ("kernel", None)
    assert forward.compile_kernel(spec, source="# edited") == ("kernel", "# edited")
    assert forward.compile_kernel(spec, source="# edited") == ("kernel", "# edited")
    assert forward.compile_kernel(spec) == ("kernel", None)
    assert built == [None, "# edited"]  # each text built once, neither served for the other


# -- typos, zero heads, and attngen.emulate's inputs -------------------------------------------------


def test_misspelt_keyword_names_the_call_that_got_it():
    from attngen.spec import SpecError

    q, k, v = tensors()
    with pytest.raises(SpecError, match=r"unknown key in attngen\.attention\(\.\.\.\); did you mean `causal`"):
        attngen.attention(q, k, v, casual=True)
    with pytest.raises(SpecError, match=r"attngen\.Spec\(\.\.\.\); did you mean `causal`"):
        attngen.Spec(casual=True)
    with pytest.raises(SpecError, match=r"spec_for\(\.\.\.\); did you mean `k_stages`"):
        spec_for(q, k, k_stage=2)
    with pytest.raises(SpecError, match="did you mean `causal`"):  # found before the tensors are looked at
        attngen.attention([1], [2], [3], casual=True)


def test_zero_kv_heads_says_at_least_one():
    q, k, v = tensors(hkv=4)
    with raises("k.shape[2] (kv_heads)", "= 0", "at least 1"):
        spec_for(q, k[:, :, :0])
    with raises("k.shape[2] (kv_heads)", "= 0", "at least 1"):
        check_tensors(SPEC, q, k[:, :, :0], v[:, :, :0])
    with raises("q.shape[2] (heads)", "= 0", "at least 1"):
        check_tensors(SPEC, q[:, :, :0], k, v)


def test_runtime_input_error_is_the_emulators():
    from attngen.reference import forward as reference

    assert runtime.InputError is reference.InputError and issubclass(InputError, ValueError)


EMU = Spec(head_dim=64, consumers=1)


def emu_inputs():
    return [torch.randn(s).half() for s in ((1, 5, 1, 64), (1, 7, 1, 64), (1, 7, 1, 64))]


@pytest.mark.parametrize("change, argument, fragments", [
    (lambda q, k, v: (q.bool(), k, v), "q.dtype", ["bool", "float16"]),
    (lambda q, k, v: (q, k.long(), v), "k.dtype", ["int64"]),
    (lambda q, k, v: (q, k, v.numpy().astype(complex)), "v.dtype", ["complex128"]),
    (lambda q, k, v: (q.tolist(), k, v), "q", ["list", "numpy array"]),
    (lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), "q.dtype", ["bfloat16", "float16, the spec's dtype"]),
    (lambda q, k, v: (q.numpy().astype(np.int32), k, v), "q.dtype", ["int32"]),
    # the runtime's own checks and wording (attngen/run/inputs.py)
    (lambda q, k, v: (q, k[..., :32], v[..., :32]), "k.shape[3] (head_dim)", ["= 32", "64, the spec's head_dim"]),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "q.shape[3] (head_dim)", ["= 32", "64"]),
    (lambda q, k, v: (q[0], k, v), "q.shape", ["4 dimensions"]),
    # issue 21: accepted before, although the GPU path refuses them
    (lambda q, k, v: (torch.cat([q, q], dim=1)[:, ::2], k, v), "q.stride()", ["a contiguous tensor"]),
    (lambda q, k, v: (q.numpy()[:, :, :, ::-1], k, v), "q.stride()", ["head_dim", "contiguous"]),
    (lambda q, k, v: (q.to("meta"), k, v), "q.device", ["meta", "a tensor with values"]),
    (lambda q, k, v: (q[:, :, :0], k, v), "q.shape[2] (heads)", ["= 0", "at least 1"]),
])
def test_emulate_rejects_inputs_it_cannot_take(change, argument, fragments):
    with raises(argument, *fragments):
        attngen.emulate(EMU, *change(*emu_inputs()))


@pytest.mark.parametrize("kwargs, argument", [
    ({"seed": "abc"}, "seed"), ({"seed": None}, "seed"), ({"seed": -1}, "seed"), ({"seed": True}, "seed"),
    ({"seed": 1.5}, "seed"), ({"policy": "fastest"}, "policy"), ({"source": b"x"}, "source"),
])
def test_emulate_rejects_bad_seeds_policies_and_sources(kwargs, argument):
    from attngen.emulator import emulate_stats

    with raises(argument):
        attngen.emulate(EMU, *emu_inputs(), **kwargs)
    with raises(argument):
        emulate_stats(EMU, *emu_inputs(), **kwargs)
    with raises("spec"):
        attngen.emulate("head_dim = 64", *emu_inputs())


SINKS_MOD = Spec(head_dim=64, consumers=1, sinks=True, score_mod="score + bias[h, q_idx - kv_idx + 8]")


def sinks_inputs():
    return emu_inputs(), {"sinks": torch.tensor([0.5]), "bias": torch.linspace(0, 1, 16)[None]}


@pytest.mark.parametrize("change, argument, fragments", [
    (lambda t: t.update(sinks=t["sinks"].half()), "sinks.dtype", ["float16", "float32"]),
    (lambda t: t.update(bias=torch.zeros(1, 32)[:, ::2]), "bias.stride()", ["a contiguous tensor"]),
    (lambda t: t.update(sinks=torch.tensor([float("nan")])), "sinks[0]", ["nan", "a finite logit"]),
    (lambda t: t.update(sinks=torch.tensor([float("-inf")])), "sinks[0]", ["-inf", "a finite logit"]),
    (lambda t: t.update(bias=t["bias"].to("meta")), "bias.device", ["meta"]),
    (lambda t: t.update(bias=t["bias"].numpy().astype(np.float16)), "bias.dtype", ["float16", "float32"]),
])
def test_emulate_checks_call_time_tensors_as_the_runtime_does(change, argument, fragments):
    # issue 21: the CPU model took a float16 or strided call-time tensor, a NaN sink, a meta tensor
    (q, k, v), tensors = sinks_inputs()
    attngen.emulate(SINKS_MOD, q, k, v, **tensors)  # the unchanged call runs
    change(tensors)
    with raises(argument, *fragments):
        attngen.emulate(SINKS_MOD, q, k, v, **tensors)


@pytest.mark.parametrize("change", [
    lambda qkv, t: t.update(sinks=t["sinks"].half()),
    lambda qkv, t: t.update(bias=torch.zeros(1, 32)[:, ::2]),
    lambda qkv, t: t.update(sinks=torch.tensor([float("nan")])),
    lambda qkv, t: t.update(sinks=torch.zeros(2)),
    lambda qkv, t: t.pop("bias"),
    lambda qkv, t: t.update(rel=torch.zeros(1)),
    lambda qkv, t: qkv.__setitem__(0, torch.cat([qkv[0]] * 2, dim=1)[:, ::2]),
    lambda qkv, t: qkv.__setitem__(0, qkv[0].bfloat16()),
    lambda qkv, t: qkv.__setitem__(1, qkv[1][:, :, :, :32]),
    lambda qkv, t: qkv.__setitem__(2, qkv[2][:1, :3]),
    lambda qkv, t: qkv.__setitem__(0, torch.cat([qkv[0]] * 2, dim=2)),
])
def test_the_cpu_model_and_the_runtime_refuse_a_call_with_one_error(change):
    """One home (attngen/run/inputs.py): the same bad call gives the same InputError on both paths."""
    qkv, tensors = sinks_inputs()
    qkv = list(qkv)
    change(qkv, tensors)
    plan = make_plan(SINKS_MOD)
    with pytest.raises(InputError) as gpu:
        inputs.check_extra(plan, inputs.check_tensors(plan, *qkv), tensors)
    with pytest.raises(InputError) as cpu:
        attngen.emulate(plan, *qkv, **tensors)
    assert cpu.value.argument == gpu.value.argument and str(cpu.value.value) == str(gpu.value.value), (cpu.value, gpu.value)


def test_emulate_takes_what_it_documents():
    q, k, v = emu_inputs()
    attngen.emulate(EMU, q, k, v, seed=np.int64(3))  # torch float16
    attngen.emulate(EMU, q.float(), k.double(), v.numpy())  # float32/float64 tensors, numpy float16
    bf = Spec(head_dim=64, consumers=1, dtype="bfloat16")
    attngen.emulate(bf, q.bfloat16(), k.bfloat16(), v.float())


# -- the run-time softmax scale (issue 18) ------------------------------------------------


BAD_SCALES = [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"), (0.0, "0.0"), (-0.5, "-0.5"),
              (1e-45, "1e-45"), (1e39, "1e+39"), ("0.1", "str"), (True, "bool"), (torch.tensor(0.1), "Tensor")]


@pytest.mark.parametrize("value, shown", BAD_SCALES)
def test_a_bad_scale_is_one_named_error_everywhere_before_any_launch(monkeypatch, value, shown):
    from attngen.reference import forward as reference

    monkeypatch.setattr(runtime, "compile_kernel", lambda *a, **k: pytest.fail("compiled before checking the scale"))
    launched = []
    kernel = forward.Kernel(plan=make_plan(SPEC), jit=lambda *a: launched.append(a), cache_path=None, origin="compiled",
                            compile_seconds=0.0)
    q, k, v = tensors()
    for name in ("softmax_scale", "scale"):
        with raises(name, shown, "positive float"):
            runtime.attention(q, k, v, **{name: value})
        with raises(name, shown, "positive float"):
            kernel(q, k, v, check=False, **{name: value})  # checked even when the tensors are not
        with raises(name, shown, "positive float"):
            kernel.check(q, k, v, **{name: value})
        with raises(name, shown, "positive float"):
            attngen.emulate(EMU, *emu_inputs(), **{name: value})
    with raises("scale", shown):
        reference.attention(q, k, v, False, value)
    with raises("scale", shown):
        reference.check_close(q, q, k, v, False, scale=value)
    assert launched == []


def test_softmax_scale_and_scale_name_one_argument(monkeypatch):
    monkeypatch.setattr(runtime, "compile_kernel", lambda *a, **k: pytest.fail("compiled before checking the scale"))
    q, k, v = tensors()
    with raises("softmax_scale, scale", "0.1, 0.2", "one of them"):
        runtime.attention(q, k, v, softmax_scale=0.1, scale=0.2)
    with raises("softmax_scale, scale", "one of them"):
        attngen.emulate(EMU, *emu_inputs(), softmax_scale=0.1, scale=0.2)
    with raises("q.device", "cpu"):  # equal values are one argument: the call goes on to the device check
        runtime.attention(q, k, v, softmax_scale=0.25, scale=0.25)


def test_the_kernel_is_launched_with_the_scale_last(monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())  # CPU tensors stand in
    launched = []
    kernel = forward.Kernel(plan=make_plan(SPEC), jit=lambda *a: launched.append(a), cache_path=None, origin="compiled",
                            compile_seconds=0.0)
    q, k, v = tensors()
    kernel(q, k, v, check=False)
    kernel(q, k, v, check=False, softmax_scale=0.5)
    kernel(q, k, v, check=False, scale=np.float32(2.0))
    kernel(q, k, v, check=False, softmax_scale=3, scale=3.0)
    assert [a[-1] for a in launched] == [1 / 128 ** 0.5, 0.5, 2.0, 3.0]
    assert all(type(a[-1]) is float and len(a) == 5 for a in launched)  # Q, K, V, O, softmax_scale


def test_the_cli_checks_the_scale_before_any_work(capsys, tmp_path):
    from attngen.cli import main

    spec = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "default.toml")
    for value in ("nan", "0", "-1", "inf"):
        assert main(["emulate", spec, "--softmax-scale", value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("attngen: error: --softmax-scale = ") and "positive float" in err[0]
    assert main(["check", spec, "--softmax-scale", "0", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--softmax-scale = 0.0" in err[0] and not (tmp_path / "out").exists()  # nothing generated
