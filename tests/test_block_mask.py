"""The forward kernel with a call-time block mask (spec block_mask = true, docs/variants.md).

The evidence: for hypothesis-drawn mask_mods (causal, a sliding window, documents from random
boundaries, prefix-LM, random block sparsity through a tensor) the block-mask kernel, run on the
CPU model, equals the kernel without a block mask bit for bit (out and LSE), and every block
loaded exactly its Q tile's non-empty KV tiles (none for a Q tile that has none: its rows give
the dense kernel's bits for a row that sees no key, with or without a sink). Mutants of the
emitted kernel's text are each caught: a full tile treated as empty, a partial tile run without
the mask, kv_indices read one row off, and the zero-visit guard dropped, inverted or clamped.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import tiles
from attngen.interfaces import flex, flex_blocks, flex_mods
from attngen.emulator.driver import emulate_stats
from attngen.emulator.errors import DeadlockError, EmulationError
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError, check_close, random_inputs
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec, SpecError
from gpu_marks import NEEDS_TOOLKIT

D = 64
BM_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def mask_of(kind: str, q_len: int, kv_len: int, draw):
    """A Python mask_mod of the kind, with its captures drawn."""
    if kind == "causal":
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    if kind == "window":
        w = draw(st.integers(0, 150))
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= w)
    if kind == "prefix_lm":
        p = draw(st.integers(0, kv_len))
        return lambda b, h, q_idx, kv_idx: (kv_idx < p) | (q_idx >= kv_idx)
    if kind == "document":
        n = max(q_len, kv_len)
        cuts = sorted(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=6)))
        doc = torch.from_numpy(np.searchsorted(np.array(cuts), np.arange(n), side="right")).float()
        return lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    # random block sparsity: 32 x 32 blocks on or off, through a captured tensor
    seed = draw(st.integers(0, 2**16))
    on = draw(st.sampled_from([0.2, 0.5, 0.8]))
    blk = torch.from_numpy((np.random.default_rng(seed).random((-(-q_len // 32), -(-kv_len // 32))) < on)).float()
    return lambda b, h, q_idx, kv_idx: blk[q_idx // 32, kv_idx // 32] > 0


def run_both(fn, batch, heads, q_len, kv_len, consumers, block_n, lse, seed=0, source=None, sinks=False):
    """(dense out, block-mask out, the block-mask run's Stats, the BlockMask)."""
    bm = flex_blocks.create_block_mask(fn, None, None, q_len, kv_len, BLOCK_SIZE=(64 * consumers, block_n))
    fields = dict(head_dim=D, consumers=consumers, block_n=block_n, mask_mod=bm.mask_text, lse=lse, sinks=sinks)
    dense, sparse = make_plan(Spec(**fields)), make_plan(Spec(**fields, block_mask=True))
    q, k, v = random_inputs("float16", D, batch, heads, heads, q_len, kv_len, seed)
    mod = dict(bm.mask_tensors)
    if sinks:
        mod["sinks"] = torch.from_numpy(np.random.default_rng(seed).standard_normal(heads).astype(np.float32))
    lists = {n: getattr(bm, n) for n in BM_NAMES}
    want, _ = emulate_stats(dense, q, k, v, tensors=mod, seed=seed)
    got, stats = emulate_stats(sparse, q, k, v, tensors={**mod, **lists}, seed=seed + 1, source=source)
    return want, got, stats, bm, (q, k, v)


def same_bits(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same_bits(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def expected_loads(bm, batch, heads) -> dict:
    """K tiles each block (x = Q tile, y = head, z = batch) must load: its non-empty tiles, 0 if none."""
    nonempty = (bm.states != tiles.EMPTY).sum(axis=-1)  # [B or 1, H or 1, nq]
    nonempty = np.broadcast_to(nonempty, (batch, heads, nonempty.shape[-1]))
    return {(x, h, b): int(nonempty[b, h, x]) for b in range(batch) for h in range(heads)
            for x in range(nonempty.shape[-1])}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["causal", "window", "document", "prefix_lm", "sparse"]), st.integers(1, 300),
       st.integers(1, 300), st.sampled_from([(1, 64), (2, 64), (2, 128)]), st.booleans(), st.integers(1, 2),
       st.data())
def test_the_block_mask_kernel_equals_the_dense_one_bit_for_bit_and_loads_only_non_empty_tiles(
        kind, q_len, kv_len, tile, lse, heads, data):
    if kind == "document":
        kv_len = q_len  # one packed sequence
    fn = mask_of(kind, q_len, kv_len, data.draw)
    want, got, stats, bm, _ = run_both(fn, 1, heads, q_len, kv_len, *tile, lse)
    assert same_bits(want, got)
    loads = expected_loads(bm, 1, heads)
    assert stats.k_tiles_by_cta == loads and stats.k_tiles == sum(loads.values())


def test_a_sparse_mask_loads_fewer_tiles_than_the_dense_kernel_and_the_result_is_the_references():
    doc = torch.tensor([0.0] * 200 + [1.0] * 180 + [2.0] * 132)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    want, got, stats, bm, (q, k, v) = run_both(documents, 2, 1, 512, 512, 2, 64, False)
    assert same_bits(want, got)
    dense_tiles = 2 * 4 * 8  # every KV tile for every Q tile
    assert stats.k_tiles == int((bm.states != tiles.EMPTY).sum()) * 2 < dense_tiles / 2
    assert check_close(got, q, k, v, False, dtype="float16", mask_mod=bm.mask_text, tensors=bm.mask_tensors).ok


# -- mutants of the emitted kernel: each must be caught ----------------------------------------------------------
MUTANTS = {
    "a full tile treated as empty": [("bm_partial_n + bm_full_n", "bm_partial_n"),
                                     ("bm_next_f < bm_full_n", "bm_next_f < 0")],
    "a partial tile run without the mask": [("if partial:", "if bm_p < 0:")],
    "kv_indices read one row off": [("KV_indices[bm_b, bm_h, q_block, ", "KV_indices[bm_b, bm_h, T.min(q_block + 1, bm_q_tiles - 1), ")],
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_of_the_kernel_text_is_caught(name):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = flex_blocks.create_block_mask(causal, None, None, 384, 384, BLOCK_SIZE=(128, 64))
    text = render_source(make_plan(Spec(head_dim=D, block_n=64, mask_mod=bm.mask_text, block_mask=True)))
    mutated = text
    for old, new in MUTANTS[name]:
        assert old in mutated, old
        mutated = mutated.replace(old, new)
    want, got, stats, bm, _ = run_both(causal, 1, 1, 384, 384, 2, 64, False, source=mutated)
    caught = not same_bits(want, got) or stats.k_tiles_by_cta != expected_loads(bm, 1, 1)
    assert caught, name
    _, clean, clean_stats, _, _ = run_both(causal, 1, 1, 384, 384, 2, 64, False, source=text)
    assert same_bits(want, clean) and clean_stats.k_tiles_by_cta == expected_loads(bm, 1, 1)  # the checks pass unmutated


# -- a Q tile with no listed tile: no load, no visit, the dense kernel's bits ----------------------------------
def sparse_with_empty_rows(q_len, kv_len, block_m, seed, on, empty):
    """Random 32 x 32 block sparsity with the Q tiles `empty` (indices mod the tile count) left with no key."""
    blk = np.random.default_rng(seed).random((-(-q_len // 32), -(-kv_len // 32))) < on
    nq = -(-q_len // block_m)
    for x in {e % nq for e in empty}:
        blk[x * block_m // 32:(x + 1) * block_m // 32] = False
    blk = torch.from_numpy(blk).float()
    return lambda b, h, q_idx, kv_idx: blk[q_idx // 32, kv_idx // 32] > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(65, 400), st.integers(1, 300), st.sampled_from([(1, 64), (2, 64), (2, 128), (3, 64)]),
       st.booleans(), st.booleans(), st.integers(0, 2**16), st.sampled_from([0.0, 0.3, 0.7]),
       st.lists(st.integers(0, 7), min_size=1, max_size=3))
def test_a_q_tile_with_no_listed_tile_loads_nothing_and_gives_the_dense_kernels_bits(
        q_len, kv_len, tile, lse, sinks, seed, on, empty):
    fn = sparse_with_empty_rows(q_len, kv_len, 64 * tile[0], seed, on, empty)
    want, got, stats, bm, _ = run_both(fn, 1, 2, q_len, kv_len, *tile, lse, seed=seed, sinks=sinks)
    loads = expected_loads(bm, 1, 2)
    assert 0 in loads.values()  # the draw made an empty Q tile
    assert same_bits(want, got)
    assert stats.k_tiles_by_cta == loads and stats.k_tiles == sum(loads.values())


ZERO_VISIT_MUTANTS = {
    "the zero-visit guard dropped": [("if n_tiles > 0:", "if True:")],
    "the zero-visit guard inverted": [("if n_tiles > 0:", "if n_tiles <= 0:")],
    "an empty Q tile runs one visit (n_tiles >= 1)":
        [("n_tiles = bm_partial_n + bm_full_n", "n_tiles = T.max(bm_partial_n + bm_full_n, 1)")],
    "the row sum of a skipped block left unset": [("T.fill(row_sum, 0)", "T.fill(row_sum, 1)")],
}


@pytest.mark.parametrize("name", sorted(ZERO_VISIT_MUTANTS))
def test_each_zero_visit_mutant_is_caught(name):
    fn = sparse_with_empty_rows(384, 256, 128, 7, 0.5, [0, 2])
    text = render_source(make_plan(Spec(head_dim=D, block_n=64, mask_mod=flex_blocks.create_block_mask(
        fn, None, None, 384, 256, BLOCK_SIZE=(128, 64)).mask_text, block_mask=True, lse=True)))
    mutated = text
    for old, new in ZERO_VISIT_MUTANTS[name]:
        assert old in mutated, old
        mutated = mutated.replace(old, new)
    try:
        want, got, stats, bm, _ = run_both(fn, 1, 1, 384, 256, 2, 64, True, source=mutated)
        caught = not same_bits(want, got) or stats.k_tiles_by_cta != expected_loads(bm, 1, 1)
    except EmulationError as e:  # a consumer waiting for a tile the producer never loads
        caught = isinstance(e, DeadlockError)
    assert caught, name
    want, clean, clean_stats, bm, _ = run_both(fn, 1, 1, 384, 256, 2, 64, True, source=text)
    assert 0 in expected_loads(bm, 1, 1).values()
    assert same_bits(want, clean) and clean_stats.k_tiles_by_cta == expected_loads(bm, 1, 1)  # the checks pass unmutated


# -- the tile algebra: retiling a block mask to the kernel's tiles --------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.integers(1, 200), st.sampled_from([16, 32, 64, 128]), st.sampled_from([16, 32, 64, 128]),
       st.sampled_from([64, 128]), st.sampled_from([32, 64, 128]), st.integers(0, 2**16))
def test_retiled_states_are_exact_where_they_skip_or_drop_the_mask(q_len, kv_len, bq, bk, kq, kk, seed):
    vis = np.random.default_rng(seed).random((1, 1, q_len, kv_len)) < 0.5
    vis |= np.tril(np.ones((q_len, kv_len), bool), -40)  # some full tiles too
    got = tiles.retile_states(tiles.tile_states(vis, bq, bk), (bq, bk), (kq, kk), (q_len, kv_len))
    exact = tiles.tile_states(vis, kq, kk)
    assert got.shape == exact.shape
    assert np.all(exact[got == tiles.EMPTY] == tiles.EMPTY)  # a skipped tile has no visible entry
    assert np.all(exact[got == tiles.FULL] == tiles.FULL)  # a tile run without the mask sees every entry
    if kq % bq == 0 and kk % bk == 0:  # coarsening loses nothing
        assert np.array_equal(got, exact)


# -- the doors --------------------------------------------------------------------------------------------------
def rand(*shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)).to(torch.float16)


def test_flex_attention_runs_the_block_mask_kernel_and_retiles_flex_block_sizes(monkeypatch):
    from attngen.interfaces import ops
    seen = []
    real = ops.emulate
    monkeypatch.setattr(ops, "emulate", lambda plan, *a, **kw: seen.append((plan, kw)) or real(plan, *a, **kw))
    doc = torch.tensor([0] * 70 + [1] * 130)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    q, k, v = (rand(1, 2, 200, D, seed=s) for s in (1, 2, 3))
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    for size in (128, 32):  # 32: retiled to the kernel's 128-row Q tiles
        out = flex.flex_attention(q, k, v, block_mask=flex_blocks.create_block_mask(documents, None, None, 200, 200, BLOCK_SIZE=size))
        plan, kw = seen[-1]
        assert plan.spec.block_mask and plan.spec.block_m in (64, 128, 192)
        assert kw["kv_indices"].shape[2] == -(-200 // plan.spec.block_m)
        tr = flex_mods.translate(documents, "mask_mod")
        dense = attngen.attention(*bshd, mask_mod=tr.text, **tr.tensors, consumers=plan.spec.consumers,
                                  block_n=plan.spec.block_n)
        assert torch.equal(out.transpose(1, 2), dense)
        assert check_close(dense, *bshd, False, mask_mod=tr.text, tensors=tr.tensors).ok


def test_attention_takes_a_block_mask_and_refuses_one_that_disagrees_with_the_call():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    q = rand(1, 130, 2, D)
    bm = flex_blocks.create_block_mask(causal, None, None, 130, 130, BLOCK_SIZE=(128, 64))
    out = attngen.attention(q, q, q, block_mask=bm)
    assert torch.equal(out, attngen.attention(q, q, q, mask_mod="q_idx >= kv_idx", block_n=64))
    with pytest.raises(InputError, match="mask_mod.*block mask's own mask_mod"):
        attngen.attention(q, q, q, block_mask=bm, mask_mod="q_idx > kv_idx")
    with pytest.raises(InputError, match=r"block_n.*64, the block mask's KV block"):
        attngen.attention(q, q, q, block_mask=bm, block_n=128)
    with pytest.raises(InputError, match=r"consumers.*2, the block mask's Q block"):
        attngen.attention(q, q, q, block_mask=bm, consumers=1)
    with pytest.raises(InputError, match=r"block_mask.BLOCK_SIZE.*64, 128 or 192"):
        attngen.attention(q, q, q, block_mask=flex_blocks.create_block_mask(causal, None, None, 130, 130, BLOCK_SIZE=32))
    with pytest.raises(InputError, match="block_mask.seq_lengths"):
        attngen.attention(q[:, :129], q, q, block_mask=bm)
    with pytest.raises(SpecError, match="causal"):
        attngen.attention(q, q, q, block_mask=bm, causal=True)


def test_the_kernels_inputs_name_a_wrong_block_mask_tensor():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = flex_blocks.create_block_mask(causal, None, None, 200, 200, BLOCK_SIZE=(128, 128))
    plan = make_plan(Spec(head_dim=D, mask_mod=bm.mask_text, block_mask=True))
    q, k, v = random_inputs("float16", D, 1, 1, 1, 200, 200, 0)
    lists = {n: getattr(bm, n) for n in BM_NAMES}
    plan64 = make_plan(Spec(head_dim=D, block_n=64, mask_mod=bm.mask_text, block_mask=True))
    with pytest.raises(InputError, match=r"kv_indices.shape.*bm_kv_tiles = 4"):  # the kernel's tiles are 64 keys, the mask's 128
        emulate_stats(plan64, q, k, v, tensors=lists)
    q4, k4, v4 = random_inputs("float16", D, 1, 1, 1, 200, 400, 0)
    with pytest.raises(InputError, match=r"kv_indices.shape"):
        emulate_stats(plan, q4, k4, v4, tensors=lists)
    with pytest.raises(InputError, match=r"full_kv_indices.dtype"):
        emulate_stats(plan, q, k, v, tensors={**lists, "full_kv_indices": bm.full_kv_indices.float()})
    with pytest.raises(InputError, match=r"kv_indices.shape\[0\] \(batch\).*1 \(broadcast\) or 1"):
        emulate_stats(plan, q, k, v, tensors={n: t.expand(3, *t.shape[1:]).contiguous() for n, t in lists.items()})


def test_the_spec_field_is_checked_and_off_by_default():
    assert not Spec().block_mask and "block_mask" not in Spec().canonical_dict()
    with pytest.raises(SpecError, match="block_mask.*needs a mask_mod"):
        Spec(block_mask=True)
    with pytest.raises(SpecError, match="spec field `causal`"):
        Spec(block_mask=True, mask_mod="q_idx >= kv_idx", causal=True)
    with pytest.raises(SpecError, match="spec field `window`"):
        Spec(block_mask=True, mask_mod="q_idx >= kv_idx", window=(8, -1))
    with pytest.raises(SpecError, match="spec field `splits`"):
        Spec(block_mask=True, mask_mod="q_idx >= kv_idx", splits=2)
    with pytest.raises(SpecError, match="block_mask.*true or false"):
        Spec(block_mask="yes", mask_mod="q_idx >= kv_idx")
    plan = make_plan(Spec(mask_mod="q_idx >= kv_idx", block_mask=True))
    assert plan.name.endswith("_bmask") and plan.hash != make_plan(Spec(mask_mod="q_idx >= kv_idx")).hash


def test_the_cli_emulates_a_block_mask_spec_with_the_lists_of_its_own_mask(tmp_path, capsys):
    from attngen import cli
    from attngen.emulator.driver import block_mask_lists
    spec = tmp_path / "bm.toml"
    spec.write_text('head_dim = 64\nmask_mod = "(q_idx >= kv_idx) and (q_idx - kv_idx < 100)"\nblock_mask = true\n')
    assert cli.main(["emulate", str(spec), "--q-len", "300", "--kv-len", "300"]) == 0
    assert "PASS" in capsys.readouterr().out
    plan = make_plan(attngen.load_spec(spec))
    lists = block_mask_lists(plan, 1, 1, 300, 300, {})
    ours = flex_blocks.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 100), None, None,
                                  300, 300, BLOCK_SIZE=(plan.spec.block_m, plan.spec.block_n))
    for name in BM_NAMES:  # the CLI's lists are create_block_mask's
        assert np.array_equal(lists[name], getattr(ours, name).numpy()), name


@NEEDS_TOOLKIT
@pytest.mark.parametrize("fields", [dict(head_dim=128, mask_mod="doc[q_idx] == doc[kv_idx] and q_idx >= kv_idx"),
                                    dict(head_dim=64, dtype="bfloat16", consumers=3, mask_mod="q_idx >= kv_idx")],
                         ids=["hd128-document", "hd64-bf16-c3"])
def test_the_block_mask_kernel_builds_for_sm90a_without_spills(fields, build_cache):
    from attngen.build.nvcc import build
    spec = Spec(**fields, block_mask=True)
    r = build(spec, cache_dir=build_cache).report
    assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["stack_frame_bytes"] == 0, r
    assert r["setmaxnreg_applied"] and r["sass"]["HGMMA_A_FROM_REGISTERS"] > 0 and r["sass"]["UTMALDG"] > 0


def test_block_mask_true_as_a_spec_field_takes_the_four_lists_by_name():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    q = rand(1, 130, 1, D, seed=4)
    bm = flex_blocks.create_block_mask(causal, None, None, 130, 130, BLOCK_SIZE=(128, 64))
    lists = {n: getattr(bm, n) for n in BM_NAMES}
    out = attngen.attention(q, q, q, block_mask=True, mask_mod="q_idx >= kv_idx", block_n=64, **lists)
    assert torch.equal(out, attngen.attention(q, q, q, block_mask=bm))
    with pytest.raises(InputError, match="full_kv_indices"):
        attngen.attention(q, q, q, block_mask=True, mask_mod="q_idx >= kv_idx", block_n=64,
                          **{n: t for n, t in lists.items() if n != "full_kv_indices"})


def _document_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_a_block_mask_call_is_differentiable_and_its_gradients_are_the_dense_masks():
    """The backward of a block-mask spec walks its own lists (tests/test_block_mask_backward.py),
    derived from the forward's 128 x 128 ones for its 64 x 128 tiles: the gradients through
    attention(block_mask=) equal those of causal=True bit for bit, and the backward's kernels take
    the transposed q_* lists, not the forward's kv_* ones."""
    from attngen.kernels.bwd.plan import plan_backward
    from attngen.kernels.common.plan import BLOCK_MASK_TENSORS
    from attngen.kernels.bwd.render import call_tensors, render_backward_source
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 100, 1, 64, generator=g).half().requires_grad_() for _ in range(3))
    bm = attngen.create_block_mask(_document_causal, 1, 1, 100, 100, BLOCK_SIZE=(128, 128))
    out = attngen.attention(q, k, v, block_mask=bm)
    (out.float() * torch.arange(64.0)).sum().backward()
    dense = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attngen.attention(*dense, causal=True)
    (ref.float() * torch.arange(64.0)).sum().backward()
    assert same_bits(out.detach().numpy(), ref.detach().numpy())
    for got, want in zip((q, k, v), dense):
        assert got.grad is not None and same_bits(got.grad.numpy(), want.grad.numpy())
    assert q.grad.abs().max() > 0
    bp = plan_backward(Spec(mask_mod="kv_idx <= q_idx", block_mask=True))
    names = {n for n, _, _ in BLOCK_MASK_TENSORS}
    assert bp.forward.spec.block_mask and not names & {t.name for t in call_tensors(bp)}
    assert "Q_indices: T.Tensor" in render_backward_source(bp) and "KV_indices" not in render_backward_source(bp)


def test_hand_written_block_mask_lists_are_checked_on_the_host_and_padding_is_free():
    """Lists the kernels would read out of bounds, visit twice or run unmasked (issue 25: no error,
    output off by 0.5 on the CPU model; out-of-bounds reads on a GPU) are refused, naming the list,
    the entry and the valid range; entries past a row's count are never read and may be anything."""
    q, k, v = (rand(1, 128, 1, D, seed=i) for i in range(3))
    bm = flex_blocks.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 128, 128, BLOCK_SIZE=(64, 64))
    kw = dict(block_mask=True, mask_mod=bm.mask_text, consumers=1, block_n=64)
    good = {n: getattr(bm, n).clone() for n in BM_NAMES}  # Q tile 1: tile 1 partial, tile 0 full

    def edited(name, at, value, **more):
        lists = {n: t.clone() for n, t in good.items()}
        lists[name][at] = value
        for n, (a, x) in more.items():
            lists[n][a] = x
        return lists
    padded = edited("kv_indices", (0, 0, 0, 1), 99, full_kv_indices=((0, 0, 0, 0), -7))  # unread entries
    assert torch.equal(attngen.attention(q, k, v, **kw, **padded), attngen.attention(q, k, v, **kw, **good))
    cases = [
        (edited("kv_indices", (0, 0, 1, 0), 99), r"^kv_indices\[0, 0, 1, 0\] = 99: expected a KV tile index in \[0, 1\]"),
        (edited("full_kv_indices", (0, 0, 1, 0), -1), r"^full_kv_indices\[0, 0, 1, 0\] = -1: .*\[0, 1\]"),
        (edited("kv_num_blocks", (0, 0, 0), 3), r"^kv_num_blocks\[0, 0, 0\] = 3: expected a count of KV tiles in \[0, 2\]"),
        (edited("full_kv_num_blocks", (0, 0, 1), -1), r"^full_kv_num_blocks\[0, 0, 1\] = -1: .*\[0, 2\]"),
        (edited("full_kv_indices", (0, 0, 1, 0), 1), r"^kv_indices\[0, 0, 1\] and full_kv_indices\[0, 0, 1\] = both list KV tile 1"),
        (edited("kv_num_blocks", (0, 0, 1), 2, kv_indices=((0, 0, 1, 1), 1), full_kv_num_blocks=((0, 0, 1), 0)),
         r"^kv_indices\[0, 0, 1\] = KV tile 1 listed 2 times"),
    ]
    for lists, message in cases:
        with pytest.raises(InputError, match=message):
            attngen.attention(q, k, v, **kw, **lists)
    spec = Spec(head_dim=D, consumers=1, block_n=64, mask_mod=bm.mask_text, block_mask=True)
    with pytest.raises(InputError, match=cases[0][1]):  # the backward's lists come from the same four (was an IndexError)
        attngen.emulate_backward(spec, q, k, v, q, out=q, lse=torch.zeros(1, 1, 128), **cases[0][0])
    # keys past kv_len: the last KV tile must be masked (partial); listed full it was off by 0.1
    short = flex_blocks.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 100, 100, BLOCK_SIZE=(64, 64))
    all_full = dict(kv_num_blocks=torch.zeros_like(short.kv_num_blocks), kv_indices=short.kv_indices,
                    full_kv_num_blocks=short.kv_num_blocks + short.full_kv_num_blocks,
                    full_kv_indices=torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32))
    with pytest.raises(InputError, match=r"^full_kv_indices\[0, 0, 0\] = KV tile 1, the last: expected the last KV tile partial"):
        attngen.attention(q[:, :100], k[:, :100], v[:, :100], **dict(kw, mask_mod=short.mask_text), **all_full)


