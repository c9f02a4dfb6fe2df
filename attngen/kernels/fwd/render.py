"""Plan -> the emitted forward module, through templates/fwd/fa3_fwd.py.j2.

The template is thin: it receives the numbers and the expressions built here (masks, tile
counts, guarded maxima, barrier ids), where they can be read and tested as Python, and only
lays them out in the order the GPU executes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


from attngen import expr, hw, tiles
from attngen.version import __version__
from attngen.kernels.common.plan import BLOCK_MASK_AXES, BLOCK_MASK_TENSORS, KernelNumbers, Shape
from attngen.kernels.fwd.plan import Plan, as_plan, masks_some_tile
from attngen.spec import Spec, to_toml
from attngen.kernels.combine.render import combine_context
from attngen.kernels.common.emit import render_template, tensor_param, write_if_different
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.common.schedulers import schedule_of

TEMPLATE = "fwd/fa3_fwd.py.j2"
DIMS = ("batch", "q_len", "kv_len", "kv_heads")


# -- the expressions the template prints ----------------------------------------------
# Kernels of specs without a window keep the expressions below that predate windows, byte for
# byte; `windowed(plan)` switches to the general form (first tile, both edges, visit indices).
def windowed(plan: Plan) -> bool:
    return plan.spec.window != (-1, -1)


def has_first_tile(plan: Plan) -> bool:
    """The block's first visited K tile is not 0 (the window has a left edge, or the block takes a split)."""
    return plan.window_left is not None or layout_of(plan).split_kv


def row_pos(plan: Plan, row: str = "q0 + row0 + i") -> str:
    """The query position of a block's packed row: the row itself, or row // GQA_GROUP when the
    query heads of one KV head are packed into the tile's rows."""
    return layout_of(plan).query_row(row)


def row_head(plan: Plan) -> str:
    """The query head of row i: the block's head, or (packed GQA) the row's place in the group."""
    return layout_of(plan).query_head()


def key_tile(plan: Plan, tile: str) -> str:
    """The K tile index of visit `tile` (the loop variable, or "0" for the prologue)."""
    if plan.block_mask:
        return "kv_tile"  # bound by visit_lines from the block mask's lists
    if not has_first_tile(plan):
        return tile
    return "first_tile" if tile == "0" else f"(first_tile + {tile})"


def key_index(plan: Plan, tile: str) -> str:
    """The key column `j` of visit `tile` as a kernel expression."""
    t = key_tile(plan, tile)
    return "j" if t == "0" else f"{t} * BLOCK_N + j"


def causal_diag(plan: Plan, tile: str) -> tuple[str, str] | None:
    """The diagonal in visit `tile`: (name, value), row i's diagonal key being j = i + name.

    The row-independent part is bound once per tile (a Let) so that the per-element tests of
    the causal mask and the window's edges are `i + diag >= j`, `j >= i + diag - left`: lowering
    then simplifies two indices per element, not the whole sum (docs/build.md, "Emitted-source
    edits"). A mask_mod kernel binds it for its causal or window part; the mod itself is an
    arbitrary expression of q_idx and kv_idx with no such part. None without a causal mask or a
    window, and for packed GQA, whose row position (q0 + row0 + i) // GQA_GROUP does not split
    off a row-independent part.
    """
    if layout_of(plan).pack_gqa or (plan.window_left is None and plan.window_right is None):
        return None
    t = key_tile(plan, tile)
    value = "q0 + row0 + causal_offset" if t == "0" else f"q0 + row0 + causal_offset - {t} * BLOCK_N"
    return ("diag0" if tile == "0" else "diag"), value


def mask_binding(plan: Plan, tile: str) -> str:
    """The statement the mask of visit `tile` needs before its loop, or ""."""
    diag = causal_diag(plan, tile)
    if diag is None:
        return ""
    name, value = diag
    if not windowed(plan) and plan.mask_expr is None:  # the plain causal mask
        return f"{name} = {value}  # row i of tile {key_tile(plan, tile)} sees keys j <= i + {name}"
    return f"{name} = {value}  # row i's diagonal in tile {key_tile(plan, tile)} is key j = i + {name}"


