"""attngen.flex_attention against torch's own flex_attention, the mods of PyTorch's flex tests.

The mods below are written here after the score_mods and mask_mods of PyTorch's
test/inductor/test_flex_attention.py and test_flex_decoding.py (docs/interfaces.md, "PyTorch's
test mods", lists every construct they use). Each runs through attngen.flex_attention on the CPU
model (float16 inputs) and through torch.nn.attention.flex_attention in float64 on the same
values (the oracle; its CPU backward guard, _validate_device, is lifted here): output, LSE and
the gradients of q, k and v must agree within fp16 tolerances. Shapes are tiny (B <= 2, H = 2,
lengths <= 80, head_dim 64); each distinct mod is one kernel pair on the CPU model.
"""

import functools
import math

import pytest
import torch

import attngen
from attngen.interfaces import flex_mods, flex_source
from attngen.reference.forward import InputError

F = pytest.importorskip("torch.nn.attention.flex_attention")

D = 64
S = 48


@pytest.fixture(autouse=True)
def _torch_cpu_backward(monkeypatch):
    monkeypatch.setattr(F, "_validate_device", lambda *a, **k: None, raising=False)  # (a torch without it has no guard)


def _inputs(B, H, Q, KV, seed, HKV=None, BKV=None):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.float16)  # noqa: E731
    HKV, BKV = HKV or H, BKV or B
    return mk(B, H, Q, D), mk(BKV, HKV, KV, D), mk(BKV, HKV, KV, D), mk(B, H, Q, D)


def _close(name, got, want, tol):
    got, want = got.double(), want.double()
    assert got.shape == want.shape, name
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: -inf at other places"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol * scale:.3g}"


def peer(score_mod=None, mask_mod=None, *, B=1, H=2, Q=S, KV=None, seed=0, HKV=None, BKV=None, grad=True,
         block_size=128, **kw):
    """attngen.flex_attention vs torch's flex_attention (float64) on one call: out, lse, dq, dk, dv."""
    KV = KV or Q
    q, k, v, dout = _inputs(B, H, Q, KV, seed, HKV, BKV)
    gqa = (HKV or H) != H
    ours = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    theirs = [x.double().requires_grad_(grad) for x in (q, k, v)]
    bm = attngen.create_block_mask(mask_mod, B, None, Q, KV, BLOCK_SIZE=block_size) if mask_mod else None
    tbm = F.create_block_mask(mask_mod, B, None, Q, KV, device="cpu", BLOCK_SIZE=block_size) if mask_mod else None
    out, lse = attngen.flex_attention(*ours, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True, **kw)
    ref, rlse = F.flex_attention(*theirs, score_mod=score_mod, block_mask=tbm, enable_gqa=gqa, return_lse=True, **kw)
    _close("out", out, ref, 1e-2)
    _close("lse", lse, rlse, 1e-2)
    if grad:
        (out.float() * dout.float()).sum().backward()
        (ref * dout.double()).sum().backward()
        for name, a, b in zip("qkv", ours, theirs):
            assert not torch.isnan(a.grad).any(), f"d{name} has NaN"
            _close(f"d{name}", a.grad, b.grad, 2e-2)
    return out, lse



