"""The tile-range algebra (attngen/tiles.py) is exact: every range, in both directions, equals what
the dense visibility matrix says (tiles holding any visible entry; tiles wholly visible), and the
expressions render.py emits, evaluated on integers, agree with it."""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attngen import tiles
from attngen.kernels.fwd import render  # FIXME split
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec
from attngen.tiles import Edges, Frame, Rows


def dense(f: Frame):
    """V [rows, keys] over ceildiv(q_len, BM) * BM rows and ceildiv(kv_len, BN) * BN keys; then per
    (Q tile, KV tile): any visible, all visible."""
    nq, nk = -(-f.q_len // f.block_m), max(-(-f.kv_len // f.block_n), 1)
    v = tiles.visible(np.arange(nq * f.block_m)[:, None], np.arange(nk * f.block_n)[None, :], f.q_len, f.kv_len, f.edges)
    blocks = v.reshape(nq, f.block_m, nk, f.block_n)
    return v, blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))


def _expect(any_, all_):
    return list(np.flatnonzero(any_)), list(np.flatnonzero(all_))


def mismatches(f: Frame, row_ranges=()) -> list:
    """Every place the algebra's ranges differ from the dense matrix (empty: exact)."""
    v, a, full = dense(f)
    bad = []
    nk = a.shape[1]
    ranges = [(t * f.block_m, (t + 1) * f.block_m - 1) for t in range(a.shape[0])] + list(row_ranges)
    keys = np.arange(nk * f.block_n)[None, :]
    for r0, r1 in ranges:  # Q rows -> KV tiles (any rows: past q_len they follow the same formula)
        rows = tiles.visible(np.arange(r0, r1 + 1)[:, None], keys, f.q_len, f.kv_len, f.edges)
        block = rows.reshape(r1 - r0 + 1, nk, f.block_n)
        want = _expect(block.any(axis=(0, 2)), block.all(axis=(0, 2)))
        span = f.kv_span(Rows(r0, r1))
        got = (list(span.tiles), list(span.full))
        if got != want:
            bad.append(("kv", r0, r1, got, want))
    for c in range(nk):  # a KV tile -> Q tiles
        want = _expect(a[:, c], full[:, c])
        span = f.q_span(c)
        got = (list(span.tiles), list(span.full))
        if got != want:
            bad.append(("q", c, got, want))
    return bad


def frame(q_len, kv_len, causal, window, bm, bn):
    return Frame.of(q_len, kv_len, tiles.edges(causal, window), bm, bn)


# Explicit edges: lengths and window bounds at tile multiples -1, 0, +1; q_len > kv_len; length 1; no keys.
EDGE_CASES = [
    (1, 1, True, (-1, -1), 64, 64), (1, 300, True, (-1, -1), 128, 128), (300, 100, True, (-1, -1), 128, 64),
    (129, 257, False, (37, 21), 128, 64), (64, 400, False, (270, -1), 64, 64), (64, 400, False, (256, -1), 64, 64),
    (64, 400, False, (255, -1), 64, 64), (64, 400, False, (257, -1), 64, 64), (200, 190, False, (0, 0), 64, 32),
    (333, 200, False, (-1, 5), 192, 80), (128, 128, True, (127, 0), 128, 128), (128, 129, True, (128, 0), 128, 128),
    (127, 128, False, (-1, 63), 64, 64), (100, 0, False, (-1, -1), 64, 64), (100, 0, True, (10, -1), 64, 64),
    (500, 60, True, (-1, -1), 64, 176), (191, 385, True, (129, -1), 192, 128), (65, 65, False, (64, 64), 64, 64),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[str(c) for c in EDGE_CASES])
def test_explicit_edges_are_exact(case):
    f = frame(*case)
    assert mismatches(f, [(0, 0), (f.q_len - 1 if f.q_len else 0, f.q_len + 3), (3, 70)]) == []


def _near_multiples(n):
    return st.one_of(st.integers(1, 600), st.builds(lambda m, d: max(m * n + d, 1), st.integers(0, 6), st.sampled_from([-1, 0, 1])))