def mask_condition(plan: Plan, tile: str) -> str:
    """Is key `tile * BLOCK_N + j` visible to query row `q0 + row0 + i`?"""
    key = key_index(plan, tile)
    row = row_pos(plan)
    if not windowed(plan) and plan.mask_expr is None:
        if plan.spec.causal:
            # bottom-right alignment already keeps every real row below kv_len: row i < q_len sees
            # keys up to i + kv_len - q_len < kv_len; rows past q_len are never stored
            diag = causal_diag(plan, tile)
            return f"i + {diag[0]} >= j" if diag else f"{row} + causal_offset >= {key}"
        return f"{key} < kv_len"  # the partial last tile (not aligned)
    left, right = plan.window_left, plan.window_right
    diag = causal_diag(plan, tile)
    parts = []
    # row + causal_offset vs key, or with the diagonal bound (all but packed GQA): i + diag vs j
    near, far = (f"i + {diag[0]}", "j") if diag else (f"{row} + causal_offset", key)
    if left is not None:
        parts.append(f"{far} >= {near} - {left}" if left or not diag else f"{far} >= {near}")
    if right is not None:
        parts.append(f"{near} + {right} >= {far}" if right else f"{near} >= {far}")
    if right != 0:  # right == 0 keeps every real row's keys below kv_len (see above)
        parts.append(f"{key} < kv_len")
    if plan.mask_expr is not None:
        parts.append(mod_text(plan, plan.mask_expr, tile, score=None))
    return " and ".join(parts) if len(parts) == 1 else " and ".join(f"({p})" if " and " in p else p for p in parts)


def mod_text(plan: Plan, e, tile: str, score: str | None) -> str:
    """A parsed score_mod/mask_mod as TileLang, at row q0 + row0 + i and key `key_index(tile)`."""
    return mod_at(plan, e, row_pos(plan), key_index(plan, tile), row_head(plan), score)


def mod_at(plan: Plan, e, row: str, key: str, head: str, score: str | None) -> str:
    """A parsed score_mod/mask_mod (or a derivative) as TileLang at query `row`, key `key`, head `head`
    (both passes: the backward names its transposed tile's rows and keys)."""
    tensors = {t.name: t for t in plan.extra}
    names = {"b": "batch_idx", "h": head, "q_idx": f"({row})", "kv_idx": f"({key})"}
    if score is not None:
        names["score"] = f"({score})"
    return expr.emit(e, names, lambda n: tensors[n].param, lambda n, axis: tensors[n].dim(axis))


def transform_expr(plan: Plan, tile: str) -> str:
    """acc_s[i, j] (q . k) -> the final score in base-2 units: softcap, ALiBi, score_mod, then * log2(e).

    The mods are defined on the natural-units score q . k * softmax_scale (FlexAttention's
    `score`; the scale is the kernel's run-time argument); the result is multiplied by log2(e)
    once, so the softmax below needs no scale_log2.
    """
    return f"({score_text(plan, 'acc_s[i, j]', row_pos(plan), key_index(plan, tile), row_head(plan))}) * LOG2E"


def score_text(plan: Plan, acc: str, row: str, key: str, head: str, mods: bool = True) -> str:
    """The natural-units score of the raw q . k in `acc` at query `row`, key `key`, head `head`:
    softcap, then ALiBi, then (with `mods`) the score_mod. Both passes print it (the backward's
    transposed tile names its own rows and keys)."""
    spec = plan.spec
    s = f"{acc} * softmax_scale"
    if spec.softcap:
        s = f"SOFTCAP * T.tanh({acc} * softcap_scale)"  # softcap_scale = softmax_scale / SOFTCAP, once per warpgroup
    if spec.alibi:
        s = f'{s} - Alibi[{head}] * T.Cast("float32", T.abs({row} + causal_offset - ({key})))'
    if mods and plan.score_expr is not None:
        s = mod_at(plan, plan.score_expr, row, key, head, s)
    return s


def scaled(plan: Plan, x: str) -> str:
    """A raw score or row max in the softmax's base-2 units."""
    return x if plan.prescaled else f"{x} * scale_log2"


def scale_setup(plan: Plan) -> list[str]:
    """The consumer's lines that derive, once, what its scores are multiplied by from the run-time
    softmax_scale (a float32 parameter: one compiled kernel serves every scale)."""
    if not plan.prescaled:
        return ["scale_log2 = softmax_scale * LOG2E  # the softmax runs in base 2: exp2(s * scale_log2) = exp(s * softmax_scale)"]
    if plan.spec.softcap:
        return ["softcap_scale = softmax_scale / SOFTCAP  # tanh's argument: the scaled score / SOFTCAP"]
    return []


