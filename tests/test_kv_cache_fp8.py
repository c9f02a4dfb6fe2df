"""An fp8 KV cache for 16-bit queries (issue 29, spec.kv_dtype; docs/fp8-kv-cache.md).

The emitted kernel runs on the CPU model with e4m3 K and V and float32 descales per (page or
batch, KV head), against the fp64 reference on the dequantized cache (each element times its
descale in float32, rounded to the queries' dtype: the GEMMs' inputs). Every mutant below is a
textual edit of the rendered kernel that the checks must catch: a descale ignored, applied
twice, taken from the wrong page or the wrong tensor (a wrong answer), and a barrier or fence
removed (a race, in every schedule policy).
"""

import numpy as np
import pytest

import attngen
from attngen.emulator import HazardError
from attngen.emulator.driver import check_emulated, emulate_stats
from attngen.hw import E4M3
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.reference.forward import InputError, round_to
from attngen.reference.kv_cache import dequantize, quantize, random_descales
from attngen.reference.serving import random_serving_inputs
from attngen.spec import Spec, SpecError, to_toml

POLICIES = ("random", "producer-first", "consumers-first")
SMALL = dict(head_dim=64, consumers=1, block_n=32)
# (spec fields, batch, heads, kv_heads, q_len, kv_len) of each layout an fp8 cache serves
LAYOUTS = {
    "paged": (dict(paged_kv=True, page_size=64, gqa_group=2), 2, 4, 2, 40, 100),
    "paged-split-decode": (dict(paged_kv=True, page_size=32, gqa_group=4, splits=2), 2, 8, 2, 1, 100),
    "varlen-paged-causal": (dict(layout="varlen", paged_kv=True, page_size=32, causal=True, gqa_group=2), 2, 4, 2, 40, 100),
    "varlen": (dict(layout="varlen", gqa_group=2), 2, 4, 2, 40, 100),
    "dense-causal-lse": (dict(causal=True, lse=True), 2, 2, 2, 40, 100),
    "dense-split": (dict(splits=2, softcap=20.0), 2, 2, 2, 40, 100),
}


def kv8(**fields) -> Spec:
    return Spec(**{**SMALL, "kv_dtype": E4M3, **fields})


# -- the spec ---------------------------------------------------------------------------------------
def test_the_default_and_a_cache_of_dtype_are_the_plain_kernel():
    plain = make_plan(Spec(**SMALL))
    same = make_plan(Spec(**SMALL, kv_dtype="float16"))
    assert (same.name, same.hash, render_source(same)) == (plain.name, plain.hash, render_source(plain))


def test_an_fp8_cache_has_its_own_name_and_hash():
    plain, fp8 = make_plan(Spec(**SMALL, paged_kv=True)), make_plan(kv8(paged_kv=True))
    assert fp8.name == plain.name + "_kv8" and fp8.hash != plain.hash
    assert 'kv_dtype = "float8_e4m3fn"' in to_toml(fp8.spec)


@pytest.mark.parametrize("fields, field, words", [
    (dict(kv_dtype="float8_e5m2"), "kv_dtype", 'expected "float8_e4m3fn"'),
    (dict(kv_dtype=8), "kv_dtype", 'expected "float8_e4m3fn"'),
    (dict(kv_dtype="float16", dtype="bfloat16"), "kv_dtype", 'expected "float8_e4m3fn"'),
])
def test_a_bad_kv_dtype_names_the_field(fields, field, words):
    with pytest.raises(SpecError) as e:
        Spec(**fields)
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)


def test_the_backward_refuses_an_fp8_cache():
    with pytest.raises(SpecError) as e:
        plan_backward(kv8())
    assert e.value.field == "kv_dtype" and "for inference" in str(e.value)


