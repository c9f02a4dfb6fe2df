"""attngen.interfaces.flash_attn_interface (FA3's names) on the CPU backend: the emitted kernel on the CPU model,
against the fp64 reference (attngen.reference.forward), for hypothesis-drawn small shapes (odd lengths,
GQA); varlen and the KV cache (dense and paged, random cache_seqlens, the cache left unchanged);
every FA3 argument attngen cannot serve refused by name; the wrong layout refused; a repeated call
plans once. Shapes stay tiny (B <= 2, H <= 4, lengths <= ~130, head_dim 64).
"""

import inspect
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attngen
from attngen.interfaces import op_arguments
from attngen.interfaces import flash_attn_interface as fa
from attngen.reference.forward import InputError, check_close, check_lse
from attngen.spec import SpecError

D = 64


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.float16)


def scale_accepted() -> bool:
    """Does attngen.attention take a run-time softmax_scale yet (issue 18's merge)? Asked of its behaviour."""
    q = rand(1, 1, 1, D)
    try:
        out = attngen.attention(q, q, q, softmax_scale=0.5)
    except (InputError, TypeError, ValueError):
        return False
    return out.shape == q.shape


# FA3's signatures (hopper/flash_attn_interface.py), names and defaults
FA3 = {
    "flash_attn_func": [("q", inspect._empty), ("k", inspect._empty), ("v", inspect._empty), ("softmax_scale", None),
                        ("causal", False), ("qv", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
                        ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
                        ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_varlen_func": [("q", inspect._empty), ("k", inspect._empty), ("v", inspect._empty),
                               ("cu_seqlens_q", inspect._empty), ("cu_seqlens_k", inspect._empty),
                               ("max_seqlen_q", inspect._empty), ("max_seqlen_k", inspect._empty), ("seqused_q", None),
                               ("seqused_k", None), ("softmax_scale", None), ("causal", False), ("qv", None),
                               ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
                               ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
                               ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_with_kvcache": [("q", inspect._empty), ("k_cache", inspect._empty), ("v_cache", inspect._empty),
                                ("k", None), ("v", None), ("qv", None), ("rotary_cos", None), ("rotary_sin", None),
                                ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
                                ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None),
                                ("max_seqlen_q", None), ("rotary_seqlens", None), ("q_descale", None),
                                ("k_descale", None), ("v_descale", None), ("softmax_scale", None), ("causal", False),
                                ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                                ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
                                ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", sorted(FA3))
def test_the_signatures_are_fa3s(name):
    params = inspect.signature(getattr(fa, name)).parameters
    assert [(p.name, p.default) for p in params.values()] == FA3[name]


@settings(max_examples=6)
@given(st.integers(1, 2), st.integers(1, 130), st.integers(1, 130), st.sampled_from([(2, 2), (4, 2), (4, 1)]),
       st.booleans(), st.sampled_from([(-1, -1), (17, 0), (5, 9)]), st.sampled_from([0.0, 30.0]), st.booleans(),
       st.sampled_from([1, 0, 2]))
def test_flash_attn_func_matches_the_reference(batch, sq, skv, heads, causal, window, softcap, lse, num_splits):
    h, hk = heads
    q, k, v = rand(batch, sq, h, D, seed=1), rand(batch, skv, hk, D, seed=2), rand(batch, skv, hk, D, seed=3)
    if num_splits == 2 and window != (-1, -1):  # attngen has no split kernel with a window: said so by name
        with pytest.raises(SpecError, match="splits"):
            fa.flash_attn_func(q, k, v, window_size=window, num_splits=num_splits)
        return
    result = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, return_attn_probs=lse,
                                num_splits=num_splits)
    out, got_lse = result if lse else (result, None)
    assert isinstance(result, tuple) == lse  # FA3: out alone, or (out, softmax_lse)
    assert out.shape == (batch, sq, h, D)
    variant = {"window": window, "softcap": softcap}
    verdict = check_close(out, q, k, v, causal, **variant)
    assert verdict.ok, verdict
    if lse:
        assert got_lse.shape == (batch, h, sq) and got_lse.dtype == torch.float32
        assert check_lse(got_lse, q, k, v, causal, **variant).ok


def test_attention_chunk_is_fa3s_chunked_local_attention():
    q, k, v = rand(1, 37, 2, D, seed=4), rand(1, 70, 2, D, seed=5), rand(1, 70, 2, D, seed=6)
    out = fa.flash_attn_func(q, k, v, causal=True, attention_chunk=16)
    # FA3 (mask.h): row i sees keys in [round_down(i + off, C), round_down(i + off, C) + C), with
    # causal; off = seqlen_k - seqlen_q = 33. Written here by hand, as a dense numpy mask:
    i, j = np.arange(37)[:, None], np.arange(70)[None, :]
    start = (i + 33) // 16 * 16
    dense = (j >= start) & (j < start + 16)
    table = torch.tensor(dense, dtype=torch.float32)
    assert check_close(out, q, k, v, True, mask_mod="chunk[q_idx, kv_idx] > 0", tensors={"chunk": table}).ok
    assert not check_close(out, q, k, v, True).ok  # the chunk changed the result


@settings(max_examples=4)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=3), st.lists(st.integers(1, 70), min_size=3, max_size=3),
       st.booleans(), st.sampled_from([(2, 2), (4, 2)]))