def max_floor(plan: Plan) -> str:
    """The running max's start in a kernel without sinks: finite, and finite once scaled.

    Not -inf: a row whose scores so far are all -inf (masked, or an inf in q or k) then keeps a
    finite max and gets exp2(-inf - floor) = 0 where -inf - -inf is NaN, and no tile needs a guard.
    m_cur holds q . k units, scaled by the run-time scale_log2 in the exponent, which exceeds 1
    for softmax_scale > ln 2; the lowest float times that is -inf again. So the floor is the lowest
    float halved (rounding cannot carry the product past the overflow) and divided by scale_log2
    where that is above 1: computed once per consumer, it scales to at least -FLT_MAX / 2 for every
    valid scale. Prescaled scores are base-2 units already (no scale follows): the lowest float."""
    if plan.prescaled:
        return "T.min_value(ACCUM)"
    return "T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0)"


# -- tile ranges: attngen/tiles.py states the algebra; these only name the kernel's values -----
def tile_frame(plan: Plan) -> tiles.Frame:
    """The plan's problem in the kernel's names, with what is known of each value: kv_len >= 1 in a
    bshd kernel (0 where a sequence or a split may have no key), and the offset's value for a static
    shape whose every row sees a key (the plan's guard_empty_rows is off)."""
    layout = layout_of(plan)
    static = plan.shape is not None and not layout.per_sequence
    kv_lo = 0 if layout.may_see_no_key else (plan.shape.kv_len if static else 1)
    off_lo = plan.shape.kv_len - plan.shape.q_len if static and not plan.guard_empty_rows else None
    return tiles.Frame(q_len=tiles.Sym("q_len", 1), kv_len=tiles.Sym("kv_len", kv_lo),
                       offset=tiles.Sym("causal_offset", off_lo), edges=tiles.Edges(plan.window_left, plan.window_right),
                       block_m=tiles.Sym("BLOCK_M", 1), block_n=tiles.Sym("BLOCK_N", 1))


_Q0, _ROW0, _FIRST = tiles.Sym("q0", 0), tiles.Sym("row0", 0), tiles.Sym("first_tile", 0)


def _row(plan: Plan, x) -> tiles.Expr:
    return layout_of(plan).query_position(x)


def block_rows(plan: Plan) -> tiles.Rows:
    """The block's query rows: q0 .. q0 + BLOCK_M - 1 (packed GQA: their query positions)."""
    return tiles.Rows(_row(plan, _Q0), _row(plan, tiles.add(_Q0, tiles.Sym("BLOCK_M", 1), -1)))


def warpgroup_rows(plan: Plan) -> tiles.Rows:
    """One consumer warpgroup's rows: q0 + row0 .. q0 + row0 + WG_ROWS - 1."""
    start = tiles.add(_Q0, _ROW0)
    return tiles.Rows(_row(plan, start), _row(plan, tiles.add(start, tiles.Sym("WG_ROWS", 1), -1)))


def _visits(plan: Plan, tile) -> tiles.Expr:
    """A K tile index as a visit count from the block's first tile."""
    return tiles.sub(tile, _FIRST) if has_first_tile(plan) else tile


def full_tiles_expr(plan: Plan) -> str:
    """Leading K tiles (visits) that every row of the warpgroup sees whole on the right (no mask needed).
    A warpgroup's first row is a real row (< q_len) whenever its output is stored."""
    if plan.mask_expr is not None:
        return "0"  # a custom mask_mod masks every tile
    return tiles.text(_visits(plan, tile_frame(plan).kv_full_stop(warpgroup_rows(plan), first_row_real=True)))


def lead_tiles_expr(plan: Plan) -> str:
    """Leading visits the window's left edge cuts for some row of this warpgroup (masked)."""
    if plan.window_left is None or plan.mask_expr is not None:
        return ""
    return tiles.text(tiles.max_(_visits(plan, tile_frame(plan).kv_full_first(warpgroup_rows(plan))), 0))