def test_the_plan_counts_the_staging_tiles_and_the_descales():
    plan = make_plan(kv8(paged_kv=True, page_size=64))
    assert plan.smem["K8"] == plan.spec.block_n * 64 and plan.smem["V8"] == plan.spec.block_n * 64  # 1-byte elements
    assert [(t.name, t.shape) for t in plan.extra] == [("k_descale", ("num_pages", "kv_heads")),
                                                       ("v_descale", ("num_pages", "kv_heads"))]
    dense = make_plan(kv8())
    assert [t.shape for t in dense.extra] == [("batch", "kv_heads")] * 2


# -- the kernel on the CPU model ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_emitted_kernel_matches_the_reference_on_the_dequantized_cache(layout):
    fields, *shape = LAYOUTS[layout]
    ok, text, stats = check_emulated(make_plan(kv8(**fields)), *shape)
    assert ok, text
    assert stats.tma > 0


def test_the_check_fails_on_the_cache_as_stored():
    """The reference dequantizes: the same output held to the raw e4m3 cache fails (the descales matter)."""
    from attngen.reference.serving import check_serving_close
    from attngen.run.serving import check_serving

    plan = make_plan(kv8(paged_kv=True, page_size=64, gqa_group=2))
    x = random_serving_inputs("bshd", True, 64, "float16", 64, 64, [1, 1], [70, 130], 4, 2, seed=3)
    kd, vd = random_descales(x.k.shape[0], 2, seed=4)
    k8, v8 = quantize(x.k, kd), quantize(x.v, vd)
    tensors = {"k_descale": kd, "v_descale": vd}
    out, _ = emulate_stats(plan, x.q, k8, v8, serving=x.keywords, tensors=tensors)
    call = check_serving(plan, x.q, k8, v8, **x.keywords)
    assert check_serving_close(out, x.q, dequantize(k8, kd), dequantize(v8, vd), call, False, "float16").ok
    assert not check_serving_close(out, x.q, k8, v8, call, False, "float16").ok


MUTANTS = {  # name -> (text in the kernel, its replacement)
    "k descale ignored": ("K8_shared[i, d] * k_scale", "K8_shared[i, d]"),
    "v descale ignored": ("V8_shared[i, d] * v_scale", "V8_shared[i, d]"),
    "k descale twice": ("K8_shared[i, d] * k_scale", "K8_shared[i, d] * k_scale * k_scale"),
    "v descale twice": ("V8_shared[i, d] * v_scale", "V8_shared[i, d] * v_scale * v_scale"),
    "k descale of the sequence's first page": ("K_descale[page, kv_head]", "K_descale[block_table[batch_idx, 0], kv_head]"),
    "v descale of the sequence's first page": ("V_descale[page, kv_head]", "V_descale[block_table[batch_idx, 0], kv_head]"),
    "v descale by batch, not page": ("V_descale[page, kv_head]", "V_descale[batch_idx, kv_head]"),
    "k takes v's descale": ("K_descale[page, kv_head]", "V_descale[page, kv_head]"),
}
RACES = {
    "the staging read before its TMA lands": ("T.mbarrier_wait_parity(kv8_full", "pass  # T.mbarrier_wait_parity(kv8_full"),
    "no proxy fence after the conversion": ("T.fence_proxy_async()  # generic stores", "pass  #"),
    "a K stage announced before its conversion": (
        "for i, d in T.Parallel(BLOCK_N, HEAD_DIM):  # float32",
        "T.mbarrier_arrive(k_full[k_stage])\n" + " " * 20 + "for i, d in T.Parallel(BLOCK_N, HEAD_DIM):  # float32"),
}
MUTANT_CASE = (dict(paged_kv=True, page_size=32, gqa_group=2, splits=2), 2, 4, 2, 40, 100)


@pytest.fixture(scope="module")
def mutant_plan():
    return make_plan(kv8(**MUTANT_CASE[0]))


def _mutant(plan, old: str, new: str) -> str:
    source = render_source(plan)
    assert source.count(old) == 1
    if "T.mbarrier_arrive(k_full" in new:  # moved, not added: the arrival after the fence goes
        source = source.replace("T.fence_proxy_async()  # generic stores, read next by the consumers' wgmma (async proxy)\n"
                                "                    T.mbarrier_arrive(k_full[k_stage])", "T.fence_proxy_async()")
    return source.replace(old, new)


