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
from hypothesis import given, settings, strategies as st

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
from gpu_marks import NEEDS_TOOLKIT

POLICIES = ("random", "producer-first", "consumers-first")
SMALL = dict(head_dim=64, consumers=1, block_n=32)
# (spec fields, batch, heads, kv_heads, q_len, kv_len) of each layout an fp8 cache serves, and variants
LAYOUTS = {
    "paged": (dict(paged_kv=True, page_size=64, gqa_group=2), 2, 4, 2, 40, 100),
    "paged-split-decode": (dict(paged_kv=True, page_size=32, gqa_group=4, splits=2), 2, 8, 2, 1, 100),
    "varlen-paged-causal": (dict(layout="varlen", paged_kv=True, page_size=32, causal=True, gqa_group=2), 2, 4, 2, 40, 100),
    "varlen": (dict(layout="varlen", gqa_group=2), 2, 4, 2, 40, 100),
    "dense-causal-lse": (dict(causal=True, lse=True), 2, 2, 2, 40, 100),
    "dense-split": (dict(splits=2, softcap=20.0), 2, 2, 2, 40, 100),
    "block-mask": (dict(block_mask=True, mask_mod="q_idx >= kv_idx", block_n=64), 1, 2, 2, 100, 150),
    "window": (dict(window=(30, 0), causal=True), 1, 2, 2, 100, 150),
    "alibi-sinks": (dict(alibi=True, sinks=True), 1, 2, 2, 100, 150),
    "score-mod-head-dim-v": (dict(score_mod="score * 0.5", head_dim_v=128), 1, 2, 2, 100, 150),
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
    "the next tile's TMA before every warp has read the staging": ("T.sync_threads(DEQUANT_BAR, WARPGROUP_THREADS)",
                                                                   "pass  # no DEQUANT_BAR"),
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


# -- the KV-append kernel into an fp8 cache ------------------------------------------------------------
def _append_case(seed=0, page_size=16, batch=2, kv_heads=2, s_new=5, dtype="bfloat16"):
    """An e4m3 paged cache of noise, new keys that are e4m3 values times their page's descale (the
    round trip must give those e4m3 values back), shuffled pages, and the expected cache."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 2 * page_size, batch)
    pages_per = -(-(lens + s_new) // page_size)
    num_pages = int(pages_per.sum()) + 2
    order = rng.permutation(num_pages)
    table = np.zeros((batch, int(pages_per.max())), np.int32)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[start:start + n]
        start += n
    cache = round_to(rng.standard_normal((num_pages, page_size, kv_heads, 64)) * 4, E4M3)
    kd, vd = random_descales(num_pages, kv_heads, seed)
    e4m3 = round_to(rng.standard_normal((2, batch, s_new, kv_heads, 64)) * 4, E4M3)
    new, expected = [], []
    for x, d, which in ((e4m3[0], kd, 0), (e4m3[1], vd, 1)):
        out = cache.copy()
        vals = np.empty_like(x)
        for b in range(batch):
            pos = lens[b] + np.arange(s_new)
            page, row = table[b, pos // page_size], pos % page_size
            vals[b] = round_to(x[b] * d[page][:, :, None], dtype)  # what a 16-bit caller holds
            out[page, row] = x[b]
        new.append(torch.from_numpy(vals).to(getattr(torch, dtype)))
        expected.append(out)
    fp8 = getattr(torch, E4M3)
    caches = [torch.from_numpy(cache).to(fp8), torch.from_numpy(cache).to(fp8)]
    args = (*caches, *new, torch.from_numpy(table), torch.from_numpy(lens.astype(np.int32)))
    return args, {"k_descale": torch.from_numpy(kd), "v_descale": torch.from_numpy(vd)}, expected


def test_the_append_quantizes_by_the_page_descale_and_round_trips_e4m3_values_exactly():
    from attngen.emulator.driver import emulate_append

    args, descales, (want_k, want_v) = _append_case()
    got_k, got_v = emulate_append(*args, **descales)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)


@pytest.mark.parametrize("old, new", [
    (" / K_descale[", " / V_descale["),  # the other tensor's descale
    (" / K_descale[block_table[batch_idx, (start + r0 + i) // PAGE_SIZE], kv_head]",
     " / K_descale[block_table[batch_idx, 0], kv_head]"),  # the sequence's first page's
    (" / V_descale[block_table[batch_idx, (start + r0 + i) // PAGE_SIZE], kv_head]", ""),  # no quantization
])
def test_an_append_with_a_wrong_descale_fails(old, new):
    from attngen.emulator.driver import emulate_append
    from attngen.kernels.append.plan import append_plan
    from attngen.kernels.append.render import render_append_source

    args, descales, (want_k, want_v) = _append_case()
    source = render_append_source(append_plan("bfloat16", 64, 64, 16, E4M3))
    assert old in source
    got_k, got_v = emulate_append(*args, **descales, source=source.replace(old, new))
    assert not (np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v))


def test_an_append_saturates_at_448():
    from attngen.emulator.driver import emulate_append

    args, descales, _ = _append_case()
    big = [args[2] * 1000, args[3]]
    got_k, _ = emulate_append(*args[:2], *big, *args[4:], **descales)
    assert np.isfinite(got_k).all() and np.abs(got_k).max() == 448.0


def test_an_fp8_append_needs_its_descales_and_a_16_bit_one_takes_none():
    from attngen.emulator.driver import emulate_append

    args, descales, _ = _append_case()
    with pytest.raises(InputError) as e:
        emulate_append(*args, k_descale=descales["k_descale"])
    assert "v_descale" in str(e.value) and "num_pages" in str(e.value)
    with pytest.raises(InputError) as e:
        emulate_append(*args, **{**descales, "v_descale": descales["v_descale"][:, :1]})
    assert "v_descale.shape" in str(e.value)
    sixteen = [a.to(args[2].dtype) for a in args[:2]]
    with pytest.raises(InputError) as e:
        emulate_append(*sixteen, *args[2:], **descales)
    assert "k_descale" in str(e.value) and "None" in str(e.value)


def test_a_decode_step_appends_into_the_fp8_cache_and_attends_over_it():
    """The append's stores and the forward's loads agree on every page's descale."""
    torch = pytest.importorskip("torch")
    from attngen.emulator.driver import emulate_append
    from attngen.reference.serving import check_serving_close
    from attngen.run.serving import check_serving

    args, descales, _ = _append_case(s_new=1)
    k_cache, v_cache = emulate_append(*args, **descales)
    table, lens = args[4].numpy(), args[5].numpy() + 1
    plan = make_plan(kv8(dtype="bfloat16", paged_kv=True, page_size=16, block_n=16, gqa_group=2))
    q = round_to(np.random.default_rng(9).standard_normal((2, 1, 4, 64)), "bfloat16")
    keywords = {"block_table": table, "seqused_k": lens.astype(np.int32)}
    tensors = {n: t.numpy() for n, t in descales.items()}
    out, _ = emulate_stats(plan, q, k_cache, v_cache, serving=keywords, tensors=tensors)
    call = check_serving(plan, q, k_cache, v_cache, **keywords)
    k, v = dequantize(k_cache, tensors["k_descale"]), dequantize(v_cache, tensors["v_descale"])
    res = check_serving_close(out, q, k, v, call, False, "bfloat16")
    assert res.ok, res
    assert torch is not None


# -- the doors: flash_attn_with_kvcache's k_descale/v_descale, attngen.attention, the torch op -----------
def _door_case(seed=0):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    fp8 = getattr(torch, E4M3)
    batch, heads, kv_heads, dim, page, pages = 2, 4, 2, 64, 16, 8
    k_cache = (torch.randn(pages, page, kv_heads, dim, generator=g) * 2).to(fp8)
    v_cache = (torch.randn(pages, page, kv_heads, dim, generator=g) * 2).to(fp8)
    table = torch.tensor([[3, 5, 1], [0, 7, 2]], dtype=torch.int32)
    seqlens = torch.tensor([20, 9], dtype=torch.int32)
    kd, vd = (torch.rand(batch, kv_heads, generator=g) * 2 + 0.25 for _ in range(2))
    q = torch.randn(batch, 1, heads, dim, generator=g).bfloat16()
    new = [torch.randn(batch, 1, kv_heads, dim, generator=g).bfloat16() for _ in range(2)]
    return q, k_cache, v_cache, new, table, seqlens, kd, vd


def _sequence_check(out, q, k_cache, v_cache, table, lens, kd, vd):
    """Each sequence against the fp64 reference on its pages dequantized by ITS descale (FA3's per
    sequence); returns whether all pass."""
    from attngen.reference.forward import check_close

    ok = True
    for b in range(q.shape[0]):
        pages, n = table[b].tolist(), int(lens[b])
        kb, vb = (dequantize(c[pages].float().reshape(-1, *c.shape[2:])[:n].numpy()[None], d[b:b + 1].numpy())
                  for c, d in ((k_cache, kd), (v_cache, vd)))
        ok = ok and check_close(out[b:b + 1].float().numpy(), q[b:b + 1].float().numpy(), kb, vb, False, dtype="bfloat16").ok
    return ok


def test_flash_attn_with_kvcache_appends_into_an_fp8_cache_and_attends_with_fa3_descales():
    from attngen.interfaces.flash_attn_interface import flash_attn_with_kvcache

    q, k_cache, v_cache, (k, v), table, seqlens, kd, vd = _door_case()
    before = k_cache.float().clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, page_table=table,
                                  k_descale=kd, v_descale=vd)
    assert out.dtype == q.dtype
    assert _sequence_check(out, q, k_cache, v_cache, table, seqlens + 1, kd, vd)
    assert not _sequence_check(out, q, k_cache, v_cache, table, seqlens + 1, vd, kd)  # the descales matter
    for b in range(2):  # the appended row: k / its sequence's descale in e4m3; no other row changed
        pos = int(seqlens[b])
        page, row = int(table[b, pos // 16]), pos % 16
        assert np.array_equal(k_cache[page, row].float().numpy(), quantize(k[b, 0].float().numpy()[None, None], kd[b:b + 1].numpy())[0, 0])
    assert int((k_cache.float() != before).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("batch_idx", [None, [2, 0]])
def test_a_dense_fp8_cache_read_as_pages_takes_per_sequence_descales(batch_idx):
    """A dense cache [3, 256, ..] read through its page view (two pages of 128 keys a row; a
    sequence of 200 keys spans both), the rows cache_batch_idx picks, or the first ones."""
    torch = pytest.importorskip("torch")
    from attngen.interfaces.flash_attn_interface import flash_attn_with_kvcache

    q, _, _, _, _, _, kd, vd = _door_case(seed=1)
    g = torch.Generator().manual_seed(2)
    dense_k, dense_v = ((torch.randn(3, 256, 2, 64, generator=g) * 2).to(getattr(torch, E4M3)) for _ in range(2))
    seqlens = torch.tensor([200, 9], dtype=torch.int32)
    idx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, dense_k, dense_v, cache_seqlens=seqlens, cache_batch_idx=idx, k_descale=kd,
                                  v_descale=vd)
    rows = [0, 1] if batch_idx is None else batch_idx
    table = torch.tensor([[2 * r, 2 * r + 1] for r in rows], dtype=torch.int32)
    pages_k, pages_v = (c.reshape(6, 128, 2, 64) for c in (dense_k, dense_v))
    assert _sequence_check(out, q, pages_k, pages_v, table, seqlens, kd, vd)


def test_a_page_two_sequences_share_with_different_descales_is_refused():
    torch = pytest.importorskip("torch")
    from attngen.interfaces.flash_attn_interface import flash_attn_with_kvcache

    q, k_cache, v_cache, _, _, seqlens, kd, vd = _door_case()
    shared = torch.tensor([[3, 5, 1], [3, 7, 2]], dtype=torch.int32)
    with pytest.raises(InputError) as e:
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=shared, k_descale=kd, v_descale=vd)
    assert "k_descale" in str(e.value) and "page 3" in str(e.value)
    same = torch.stack([kd[0], kd[0]])  # equal descales on the shared page: served
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=shared, k_descale=same, v_descale=same)