def masked_visit_expr(plan: Plan) -> tuple[str, str]:
    """(condition, comment): is visit k of the steady loop masked? Leading visits the window's left edge
    cuts and every visit from the first diagonal or partial tile on (steady_loop = "one"). One loop
    with a branch, not a masked and an unmasked copy of the loop: TileLang's layout inference grows
    with the square of a warpgroup's tile operations, and the copy made the lowering 1.3 to 1.4
    times slower (docs/build.md)."""
    if plan.block_mask:
        return BLOCK_MASK_TEST
    if plan.mask_expr is not None:
        return "", ""  # a custom mask_mod masks every visit, unconditionally
    if lead_tiles_expr(plan):
        return "k < lead or k >= full_tiles", "cut by an edge of the window, or a diagonal or partial tile: masked"
    return "k >= full_tiles", "a diagonal or partial tile: masked"


def steady_loops(plan: Plan) -> tuple[list[str], list[dict]]:
    """The steady loop's form (spec.steady_loop): the lines that split its visits, and each loop's
    range, comment and mask ("test": a per-visit `if`, "always", "never").

    "one": one loop over every visit; the mask runs under masked_visit_expr's test. "split": the
    seed's and FlashAttention-3's form, a copy without mask code (nor -inf guard) over the tiles
    every row sees whole and a masked copy over the rest, and before them, with a window's left
    edge, a masked copy over the visits it cuts. Same values; two copies cost build time
    (docs/build.md)."""
    spec = plan.spec
    if spec.steady_loop == "one":  # also every spec with nothing to split (make_plan resolves it to "one")
        mask = "always" if plan.mask_expr is not None and not plan.block_mask else "test" if masks_some_tile(spec) else "never"
        return [], [{"start": "1", "end": "n_tiles", "comment": "", "mask": mask}]
    masked = {"end": "n_tiles", "comment": "diagonal and partial tiles: masked", "mask": "always"}
    if not lead_tiles_expr(plan):
        return (["split = T.max(1, T.min(n_tiles, full_tiles))"],
                [{"start": "1", "end": "split", "comment": "tiles every row sees whole", "mask": "never"},
                 {**masked, "start": "split"}])
    return (["split_lo = T.max(1, T.min(n_tiles, lead))", "split = T.max(split_lo, T.min(n_tiles, full_tiles))"],
            [{"start": "1", "end": "split_lo", "comment": "tiles the window's left edge cuts: masked", "mask": "always"},
             {"start": "split_lo", "end": "split", "comment": "tiles every row sees whole", "mask": "never"},
             {**masked, "start": "split"}])


def first_tile_expr(plan: Plan) -> str:
    """The block's first visited K tile: the window's left edge for its first row."""
    if plan.window_left is None:  # a split's first tile is laid out with the split (split_exprs)
        return ""
    return tiles.text(tile_frame(plan).kv_first(block_rows(plan)))


def n_tiles_expr(plan: Plan) -> str:
    """K tiles a block of query rows visits (with its comment): the window's or the diagonal's, and
    at least one (a block whose rows see no key runs one fully masked tile)."""
    if plan.block_mask:
        return (tiles.text(tiles.add(tiles.Sym("bm_partial_n", 0), tiles.Sym("bm_full_n", 0)))
                + "  # the block mask's partial and full tiles of this Q tile; 0: none is loaded (visit_guard)")
    stop = tile_frame(plan).kv_stop(block_rows(plan))
    windowed_first = windowed(plan) and has_first_tile(plan)
    visits = _visits(plan, stop) if windowed_first else stop
    n = tiles.at_least_one(visits)
    if windowed_first:
        return tiles.text(n) + "  # tiles [first_tile, first_tile + n_tiles): exactly the window's; >= 1 (a block that sees no key runs one masked tile)"
    if n != visits:  # the clamp is not proven redundant: say why it is there
        return tiles.text(n) + "  # >= 1: a block of rows that see no key still runs (fully masked) tile 0"
    return tiles.text(n)


# -- a call-time block mask (FlexAttention's BlockMask): the visits are its listed tiles -------------
# Each agent (the producer warp, every consumer warpgroup) walks the two ascending lists of its Q
# tile, partial (KV_indices) and full (Full_kv_indices), with a cursor per list, and visits the lower
# head first: the tiles in ascending order, the dense kernel's order, so that skipping the empty
# tiles (which add exactly 0 and rescale by exactly 1 there) leaves every bit of the result as it was.
BLOCK_MASK_TEST = ("partial", "a partial tile of the block mask: masked (a full tile needs no mask)")


