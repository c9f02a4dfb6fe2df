"""The backward of a block-mask spec (docs/backward.md, "Block masks"): its main kernel walks the
transposed lists (q_num_blocks, q_indices, full_q_*: per KV tile its partial and full Q tiles),
its deterministic dq kernel the kv_* lists, each over its own tiles (tiles.backward_lists).

The evidence, for hypothesis-drawn mask_mods (causal, a sliding window, documents from random
boundaries, prefix-LM, random block sparsity through a tensor), on the CPU model:
- the gradients equal the dense mask_mod backward's bit for bit. Deterministic: by the promise.
  Otherwise too, and asserted: dK and dV are register sums in one Q-tile order in both kernels,
  and dQ's reduce-adds land block after block in the CPU model's block order (the same for both
  runs: same grid, same seed), the skipped tiles adding exact zeros. On a GPU the reduce-adds'
  order is free, so there only check_grads (asserted here as well) holds;
- each main-kernel block loaded exactly its KV tile's non-empty Q tiles (Stats.q_tiles_by_cta);
  a KV tile that no Q tile sees loads none and still writes dK = dV = 0 (outputs start NaN);
- three mutants of the emitted backward are caught: a full tile treated as empty, a partial tile
  run without the mask, q_indices read one row off.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngen import tiles
from attngen.interfaces import flex_blocks, flex_mods
from attngen.emulator import emulate_backward
from attngen.emulator.driver import Stats
from attngen.kernels.bwd.plan import plan_backward
from attngen.reference.forward import variant_of
from attngen.reference.backward import check_grads
from attngen.kernels.bwd.render import render_backward_source
from attngen.spec import Spec, SpecError
from test_block_mask import BM_NAMES, mask_of, same_bits

D = 64
TILE = (64, 128)  # the forward's tile, which is also the backward main kernel's at head_dim 64 (asserted)
KINDS = ["causal", "window", "prefix_lm", "document", "random"]


def specs(text: str, det: bool):
    fields = dict(head_dim=D, consumers=1, block_n=TILE[1], mask_mod=text, deterministic=det)
    return Spec(**fields, block_mask=True), Spec(**fields)


def inputs(heads, q_len, kv_len, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, n, heads, D)).astype(np.float16) for n in (q_len, kv_len, kv_len, q_len))
    return q, k, v, do


def run(fn, heads, q_len, kv_len, det, seed=0, source=None):
    """(block-mask grads, dense grads, the block-mask run's Stats, the BlockMask, inputs, specs)."""
    bm = flex_blocks.create_block_mask(fn, None, None, q_len, kv_len, BLOCK_SIZE=TILE)
    sparse, dense = specs(bm.mask_text, det)
    q, k, v, do = inputs(heads, q_len, kv_len, seed)
    mod = {n: t.numpy() for n, t in bm.mask_tensors.items()}
    lists = {n: getattr(bm, n).numpy() for n in BM_NAMES}
    stats = Stats()
    got = emulate_backward(sparse, q, k, v, do, seed=seed, stats=stats, source=source, **mod, **lists)
    want = emulate_backward(dense, q, k, v, do, seed=seed, **mod)
    return got, want, stats, bm, (q, k, v, do), (sparse, dense), mod


def expected_q_loads(bm, heads) -> dict:
    """Q tiles each main-kernel block (x = KV tile, y = head) loads: its non-empty ones (none: no entry)."""
    nonempty = (bm.states[0, 0] != tiles.EMPTY).sum(axis=0)  # per KV tile
    return {("build_kernel", x, y, 0): int(n) for y in range(heads) for x, n in enumerate(nonempty) if n}


def unseen_keys(bm, kv_len):
    seen = (bm.states[0, 0] != tiles.EMPTY).any(axis=0)
    return [j for j in range(kv_len) if not seen[j // TILE[1]]]


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(KINDS), st.integers(1, 300), st.integers(1, 300), st.integers(1, 2), st.booleans(), st.data())
def test_block_mask_backward_equals_the_dense_mask_mods_and_loads_only_listed_q_tiles(kind, q_len, kv_len, heads, det, data):
    fn = mask_of(kind, q_len, kv_len, data.draw)
    got, want, stats, bm, (q, k, v, do), (sparse, dense), mod = run(fn, heads, q_len, kv_len, det)
    bp = plan_backward(sparse)
    assert (bp.block_m, bp.block_n) == TILE  # so bm.states are the main kernel's tiles
    assert same_bits(tuple(got), tuple(want))
    if not det:  # what holds on a GPU too, whatever order the reduce-adds take
        variant = variant_of(sparse, None, None, mod)
        checks = check_grads(dict(zip(("dq", "dk", "dv"), got)), q, k, v, do, False, dtype="float16", **variant)
        assert all(c.ok for c in checks.values()), {n: str(c) for n, c in checks.items()}
    main = {key: n for key, n in stats.q_tiles_by_cta.items() if key[0] == "build_kernel"}
    assert main == expected_q_loads(bm, heads)
    dead = unseen_keys(bm, kv_len)
    assert np.all(got[1][0, dead] == 0) and np.all(got[2][0, dead] == 0)  # written (outputs start NaN), zero


def test_a_kv_tile_no_q_tile_sees_loads_nothing_and_writes_zero_gradients():
    fn = mask_of("prefix_lm", 100, 300, lambda s: 0)  # kv_idx < 0 | q_idx >= kv_idx: keys 100.. are seen by no row
    got, want, stats, bm, *_ = run(fn, 1, 100, 300, False)
    assert ("build_kernel", 1, 0, 0) not in stats.q_tiles_by_cta and ("build_kernel", 2, 0, 0) not in stats.q_tiles_by_cta
    assert np.all(got[1][0, 128:] == 0) and np.all(got[2][0, 128:] == 0) and np.abs(got[1][0, :100]).max() > 0
    assert same_bits(tuple(got), tuple(want))


def _document(b, h, q_idx, kv_idx):
    return (q_idx // 256 == kv_idx // 256) & (q_idx >= kv_idx)  # full tiles, diagonal ones and empty ones


DOC_TEXT = flex_mods.translate(_document, "mask_mod").text
MUTANTS = {  # (what, the emitted text, its mutant)
    "a full tile treated as empty": ("bm_full_n = Full_q_num_blocks[bm_b, bm_h, kv_block]",
                                     "bm_full_n = 0 * Full_q_num_blocks[bm_b, bm_h, kv_block]"),
    "a partial tile run without the mask": ("if partial:", "if False:"),
    "q_indices read one row off": ("Q_indices[bm_b, bm_h, kv_block,", "Q_indices[bm_b, bm_h, T.min(kv_block + 1, bm_kv_tiles - 1),"),
}


@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_mutant_of_the_block_mask_backward_is_caught(mutant, det):
    text = render_backward_source(specs(DOC_TEXT, det)[0])
    old, new = MUTANTS[mutant]
    assert old in text
    got, want, stats, bm, *_ = run(_document, 1, 520, 520, det)
    assert same_bits(tuple(got), tuple(want)) and stats.q_tiles_by_cta  # the checks pass unmutated
    bad, want, bad_stats, bm, *_ = run(_document, 1, 520, 520, det, source=text.replace(old, new))
    main = {key: n for key, n in bad_stats.q_tiles_by_cta.items() if key[0] == "build_kernel"}
    assert not (same_bits(tuple(bad), tuple(want)) and main == expected_q_loads(bm, 1))


def test_the_deterministic_dq_kernel_reads_its_own_kv_lists():
    """The dq kernel's walk: its KV tiles are the kv_* lists over its 128 x 64 tiles; a row read one
    off is caught."""
    text = render_backward_source(specs(DOC_TEXT, True)[0])
    old = "KV_indices[bm_b, bm_h, q_block,"
    assert old in text
    bad, want, stats, bm, *_ = run(_document, 1, 520, 520, True,
                                   source=text.replace(old, "KV_indices[bm_b, bm_h, T.min(q_block + 1, bm_dq_q_tiles - 1),"))
    assert not same_bits(bad[0], want[0]) and same_bits(bad[1], want[1])  # dQ alone is the dq kernel's
    got, want, stats, bm, *_ = run(_document, 1, 520, 520, True)
    assert same_bits(tuple(got), tuple(want))
    # K tiles per dq block (k_tiles_by_cta: the last launch that loads K, the dq kernel): its non-empty ones
    dq_states = tiles.retile_states(bm.states, TILE, (128, 64), (520, 520))[0, 0]
    loads = {key: n for key, n in stats.k_tiles_by_cta.items() if n}  # (the preprocess's blocks load none)
    assert loads == {(x, 0, 0): int(n) for x, n in enumerate((dq_states != tiles.EMPTY).sum(axis=1)) if n}
    assert sum(stats.k_tiles_by_cta.values()) < 5 * 9  # fewer than every tile


def test_deterministic_gqa_with_a_block_mask_is_refused():
    with pytest.raises(SpecError, match="deterministic"):
        plan_backward(Spec(head_dim=D, gqa_group=2, mask_mod="q_idx >= kv_idx", block_mask=True, deterministic=True))


# -- the tile algebra the backward's lists come from ---------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.sampled_from([16, 48, 64, 128]), st.sampled_from([16, 80, 128]),
       st.sampled_from([64, 128, 192]), st.sampled_from([64, 80, 112, 128]), st.integers(0, 2**16))
def test_retiling_at_any_sizes_is_exact_and_the_lists_invert(q_len, kv_len, bq, bk, kq, kk, seed):
    vis = np.random.default_rng(seed).random((2, 1, q_len, kv_len)) < 0.3
    vis |= np.tril(np.ones((q_len, kv_len), bool), -60)
    states = tiles.tile_states(vis, bq, bk)
    lists = tiles.mask_lists(states)
    nq, nk = states.shape[-2:]
    assert np.array_equal(tiles.list_states(lists["kv_num_blocks"], lists["kv_indices"], lists["full_kv_num_blocks"],
                                            lists["full_kv_indices"], nk), states)
    assert np.array_equal(np.swapaxes(tiles.list_states(lists["q_num_blocks"], lists["q_indices"], lists["full_q_num_blocks"],
                                                        lists["full_q_indices"], nq), -1, -2), states)
    got = tiles.retile_states(states, (bq, bk), (kq, kk), (q_len, kv_len))
    exact = tiles.tile_states(vis, kq, kk)
    assert got.shape == exact.shape
    assert np.all(exact[got == tiles.EMPTY] == tiles.EMPTY) and np.all(exact[got == tiles.FULL] == tiles.FULL)
    assert not np.any((got == tiles.EMPTY) & (exact != tiles.EMPTY))
    if kq % bq == 0 and kk % bk == 0:  # coarsening by whole blocks loses nothing
        assert np.array_equal(got, exact)
    back = tiles.backward_lists({n: lists[n] for n in BM_NAMES}, (bq, bk), (q_len, kv_len), (kq, kk))
    assert np.array_equal(np.swapaxes(tiles.list_states(back["q_num_blocks"], back["q_indices"], back["full_q_num_blocks"],
                                                        back["full_q_indices"], got.shape[-2]), -1, -2), got)


def test_the_backward_without_the_forwards_lists_is_an_input_error():
    from attngen.reference.forward import InputError
    sparse, _ = specs("q_idx >= kv_idx", False)
    q, k, v, do = inputs(1, 70, 70, 0)
    with pytest.raises(InputError, match="kv_num_blocks"):
        emulate_backward(sparse, q, k, v, do, out=np.zeros_like(do), lse=np.zeros((1, 1, 70), np.float32))
