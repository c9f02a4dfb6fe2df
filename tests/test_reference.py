"""The fp64 reference, its low-precision twin and the tolerance rule (attngen.reference)."""

import math

import numpy as np
import pytest
import torch

from attngen.reference import EPS, attention, attention_lowprec, causal_visible, check_close, round_to


def randn(shape, seed, dtype=None):
    x = np.random.default_rng(seed).standard_normal(shape)
    return round_to(x, dtype) if dtype else x


def torch_reference(q, k, v, causal):
    """An independent oracle: torch SDPA in float64, GQA by repeating KV heads, explicit bottom-right mask."""
    qt, kt, vt = (torch.from_numpy(np.asarray(x, np.float64)).permute(0, 2, 1, 3) for x in (q, k, v))
    group = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    sq, skv = qt.shape[2], kt.shape[2]
    mask = None
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(skv)[None, :]
        mask = j <= i + (skv - sq)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    scores = qt @ kt.transpose(-1, -2) / math.sqrt(qt.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out.permute(0, 2, 1, 3).numpy(), torch.logsumexp(scores, dim=-1).numpy()


@pytest.mark.parametrize("b, sq, skv, h, hkv, d, causal", [
    (1, 7, 7, 1, 1, 16, False),
    (2, 5, 9, 4, 2, 32, True),  # GQA, Sq < Skv: bottom-right
    (1, 9, 9, 3, 1, 8, True),  # MQA
    (1, 1, 13, 2, 2, 16, True),  # one query row sees every key
])
def test_matches_torch_sdpa(b, sq, skv, h, hkv, d, causal):
    q, k, v = randn((b, sq, h, d), 1), randn((b, skv, hkv, d), 2), randn((b, skv, hkv, d), 3)
    out, lse = attention(q, k, v, causal)
    want_out, want_lse = torch_reference(q, k, v, causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    # q = 0 gives uniform weights over the visible keys: row i averages v[0 : i + Skv - Sq + 1].
    sq, skv = 2, 5
    q = np.zeros((1, sq, 1, 4))
    k = randn((1, skv, 1, 4), 4)
    v = randn((1, skv, 1, 4), 5)
    out, lse = attention(q, k, v, causal=True)
    for i in range(sq):
        n = i + skv - sq + 1
        np.testing.assert_allclose(out[0, i, 0], v[0, :n, 0].mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(lse[0, 0, i], math.log(n), rtol=1e-12)
    assert causal_visible(sq, skv).sum() == (skv - sq + 1) + (skv - sq + 2)


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v = randn((1, 6, 2, 8), 6), randn((1, 2, 1, 8), 7), randn((1, 2, 1, 8), 8)
    out, lse = attention(q, k, v, causal=True)  # rows 0..3 see no key (j <= i - 4)
    assert np.all(out[0, :4] == 0) and np.all(np.isneginf(lse[0, :, :4]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[0, :, 4:]))
    np.testing.assert_allclose(out[0, 4, :], np.broadcast_to(v[0, 0, 0], (2, 8)), rtol=1e-12)  # one key: its value
    low = attention_lowprec(q, k, v, causal=True, dtype="float16")
    assert np.all(low[0, :4] == 0) and np.all(np.isfinite(low))


def test_gqa_head_mapping():
    q, k, v = randn((1, 5, 6, 8), 9), randn((1, 7, 2, 8), 10), randn((1, 7, 2, 8), 11)
    out, _ = attention(q, k, v)
    for h in range(6):
        one, _ = attention(q[:, :, h:h + 1], k[:, :, h // 3:h // 3 + 1], v[:, :, h // 3:h // 3 + 1])
        np.testing.assert_allclose(out[:, :, h], one[:, :, 0], rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_to_matches_torch(dtype):
    x = np.random.default_rng(12).standard_normal(100_000).astype(np.float32) * 100
    bits = np.arange(0x3F800000, 0x3F800000 + 4096, dtype=np.uint32)  # every low-bit pattern near 1.0: ties included
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 3.4e38, 1e-8, -1e-8], np.float32)
    x = np.concatenate([x, bits.view(np.float32), special])
    want = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(round_to(x, dtype), want)
    nan = round_to(np.array([np.nan], np.float32), dtype)
    assert np.isnan(nan).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lowprec_error_is_small_but_not_zero(dtype):
    q, k, v = (randn(s, i, dtype) for i, s in enumerate([(1, 64, 2, 64), (1, 80, 2, 64), (1, 80, 2, 64)]))
    ref, _ = attention(q, k, v, causal=True)
    err = np.abs(attention_lowprec(q, k, v, causal=True, dtype=dtype) - ref).max()
    ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
    assert 0 < err < 8 * ulp


def test_check_close_accepts_good_and_rejects_bad_outputs():
    dtype = "float16"
    q, k, v = (randn(s, 20 + i, dtype) for i, s in enumerate([(1, 33, 2, 32), (1, 47, 1, 32), (1, 47, 1, 32)]))
    ref, _ = attention(q, k, v, causal=True)
    good = check_close(round_to(ref, dtype), q, k, v, True, dtype=dtype)
    assert good.ok and good.err <= good.bound
    assert check_close(attention_lowprec(q, k, v, True, dtype), q, k, v, True, dtype=dtype).ok
    assert good.bound > EPS[dtype]  # the bound grows with the low-precision error, it is not a fixed atol

    bad = ref.copy()
    bad[0, 5, 1, 3] += 0.05  # one element off
    res = check_close(bad, q, k, v, True, dtype=dtype)
    assert not res.ok and res.err == pytest.approx(0.05, rel=1e-3)

    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    res = check_close(nan, q, k, v, True, dtype=dtype)
    assert not res.ok and res.err == float("inf")

    noncausal, _ = attention(q, k, v, causal=False)
    assert not check_close(noncausal, q, k, v, True, dtype=dtype).ok


def test_check_close_rejects_top_left_causal():
    # torch's is_causal=True aligns top-left; with Sq != Skv that is a different function.
    q, k, v = (randn(s, 30 + i, "float16") for i, s in enumerate([(1, 8, 1, 16), (1, 20, 1, 16), (1, 20, 1, 16)]))
    qt, kt, vt = (torch.from_numpy(x.astype(np.float64)).permute(0, 2, 1, 3) for x in (q, k, v))
    top_left = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True).permute(0, 2, 1, 3).numpy()
    assert not check_close(top_left, q, k, v, True, dtype="float16").ok


def test_check_close_takes_dtype_from_torch_tensors():
    q, k, v = (torch.from_numpy(randn(s, 40 + i)).to(torch.bfloat16) for i, s in enumerate([(1, 9, 1, 16), (1, 9, 1, 16), (1, 9, 1, 16)]))
    ref, _ = attention(q.float(), k.float(), v.float())
    res = check_close(torch.from_numpy(ref).to(torch.bfloat16), q, k, v, False)
    assert res.ok and res.bound >= EPS["bfloat16"]
    with pytest.raises(ValueError, match="dtype"):
        check_close(ref, q.float(), k.float(), v.float(), False)