def block_mask_setup(plan: Plan) -> list[str]:
    """The block's row of the block mask (a batch or head extent of 1 broadcasts) and its counts."""
    if not plan.block_mask:
        return []
    return ["bm_b = T.min(batch_idx, bm_batch - 1)  # the block mask's batch and head: an extent of 1 broadcasts",
            "bm_h = T.min(head, bm_heads - 1)",
            "bm_partial_n = KV_num_blocks[bm_b, bm_h, q_block]  # KV tiles of this Q tile that the mask cuts",
            "bm_full_n = Full_kv_num_blocks[bm_b, bm_h, q_block]  # KV tiles it sees whole"]


def visit_init(plan: Plan) -> list[str]:
    """An agent's cursors into the two lists, before its first visit."""
    if not plan.block_mask:
        return []
    return list_cursors("KV_indices", "Full_kv_indices")


def visit_lines(plan: Plan) -> list[str]:
    """At the start of each visit: its KV tile (kv_tile) and whether it is partial; the cursors step."""
    if not plan.block_mask:
        return []
    return list_walk("KV_indices", "Full_kv_indices", "bm_b, bm_h, q_block", "bm_kv_tiles", "kv_tile", "n_tiles")


def list_cursors(partial: str, full: str) -> list[str]:
    """The cursors of a walk over two block-mask lists (list_walk)."""
    return [f'bm_next_p = T.alloc_var("int32", 0)  # the next unvisited entry of {partial} (partial tiles)',
            f'bm_next_f = T.alloc_var("int32", 0)  # and of {full} (full tiles)']


def list_walk(partial: str, full: str, row: str, extent: str, tile: str, count: str) -> list[str]:
    """One step of the walk over a row of two ascending block-mask lists (the forward's KV tiles
    of a Q tile, the backward's Q tiles of a KV tile): `tile` is the lower head, `partial` says
    which list it came from, and that list's cursor steps. `count`: the visits, both lists' counts."""
    return [f"bm_p = T.if_then_else(bm_next_p < bm_partial_n, {partial}[{row}, T.min(bm_next_p, {extent} - 1)], {extent})"
            f"  # the next partial tile ({extent}: none left)",
            f"bm_f = T.if_then_else(bm_next_f < bm_full_n, {full}[{row}, T.min(bm_next_f, {extent} - 1)], {extent})"
            "  # the next full tile",
            f"{tile} = T.min(T.min(bm_p, bm_f), {extent} - 1)  # the lower of the two: tiles in ascending order",
            f"partial = bm_p <= bm_f  # never equal: a visit has a tile left in one list ({count} counts both)",
            "bm_next_p = bm_next_p + T.if_then_else(partial, 1, 0)  # a T.alloc_var: assigning stores it",
            "bm_next_f = bm_next_f + T.if_then_else(partial, 0, 1)"]


def visit_guard(plan: Plan) -> tuple:
    """(condition, comment) under which a consumer visits any tile, or (): only a block mask's Q tile
    can list none (random block sparsity makes them). Such a block loads no K/V tile and skips the
    prologue, the steady loop and the last PV; every consumer of the block skips together (the lists
    are per Q tile), so the ping-pong ring keeps the primer's one arrival, as every block leaves it."""
    if not plan.block_mask:
        return ()
    return ("n_tiles > 0", "a Q tile with no listed tile visits none: O = 0, LSE -inf (or the sink's own)")


def no_visit_init(plan: Plan) -> list[str]:
    """What the skipped prologue would have set for a row that sees no key: the row sum it starts
    (0; with a sink it starts at the sink's 1). The running max is at its start and alpha 1, so the
    epilogue writes what the dense kernel writes for such a row, bit for bit."""
    if not plan.block_mask or plan.spec.sinks:
        return []
    return ["T.fill(row_sum, 0)  # read by the epilogue only if the block visits no tile (the prologue sets it)"]


def visit_comments(plan: Plan) -> tuple[str, str]:
    """What the prologue's and the steady loop's visits are, for their comments."""
    if plan.block_mask:
        return "the block mask's first listed tile", "visit k (the block mask's k-th listed tile, kv_tile)"
    if has_first_tile(plan):
        return "the first visited tile", "visit k (K tile first_tile + k)"
    return "tile 0", "tile k"