@st.composite
def problems(draw):
    bm = draw(st.sampled_from([16, 64, 128, 192]))
    bn = draw(st.sampled_from([16, 32, 64, 80, 128, 176]))
    q_len = draw(_near_multiples(bm))
    kv_len = draw(st.one_of(st.just(0), _near_multiples(bn)))
    edge = st.one_of(st.just(-1), st.integers(0, 700), st.builds(lambda m, d: max(m * bn + d, 0), st.integers(0, 5),
                                                                  st.sampled_from([-1, 0, 1])))
    window = (draw(edge), draw(edge))
    r0 = draw(st.integers(0, max(q_len - 1, 0)))
    r1 = draw(st.integers(r0, -(-q_len // bm) * bm - 1 if q_len else 0))
    return (q_len, kv_len, draw(st.booleans()), window, bm, bn), (r0, r1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@example(((64, 400, False, (270, -1), 64, 64), (0, 63)))
def test_hypothesis_drawn_problems_are_exact_both_ways(drawn):
    case, rows = drawn
    f = frame(*case)
    assert mismatches(f, [rows] if f.q_len else []) == []


# -- a wrong algebra is caught: each mutant is an off-by-one in one bound -----------------------
def _shift(method, d):
    def wrong(self, *args, **kw):
        return method(self, *args, **kw) + d
    return wrong


@pytest.mark.parametrize("name, d", [("kv_first", 1), ("kv_stop", -1), ("kv_full_first", -1), ("kv_full_stop", 1),
                                     ("q_first", 1), ("q_stop", 1), ("q_full_first", -1), ("q_full_stop", 1)])
def test_an_off_by_one_in_any_bound_is_caught(monkeypatch, name, d):
    cases = [frame(*c) for c in EDGE_CASES]
    assert all(mismatches(f) == [] for f in cases)
    monkeypatch.setattr(Frame, name, _shift(getattr(Frame, name), d))
    assert any(mismatches(f) for f in cases), f"{name} {d:+d} went unnoticed"


def test_an_off_by_one_in_the_visibility_itself_is_caught(monkeypatch):
    """The dense matrix is not the algebra restated: move the left edge by one key and the ranges disagree."""
    f = frame(64, 400, False, (270, -1), 64, 64)  # the last row's left edge at a tile multiple + 1
    assert mismatches(f) == []
    good = tiles.visible
    monkeypatch.setattr(tiles, "visible", lambda i, j, q, k, e: good(i, j, q, k, Edges(e.left + 1, e.right)))
    assert mismatches(f)


# -- the builder: one definition, ints or text -------------------------------------------------
def test_the_builder_folds_only_what_is_proven():
    q0, off = tiles.Sym("q0", 0), tiles.Sym("causal_offset")
    assert tiles.text(tiles.add(q0, off, 0)) == "q0 + causal_offset"
    assert tiles.text(tiles.add(q0, tiles.Sym("BLOCK_M", 1), -1, 1, off)) == "q0 + BLOCK_M + causal_offset"
    assert tiles.text(tiles.add(q0, tiles.Sym("WG_ROWS", 1), -1, off, -511)) == "q0 + WG_ROWS - 1 + causal_offset - 511"
    assert tiles.text(tiles.mul(q0, 1)) == "q0" and tiles.mul(q0, 0) == 0
    assert tiles.max_(3, 5) == 5 and tiles.min_(3, 5) == 3 and tiles.ceildiv(-5, 4) == -1 and tiles.floordiv(-5, 4) == -2
    assert tiles.text(tiles.max_(tiles.add(q0, 1), 1)) == "q0 + 1"  # q0 >= 0: proven
    assert tiles.text(tiles.max_(tiles.add(q0, off), 1)) == "T.max(q0 + causal_offset, 1)"  # offset unknown: kept
    f_int = frame(300, 100, True, (50, -1), 128, 64)
    env = {"q0": 128, "causal_offset": -200, "kv_len": 100, "BLOCK_N": 64, "BLOCK_M": 128, "q_len": 300}
    sym = Frame(tiles.Sym("q_len", 1), tiles.Sym("kv_len", 1), off, f_int.edges, tiles.Sym("BLOCK_M", 1), tiles.Sym("BLOCK_N", 1))
    rows_s, rows_i = Rows(q0, tiles.add(q0, tiles.Sym("BLOCK_M", 1), -1)), Rows(128, 255)
    for name in ("kv_first", "kv_stop", "kv_full_first", "kv_full_stop"):
        assert tiles.evaluate(getattr(sym, name)(rows_s), env) == getattr(f_int, name)(rows_i), name
    for name in ("q_first", "q_stop", "q_full_first", "q_full_stop"):
        env["kt"] = 1
        assert tiles.evaluate(getattr(sym, name)(tiles.Sym("kt", 0)), env) == getattr(f_int, name)(1), name


# -- render's emitted text, evaluated, agrees with the dense matrix ------------------------------
class _T:
    """The integer T.* the tile-range expressions use, on Python ints (floor division)."""
    min, max = staticmethod(min), staticmethod(max)
    floordiv = staticmethod(lambda a, b: a // b)
    ceildiv = staticmethod(lambda a, b: -(-a // b))


def _eval(text, env):
    return eval(text.split("  #")[0], {"T": _T}, env)


def render_mismatches(plan, q_len, kv_len) -> list:
    """For each block and warpgroup: the visits the emitted n_tiles/first_tile give, and which of them
    the emitted full_tiles/lead mask, against the dense visibility of the spec's edges. Packed GQA
    rows r are query positions r // GQA_GROUP; a split plan is checked as one split (its shares:
    test_split_shares_cover_the_block_once)."""
    spec = plan.spec
    group = spec.gqa_group if plan.pack_gqa else 1
    e = tiles.edges(spec.causal, spec.window)
    bn = spec.block_n
    nk = max(-(-kv_len // bn), 1)
    n_rows = -(-q_len * group // spec.block_m) * spec.block_m
    v = tiles.visible((np.arange(n_rows) // group)[:, None], np.arange(nk * bn)[None, :], q_len, kv_len, e)
    env0 = {"q_len": q_len, "kv_len": kv_len, "causal_offset": kv_len - q_len, "BLOCK_M": spec.block_m,
            "BLOCK_N": bn, "WG_ROWS": plan.wg_rows, "GQA_GROUP": spec.gqa_group}
    bad = []
    for q0 in range(0, q_len * group, spec.block_m):
        env = dict(env0, q0=q0)
        first = _eval(render.first_tile_expr(plan), env) if render.first_tile_expr(plan) else 0
        env["first_tile"] = first
        n = _eval(render.n_tiles_expr(plan), env)
        block = v[q0:q0 + spec.block_m].reshape(spec.block_m, nk, bn).any(axis=(0, 2))
        want = list(np.flatnonzero(block))
        if (list(range(first, first + n)) != want) if want else not (n == 1 and first >= 0):
            bad.append(("visits", q0, first, n, want))
        for row0 in range(0, spec.block_m, plan.wg_rows):
            if (q0 + row0) // group >= q_len:  # a warpgroup of padding rows only: computed, never stored
                continue
            env["row0"] = row0
            full_tiles = _eval(render.full_tiles_expr(plan), env)
            lead = _eval(render.lead_tiles_expr(plan), env) if render.lead_tiles_expr(plan) else 0
            rows = v[q0 + row0:q0 + row0 + plan.wg_rows].reshape(plan.wg_rows, nk, bn)
            for k in range(n):
                t = first + k
                whole = kv_len > 0 and bool(rows[:, t].all())
                if (k < lead or k >= full_tiles) == whole:
                    bad.append(("mask", q0, row0, t, whole))
    return bad


RENDER_SPECS = [dict(causal=True), dict(), dict(window=[511, -1], causal=True), dict(window=[37, 21]),
                dict(window=[0, 0]), dict(window=[-1, 5]), dict(window=[256, -1], block_n=64),
                dict(window=[130, 300], causal=True), dict(window=[1, -1], block_n=64),
                dict(layout="varlen", causal=True), dict(layout="varlen"), dict(layout="varlen", window=[-1, 5]),
                dict(layout="varlen", window=[40, 0]), dict(splits=3, causal=True), dict(splits=2),
                dict(splits=2, causal=True, gqa_group=4, consumers=1), dict(causal=True, gqa_group=2, consumers=3)]
LENGTHS = [(1, 1), (300, 100), (100, 300), (129, 257), (64, 400), (256, 256), (255, 257), (700, 650)]
EMPTY = [(5, 0), (1, 0), (130, 0)]  # a sequence (or split) with no key: one fully masked visit


@pytest.mark.parametrize("fields", RENDER_SPECS, ids=[str(s) for s in RENDER_SPECS])
def test_render_ranges_match_the_dense_matrix(fields):
    plan = make_plan(Spec(head_dim=64, **fields))
    per_sequence = fields.get("layout") == "varlen" or "splits" in fields
    for q_len, kv_len in LENGTHS + (EMPTY if per_sequence else []):
        assert render_mismatches(plan, q_len, kv_len) == [], (q_len, kv_len)


@st.composite
def render_problems(draw):
    bn = draw(st.sampled_from([64, 128]))
    edge = st.one_of(st.just(-1), st.integers(0, 600), st.builds(lambda m, d: max(m * bn + d, 0), st.integers(0, 4),
                                                                  st.sampled_from([-1, 0, 1])))
    fields = dict(head_dim=64, block_n=bn, consumers=draw(st.integers(1, 3)), causal=draw(st.booleans()),
                  window=[draw(edge), draw(edge)], layout=draw(st.sampled_from(["bshd", "varlen"])))
    lengths = st.one_of(st.integers(1, 700), st.builds(lambda m, d: max(m * 64 + d, 1), st.integers(1, 10),
                                                       st.sampled_from([-1, 0, 1])))
    kv = st.one_of(st.just(0), lengths) if fields["layout"] == "varlen" else lengths
    return fields, draw(lengths), draw(kv)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(render_problems())
def test_hypothesis_drawn_kernels_emit_exact_ranges(drawn):
    fields, q_len, kv_len = drawn
    # The ranges do not depend on registers: a drawn block_n the register budget refuses (3
    # consumers, 128 keys, a diagonal mask) still emits ranges worth checking.
    assert render_mismatches(make_plan(Spec(**fields), check_registers=False), q_len, kv_len) == []


@pytest.mark.parametrize("q_len, kv_len", [(100, 300), (128, 128), (300, 100)])
def test_render_ranges_of_static_shapes_match(q_len, kv_len):
    """A static shape lets the builder drop a clamp it proves redundant; the ranges stay exact."""
    plan = make_plan(Spec(head_dim=64, causal=True), Shape(batch=1, heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len))
    assert render_mismatches(plan, q_len, kv_len) == []


def test_render_mismatches_catches_an_emitted_off_by_one(monkeypatch):
    plan = make_plan(Spec(head_dim=64, window=[270, -1], consumers=1))
    assert render_mismatches(plan, 64, 400) == []
    good = render.lead_tiles_expr
    monkeypatch.setattr(render, "lead_tiles_expr", lambda p: good(p).replace("WG_ROWS - 1", "WG_ROWS - 2"))
    assert render_mismatches(plan, 64, 400)


@pytest.mark.parametrize("n_block, splits", [(1, 1), (1, 4), (7, 3), (8, 4), (9, 4), (5, 8)])
def test_split_shares_cover_the_block_once(n_block, splits):
    """The emitted split shares, evaluated: disjoint, in order, covering [0, n_block); an empty split runs one visit."""
    ex = render.split_exprs(make_plan(Spec(head_dim=64, causal=True, splits=2)))
    seen = []
    for s in range(splits):
        env = {"n_block_tiles": n_block, "num_splits": splits, "split_idx": s}
        env["tiles_per_split"] = _eval(ex["split_tiles_per"], env)
        env["first_tile"] = _eval(ex["split_first"], env)
        n = _eval(ex["split_n_tiles"], env)
        exact = max(tiles.split_count(n_block, env["first_tile"], env["tiles_per_split"]), 0)
        assert n == max(exact, 1)
        seen += list(range(env["first_tile"], env["first_tile"] + exact))
    assert seen == list(range(n_block))


def test_a_varlen_sequence_with_no_key_under_a_right_only_window_runs_on_the_cpu_model():
    """Before the algebra had one home, this kernel's n_tiles was 0 for a sequence with no key (its
    comment said >= 1) and the CPU model deadlocked at the consumer's first k_full wait."""
    import attngen
    from attngen.reference.forward import check_close, round_to

    spec = attngen.Spec(head_dim=64, layout="varlen", window=[-1, 5], consumers=1)
    rng = np.random.default_rng(0)
    cu_q, cu_k = np.array([0, 10, 40], np.int32), np.array([0, 0, 90], np.int32)  # sequence 0 has no key
    q, k, v = (round_to(rng.standard_normal(s), "float16") for s in [(40, 1, 64), (90, 1, 64), (90, 1, 64)])
    out = np.asarray(attngen.emulate(spec, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30))
    assert np.all(out[:10] == 0)
    assert check_close(out[None, 10:40], q[None, 10:40], k[None], v[None], False, dtype="float16", window=(-1, 5)).ok


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700), st.integers(0, 8)), min_size=1, max_size=8),
       st.booleans(), st.sampled_from([(-1, -1), (0, 0), (37, -1), (-1, 50), (200, 3)]),
       st.sampled_from([(128, 128), (64, 176), (128, 64), (16, 16)]))
def test_the_array_valued_frame_agrees_with_the_scalar_one(rows, causal, window, blocks):
    """Frame with torch tensor lengths (the varlen order's visit counts) computes each element as the
    scalar Frame does: row_tile_visits, kv_first, kv_stop and rows_see_any, row tiles past q_len too."""
    import torch

    e = tiles.edges(causal, window)
    q, k, t = (torch.tensor([r[i] for r in rows]) for i in range(3))
    frame = Frame(q, k, k - q, e, *blocks)
    span = Rows(t * blocks[0], (t + 1) * blocks[0] - 1)
    got = [frame.row_tile_visits(t), frame.kv_first(span), frame.kv_stop(span), frame.rows_see_any(span)]
    for n, (ql, kl, tile) in enumerate(rows):
        one = Frame.of(ql, kl, e, *blocks)
        rs = Rows(tile * blocks[0], (tile + 1) * blocks[0] - 1)
        want = [len(one.kv_span(Rows(tile * blocks[0], min(ql, (tile + 1) * blocks[0]) - 1)).tiles),
                one.kv_first(rs), one.kv_stop(rs), one.rows_see_any(rs)]
        assert [int(g) if isinstance(g, int) else int(g[n]) for g in got] == [int(w) for w in want], (ql, kl, tile)