def test_flash_attn_varlen_func_matches_the_reference_per_sequence(q_lens, kv_lens, causal, heads):
    h, hk = heads
    kv_lens = kv_lens[:len(q_lens)]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
    q, k, v = rand(int(cu_q[-1]), h, D, seed=7), rand(int(cu_k[-1]), hk, D, seed=8), rand(int(cu_k[-1]), hk, D, seed=9)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), causal=causal,
                                         return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, int(cu_q[-1]))
    for b in range(len(q_lens)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.start == qs.stop:
            continue
        one = lambda t, s: t[s][None]  # noqa: E731
        assert check_close(one(out, qs), one(q, qs), one(k, ks), one(v, ks), causal).ok
        assert check_lse(lse[:, qs][None], one(q, qs), one(k, ks), one(v, ks), causal).ok
    with pytest.raises(InputError, match="max_seqlen_k"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens) - 1)


@settings(max_examples=5)
@given(st.integers(1, 2), st.integers(1, 5), st.sampled_from([64, 96]), st.booleans(), st.booleans(),
       st.sampled_from([0, 1, 2]), st.sampled_from([(-1, -1), (-1, -1), (20, 0)]), st.randoms(use_true_random=False))
def test_flash_attn_with_kvcache_matches_the_reference(batch, sq, s_cache, paged, causal, num_splits, window, rnd):
    if window != (-1, -1) and num_splits == 2:
        num_splits = 0  # FA3's default with a window: no split (attngen has no split kernel with a window)
    h, hk = 4, 2
    lens = [rnd.randint(0, s_cache) for _ in range(batch)]
    q = rand(batch, sq, h, D, seed=10)
    kc, vc = rand(batch, s_cache, hk, D, seed=11), rand(batch, s_cache, hk, D, seed=12)
    if paged:  # the same keys in pages of 16, scattered through a larger pool
        per = s_cache // 16
        perm = torch.tensor(rnd.sample(range(batch * per + 3), batch * per), dtype=torch.int32)
        k_pool, v_pool = rand(batch * per + 3, 16, hk, D, seed=13), rand(batch * per + 3, 16, hk, D, seed=14)
        k_pool[perm.long()] = kc.reshape(batch * per, 16, hk, D)
        v_pool[perm.long()] = vc.reshape(batch * per, 16, hk, D)
        caches, extra = (k_pool, v_pool), {"page_table": perm.reshape(batch, per)}
    else:
        caches, extra = (kc, vc), {}
    before = [c.clone() for c in caches]
    seqlens = torch.tensor(lens, dtype=torch.int32) if rnd.random() < 0.5 or batch > 1 else lens[0]
    out, lse = fa.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, causal=causal, num_splits=num_splits,
                                         window_size=window, return_softmax_lse=True, **extra)
    assert all(torch.equal(a, b) for a, b in zip(caches, before))  # the cache is read, never written
    assert out.shape == q.shape and lse.shape == (batch, h, sq)
    for b, n in enumerate(lens):
        if n == 0:  # an empty cache: no key, output 0 and LSE -inf (FA3's convention)
            assert not out[b].any() and bool(torch.isneginf(lse[b]).all())
            continue
        args = q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n]
        assert check_close(out[b:b + 1], *args, causal, window=window).ok
        assert check_lse(lse[b:b + 1], *args, causal, window=window).ok


def test_kvcache_without_seqlens_is_the_whole_cache_and_batch_idx_picks_rows():
    q, kc, vc = rand(2, 3, 2, D, seed=15), rand(3, 48, 2, D, seed=16), rand(3, 48, 2, D, seed=17)
    out = fa.flash_attn_with_kvcache(q[:1], kc[:1], vc[:1])
    assert check_close(out, q[:1], kc[:1], vc[:1], False).ok
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([40, 7], dtype=torch.int32),
                                     cache_batch_idx=idx, causal=True)
    for b, (row, n) in enumerate([(2, 40), (0, 7)]):
        assert check_close(out[b:b + 1], q[b:b + 1], kc[row:row + 1, :n], vc[row:row + 1, :n], True).ok