def test_the_torch_op_takes_an_fp8_cache_its_fake_and_compile_too():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k_cache, v_cache, _, table, seqlens, _, _ = _door_case()
    pages_kd = torch.rand(k_cache.shape[0], 2) + 0.5

    def call(q, k, v, table, seqlens, kd):
        return attngen.attention(q, k, v, block_table=table, seqused_k=seqlens, k_descale=kd, v_descale=kd)

    out = call(q, k_cache, v_cache, table, seqlens, pages_kd)
    per_sequence = [dequantize(c.float().numpy(), pages_kd.numpy()) for c in (k_cache, v_cache)]  # per page
    from attngen.reference.serving import check_serving_close
    from attngen.run.serving import check_serving

    plan = make_plan(Spec(head_dim=64, dtype="bfloat16", gqa_group=2, paged_kv=True, page_size=16, kv_dtype=E4M3))
    served = check_serving(plan, q, k_cache, v_cache, block_table=table, seqused_k=seqlens)
    assert check_serving_close(out, q, *per_sequence, served, False, "bfloat16").ok
    with FakeTensorMode():
        fake = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k_cache, v_cache, table, seqlens, pages_kd)]
        got = call(*fake)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch._dynamo.explain(call)(q, k_cache, v_cache, table, seqlens, pages_kd).graph_break_count == 0