def test_the_unmutated_kernel_passes_in_every_policy(mutant_plan):
    for policy in POLICIES:
        ok, text, _ = check_emulated(mutant_plan, *MUTANT_CASE[1:], policy=policy)
        assert ok, (policy, text)


@pytest.mark.parametrize("name", MUTANTS)
def test_a_wrong_descale_fails_the_reference(mutant_plan, name):
    ok, text, _ = check_emulated(mutant_plan, *MUTANT_CASE[1:], source=_mutant(mutant_plan, *MUTANTS[name]))
    assert not ok, text


@pytest.mark.parametrize("name", RACES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_missing_barrier_is_a_race_in_every_schedule(mutant_plan, name, policy):
    with pytest.raises(HazardError):
        check_emulated(mutant_plan, *MUTANT_CASE[1:], source=_mutant(mutant_plan, *RACES[name]), policy=policy)


# -- the call's checks -----------------------------------------------------------------------------
def _paged_call(plan, seed=0):
    x = random_serving_inputs("bshd", True, 64, "float16", 64, 64, [1], [70], 4, 2, seed=seed)
    kd, vd = random_descales(x.k.shape[0], 2, seed=seed)
    return x, quantize(x.k, kd), quantize(x.v, vd), {"k_descale": kd, "v_descale": vd}


def test_a_16_bit_cache_is_refused_by_an_fp8_kernel():
    torch = pytest.importorskip("torch")
    plan = make_plan(kv8(paged_kv=True, page_size=64, gqa_group=2))
    x, k8, v8, tensors = _paged_call(plan)
    q = torch.from_numpy(x.q).half()
    with pytest.raises(InputError) as e:
        emulate_stats(plan, q, torch.from_numpy(k8).half(), torch.from_numpy(v8).to(getattr(torch, E4M3)),
                      serving=x.keywords, tensors=tensors)
    assert "k.dtype" in str(e.value) and E4M3 in str(e.value)


@pytest.mark.parametrize("change, words", [
    (lambda t: {"v_descale": t["v_descale"]}, "k_descale"),
    (lambda t: {**t, "k_descale": t["k_descale"][:1]}, "k_descale.shape"),
])
def test_descales_are_checked_against_the_cache(change, words):
    plan = make_plan(kv8(paged_kv=True, page_size=64, gqa_group=2))
    x, k8, v8, tensors = _paged_call(plan)
    with pytest.raises(InputError) as e:
        emulate_stats(plan, x.q, k8, v8, serving=x.keywords, tensors=change(tensors))
    assert words in str(e.value) and "num_pages" in str(e.value)


def test_quantize_saturates_and_dequantize_inverts_it_on_e4m3_values():
    d = np.array([[0.5, 2.0]], np.float32)
    x = np.array([[[[1000.0, -3.0], [0.75, 448.0]]]], np.float32).transpose(0, 2, 1, 3)  # [1, 2 rows, 2 heads, 2]
    q = quantize(x, d)
    assert np.all(np.abs(q) <= 448.0) and q[0, 0, 0, 0] == 448.0  # 1000 / 0.5 saturates
    e4m3 = round_to(np.random.default_rng(0).standard_normal((2, 4, 2, 8)) * 8, E4M3)
    d2 = np.array([[0.5, 2.0], [0.25, 4.0]], np.float32)  # powers of two: the round trip is exact
    assert np.array_equal(quantize(dequantize(e4m3, d2), d2), e4m3)


def test_attngen_emulate_takes_the_descales_by_name():
    plan = make_plan(kv8(paged_kv=True, page_size=64, gqa_group=2))
    x, k8, v8, tensors = _paged_call(plan)
    out = attngen.emulate(plan, x.q, k8, v8, **x.keywords, **tensors)
    ref, _ = emulate_stats(plan, x.q, k8, v8, serving=x.keywords, tensors=tensors)
    assert np.array_equal(out, ref)