QKV = (rand(1, 9, 2, D), rand(1, 9, 2, D), rand(1, 9, 2, D))
T = torch.zeros(1)
REFUSED = [  # (function, the argument, a value that attngen cannot serve)
    *[(f, "qv", T) for f in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")],
    *[(f, "pack_gqa", True) for f in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")],
    *[(f, "sm_margin", 4) for f in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")],
    ("flash_attn_varlen_func", "seqused_q", T), ("flash_attn_varlen_func", "seqused_k", T),
    ("flash_attn_varlen_func", "attention_chunk", 16), ("flash_attn_with_kvcache", "attention_chunk", 16),
    ("flash_attn_with_kvcache", "cu_seqlens_k_new", T), ("flash_attn_with_kvcache", "rotary_cos", T),
    ("flash_attn_with_kvcache", "rotary_sin", T), ("flash_attn_with_kvcache", "rotary_seqlens", T),
    ("flash_attn_with_kvcache", "cache_leftpad", T), ("flash_attn_with_kvcache", "scheduler_metadata", T),
]


def _call(name, **kw):
    q, k, v = QKV
    if name == "flash_attn_varlen_func":
        cu = torch.tensor([0, 9], dtype=torch.int32)
        return fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9, **kw)
    return getattr(fa, name)(q, k, v, **kw)


@pytest.mark.parametrize("name, arg, value", REFUSED, ids=[f"{f}-{a}" for f, a, _ in REFUSED])
def test_an_fa3_argument_attngen_cannot_serve_is_refused_by_name(name, arg, value):
    with pytest.raises(InputError) as info:
        _call(name, **{arg: value})
    msg = str(info.value)
    assert msg.startswith(f"{arg} = ") and "FA3's default" in msg or arg == "attention_chunk", msg
    assert "\n" not in msg


@pytest.mark.parametrize("name", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"])
@pytest.mark.parametrize("arg", ["q_descale", "k_descale", "v_descale"])
def test_a_descale_of_16_bit_inputs_is_refused_by_name(name, arg):
    """FA3's descales scale fp8 inputs (tests/test_fp8.py calls them so); beside float16 q, k, v they are refused.
    The cache door says which of its inputs a descale would scale (an fp8 cache's k and v)."""
    with pytest.raises(InputError) as info:
        _call(name, **{arg: torch.ones(1, 2)})
    msg = str(info.value)
    why = "only an e4m3 (fp8) cache is descaled" if name == "flash_attn_with_kvcache" and arg != "q_descale" \
        else "descales scale fp8 inputs"
    assert msg.startswith(f"{arg} = ") and why in msg and "\n" not in msg, msg


def test_k_and_v_are_appended_together():  # the append itself: tests/test_kv_append.py
    q, k, v = QKV
    for appended, missing in (({"k": k[:, :1]}, "v"), ({"v": v[:, :1]}, "k")):
        with pytest.raises(InputError, match=f"^{missing} = NoneType: .*appended together"):
            fa.flash_attn_with_kvcache(q, rand(1, 16, 2, D), rand(1, 16, 2, D), cache_seqlens=3, **appended)


@pytest.mark.parametrize("name", sorted(FA3))
def test_every_default_given_explicitly_is_accepted(name):
    defaults = {n: d for n, d in FA3[name] if d is not inspect._empty}
    out = _call(name, **defaults)
    ref = _call(name)
    assert torch.equal(out, ref)


def test_a_flex_layout_tensor_is_a_layout_error():
    q = rand(1, 4, 37, D)  # [B, H, S, D]: read as [B, S, H, D] it has 37 heads
    k, v = rand(1, 2, 53, D), rand(1, 2, 53, D)
    with pytest.raises(InputError, match=r"q.shape\[2\] \(nheads\).*\[batch, seqlen, nheads, headdim\].*transpose"):
        fa.flash_attn_func(q, k, v)
    with pytest.raises(InputError, match=r"v.shape"):
        fa.flash_attn_func(rand(1, 9, 2, D), rand(1, 9, 2, D), rand(1, 8, 2, D))
    with pytest.raises(InputError, match=r"q.shape\[2\] \(nheads\)"):
        fa.flash_attn_with_kvcache(rand(1, 4, 3, D), rand(1, 2, 64, D), rand(1, 2, 64, D), cache_seqlens=5)


def test_the_varlen_door_compiles_fullgraph_and_matches_eager():
    """issue 25: the max_seqlen_k check read cu_seqlens_k's values while tracing (a data-dependent guard
    under fullgraph); it runs eagerly only, where a short max_seqlen_k is still refused."""
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    q, k, v = rand(100, 2, D, seed=30), rand(100, 2, D, seed=31), rand(100, 2, D, seed=32)

    def f(q, k, v, cu):
        return fa.flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, causal=True)

    torch._dynamo.reset()
    report = torch._dynamo.explain(f)(q, k, v, cu)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu)
    assert torch.equal(compiled, f(q, k, v, cu))
    with pytest.raises(InputError, match="max_seqlen_k = 59: expected at least 60"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 60, 59)


def test_a_repeated_call_plans_once(monkeypatch):
    calls = []
    real = op_arguments._resolve
    monkeypatch.setattr(op_arguments, "_resolve", lambda *a: calls.append(1) or real(*a))
    op_arguments._plans.clear()
    q, k, v = rand(1, 21, 2, D, seed=20), rand(1, 33, 2, D, seed=21), rand(1, 33, 2, D, seed=22)
    first = fa.flash_attn_func(q, k, v, causal=True, window_size=(8, 0))
    second = fa.flash_attn_func(q, k, v, causal=True, window_size=(8, 0))
    assert torch.equal(first, second) and len(calls) == 1
    fa.flash_attn_func(q, k, v, causal=False)  # another spec: planned anew
    assert len(calls) == 2
    kc = rand(2, 64, 2, D, seed=26)
    for lens in ([5, 60], [33, 1]):  # other cache lengths, the same kernel
        fa.flash_attn_with_kvcache(q[:, :3].expand(2, 3, 2, D).contiguous(), kc, kc,
                                   cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=True)
    assert len(calls) == 3


@pytest.mark.skipif(not scale_accepted(), reason="attngen.attention takes no run-time softmax_scale yet (issue 18)")
def test_softmax_scale_reaches_the_kernel():
    q, k, v = rand(1, 19, 2, D, seed=23), rand(1, 27, 2, D, seed=24), rand(1, 27, 2, D, seed=25)
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    assert check_close(out, q, k, v, True, scale=0.3).ok
    assert not check_close(out, q, k, v, True).ok


@pytest.mark.parametrize("door, keywords", [
    ("attention", {"window": (np.int64(5), 0), "softcap": np.float32(3.0), "causal": np.bool_(True),
                   "return_lse": np.bool_(True), "consumers": np.int64(1)}),
    ("attention", {"window": (torch.tensor(5), torch.tensor(0)), "softcap": torch.tensor(3.0),
                   "causal": torch.tensor(True), "return_lse": True}),
    ("flash_attn_func", {"window_size": (np.int64(5), 0), "softcap": np.float32(3.0), "causal": np.bool_(True),
                         "deterministic": np.bool_(False), "num_splits": np.int64(1), "attention_chunk": np.int64(0)}),
    ("flash_attn_func", {"window_size": (torch.tensor(5), 0), "softcap": torch.tensor(3.0),
                         "causal": torch.tensor(True), "deterministic": torch.tensor(False)}),
])
def test_numpy_scalars_and_cpu_0d_tensors_are_the_numbers_they_hold(door, keywords):
    """Issue 25: a NumPy scalar (or a 0-d CPU tensor) is the same call as the Python number."""
    q, k, v = rand(1, 5, 2, D, seed=1), rand(1, 7, 2, D, seed=2), rand(1, 7, 2, D, seed=3)
    fn = attngen.attention if door == "attention" else fa.flash_attn_func
    plain = {n: tuple(int(e) for e in x) if isinstance(x, tuple) else getattr(x, "item", lambda: x)()
             for n, x in keywords.items()}
    got, want = fn(q, k, v, **keywords), fn(q, k, v, **plain)
    for a, b in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (got, want))):
        assert torch.equal(a, b)


