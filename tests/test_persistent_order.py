"""The persistent schedule's order (schedulers.persistent_tile): each tile handed out once, row
tiles longest-first inside each L2 section, and the kernel's text equal to the Python rule."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from attngen import tiles
from attngen.hw import L2_KV_BYTES
from attngen.kernels.common.schedulers import persistent_tile, section_heads

shapes = st.tuples(st.integers(1, 9), st.integers(1, 11), st.integers(1, 12), st.booleans())


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_every_tile_is_handed_out_exactly_once(shape):
    m_blocks, heads_total, section, longest_first = shape
    order = [persistent_tile(i, m_blocks, heads_total, section, longest_first) for i in range(m_blocks * heads_total)]
    assert sorted(order) == list(itertools.product(range(heads_total), range(m_blocks)))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_sections_keep_their_heads_together_and_run_longest_first(shape):
    m_blocks, heads_total, section, longest_first = shape
    order = [persistent_tile(i, m_blocks, heads_total, section, longest_first) for i in range(m_blocks * heads_total)]
    for start in range(0, len(order), section * m_blocks):
        chunk = order[start:start + section * m_blocks]
        heads = sorted({bh for bh, _ in chunk})
        assert heads == list(range(start // m_blocks, start // m_blocks + len(heads)))  # one contiguous section
        rows = [m for _, m in chunk]
        assert rows == sorted(rows, reverse=longest_first)  # row tile by row tile, across the section


def test_the_kernel_text_is_the_same_rule():
    names = [tiles.Sym(n) for n in ("tile_idx", "m_blocks", "heads_total", "section")]
    exprs = persistent_tile(*names, longest_first=True)
    for m_blocks, heads_total, section in [(3, 5, 2), (7, 4, 8), (1, 1, 1)]:
        for i in range(m_blocks * heads_total):
            env = {"tile_idx": i, "m_blocks": m_blocks, "heads_total": heads_total, "section": section}
            assert tuple(tiles.evaluate(e, env) for e in exprs) == persistent_tile(i, m_blocks, heads_total, section, True)


@pytest.mark.parametrize("kv_len, per_key, group, want", [
    (4096, 512, 1, 16),  # 2 MiB per KV head: 16 fit in 32 MiB
    (3000, 512, 1, 16),  # 21.8 fit: rounded down to a power of two
    (4096, 512, 4, 64),  # each KV head serves 4 query heads
    (2**20, 512, 1, 1),  # one head's K/V exceeds the budget: still one head per section
])
def test_section_heads(kv_len, per_key, group, want):
    assert section_heads(kv_len, per_key, group) == want
    assert (want // group) * kv_len * per_key <= L2_KV_BYTES or want == group