def split_exprs(plan: Plan) -> dict:
    """A split's share of the block's n_block_tiles visits (names the template binds under layout.split_kv)."""
    n, per = tiles.Sym("n_block_tiles", 1), tiles.Sym("tiles_per_split", 1)
    return {"split_tiles_per": tiles.text(tiles.split_tiles_per(n, tiles.Sym("num_splits", 1))),
            "split_first": tiles.text(tiles.split_first(tiles.Sym("split_idx", 0), per)),
            "split_n_tiles": tiles.text(tiles.at_least_one(tiles.split_count(n, _FIRST, per)))}


def normalize_stmt(plan: Plan) -> str:
    """The epilogue's division by the row sum. A row whose every score is -inf (masked, or from an
    inf in q or k, in any kernel) ends with sum 0 and acc_o 0: it gives 0, as in the reference.
    The running max never reaches -inf (it starts at a finite floor, max_floor; docs/online-softmax.md
    step 4), so this once-per-row test is the only guard: no tile pays for one."""
    if not plan.spec.sinks:  # with a sink every row sum is >= exp(0)
        return "acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0"
    return "acc_o[i, j] /= row_sum[i]"


def lse_expr(plan: Plan) -> str:
    """Natural-log log-sum-exp of a row: (m * scale_log2 + log2(row sum)) * ln 2; -inf for a row with no key."""
    if not (plan.spec.lse or layout_of(plan).split_kv):  # a split always writes its LSE: the combine weighs by it
        return ""
    value = f"({scaled(plan, 'm_cur[i]')} + T.log2(row_sum[i])) * LN2"
    if plan.guard_empty_rows and not plan.spec.sinks:
        return f"T.if_then_else(row_sum[i] == 0, -T.infinity(ACCUM), {value})"
    return value


def sink_init(plan: Plan) -> str:
    """The running max starts at the sink's logit (in the units m_cur holds), the row sum at its exp(0) = 1."""
    if not plan.spec.sinks:
        return ""
    if plan.prescaled:
        return "Sinks[head] * LOG2E"
    return "Sinks[head] / softmax_scale"  # a natural-log logit in the units of q . k


def variant_constants(plan: Plan) -> list[str]:
    spec = plan.spec
    lines = []
    if plan.head_dim_v != spec.head_dim:
        lines.append(f"HEAD_DIM_V = {plan.head_dim_v}  # V and O head dim")
    if spec.softcap:
        lines.append(f"SOFTCAP = {spec.softcap!r}  # score = SOFTCAP * tanh(score / SOFTCAP)")
    if spec.lse or layout_of(plan).split_kv:
        lines.append(f"LN2 = {math.log(2)!r}  # the LSE is returned in natural log")
    return lines + layout_of(plan).constants()


def kernel_params(plan: Plan, dv: str) -> list[str]:
    """The main prim_func's parameter lines, in the order of docs/serving.md's ABI."""
    layout = layout_of(plan)
    lines = layout.io_params(dv)
    for t in plan.extra:
        if t.output and not layout.kernel_writes_lse:
            continue  # the combine kernel writes the LSE
        dims = [t.dim(a) for a in range(len(t.shape))]
        lines.append(tensor_param(t.param, dims, f'"{t.dtype}"',
                             "output: log-sum-exp per row, natural log" if t.output else f"call time: {t.name}"))
    lines += layout.serving_params()
    lines.append("softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))")
    return lines


def has_offset(plan: Plan) -> bool:
    return plan.spec.causal or windowed(plan) or plan.spec.alibi


def consumer_args(plan: Plan) -> str:
    """The consumer macro's parameters after (g, wait_bar, signal_bar); the call passes the same names."""
    layout = layout_of(plan)
    names = ["Q_shared", "K_shared", "V_shared"] + layout.consumer_outputs() + layout.q_barrier_args()
    names += ["k_full", "k_empty", "v_full", "v_empty", "q0", "n_tiles", "head", "batch_idx"]
    names += [layout.lse_param if t.output else t.param for t in plan.extra]
    names += layout.extra_output_args(plan.spec.lse)
    if has_first_tile(plan):
        names.append("first_tile")
    names += layout.q_load_args() + layout.sequence_args(has_offset(plan)) + layout.split_args()
    if plan.block_mask:
        names += ["q_block", "bm_b", "bm_h", "bm_partial_n", "bm_full_n"]
    names.append("softmax_scale")
    return ", ".join(names)