def _kvcache_call(case):
    q = rand(2, 3, 2, D)
    dense, pages = rand(4, 128, 2, D, seed=1), rand(8, 64, 2, D, seed=2)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([200, 3], dtype=torch.int32)
    calls = {
        "dense lengths": dict(k_cache=dense, v_cache=dense, cache_seqlens=lens),
        "paged lengths": dict(k_cache=pages, v_cache=pages, page_table=table, cache_seqlens=lens),
        "int64 lengths": dict(k_cache=dense, v_cache=dense, cache_seqlens=lens.long() // 100),
        "batch idx": dict(k_cache=dense, v_cache=dense, cache_seqlens=5, cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32)),
        "batch idx shape": dict(k_cache=dense, v_cache=dense, cache_seqlens=5, cache_batch_idx=torch.tensor([0], dtype=torch.int32)),
        "splits with a window": dict(k_cache=dense, v_cache=dense, cache_seqlens=5, num_splits=4, window_size=(3, 0)),
        "int64 page table": dict(k_cache=pages, v_cache=pages, page_table=table.long(), cache_seqlens=5),
        "page out of range": dict(k_cache=pages, v_cache=pages, page_table=table + 6, cache_seqlens=100),
        "too many new keys": dict(k_cache=dense, v_cache=dense, cache_seqlens=5, k=rand(2, 200, 2, D), v=rand(2, 200, 2, D)),
    }
    return lambda: fa.flash_attn_with_kvcache(q, **calls[case])


