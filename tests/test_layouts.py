"""Layout objects (kernels/common/layouts.py) and the scheduler seam (kernels/common/schedulers.py).

Each layout must give the index and box text its kernels need (a wrong layout's text names the
wrong rows: a dense box has no q_start, a packed one no batch_idx); layout_of must choose the
layout the serving fields describe; the single-tile scheduler must print today's phases, and
every phase of the templates must come from it; and no renderer may test the plan's layout
fields itself.
"""

import ast
import re
from pathlib import Path

import pytest

from attngen.kernels.bwd import render as bwd_render
from attngen.kernels.bwd.render import render_backward_source
from attngen.kernels.combine.render import combine_context
from attngen.kernels.common import schedulers
from attngen.kernels.common.layouts import Dense, Paged, PagedVarlen, Varlen, layout_of
from attngen.kernels.fwd import render
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("fields, kind, split_kv, pack_gqa", [
    ({}, Dense, False, False),
    (dict(layout="varlen"), Varlen, False, False),
    (dict(paged_kv=True), Paged, False, False),
    (dict(layout="varlen", paged_kv=True, page_size=256), PagedVarlen, False, False),
    (dict(splits=2), Dense, True, False),
    (dict(splits="auto", gqa_group=4, consumers=1), Dense, True, True),
    (dict(layout="varlen", splits=4), Varlen, True, False),
    (dict(paged_kv=True, splits=2, gqa_group=2, consumers=1), Paged, True, True),
])
def test_layout_of_picks_the_serving_layout(fields, kind, split_kv, pack_gqa):
    layout = layout_of(make_plan(Spec(**fields)))
    assert type(layout) is kind and (layout.split_kv, layout.pack_gqa) == (split_kv, pack_gqa)


def test_paged_layout_carries_its_page():
    layout = layout_of(make_plan(Spec(paged_kv=True, page_size=256, head_dim=64)))
    assert layout.constants() == ["PAGE_SIZE = 256  # keys per page of the K/V cache",
                                  f"TILES_PER_PAGE = {256 // layout.block_n}  # a K/V tile is one TMA box inside one page"]
    assert layout_of(make_plan(Spec())).constants() == []


# (layout, question, exact text): each answer names the rows a wrong layout would get wrong
INDEXES = [
    (Dense(), "q_box", ("m0", "m0 + BLOCK_M"), "batch_idx, m0:m0 + BLOCK_M, head"),
    (Varlen(), "q_box", ("m0", "m0 + BLOCK_M"), "q_start + m0:q_start + m0 + BLOCK_M, head"),
    (Dense(), "q_at", ("r0 + i",), "batch_idx, r0 + i, head"),
    (Varlen(), "q_at", ("r0 + i",), "q_start + r0 + i, head"),
    (Dense(), "row_box", ("m0", "m0 + BLOCK_M"), "batch_idx, head, m0:m0 + BLOCK_M"),
    (Varlen(), "row_box", ("m0", "m0 + BLOCK_M"), "head, q_start + m0:q_start + m0 + BLOCK_M"),
    (Varlen(), "row_at", ("r0 + i",), "head, q_start + r0 + i"),
    (Dense(), "k_box", ("kv0", "kv0 + BLOCK_N"), "batch_idx, kv0:kv0 + BLOCK_N, kv_head"),
    (Varlen(), "k_box", ("kv0", "kv0 + BLOCK_N"), "k_start + kv0:k_start + kv0 + BLOCK_N, kv_head"),
    (Varlen(), "k_at", ("key0 + i",), "k_start + key0 + i, kv_head"),
    (Dense(), "q_clamped_at", ("r0 + i",), "batch_idx, T.min(r0 + i, q_len - 1), head"),
    (Varlen(), "q_clamped_at", ("r0 + i",), "T.min(q_start + r0 + i, total_q - 1), head"),
    (Varlen(), "row_clamped_at", ("r0 + i",), "head, T.min(q_start + r0 + i, total_q - 1)"),
    (Dense(), "kv_box", ("(first_tile + k)",), "batch_idx, (first_tile + k) * BLOCK_N:((first_tile + k) + 1) * BLOCK_N, kv_head, :"),
    (Varlen(), "kv_box", ("k",), "k_start + k * BLOCK_N:k_start + (k + 1) * BLOCK_N, kv_head, :"),
    (Paged(page_size=256, block_n=128), "kv_box", ("k",), "page, page_row:page_row + BLOCK_N, kv_head, :"),
    (Dense(split_kv=True), "out_index", ("q0 + row0 + i", "head"), "split_idx, batch_idx, q0 + row0 + i, head, j"),
    (PagedVarlen(page_size=256, block_n=128), "out_index", ("q0 + row0 + i", "head"), "q_start + q0 + row0 + i, head, j"),
    (Varlen(split_kv=True), "lse_index", ("q0 + row0 + i", "head"), "split_idx, head, q_start + q0 + row0 + i"),
    (Dense(), "lse_index", ("q0 + row0 + i", "head"), "batch_idx, head, q0 + row0 + i"),
    (Varlen(pack_gqa=True), "q_pack_index", (),
     "T.min(q_start + (q0 + row0 + r) // GQA_GROUP, total_q - 1), head + (q0 + row0 + r) % GQA_GROUP, d"),
    (Dense(pack_gqa=True), "q_pack_index", (),
     "batch_idx, T.min((q0 + row0 + r) // GQA_GROUP, q_len - 1), head + (q0 + row0 + r) % GQA_GROUP, d"),
]