# -- the command line ---------------------------------------------------------------------------------
def test_the_cli_emulates_an_fp8_cache_spec_and_the_timeline_refuses_it_in_one_line(tmp_path, capsys):
    from attngen.cli import main

    path = tmp_path / "kv8.toml"
    path.write_text(to_toml(kv8(paged_kv=True, page_size=64, gqa_group=2)))
    assert main(["emulate", str(path), "--q-len", "40", "--kv-len", "100"]) == 0
    assert "PASS" in capsys.readouterr().out
    path.write_text(to_toml(kv8()))
    rc = main(["timeline", str(path), "-o", str(tmp_path / "t.html")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "kv_dtype" in err and len(err.splitlines()) == 1


# -- drawn cases: fp8-cache specs x layouts x variants x lengths x descales x schedules ------------------
DRAWN_LAYOUTS = {  # spec fields of each layout an fp8 cache serves (small kernels: hd64, block_n 32)
    "paged": dict(paged_kv=True, page_size=32),
    "paged_split": dict(paged_kv=True, page_size=64, splits=2),
    "varlen_paged": dict(layout="varlen", paged_kv=True, page_size=32),
    "varlen": dict(layout="varlen"),
    "dense": dict(),
}


@st.composite
def fp8_cache_cases(draw):
    fields = dict(DRAWN_LAYOUTS[draw(st.sampled_from(sorted(DRAWN_LAYOUTS)))])
    fields.update(dtype=draw(st.sampled_from(["float16", "bfloat16"])), causal=draw(st.booleans()),
                  lse=draw(st.booleans()), gqa_group=draw(st.sampled_from([1, 2, 4])))
    if not fields.get("splits") and draw(st.booleans()):
        fields["softcap"] = 30.0
    kv_heads = draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), kv_heads * fields["gqa_group"], kv_heads, draw(st.sampled_from([1, 7, 64, 70])),
             draw(st.integers(1, 140)))
    return fields, shape, draw(st.integers(0, 2 ** 16)), draw(st.sampled_from(POLICIES))