KVCACHE_ERRORS = {  # each message names FA3's argument, and its value as given
    "dense lengths": r"^cache_seqlens\[0\] = 200: expected 0 to 128: .* k_cache\.shape\[1\]",
    "paged lengths": r"^cache_seqlens\[0\] = 200: expected at most .* \(page_table\.shape\[1\] pages",
    "int64 lengths": r"^cache_seqlens = a torch\.int64 tensor",
    "batch idx": r"^cache_batch_idx\[1\] = 7: expected a row of the cache in \[0, 4\)",
    "batch idx shape": r"^cache_batch_idx = a torch\.int32 tensor of shape \[1\]",
    "splits with a window": r"`num_splits` = 4: expected 1 with window_size = \[3, 0\]",
    "int64 page table": r"^page_table\.dtype = torch\.int64",
    "page out of range": r"^page_table\[1, 0\] = 8: .*num_pages = k_cache\.shape\[0\]\).*cache_seqlens\[1\] = 100",
    "too many new keys": r"^k\.shape\[1\] \(seqlen_new\) = 200: expected at most 128",
}


@pytest.mark.parametrize("case", sorted(KVCACHE_ERRORS))
def test_kvcache_errors_speak_fa3s_argument_names(case):
    """Issue 25: the kvcache door's errors named attngen's internals (seqused_k, block_table, splits)."""
    with pytest.raises((InputError, SpecError), match=KVCACHE_ERRORS[case]) as info:
        _kvcache_call(case)()
    assert not re.search(r"seqused_k|block_table|(?<!num_)splits =|`splits`", str(info.value))


def test_varlen_errors_speak_fa3s_argument_names():
    q = rand(6, 2, D)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(SpecError, match=r"`num_splits` = 4: expected 1 with window_size = \[2, 0\]"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, num_splits=4, window_size=(2, 0))
    with pytest.raises(SpecError, match=r"`window_size` = \[-2, 0\]"):
        fa.flash_attn_func(rand(1, 3, 2, D), rand(1, 3, 2, D), rand(1, 3, 2, D), window_size=(-2, 0))


def test_strided_inputs_fa3_takes_are_copied_and_gradients_reach_the_original():
    """Issue 25: q, k, v = qkv.unbind(2) (last dim contiguous, strides multiples of 16 bytes) is FA3's
    usual call; the door copies it to packed tensors, and autograd carries gradients back to qkv."""
    qkv = rand(1, 5, 3, 2, D, seed=4).requires_grad_()
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = fa.flash_attn_func(q, k, v, causal=True)
    out.float().square().sum().backward()
    packed = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = fa.flash_attn_func(*packed, causal=True)
    want.float().square().sum().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(qkv.grad[:, :, i], t.grad) for i, t in enumerate(packed))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q, k, v = rand(5, 3, 2, D, seed=5).unbind(1)
    assert torch.equal(fa.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3),
                       fa.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 3, 3))


@pytest.mark.parametrize("make, message", [
    (lambda: rand(1, 5, 2, 2 * D)[..., ::2], r"^q\.stride\(\) = \(1280, 256, 128, 2\): expected the last dimension"),
    (lambda: rand(1, 5, 2, D + 1)[..., :D], r"^q\.stride\(1\) = 130: expected a multiple of 8 elements \(16 bytes\)"),
])
def test_strided_inputs_fa3_refuses_are_refused_by_name(make, message):
    x = make()
    with pytest.raises(InputError, match=message):
        fa.flash_attn_func(x, x, x)