@pytest.mark.parametrize("layout, method, args, text", INDEXES, ids=[f"{type(x[0]).__name__}.{x[1]}-{i}" for i, x in enumerate(INDEXES)])
def test_layout_index_text(layout, method, args, text):
    assert getattr(layout, method)(*args) == text


@pytest.mark.parametrize("layout, dims, shapes", [
    (Dense(), ["batch", "q_len", "kv_len", "kv_heads"],
     (["batch", "q_len", "heads", "D"], ["batch", "kv_len", "kv_heads", "D"], ["batch", "heads", "q_len"])),
    (Varlen(), ["batch", "total_q", "total_k", "kv_heads"],
     (["total_q", "heads", "D"], ["total_k", "kv_heads", "D"], ["heads", "total_q"])),
    (Paged(split_kv=True), ["batch", "q_len", "kv_heads", "num_pages", "max_pages", "num_splits"],
     (["batch", "q_len", "heads", "D"], ["num_pages", "PAGE_SIZE", "kv_heads", "D"], ["batch", "heads", "q_len"])),
    (PagedVarlen(), ["batch", "total_q", "kv_heads", "num_pages", "max_pages"],
     (["total_q", "heads", "D"], ["num_pages", "PAGE_SIZE", "kv_heads", "D"], ["heads", "total_q"])),
])
def test_layout_shapes_and_dims(layout, dims, shapes):
    assert layout.dims() == dims
    assert (layout.q_shape("D"), layout.kv_shape("D"), layout.lse_shape()) == shapes


def test_block_setup_binds_each_layouts_sequence():
    paged = PagedVarlen(split_kv=True, page_size=256, block_n=128).block_setup(offset=True)
    assert [line.split(" = ")[0] for line in paged] == [
        "kv_head", "batch_idx", "split_idx", "q_start", "q_len", "kv_len", "last_page", "causal_offset"]
    assert paged[5] == "kv_len = seqused_k[batch_idx]"
    varlen = Varlen().block_setup(offset=False)
    assert [line.split(" = ")[0] for line in varlen] == ["kv_head", "q_start", "q_len", "k_start", "kv_len"]
    assert Dense(pack_gqa=True).block_setup(offset=True) == [
        "head = kv_head * GQA_GROUP  # packed GQA: row r is query r // GQA_GROUP of head head + r % GQA_GROUP"]
    assert Paged().kv_tile_setup("k")[0] == ("page = block_table[batch_idx, T.min(k // TILES_PER_PAGE, last_page)]"
                                             "  # the page holding this tile")
    assert Varlen().guard_count("n", "kv0", "kv_len") == "T.if_then_else(kv0 < kv_len, n, 0)"
    assert Dense().guard_count("n", "kv0", "kv_len") == "n"


@pytest.mark.parametrize("fields, lines", [
    (dict(paged_kv=True), ["T.tma_copy(K[page, page_row:page_row + BLOCK_N, kv_head, :]", "kv_len = seqused_k[batch_idx]"]),
    (dict(layout="varlen"), ["T.tma_copy(Q[q_start + q0:q_start + q0 + 64, head, :]",
                             "O[q_start + q0 + row0 + i, head, j] = O_shared[g, i, j]"]),
    (dict(splits=2, gqa_group=4, consumers=1), [
        "with T.Kernel(T.ceildiv(q_len * GQA_GROUP, BLOCK_M), kv_heads, batch * num_splits, threads=THREADS)"
        " as (q_block, kv_head, batch_split):",
        "Q_shared[g, r, d] = Q[batch_idx, T.min((q0 + row0 + r) // GQA_GROUP, q_len - 1),"
        " head + (q0 + row0 + r) % GQA_GROUP, d]"]),
])
def test_the_forward_kernel_prints_its_layouts_text(fields, lines):
    source = render_source(Spec(**fields))
    for line in lines:
        assert line in source