def test_a_reused_block_mask_is_checked_once_and_an_edit_to_it_again(monkeypatch):
    """One BlockMask in every layer: its lists are checked once, not per call (the host copy costs
    up to 50 ms a call, docs/variants.md). A list written in place since (its version counter
    moved) and new tensors, even ones that reuse a dead tensor's id, are checked again."""
    from attngen.run import inputs

    bm = flex_blocks.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 128, 128, BLOCK_SIZE=(64, 64))
    lists = {n: getattr(bm, n).clone() for n in BM_NAMES}
    calls = []
    real = inputs.check_lists_values
    monkeypatch.setattr(inputs, "check_lists_values", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(inputs, "_CHECKED_LISTS", {})
    for _ in range(3):
        inputs.check_block_mask_lists(lists, 2, False)
    assert len(calls) == 1
    lists["kv_indices"][0, 0, 1, 0] = 99  # in place: the version counter moves
    with pytest.raises(InputError, match=r"^kv_indices\[0, 0, 1, 0\] = 99"):
        inputs.check_block_mask_lists(lists, 2, False)
    # a new tensor at a dead checked one's id and version: the weak references tell them apart
    bad = {n: t.clone() for n, t in lists.items()}
    ghosts = {n: t.clone() for n, t in bad.items()}
    inputs._CHECKED_LISTS[inputs.checked_lists_key(bad, 2, False)] = [weakref.ref(ghosts[n]) for n in sorted(ghosts)]
    del ghosts
    with pytest.raises(InputError, match=r"^kv_indices\[0, 0, 1, 0\] = 99"):
        inputs.check_block_mask_lists(bad, 2, False)
