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


@pytest.mark.parametrize("mask", [{"causal": True}, {"window": (64, -1)}, {"window": (64, 0)}, {"causal": True, "window": (48, 0)},
                                  {}])
def test_the_forward_hands_out_a_row_tile_that_sees_the_most_keys_first(mask):
    """Longest first as tiles.py's ranges say: the last row tile under causal attention, the first under
    a left-only window (where reversing the order would put the shortest first)."""
    import attngen
    from attngen.kernels.common.schedulers import sample_frame
    from attngen.kernels.fwd.plan import make_plan
    from attngen.kernels.fwd.render import longest_first

    plan = make_plan(attngen.Spec(head_dim=64, scheduler="persistent", **mask))
    frame = sample_frame(plan, plan.spec.block_m, plan.spec.block_n)
    visits = [frame.row_tile_visits(t) for t in range(frame.q_tiles())]
    _, first = persistent_tile(0, len(visits), 1, 1, longest_first(plan))
    assert visits[first] == max(visits), (visits, first)


def test_a_two_sided_window_keeps_the_natural_order():
    """Under a window open on both sides the interior row tiles see the most keys and both ends fewer:
    the order, which reverses an axis or not, cannot put the longest first, and keeps its natural
    order (the ends tie). Documented in docs/build.md."""
    import attngen
    from attngen.kernels.common.schedulers import sample_frame
    from attngen.kernels.fwd.plan import make_plan
    from attngen.kernels.fwd.render import longest_first

    plan = make_plan(attngen.Spec(head_dim=64, scheduler="persistent", window=(64, 64)))
    frame = sample_frame(plan, plan.spec.block_m, plan.spec.block_n)
    visits = [frame.row_tile_visits(t) for t in range(frame.q_tiles())]
    assert visits[0] == visits[-1] < max(visits) and not longest_first(plan)