def offset_comment(plan: Plan) -> str:
    if plan.spec.causal and not windowed(plan):
        return "# bottom-right alignment: row i sees keys j <= i + causal_offset"
    return "# bottom-right alignment: the window, causal mask and ALiBi measure from key i + causal_offset"


def q_rows(plan: Plan, g: int) -> str:
    """The query rows consumer g owns, as a slice of this block's rows."""
    rows = plan.wg_rows
    return f"q0 + {rows * g}:q0 + {rows * (g + 1)}" if g else f"q0:q0 + {rows}"


def header_lines(plan: Plan) -> list[str]:
    spec = plan.spec
    shape = f"static B,H,HKV,SQ,SKV = {plan.shape}" if plan.shape else f"dynamic: {', '.join(layout_of(plan).dims())} are runtime values"
    lines = [
        "=" * 78,
        "attngen auto-generated kernel: do not edit; regenerate with `attngen generate`.",
        f"kernel:    {plan.name}",
        f"spec hash: {plan.hash}",
        f"generator: attngen {__version__}, template {Path(TEMPLATE).name}",
        f"shape:     {shape}",
        f"schedule:  1 TMA producer warpgroup + {spec.consumers} consumer warpgroup(s)"
        + (", ping-pong" if spec.pingpong else "")
        + f", {plan.threads} threads, setmaxnreg {plan.producer_regs}/{plan.consumer_regs}",
        f"smem:      {plan.smem_bytes} bytes dynamic (" + ", ".join(f"{k} {v}" for k, v in plan.smem.items()) + ")",
    ]
    lists = {n for n, _, _ in BLOCK_MASK_TENSORS}
    inputs = [t for t in plan.extra if not t.output and t.name not in lists]
    if inputs:  # a free axis takes any extent >= 1
        marked = any(t.dtype != "float32" for t in inputs)  # int32 mod tensors (name.int32[...])
        lines.append("tensors:   " + ", ".join(f"{t.name} [{', '.join(a or 'any' for a in t.shape)}]"
                                               + (f" {t.dtype}" if t.dtype != "float32" else "") for t in inputs)
                     + f" (float32{' unless marked' if marked else ''}, passed by name at call time)")
    if plan.block_mask:
        lines.append("block mask: " + ", ".join(f"{t.name} [{', '.join(t.shape)}]" for t in plan.extra if t.name in lists)
                     + " (int32, by name at call time; bm_batch, bm_heads: 1 or the call's)")
    lines.append("spec:")
    lines += ["  " + line for line in to_toml(spec).splitlines()]
    lines.append("=" * 78)
    return lines


@dataclass(frozen=True, kw_only=True)
class ForwardNumbers(KernelNumbers):
    """fa3_fwd.py.j2's `kernel`: the shared numbers plus the forward's stages, ping-pong ring and
    barrier numbering, all decided by the Plan."""

    wg_rows: int
    """query rows per consumer warpgroup (one wgmma M tile)"""
    k_stages: int
    """K tiles in flight"""
    v_stages: int
    """V tiles in flight"""
    pingpong: bool
    """consumers take turns on the tensor cores (named-barrier ring)"""
    pingpong_threads: int
    """threads on the ping-pong ring"""
    primer: int
    """the warpgroup that primes the ring"""
    epilogue_bar: int
    """first epilogue named barrier"""
    barriers: tuple
    """per consumer: .wait_bar and .signal_bar (0 when ping-pong is off)"""

    @classmethod
    def of(cls, plan: Plan) -> ForwardNumbers:
        spec = plan.spec
        return cls(header=header_lines(plan), name=plan.name, spec_hash=plan.hash, head_dim=spec.head_dim,
                   dtype=spec.dtype, gqa_group=spec.gqa_group, consumers=spec.consumers, block_m=spec.block_m,
                   block_n=spec.block_n, wg_rows=plan.wg_rows, k_stages=spec.k_stages, v_stages=spec.v_stages,
                   log2e=hw.LOG2E, threads=plan.threads, consumer_threads=plan.consumer_threads,
                   tma_thread_end=plan.tma_thread_end, tma_threads=plan.tma_threads,
                   producer_regs=plan.producer_regs, consumer_regs=plan.consumer_regs, pingpong=spec.pingpong,
                   pingpong_threads=plan.pingpong_threads, primer=plan.primer,
                   warpgroup_threads=plan.warpgroup_threads, epilogue_bar=plan.epilogue_bar,
                   compile_flags=plan.compile_flags, barriers=plan.consumer_barriers,
                   consumer_args=consumer_args(plan))


