"""attngen.interfaces.flex (docs/interfaces.md): Python score_mod/mask_mod functions translated into the
expression language, create_block_mask's tile classification, and flex_attention in [B, H, S, D]
on the CPU model against the fp64 reference; the integer % and // the language grew for them.

The translation is checked against the Python function itself, run by torch in float64 over
broadcast index tensors as FlexAttention runs it (so a wrong translation cannot agree with
itself); the block mask against a dense evaluation of the Python function; the kernel against
attngen.reference.forward. Shapes stay tiny (B <= 2, H <= 4, lengths <= ~130, head_dim 64).
"""

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attngen
from attngen import expr, tiles
from attngen.interfaces import flex, flex_blocks, flex_mods, flex_source
from attngen.reference.forward import InputError, check_close, check_lse

D = 64


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.float16)


def grid(B, H, Q, KV):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1), torch.arange(Q).view(1, 1, Q, 1),
            torch.arange(KV).view(1, 1, 1, KV))


def dense_mask(mask_mod, B, H, Q, KV) -> np.ndarray:
    """The Python mask_mod run by torch over the whole grid (FlexAttention's own semantics)."""
    return np.broadcast_to(mask_mod(*grid(B, H, Q, KV)).numpy(), (B, H, Q, KV))


def translated_mask(mask_mod, B, H, Q, KV) -> np.ndarray:
    tr = flex_mods.translate(mask_mod, "mask_mod")
    b, h, qi, kj = (x.numpy() for x in grid(B, H, Q, KV))
    env = {"b": b, "h": h, "q_idx": qi, "kv_idx": kj}
    vis = expr.evaluate(expr.parse(tr.text, "mask_mod"), env, {n: t.numpy() for n, t in tr.tensors.items()})
    return np.broadcast_to(vis, (B, H, Q, KV))


# -- mods as users write them -----------------------------------------------------------------------------------
WINDOW = 9
doc_ids = torch.tensor([0] * 30 + [1] * 41 + [2] * 29)
rel_bias = torch.linspace(-1.0, 1.0, 4)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    """Causal within WINDOW keys."""
    near = q_idx - kv_idx <= WINDOW
    return causal(b, h, q_idx, kv_idx) & near


def document(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)


def prefix_lm_of(prefix):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)
    return prefix_lm