@settings(max_examples=max(4, settings().max_examples // 2))
@given(case=fp8_cache_cases())
def test_drawn_fp8_cache_kernels_match_the_dequantized_reference(case):
    """check_emulated draws the descales from the seed and quantizes the cache by them."""
    fields, shape, seed, policy = case
    ok, text, _ = check_emulated(make_plan(kv8(**fields)), *shape, seed=seed, policy=policy)
    assert ok, text


# -- built for sm_90a (a CUDA toolkit, no GPU) ----------------------------------------------------------
@NEEDS_TOOLKIT
def test_an_fp8_cache_kernel_builds_with_its_own_shared_memory_and_no_spill(tmp_path):
    """TileLang 0.1.15's shared-memory reuse put the producer-only staging tile on the consumers'
    Q_shared; the kernel turns reuse off, so TileLang allocates what the plan counts, every byte."""
    from attngen.build.nvcc import build

    plan = make_plan(kv8(paged_kv=True, page_size=64, gqa_group=2, splits="auto", block_n=64))
    report = build(plan, cache_dir=tmp_path).report
    assert report["dynamic_smem_bytes"] == plan.smem_bytes
    assert report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0 and report["stack_frame_bytes"] == 0
    assert report["sass"]["HGMMA"] > 0 and report["sass"]["LDL"] == 0


@NEEDS_TOOLKIT
def test_the_fp8_append_kernel_builds_without_spills(tmp_path):
    from attngen.build.nvcc import build_append
    from attngen.kernels.append.plan import append_plan

    report = build_append(append_plan("bfloat16", 128, 128, 128, E4M3), cache_dir=tmp_path).report
    assert report["kernel"].endswith("_kv8") and report["spill_store_bytes"] == 0 and report["stack_frame_bytes"] == 0