def template_context(plan: Plan) -> dict:
    """Every name the template uses (documented at the top of the template)."""
    spec = plan.spec
    has_masked = masks_some_tile(spec)
    dv = "HEAD_DIM" if plan.head_dim_v == spec.head_dim else "HEAD_DIM_V"
    free_dims = [t.dim(a) for t in plan.extra for a in range(len(t.shape)) if t.shape[a] is None]
    if plan.block_mask:
        free_dims += list(BLOCK_MASK_AXES)
    masked_visit, masked_visit_comment = masked_visit_expr(plan) if has_masked else ("", "")
    loop_setup, loops = steady_loops(plan)
    layout = layout_of(plan)
    return {
        "layout": layout,
        "schedule": schedule_of(plan),
        "row_pos": row_pos(plan),  # a row's query position and head, as the layout's indexes take them
        "row_head": row_head(plan),
        "q_rows": lambda g: q_rows(plan, g),
        "key_tile": lambda tile: key_tile(plan, tile),
        "block_setup": layout.block_setup(has_offset(plan)) + block_mask_setup(plan),
        "dv": dv,
        "scale_setup": scale_setup(plan),
        "variant_constants": variant_constants(plan),
        "kernel": ForwardNumbers.of(plan),
        "dims": layout.kernel_dims(plan.shape, DIMS),
        "free_dims": free_dims,
        "offset": has_offset(plan) and not layout.per_sequence,
        "offset_comment": offset_comment(plan),
        "has_masked": has_masked,
        "all_masked": plan.mask_expr is not None,
        "first_tile": first_tile_expr(plan),
        "n_tiles": n_tiles_expr(plan),
        "full_tiles": full_tiles_expr(plan) if has_masked else "",
        "lead_tiles": lead_tiles_expr(plan),
        "masked_visit": masked_visit,
        "masked_visit_comment": masked_visit_comment,
        "steady_setup": loop_setup,
        "steady_loops": loops,
        "normalize": normalize_stmt(plan),
        "params": kernel_params(plan, dv),
        "first_visit_comment": visit_comments(plan)[0],
        "visit_comment": visit_comments(plan)[1],
        "block_mask": plan.block_mask,
        "first_visit_mask": BLOCK_MASK_TEST if plan.block_mask else ("", ""),
        "visit_init": visit_init(plan),
        "visit_setup": visit_lines(plan),
        "visit_guard": visit_guard(plan),
        "no_visit_init": no_visit_init(plan),
        **(combine_context(plan, dv) if layout.split_kv else {}),
        **(split_exprs(plan) if layout.split_kv else {}),
        "sink_init": sink_init(plan),
        "max_floor": max_floor(plan),
        "lse": lse_expr(plan),
        "prescaled": plan.prescaled,
        "transform": lambda tile: transform_expr(plan, tile),
        "scaled": lambda x: scaled(plan, x),
        "mask_bind": lambda tile: mask_binding(plan, tile),
        "mask_cond": lambda tile: mask_condition(plan, tile),
    }


def render_source(spec_or_plan: Spec | Plan, shape: Shape | None = None) -> str:
    """The emitted TileLang source (dynamic shapes unless the plan has a static shape)."""
    plan = as_plan(spec_or_plan, shape)
    return render_template(TEMPLATE, template_context(plan))


def output_path(plan: Plan, out_dir: str | Path) -> Path:
    return Path(out_dir) / f"{plan.name}.py"


def generate(spec_or_plan: Spec | Plan, out_dir: str | Path = "generated", shape: Shape | None = None) -> Path:
    """Write the emitted kernel under `out_dir`; return its path."""
    plan = as_plan(spec_or_plan, shape)
    path = output_path(plan, out_dir)
    write_if_different(path, render_source(plan))
    return path