def test_combine_kernel_indexes_through_the_same_layout():
    names = combine_context(make_plan(Spec(layout="varlen", splits=2, lse=True)), "HEAD_DIM")
    assert names["partial_lse"] == "LSE_partial[s, head, T.min(r0 + i, total_q - 1)]"
    assert names["combine_grid"] == "T.ceildiv(total_q, COMBINE_ROWS), heads" and names["combine_vars"] == "row_block, head"
    dense = combine_context(make_plan(Spec(splits=2)), "HEAD_DIM")
    assert dense["out_o"] == "O[batch_idx, r0 + i, head, j]" and dense["combine_grid"] == "T.ceildiv(q_len, COMBINE_ROWS), heads, batch"


# -- the scheduler seam -----------------------------------------------------------------------
def test_single_tile_phases_are_todays_text():
    s = schedulers.SingleTile()
    assert s.stage("k", "K_STAGES") == "k % K_STAGES"
    assert s.stage("k - 1", "V_STAGES") == "(k - 1) % V_STAGES"
    assert s.parity("n_tiles - 1", "V_STAGES") == "((n_tiles - 1) // V_STAGES) % 2"
    assert s.free_parity("k", "K_STAGES") == "((k // K_STAGES) % 2) ^ 1"
    assert (s.stage("0", "K_STAGES"), s.parity("0", "K_STAGES"), s.tile_parity()) == ("0", "0", "0")
    assert s.tile_start("q0", "q_block", "BLOCK_M") == "q0 = q_block * BLOCK_M"
    assert s.grid("total_q", "COMBINE_ROWS", "heads") == "T.ceildiv(total_q, COMBINE_ROWS), heads"


class Offset(schedulers.SingleTile):
    """A persistent scheduler's phases: visits counted from the block's earlier tiles (visit_base)."""

    def stage(self, visit, stages):
        return f"(visit_base + {visit}) % {stages}"

    def parity(self, visit, stages):
        return f"((visit_base + {visit}) // {stages}) % 2"

    def tile_parity(self):
        return "tile_parity"


@pytest.mark.parametrize("which, fields", [
    ("fwd", dict(causal=True)), ("fwd", dict(paged_kv=True, splits=2)),
    ("bwd", dict(causal=True)), ("bwd", dict(deterministic=True, layout="varlen")),
])
def test_every_phase_comes_from_the_scheduler(monkeypatch, which, fields):
    """With a scheduler that offsets every visit, no stage or phase of the template's own remains."""
    module = render if which == "fwd" else bwd_render
    monkeypatch.setattr(module, "schedule_of", lambda plan: Offset())
    source = (render_source if which == "fwd" else render_backward_source)(Spec(**fields))
    assert "visit_base" in source and "tile_parity" in source
    assert [line for line in source.splitlines() if re.search(r"(%|//) (K|V|Q|KV)_STAGES", line) and "visit_base" not in line] == []
    assert not re.search(r"_full(\[0\])?, 0\)|_empty\[0\]", source)  # the prologue's visit 0 and the once-per-tile barriers


# -- renderers never test the plan's layout fields ----------------------------------------------
LAYOUT_FIELDS = {"varlen", "page_size", "split_kv", "pack_gqa"}
RENDERERS = ("attngen/kernels/fwd/render.py", "attngen/kernels/bwd/render.py", "attngen/kernels/combine/render.py")


def layout_field_reads(source: str) -> list:
    """(function, line, field) of each read of a layout field on anything but a layout (a name
    `layout`, or layout_of(...)): such a read is a renderer choosing by layout itself."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr in LAYOUT_FIELDS:
                base = node.value
                asks_layout = (isinstance(base, ast.Name) and base.id == "layout") or (
                    isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "layout_of")
                if not asks_layout:
                    found.append((fn.name, node.lineno, node.attr))
    return found


def test_the_scan_sees_a_renderer_branch():
    assert layout_field_reads("def grid(plan):\n    return 'max_seqlen_q' if plan.varlen else 'q_len'\n") == [("grid", 2, "varlen")]
    assert layout_field_reads("def f(bp):\n    return bp.forward.page_size\n") == [("f", 2, "page_size")]
    assert layout_field_reads("def f(plan):\n    return layout_of(plan).split_kv\n") == []


@pytest.mark.parametrize("path", RENDERERS)
def test_renderers_do_not_branch_on_layout_fields(path):
    assert layout_field_reads((ROOT / path).read_text()) == []