# -- the mods, written after PyTorch's test_flex_attention.py / test_flex_decoding.py ----------------------------
H = 2
g = torch.Generator().manual_seed(3)
head_offset = torch.rand(H, generator=g, dtype=torch.float64)
head_scale, batch_scale, tok_scale = (torch.randn(n, generator=g) for n in (H, 2, S))
bias_bs = torch.randn(2, S, generator=g)
bias_weird1 = torch.randn(4, 2, H, S, generator=g)
bias_weird2 = torch.randn(2, H, 4, S, generator=g)
which_bias = torch.tensor(1)
bias_qk = torch.randn(S, S, generator=g)
bias_bqk = torch.randn(2, S, S, generator=g)
bias_bhqk = torch.randn(2, H, S, S, generator=g)
rel_bias = torch.randn(2 * S, generator=g)
rel_short = torch.randn(S, generator=g)  # rel_short[q - kv]: negative indices count from the end
document_id = torch.tensor([0] * 20 + [1] * 16 + [2] * (S - 36), dtype=torch.int32)
big_ids = torch.tensor([2**24] * 24 + [2**24 + 1] * (S - 24))  # int64 ids float32 cannot tell apart
seq_idx = torch.zeros(S, dtype=torch.bool)
seq_idx[S // 2:] = True
num_bidirectional = torch.tensor([5, 17], dtype=torch.int32)
seq_len = torch.tensor([1, 2], dtype=torch.int32)
scale_0d = torch.ones((), dtype=torch.int32)
offsets = torch.tensor([0, 20, 31, S], dtype=torch.int32)
seq_of = torch.bucketize(torch.arange(S), offsets[1:], right=True).to(torch.int32)
attn_mask = torch.ones(2, 1, S, S, dtype=torch.bool).tril()
keep = torch.ones(2, S, dtype=torch.bool)
keep[1, 40:] = False  # Hugging Face's padding mask: the second sequence's last keys are padding
pad_rows = torch.zeros(2, S, dtype=torch.bool)
pad_rows[0, :3] = True
input_lengths = torch.tensor([S, 30])
means = torch.randn(S, 3, generator=g)
x_cap = torch.randn(S, generator=g) * 2
W = 8


def _identity(score, b, h, m, n):
    return score


def _times_two(score, b, h, m, n):
    return score * 2


def _squared(score, b, h, m, n):
    return score * score


def _causal_score(score, b, h, token_q, token_kv):
    return torch.where(token_q >= token_kv, score, float("-inf"))


def _inverse_causal(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def _rel_bias(score, b, h, token_q, token_kv):
    return score + (token_q - token_kv)


def _rel_causal(score, b, h, token_q, token_kv):
    return torch.where(token_q >= token_kv, score + (token_q - token_kv), float("-inf"))


def _generate_alibi_bias(num_heads):
    def _alibi_bias(score, b, h, token_q, token_kv):
        scale = torch.exp2(-((h + 1) * 8.0 / num_heads))
        return score + (token_kv - token_q) * scale
    return _alibi_bias


def _generate_windowed(offset):  # test_flex_decoding.py
    def _windowed(score, b, h, q, kv):
        return torch.where(q + offset >= kv, score, float("-inf"))
    return _windowed


def _head_offset(score, b, h, m, n):
    return score * head_offset[h]


def _trig(score, b, h, m, n):
    return torch.sin(torch.cos(score)) + torch.tan(b)


def _trig2(score, b, h, m, n):
    cos_score = torch.cos(score)
    sin_score = torch.sin(score)
    z = cos_score * sin_score + torch.tan(b)
    return z


def document_masking_causal(score, b, h, q_idx, kv_idx):
    causal_mask = q_idx >= kv_idx
    document_mask = document_id[q_idx] == document_id[kv_idx]
    return torch.where(causal_mask & document_mask, score, -float("inf"))


def index_multiple(score, b, h, q_idx, kv_idx):
    return score + bias_bs[b][q_idx]


def index_weird1(score, b, h, q_idx, kv_idx):
    return score + bias_weird1[0][b, h][q_idx]


def index_weird2(score, b, h, q_idx, kv_idx):
    return score + bias_weird2[b][h][which_bias, q_idx]


def skip_odd_keys(score, b, h, q, kv):
    return torch.where(kv % 2 == 0, score, float("-inf"))


def score_mod_1(score, b, h, m, n):
    return score + (m - n)


def score_mod_2(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def composed_score_mod(score, b, h, m, n):
    return score_mod_2(score_mod_1(score, b, h, m, n), b, h, m, n)


def all_bias(score, batch, head, token_q, token_kv):
    score = score + tok_scale[token_q]
    score = score + batch_scale[batch]
    score = score + head_scale[head]
    return score


def seq_mask_mod(score, b, h, q, kv):
    return torch.where(seq_idx[q] == seq_idx[kv], score, float("-inf"))


def bias_seq_only(score, b, h, q, kv):
    return score + bias_qk[q, kv]


def bias_seq_batch(score, b, h, q, kv):
    return score + bias_bqk[b, q, kv]


def bias_head_seq_batch(score, b, h, q, kv):
    return score + bias_bhqk[b, h, q, kv]


def load_rel_bias(score, b, h, q, kv):
    return score + rel_bias[(q - kv) + S]


def negative_rel_bias(score, b, h, q, kv):
    return score + rel_short[q - kv]


def dependent_causal_bidirectional(score, b, h, q, kv):
    causal_attention = q >= kv
    cur_num_bidirectional = num_bidirectional[b]
    bidirectional_attention_on_video = (q <= cur_num_bidirectional) & (kv <= cur_num_bidirectional)
    return torch.where(bidirectional_attention_on_video | causal_attention, score, -float("inf"))


def get_x_y(idx):
    return idx / W, idx % W  # (PyTorch's test: "should be a floor divide")


def natten_mask(score, b, h, q, kv):
    q_x, q_y = get_x_y(q)
    kv_x, kv_y = get_x_y(kv)
    return torch.where(((q_x - kv_x).abs() <= 3) | ((q_y - kv_y).abs() <= 3), score, float("-inf"))


def score_mod_func(score, b, h, q, kv):
    return score - q // (1 + kv)


def silu_score(score, b, h, q, kv):
    return torch.nn.functional.silu(score)


def padded_dense(qk, b, h, q, kv):
    return torch.where(qk <= seq_len[b], _causal_score(qk, b, h, q, kv), -float("inf"))


def score_mod_scale(qk, b, h, q, kv):
    return qk + scale_0d


def captured_reduction(qk, b, h, q, kv):
    return qk + bias_bs[b].sum(dim=-1)


def inputs_are_realized(qk, b, h, q, kv):
    return qk + x_cap[q]


def njt_score_mod(qk, b, h, q, kv):
    q_nested = q - offsets[seq_of[q]]
    kv_nested = kv - offsets[seq_of[kv]]
    return _causal_score(qk, b, h, q_nested, kv_nested)


def new_zeros_score(score, b, h, q_idx, kv_idx):
    h_ = h.new_zeros(h.shape)
    return score + attn_mask[b, h_, q_idx, kv_idx]


def euclidean_dist_pos_embed(score, b, h, q_idx, k_idx):
    q_pos = means[q_idx]
    k_pos = means[k_idx]
    dist = (q_pos - k_pos).pow(2).sum(-1).sqrt()
    return torch.exp(-dist / 2.0) * score


def big_document(score, b, h, q_idx, kv_idx):
    return torch.where(big_ids[q_idx] == big_ids[kv_idx], score, -float("inf"))


def finfo_min(score, b, h, q, kv):
    return torch.where(q >= kv, score, torch.finfo(score.dtype).min)


def clamp_pow_sqrt(score, b, h, q, kv):
    return score.clamp(min=-2.0, max=2.0) + (score.abs() + 1).sqrt() * 0.5 + score.pow(2) * 0.1 + torch.sigmoid(score)


class ApplyMask(torch.autograd.Function):
    @staticmethod
    def forward(a, mask):
        return torch.where(mask, a, -float("inf"))


def autograd_function_mod(score, b, h, q, kv):
    return ApplyMask.apply(score, q <= kv)


ADD = True


def recompile_changed(qk, b, h, q, kv):
    if ADD:
        return qk + scale_0d
    else:
        return qk * scale_0d


# mask mods
def causal_mask(b, h, q, kv):
    return q >= kv


def inverse_causal_mask(b, h, q, kv):
    return q <= kv


def neg_causal_mask(b, h, q, kv):
    return q < kv


def sliding_window(b, h, q, kv):
    return (q - kv) <= 9


def causal_slidewindow(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx <= kv_idx + 7)


def ends_mask(b, h, q, kv):
    return (kv < 8) | (kv >= 40)


def document_masks(b, h, q, kv):
    same_doc = document_id[q] == document_id[kv]
    return same_doc


def first_half_rows(b, h, q, kv):
    return q < S // 2  # the other rows see no key: 0, LSE -inf, gradient 0


seq_blocks = torch.arange(S) // 16


def non_divisible(b, h, q, kv):
    return seq_blocks[q] == seq_blocks[kv]


def padding_mask(b, h, q_idx, kv_idx, input_lengths):
    return (q_idx < input_lengths[b]) & (kv_idx < input_lengths[b])


def odd_keys_bitwise(b, h, q, kv):
    return (kv & 1) == 0


def hf_padding(b, h, q_idx, kv_idx):
    return keep[b, kv_idx] & ~pad_rows[b, q_idx]


def global_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx > 9)


def new_zeros_mask(b, h, q_idx, kv_idx):
    h_ = h.new_zeros(h.shape)
    return attn_mask[b, h_, q_idx, kv_idx]


# name: (score_mod, mask_mod, peer() keywords); None where the case is refused (REFUSED says why)
ACCEPTED = {
    "identity": (_identity, None, {}),
    "times_two": (_times_two, None, {}),
    "squared": (_squared, None, {}),
    "causal": (_causal_score, None, {}),
    "inverse_causal": (_inverse_causal, None, {}),
    "rel_bias": (_rel_bias, None, {}),
    "rel_causal": (_rel_causal, None, {}),
    "alibi": (_generate_alibi_bias(H), None, {}),
    "head_offset": (_head_offset, None, {}),
    "trig": (_trig, None, {"B": 2}),
    "trig2": (_trig2, None, {"B": 2}),
    "document_masking_causal": (document_masking_causal, None, {}),
    "index_multiple": (index_multiple, None, {"B": 2}),
    "index_weird1": (index_weird1, None, {"B": 2}),
    "index_weird2": (index_weird2, None, {"B": 2}),
    "skip_odd_keys": (skip_odd_keys, None, {}),
    "function_composition": (composed_score_mod, None, {}),
    "captured_buffers_all_dims": (all_bias, None, {"B": 2}),
    "seq_masking": (seq_mask_mod, None, {}),
    "bias_seq_only": (bias_seq_only, None, {}),
    "bias_seq_batch": (bias_seq_batch, None, {"B": 2}),
    "bias_head_seq_batch": (bias_head_seq_batch, None, {"B": 2}),
    "load_rel_bias": (load_rel_bias, None, {}),
    "negative_index": (negative_rel_bias, None, {}),
    "dependent_causal_bidirectional": (dependent_causal_bidirectional, None, {"B": 2}),
    "natten_2d": (natten_mask, None, {}),
    "floor_divide_by_tensor": (score_mod_func, None, {}),
    "silu": (silu_score, None, {}),
    "captured_scale_0d": (score_mod_scale, None, {}),
    "inputs_are_realized": (inputs_are_realized, None, {}),
    "njt_causal": (njt_score_mod, None, {}),
    "new_empty_score": (new_zeros_score, None, {"B": 2}),
    "big_document_ids": (big_document, None, {}),
    "finfo_min": (finfo_min, None, {}),
    "clamp_pow_sqrt_sigmoid": (clamp_pow_sqrt, None, {}),
    "causal_block": (None, causal_mask, {}),
    "inverse_causal_block": (_identity, inverse_causal_mask, {}),
    "and_masks": (None, F.and_masks(causal_mask, sliding_window), {}),
    "and_masks_empty": (None, F.and_masks(causal_mask, neg_causal_mask), {}),
    "or_masks": (None, F.or_masks(causal_mask, neg_causal_mask), {}),
    "noop_mask": (_rel_bias, F.noop_mask, {}),
    "causal_slidewindow": (None, causal_slidewindow, {}),
    "ends_mask": (None, ends_mask, {}),
    "document_masks": (None, document_masks, {}),
    "fully_masked_rows": (None, first_half_rows, {}),
    "block_non_divisible": (None, non_divisible, {"Q": S - 1, "KV": S - 1}),
    "partial_mask": (None, functools.partial(padding_mask, input_lengths=input_lengths), {"B": 2}),
    "bitwise_and": (None, odd_keys_bitwise, {}),
    "hf_padding": (None, hf_padding, {"B": 2}),
    "global_causal": (None, global_causal, {}),
    "new_empty_mask": (_times_two, new_zeros_mask, {"B": 2}),
    "score_and_mask": (_rel_causal, F.and_masks(sliding_window, causal_mask), {}),
    "one_capture_in_both_mods": (document_masking_causal, document_masks, {}),
    "kv_batch_broadcast": (_generate_alibi_bias(H), F.noop_mask, {"B": 2, "BKV": 1}),  # torch needs a B-batch mask
    "gqa": (_rel_causal, None, {"H": 4, "HKV": 2}),
    "different_seqlen": (_rel_bias, causal_mask, {"Q": S // 2, "KV": S}),
    "decode_windowed": (_generate_windowed(20), None, {"Q": 1, "KV": S}),  # one query row, as flex decoding
    "decode_gqa": (_generate_alibi_bias(4), None, {"Q": 1, "KV": S, "H": 4, "HKV": 1}),
}
REFUSED = {  # name: (score_mod, the construct the one-line error names)
    "padded_dense_causal": (padded_dense, "an infinity where it is not a masked key"),
    "captured_reduction": (captured_reduction, "method `.sum()`"),
    "euclidean_dist_pos_embed": (euclidean_dist_pos_embed, "has 2 dimensions, indexed with 1"),
    "autograd_function_in_score_mod": (autograd_function_mod, "calling `ApplyMask.apply`"),
    "recompile_changed_score_mod": (recompile_changed, "the statement `If`"),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_a_pytorch_test_mod_equals_torchs_flex_attention(name):
    score_mod, mask_mod, kw = ACCEPTED[name]
    peer(score_mod, mask_mod, **kw)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_pytorch_test_mod_attngen_cannot_express_is_one_line_naming_the_construct(name):
    score_mod, construct = REFUSED[name]
    q, k, v, _ = _inputs(1, H, S, S, 0)
    with pytest.raises(flex_source.FlexTranslationError) as info:
        attngen.flex_attention(q, k, v, score_mod=score_mod)
    msg = str(info.value)
    assert construct in msg and score_mod.__name__ in msg and "\n" not in msg, msg


def test_fully_masked_rows_give_0_an_lse_of_minus_inf_and_no_gradient():
    out, lse = peer(_causal_score, first_half_rows)
    assert torch.all(out[:, :, S // 2:] == 0) and torch.all(lse[:, :, S // 2:] == -math.inf)


@pytest.mark.parametrize("name, breaks", [
    ("negative_index", "_nonnegative"),  # a negative index clamped to 0 (the old translation): off by ~0.8
    ("big_document_ids", "_exact_integers"),  # integer ids rounded to float32: 2**24 and 2**24 + 1 merge
])
def test_the_peer_check_fails_on_the_old_silent_wrong_answers(name, breaks, monkeypatch):
    wrong = {"_nonnegative": lambda node: True,
             "_exact_integers": lambda t: False}[breaks]
    monkeypatch.setattr(flex_mods, breaks, wrong)
    score_mod, mask_mod, kw = ACCEPTED[name]
    with pytest.raises(AssertionError):
        peer(score_mod, mask_mod, **kw)


def test_rest_of_the_api_return_aux_kernel_options_and_separate_full_blocks():
    q, k, v, _ = _inputs(1, H, S, S, 1)
    out, aux = attngen.flex_attention(q, k, v, score_mod=_rel_bias, return_aux=F.AuxRequest(lse=True))
    ref, raux = F.flex_attention(q.double(), k.double(), v.double(), score_mod=_rel_bias,
                                 return_aux=F.AuxRequest(lse=True))
    _close("out", out, ref, 1e-2)
    _close("lse", aux.lse, raux.lse, 1e-2)
    assert aux.max_scores is None
    with pytest.raises(InputError, match="max_scores"):
        attngen.flex_attention(q, k, v, return_aux=F.AuxRequest(lse=True, max_scores=True))
    bm = attngen.create_block_mask(causal_mask, 1, 1, S, S, BLOCK_SIZE=64)
    tiled = attngen.flex_attention(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 64, "BLOCK_N": 32})
    _close("out", tiled, F.flex_attention(q.double(), k.double(), v.double(),
                                          block_mask=F.create_block_mask(causal_mask, 1, 1, S, S, device="cpu")), 1e-2)
    with pytest.raises(InputError, match=r"kernel_options\['num_warps'\]"):
        attngen.flex_attention(q, k, v, kernel_options={"num_warps": 4})
    full = attngen.create_block_mask(causal_mask, 1, 1, 128, 128, BLOCK_SIZE=64)
    merged = attngen.create_block_mask(causal_mask, 1, 1, 128, 128, BLOCK_SIZE=64, separate_full_blocks=False)
    assert int(full.full_kv_num_blocks.sum()) == 1 and int(merged.full_kv_num_blocks.sum()) == 0
    assert int(merged.kv_num_blocks.sum()) == int(full.kv_num_blocks.sum()) + 1


def test_a_mod_without_a_source_file_is_translated_from_its_torch_fx_trace():
    namespace = {"torch": torch, "rel_short": rel_short}
    exec("def no_source(score, b, h, q, kv):\n    return torch.where(q >= kv, score + rel_short[q - kv], -float('inf'))",
         namespace)
    peer(namespace["no_source"])


# -- torch.compile ---------------------------------------------------------------------------------------------
_tbl = torch.linspace(-1.0, 1.0, 2 * S)
_doc = torch.tensor([0] * 20 + [1] * (S - 20))


def _doc_bias(score, b, h, q_idx, kv_idx):
    return torch.where(_doc[q_idx] == _doc[kv_idx], score + _tbl[q_idx - kv_idx], -float("inf"))


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("mods", ["score_mod", "block_mask", "both"])
def test_fullgraph_compile_has_no_graph_break_and_equals_eager_forward_and_backward(mods):
    """The translation runs once while dynamo traces (flex._traced_mods), outside the graph."""
    torch._dynamo.reset()
    score_mod = _doc_bias if mods != "block_mask" else None
    bm = attngen.create_block_mask(_causal, 1, 1, S, S) if mods != "score_mod" else None

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attngen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    q, k, v, dout = _inputs(1, 2, S, S, seed=7)
    explained = torch._dynamo.explain(Attend())(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    grads = []
    for module in (torch.compile(Attend(), fullgraph=True), Attend()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*leaves)
        (out.float() * dout.float()).sum().backward()
        grads.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # one kernel, the same inputs


def test_compiled_translations_are_bounded_and_a_dropped_one_is_traced_again(monkeypatch):
    """flex._TRACED holds at most _TRACED_MAX translations; a graph whose entry was dropped is traced
    again (its guard on _TRACED fails), so alternating two mods past the bound stays right."""
    from attngen.interfaces import flex

    monkeypatch.setattr(flex, "_TRACED", {})
    monkeypatch.setattr(flex, "_TRACED_MAX", 1)
    torch._dynamo.reset()

    def shifted(score, b, h, q_idx, kv_idx):
        return _doc_bias(score, b, h, q_idx, kv_idx) + 0.5

    q, k, v, _ = _inputs(1, 2, S, S, seed=8)
    compiled = torch.compile(lambda mod, *x: attngen.flex_attention(*x, score_mod=mod), fullgraph=True)
    for mod in (_doc_bias, shifted, _doc_bias):
        assert torch.equal(compiled(mod, q, k, v), attngen.flex_attention(q, k, v, score_mod=mod))
        assert len(flex._TRACED) == 1


# -- learnable captured tensors: the gradients of what a score_mod captures (issue 27, item 3) --------------------
_learn = torch.Generator().manual_seed(5)
LEARNABLE = {  # name: (a make(t) -> score_mod, t's value, kw)
    "bias[h]": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t[h], torch.randn(H, generator=_learn), {}),
    "bias[q_idx - kv_idx]": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t[q_idx - kv_idx],  # negatives wrap
                             torch.randn(S, generator=_learn), {}),
    "bias[b, h, q_idx, kv_idx]": (lambda t: lambda score, b, h, q_idx, kv_idx: torch.where(
        q_idx >= kv_idx, score + t[b, h, q_idx, kv_idx], -float("inf")), torch.randn(2, H, S, S, generator=_learn),
        {"B": 2}),
    "a 0-d scalar": (lambda t: lambda score, b, h, q_idx, kv_idx: score * t, torch.tensor(0.8), {}),
    "ALiBi slopes": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t[h] * (kv_idx - q_idx),
                     torch.rand(H, generator=_learn), {"Q": 32, "KV": S}),
}


def learnable_peer(make, value, *, B=1, Q=S, KV=S, seed=9):
    """peer() for a captured tensor that requires grad: out and the gradients of q, k, v and the tensor
    against torch's flex_attention in float64 (whose eager CPU backward takes no 0-d capture: a 0-d
    tensor is given to it as a 1-entry one, t[0], and its gradient read back as 0-d)."""
    q, k, v, dout = _inputs(B, H, Q, KV, seed)
    mine = value.clone().requires_grad_()
    theirs = value.double().reshape(value.shape or (1,)).clone().requires_grad_()
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    out = attngen.flex_attention(*ours, score_mod=make(mine))
    mod = make(theirs) if value.dim() else lambda *idx: make(theirs[0])(*idx)  # (t[0] taken inside torch's vmap)
    ref = F.flex_attention(*ref_in, score_mod=mod)
    _close("out", out, ref, 1e-2)
    (out.float() * dout.float()).sum().backward()
    (ref * dout.double()).sum().backward()
    for name, a, b in zip("qkv", ours, ref_in):
        _close(f"d{name}", a.grad, b.grad, 2e-2)
    assert mine.grad is not None and mine.grad.shape == value.shape and mine.grad.dtype == value.dtype
    _close("dtensor", mine.grad, theirs.grad.reshape(value.shape), 2e-2)


@pytest.mark.parametrize("name", sorted(LEARNABLE))
def test_a_captured_tensor_that_requires_grad_gets_torchs_gradient(name):
    make, value, kw = LEARNABLE[name]
    learnable_peer(make, value, **kw)


def test_the_learnable_peer_check_fails_on_a_wrong_derivative(monkeypatch):
    """d(score * t)/d t is the score: the kernel that scatters dZ alone (the derivative's factor dropped) is caught."""
    from attngen.kernels.common import variants

    honest = variants.Variant.tensor_grads
    monkeypatch.setattr(variants.Variant, "tensor_grads", lambda self, learnable, at=None: [
        (target, "") for target, _ in honest(self, learnable, at)])
    make, value, kw = LEARNABLE["a 0-d scalar"]
    with pytest.raises(AssertionError, match="dtensor"):
        learnable_peer(make, value, **kw)


_rel_learn = torch.linspace(-1.0, 1.0, 2 * S).requires_grad_()


def _learnable_doc_bias(score, b, h, q_idx, kv_idx):
    return torch.where(_doc[q_idx] == _doc[kv_idx], score + _rel_learn[q_idx - kv_idx], -float("inf"))


def test_fullgraph_compile_of_a_learnable_bias_has_no_graph_break_and_equals_eager():
    torch._dynamo.reset()

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attngen.flex_attention(q, k, v, score_mod=_learnable_doc_bias)

    q, k, v, dout = _inputs(1, 2, S, S, seed=7)
    explained = torch._dynamo.explain(Attend())(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    grads = []
    for module in (torch.compile(Attend(), fullgraph=True), Attend()):
        _rel_learn.grad = None
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*leaves)
        (out.float() * dout.float()).sum().backward()
        grads.append([out.detach(), _rel_learn.grad.clone()] + [x.grad for x in leaves])
    assert grads[0][1].abs().max() > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # one kernel, the same inputs