strided = lambda b, h, q, kv: ((q - kv) % 4 == 0) | ((q // 16) == (kv // 16))  # noqa: E731


def bias_mod(score, b, h, q_idx, kv_idx):
    capped = 20.0 * torch.tanh(score / 20.0)
    return torch.where(q_idx >= kv_idx, capped + rel_bias[h] * (q_idx - kv_idx) / 64, capped - 1.0)


def alibi_like(score, b, h, q_idx, kv_idx):
    return score - abs(q_idx - kv_idx) * torch.exp(rel_bias[h]) / 32 + torch.minimum(score, score * 0.5)


def with_heads(fn, heads):
    """fn's code with its own rel_bias of `heads` entries (a call-time tensor has one per head)."""
    import types
    return types.FunctionType(fn.__code__, {**fn.__globals__, "rel_bias": torch.linspace(-1.0, 1.0, heads)},
                              fn.__name__)


MASKS = {"causal": causal, "sliding": sliding, "document": document, "prefix_lm": prefix_lm_of(17), "strided": strided}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_a_mask_mod_translates_to_what_the_function_computes(name):
    fn = MASKS[name]
    assert np.array_equal(translated_mask(fn, 2, 3, 100, 100), dense_mask(fn, 2, 3, 100, 100))


@pytest.mark.parametrize("fn", [bias_mod, alibi_like])
def test_a_score_mod_translates_to_what_the_function_computes(fn):
    tr = flex_mods.translate(fn, "score_mod")
    b, h, qi, kj = grid(1, 4, 50, 60)
    score = torch.randn(1, 4, 50, 60, dtype=torch.float64) * 5
    want = fn(score, b, h, qi, kj).numpy()
    env = {"score": score.numpy(), "b": b.numpy(), "h": h.numpy(), "q_idx": qi.numpy(), "kv_idx": kj.numpy()}
    got = expr.evaluate(expr.parse(tr.text, "score_mod"), env, {n: t.numpy() for n, t in tr.tensors.items()})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # rel_bias is float32 in both


def test_captures_helpers_and_locals_become_expression_parts():
    tr = flex_mods.translate(sliding, "mask_mod")
    assert tr.text == "q_idx >= kv_idx and q_idx - kv_idx <= 9" and tr.tensors == {}
    tr = flex_mods.translate(document, "mask_mod")
    assert tr.text == "doc_ids.int32[q_idx] == doc_ids.int32[kv_idx] and q_idx >= kv_idx"  # integers stay exact
    assert tr.tensors["doc_ids"].dtype == torch.int32 and torch.equal(tr.tensors["doc_ids"], doc_ids.int())
    q = torch.zeros(3)  # a captured tensor under a reserved name gets another
    assert flex_mods.translate(lambda b, h, i, j: q[i] > 0, "mask_mod").text == "t_q[q_idx] > 0"


def test_a_rebound_capture_is_seen_by_the_next_call_which_plans_nothing_new(monkeypatch):
    from attngen.interfaces import op_arguments
    global doc_ids
    saved = doc_ids
    q = rand(1, 2, 100, D, seed=30)
    calls = []
    real = op_arguments._resolve
    monkeypatch.setattr(op_arguments, "_resolve", lambda *a: calls.append(1) or real(*a))
    op_arguments._plans.clear()
    block = flex_blocks.create_block_mask(document, None, None, 100, 100)
    first = flex.flex_attention(q, q, q, block_mask=block)
    assert torch.equal(flex.flex_attention(q, q, q, block_mask=block), first) and len(calls) == 1
    try:
        doc_ids = torch.tensor([0] * 50 + [1] * 50)
        second = flex.flex_attention(q, q, q, block_mask=block)
    finally:
        doc_ids = saved
    assert not torch.equal(first, second) and len(calls) == 1  # new values, the same kernel
    bshd = q.transpose(1, 2)
    assert check_close(second.transpose(1, 2), bshd, bshd, bshd, False,
                       mask_mod="doc_ids.int32[q_idx] == doc_ids.int32[kv_idx] and q_idx >= kv_idx",
                       tensors={"doc_ids": torch.tensor([0] * 50 + [1] * 50, dtype=torch.int32)}).ok


def test_a_wrong_translation_is_caught_by_the_check(monkeypatch):
    monkeypatch.setitem(flex_mods.TORCH_FUNCS, "minimum", "max")  # a deliberately broken mapping
    tr = flex_mods.translate(alibi_like, "score_mod")
    b, h, qi, kj = grid(1, 4, 8, 8)
    score = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    env = {"score": score.numpy(), "b": b.numpy(), "h": h.numpy(), "q_idx": qi.numpy(), "kv_idx": kj.numpy()}
    got = expr.evaluate(expr.parse(tr.text, "score_mod"), env, {n: t.numpy() for n, t in tr.tensors.items()})
    assert not np.allclose(got, alibi_like(score, b, h, qi, kj).numpy())


# -- translation errors: the function, the file's line, the construct ---------------------------------------


def shift_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx << 2)


def branchy(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return q_idx > 0
    return kv_idx > 0


def ternary(score, b, h, q_idx, kv_idx):
    return score if q_idx > kv_idx else -score


def method(score, b, h, q_idx, kv_idx):
    x = score * 2
    return x.sum()


def unknown_call(score, b, h, q_idx, kv_idx):
    return torch.erf(score)


def float_mod(score, b, h, q_idx, kv_idx):
    return score % 2


def inf_times(score, b, h, q_idx, kv_idx):
    return score * float("inf")


huge_ids = torch.tensor([0, 2**40])


def huge_id_mask(b, h, q_idx, kv_idx):
    return huge_ids[q_idx] == huge_ids[kv_idx]


def _line(fn, offset):
    return inspect.getsourcelines(fn)[1] + offset


@pytest.mark.parametrize("fn, kind, offset, construct", [
    (shift_mod, "score_mod", 1, "the operator <<"),
    (branchy, "mask_mod", 1, "the statement `If`"),
    (ternary, "score_mod", 1, "conditional expression"),
    (method, "score_mod", 2, "method `.sum()`"),
    (unknown_call, "score_mod", 1, "calling `torch.erf`"),
    (float_mod, "score_mod", 0, "left operand of % must be an integer expression"),
    (inf_times, "score_mod", 0, "an infinity where it is not a masked key"),
    (huge_id_mask, "mask_mod", 1, "holds values beyond int32"),
])
def test_an_untranslatable_construct_names_the_function_the_line_and_the_construct(fn, kind, offset, construct):
    with pytest.raises(flex_source.FlexTranslationError) as info:
        flex_mods.translate(fn, kind)
    msg = str(info.value)
    assert msg.startswith(f"{fn.__qualname__} (") and f"line {_line(fn, offset)})" in msg and construct in msg, msg
    assert isinstance(info.value, InputError) and "\n" not in msg


def test_a_lambda_and_a_nested_def_report_their_own_lines():
    bad = lambda b, h, q, kv: q ^ kv  # noqa: E731
    with pytest.raises(flex_source.FlexTranslationError, match=rf"<lambda> \(.*line {inspect.getsourcelines(bad)[1]}\).*\^"):
        flex_mods.translate(bad, "mask_mod")

    def outer():
        n = 3

        def inner(b, h, q, kv):
            return q @ kv + n
        return inner
    fn = outer()
    with pytest.raises(flex_source.FlexTranslationError, match=rf"outer.<locals>.inner \(.*line {_line(fn, 1)}\).*@"):
        flex_mods.translate(fn, "mask_mod")


# -- the integer % and // of the expression language ----------------------------------------------------------


def test_percent_and_floordiv_have_python_floor_semantics_with_negative_operands():
    e = expr.parse("(q_idx - kv_idx) % -3 + (q_idx - kv_idx) // 5 * 100", "score_mod")
    qi, kj = np.arange(-20, 20)[:, None], np.arange(7)[None, :]
    got = expr.evaluate(e, {"q_idx": qi, "kv_idx": kj}, {})
    want = np.array([[(i - j) % -3 + (i - j) // 5 * 100 for j in range(7)] for i in range(-20, 20)])
    assert np.array_equal(got, want)
    t = torch.arange(-20, 20)[:, None] - torch.arange(7)[None, :]  # torch's % and // on ints agree
    assert np.array_equal(want, (t % -3 + torch.div(t, 5, rounding_mode="floor") * 100).numpy())


def test_percent_and_floordiv_emit_tilelangs_floor_forms():
    e = expr.parse("q_idx % 4 == kv_idx // 16", "mask_mod")
    assert expr.emit(e, {"q_idx": "i", "kv_idx": "j"}, None, None) == "(T.floormod(i, 4) == T.floordiv(j, 16))"


@pytest.mark.parametrize("text, col, fragment", [
    ("score % 2", 1, "left operand of % must be an integer"),
    ("bias[h] // 4", 1, "left operand of // must be an integer"),
    ("q_idx % 2.5", 9, "right operand of % must be an integer literal"),
    ("q_idx // (kv_idx / 2)", 11, "right operand of // must be an integer literal"),
    ("q_idx % 0", 9, "% by the literal 0"),
    ("(q_idx / 2) % 3", 2, "left operand of %"),
])
def test_a_non_integer_operand_of_percent_is_a_column_precise_error(text, col, fragment):
    with pytest.raises(expr.ExprError) as info:
        expr.parse(text, "score_mod")
    assert info.value.col == col and fragment in info.value.message


def test_a_run_time_divisor_gives_0_where_it_is_0_in_the_kernel_and_the_reference():
    e = expr.parse("q_idx // (kv_idx - 3) + q_idx % (kv_idx - 3)", "score_mod")
    qi, kj = np.arange(10)[:, None], np.arange(7)[None, :]
    got = expr.evaluate(e, {"q_idx": qi, "kv_idx": kj}, {})
    want = [[0 if j == 3 else i // (j - 3) + i % (j - 3) for j in range(7)] for i in range(10)]
    assert np.array_equal(got, want)
    q, k, v = rand(1, 70, 2, D, seed=1), rand(1, 70, 2, D, seed=2), rand(1, 70, 2, D, seed=3)
    mask = "(q_idx + 5) // (kv_idx - 3) % 3 != 1"
    out = attngen.attention(q, k, v, mask_mod=mask)
    assert check_close(out, q, k, v, False, mask_mod=mask).ok
    assert not check_close(out, q, k, v, False, mask_mod="(q_idx + 5) // max(kv_idx - 3, 1) % 3 != 1").ok


def test_a_percent_mask_on_the_cpu_model_matches_the_reference():
    q, k, v = rand(1, 77, 2, D, seed=1), rand(1, 93, 2, D, seed=2), rand(1, 93, 2, D, seed=3)
    mask = "(q_idx - kv_idx) % 3 != 1 and (q_idx - 40) // 32 >= kv_idx // 32 - 1"  # negative left operands
    out = attngen.attention(q, k, v, mask_mod=mask)
    assert check_close(out, q, k, v, False, mask_mod=mask).ok
    # C's truncated % (what a plain `%` in CUDA gives) differs wherever q_idx < kv_idx: the check sees it
    trunc = ("where(q_idx >= kv_idx, (q_idx - kv_idx) % 3, -(abs(q_idx - kv_idx) % 3)) != 1 and "
             "(q_idx - 40) // 32 >= kv_idx // 32 - 1")
    assert not check_close(out, q, k, v, False, mask_mod=trunc).ok


# -- create_block_mask ------------------------------------------------------------------------------------------


def expected_states(dense: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """Per tile, independently: EMPTY if no entry is visible, FULL if all bm x bn are (a tile that
    runs past a length is never full: entries past it are masked, as in FlexAttention), else PARTIAL."""
    B, H, Q, KV = dense.shape
    nq, nk = -(-Q // bm), -(-KV // bn)
    out = np.zeros((B, H, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            tile = dense[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            whole = tile.shape[2] == bm and tile.shape[3] == bn
            full = tile.all(axis=(2, 3)) & whole
            out[:, :, i, j] = np.where(full, tiles.FULL, np.where(tile.any(axis=(2, 3)), tiles.PARTIAL, tiles.EMPTY))
    return out


def check_lists(bmask, states):
    """kv_*/full_kv_* list exactly the partial/full tiles of each row, ascending; q_* the columns."""
    for (n_name, i_name, kind, axis) in [("kv_num_blocks", "kv_indices", tiles.PARTIAL, 3),
                                         ("full_kv_num_blocks", "full_kv_indices", tiles.FULL, 3),
                                         ("q_num_blocks", "q_indices", tiles.PARTIAL, 2),
                                         ("full_q_num_blocks", "full_q_indices", tiles.FULL, 2)]:
        counts, idx = getattr(bmask, n_name).numpy(), getattr(bmask, i_name).numpy()
        sel = states == kind if axis == 3 else np.swapaxes(states == kind, 2, 3)
        for pos in np.ndindex(sel.shape[:3]):
            want = np.flatnonzero(sel[pos])
            if counts[pos] != len(want) or not np.array_equal(idx[pos][:counts[pos]], want):
                return f"{n_name}/{i_name} at {pos}: {idx[pos][:counts[pos]]} != {want}"
    return None


@st.composite
def doc_boundaries(draw, total):
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=6)))
    ids = np.zeros(total, np.int64)
    for c in cuts:
        ids[c:] += 1
    return torch.tensor(ids)


@settings(max_examples=12)
@given(st.integers(1, 200), st.integers(1, 200), st.sampled_from([16, 32, (16, 48), 128]), st.data())
def test_block_mask_tiles_match_a_dense_evaluation(q_len, kv_len, block, data):
    kind = data.draw(st.sampled_from(["causal", "sliding", "document", "prefix_lm", "strided"]))
    if kind == "document":
        ids = data.draw(doc_boundaries(max(q_len, kv_len) + 1))
        fn = lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)  # noqa: E731
    elif kind == "prefix_lm":
        fn = prefix_lm_of(data.draw(st.integers(0, kv_len)))
    else:
        fn = MASKS[kind]
    bm, bn = (block, block) if isinstance(block, int) else block
    bmask = flex_blocks.create_block_mask(fn, 1, 1, q_len, kv_len, BLOCK_SIZE=block)
    dense = dense_mask(fn, 1, 1, q_len, kv_len)
    states = expected_states(dense, bm, bn)
    assert np.array_equal(bmask.states, states)
    assert check_lists(bmask, states) is None
    assert bmask.shape == (1, 1, q_len, kv_len) and bmask.kv_indices.dtype == torch.int32


def test_the_tile_check_catches_a_full_tile_counted_empty_and_an_index_row_off_by_one():
    bmask = flex_blocks.create_block_mask(causal, 1, 2, 100, 100, BLOCK_SIZE=16)
    states = expected_states(dense_mask(causal, 1, 2, 100, 100), 16, 16)
    assert check_lists(bmask, states) is None and (states == tiles.FULL).any()
    broken = states.copy()
    broken[0, 0, 3, 0] = tiles.EMPTY  # a full tile treated as empty
    assert check_lists(bmask, broken) is not None
    shifted = flex_blocks.BlockMask(**{**bmask.__dict__, "kv_indices": torch.roll(bmask.kv_indices, 1, dims=2)})
    assert check_lists(shifted, states) is not None  # kv_indices read one row off


def test_block_mask_per_batch_and_head():
    heads_mask = lambda b, h, q, kv: (kv <= q + h * 20) & (kv >= b * 10)  # noqa: E731
    bmask = flex_blocks.create_block_mask(heads_mask, 2, 3, 70, 90, BLOCK_SIZE=32)
    assert np.array_equal(bmask.states, expected_states(dense_mask(heads_mask, 2, 3, 70, 90), 32, 32))
    with pytest.raises(InputError, match="Q_LEN"):
        flex_blocks.create_block_mask(causal, 1, 1, 0, 10)


# -- flex_attention ----------------------------------------------------------------------------------------------


@settings(max_examples=5)
@given(st.integers(1, 2), st.integers(1, 100), st.integers(1, 100), st.sampled_from([(2, 2), (4, 2), (4, 1)]),
       st.sampled_from([None, "bias", "alibi_like"]), st.sampled_from([None, "causal", "document", "strided"]),
       st.booleans())
def test_flex_attention_matches_the_reference(batch, sq, skv, heads, score, mask, lse):
    h, hk = heads
    q, k, v = rand(batch, h, sq, D, seed=4), rand(batch, hk, skv, D, seed=5), rand(batch, hk, skv, D, seed=6)
    score_mod = {"bias": bias_mod, "alibi_like": alibi_like}.get(score)
    if score_mod is not None and h != 4:  # rel_bias[h] must have one entry per head: the same code over h entries
        score_mod = with_heads(score_mod, h)
    block_mask = None if mask is None else flex_blocks.create_block_mask(MASKS[mask], None, None, sq, skv, BLOCK_SIZE=32)
    result = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=h != hk,
                                 return_lse=lse)
    out, got_lse = result if lse else (result, None)
    assert out.shape == (batch, h, sq, D)
    variant = {"tensors": {}}
    for fn, kind in ((score_mod, "score_mod"), (block_mask and block_mask.mask_mod, "mask_mod")):
        if fn is not None:
            tr = flex_mods.translate(fn, kind)
            variant[kind] = tr.text
            variant["tensors"].update(tr.tensors)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert check_close(out.transpose(1, 2), *bshd, False, **variant).ok
    if lse:
        assert got_lse.shape == (batch, h, sq) and check_lse(got_lse, *bshd, False, **variant).ok
    if block_mask is not None:  # the block mask's mask_mod is exactly a spec mask_mod: bit for bit on the same tiles
        block_n = int(block_mask.BLOCK_SIZE[1])  # another block_n would sum a row's tiles in another order
        same = attngen.attention(*[t.contiguous() for t in bshd], mask_mod=variant["mask_mod"], block_n=block_n,
                                 **({"score_mod": variant["score_mod"]} if score_mod else {}), **variant["tensors"])
        assert torch.equal(out.transpose(1, 2), same)


def test_a_transposed_packed_tensor_is_not_copied_and_a_packed_bhsd_one_is(monkeypatch):
    seen = {}
    real = flex.attention

    def spy(q, k, v, **kw):
        seen.update(q=q.data_ptr(), k=k.data_ptr())
        return real(q, k, v, **kw)
    monkeypatch.setattr(flex, "attention", spy)
    q_bshd, k_bshd = rand(1, 33, 2, D, seed=7), rand(1, 40, 2, D, seed=8)
    q, k = q_bshd.transpose(1, 2), k_bshd.transpose(1, 2)  # [B, H, S, D] views of packed [B, S, H, D]
    out = flex.flex_attention(q, k, k)
    assert seen == {"q": q_bshd.data_ptr(), "k": k_bshd.data_ptr()}  # no copy
    assert check_close(out.transpose(1, 2), q_bshd, k_bshd, k_bshd, False).ok
    packed = q.contiguous()  # a packed [B, H, S, D]: the kernels take packed [B, S, H, D], so one copy
    flex.flex_attention(packed, k, k)
    assert seen["q"] != packed.data_ptr()


def test_a_flash_layout_tensor_is_a_layout_error():
    q, k = rand(1, 37, 4, D), rand(1, 53, 2, D)  # [B, S, H, D] given to the [B, H, S, D] door
    with pytest.raises(InputError, match=r"query.shape\[1\] \(H\) = 37.*\[B, H, S, D\].*transpose\(1, 2\)"):
        flex.flex_attention(q, k, k, enable_gqa=True)
    with pytest.raises(InputError, match=r"value.shape.*\[B, H, S, D\]"):
        flex.flex_attention(rand(1, 2, 9, D), rand(1, 2, 9, D), rand(1, 9, 2, D))
    with pytest.raises(InputError, match="enable_gqa"):
        flex.flex_attention(rand(1, 4, 9, D), rand(1, 2, 9, D), rand(1, 2, 9, D))
    with pytest.raises(InputError, match="block_mask.seq_lengths"):
        flex.flex_attention(rand(1, 2, 9, D), rand(1, 2, 9, D), rand(1, 2, 9, D),
                            block_mask=flex_blocks.create_block_mask(causal, 1, 1, 9, 10))


def _scale_accepted() -> bool:
    q = rand(1, 1, 1, D)
    try:
        return attngen.attention(q, q, q, softmax_scale=0.5).shape == q.shape
    except (InputError, TypeError, ValueError):
        return False


@pytest.mark.skipif(not _scale_accepted(), reason="attngen.attention takes no run-time softmax_scale yet (issue 18)")
def test_scale_reaches_the_kernel():
    q, k = rand(1, 2, 19, D, seed=9), rand(1, 2, 27, D, seed=10)
    out = flex.flex_attention(q, k, k, scale=0.3)
    bshd = [t.transpose(1, 2) for t in (q, k, k)]
    assert check_close(out.transpose(1, 2), *bshd, False, scale=0.3).ok


# -- next to torch's own FlexAttention (CPU, float64), where this torch has it -------------------------------------

try:
    from torch.nn.attention import flex_attention as torch_flex
except ImportError:  # torch before 2.5
    torch_flex = None


@pytest.mark.skipif(torch_flex is None, reason="this torch has no torch.nn.attention.flex_attention")
@settings(max_examples=4)
@given(st.integers(1, 100), st.integers(1, 100), st.sampled_from(["causal", "document", "strided", "prefix_lm"]),
       st.sampled_from([16, 32, 128]))
def test_next_to_torchs_flex_attention(sq, skv, mask, block):
    import warnings
    fn = MASKS[mask]
    q, k, v = rand(1, 4, sq, D, seed=11), rand(1, 4, skv, D, seed=12), rand(1, 4, skv, D, seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch_flex.create_block_mask(fn, None, None, sq, skv, device="cpu", BLOCK_SIZE=block)
        ref, ref_lse = torch_flex.flex_attention(q.double(), k.double(), v.double(), score_mod=bias_mod,
                                                 block_mask=theirs, return_lse=True)
    ours = flex_blocks.create_block_mask(fn, None, None, sq, skv, BLOCK_SIZE=block)
    for n_name, i_name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n_ours, n_theirs = getattr(ours, n_name), getattr(theirs, n_name)
        assert torch.equal(n_ours, n_theirs.to(torch.int32)), n_name
        for r in range(n_ours.shape[-1]):
            c = int(n_ours[0, 0, r])
            assert torch.equal(getattr(ours, i_name)[0, 0, r, :c], getattr(theirs, i_name)[0, 0, r, :c].to(torch.int32))
    for bm in (ours, theirs):  # torch's BlockMask is read the same way (its mask_mod, its lengths)
        out, lse = flex.flex_attention(q, k, v, score_mod=bias_mod, block_mask=bm, return_lse=True)
        tr_s, tr_m = flex_mods.translate(bias_mod, "score_mod"), flex_mods.translate(fn, "mask_mod")
        bound = check_close(out.transpose(1, 2), *[t.transpose(1, 2) for t in (q, k, v)], False, score_mod=tr_s.text,
                            mask_mod=tr_m.text, tensors={**tr_s.tensors, **tr_m.tensors}).bound
        seen = ~torch.isneginf(ref_lse)  # torch gives NaN-free zeros for rows that see no key as well
        assert float((out.double() - ref).abs().max()) <= bound
        assert torch.equal(torch.isneginf(lse), ~seen)
        if seen.any():
            assert float((lse.double() - ref_lse)[seen].abs().max()) < 2e-3
