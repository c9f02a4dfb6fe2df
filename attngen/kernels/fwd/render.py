"""Plan -> emitted TileLang source, through one Jinja2 template.

The template is thin: it receives flat numbers and the expressions built here (masks,
tile counts, guarded maxima, barrier ids), where they can be read and tested as Python,
and only lays them out in the order the GPU executes them.
"""

from __future__ import annotations

from pathlib import Path


from attngen import hw, tiles
from attngen.version import __version__
from attngen.kernels.common.plan import BLOCK_MASK_AXES, BLOCK_MASK_TENSORS, Shape
from attngen.kernels.fwd.plan import Plan, as_plan, masks_some_tile
from attngen.spec import Spec, to_toml
from attngen.kernels.combine.render import combine_context
from attngen.kernels.common.block_mask import BLOCK_MASK_TEST, ForwardVisits
from attngen.kernels.common.emit import render_template, tensor_param, write_if_different
from attngen.kernels.common.layouts import kv_shape, lse_shape, q_shape
from attngen.kernels.common.variants import Variant, has_first_tile, has_offset, key_tile, row_head, row_pos, windowed

TEMPLATE = "fwd/fa3_fwd.py.j2"
DIMS = ("batch", "q_len", "kv_len", "kv_heads")


# -- tile ranges: attngen/tiles.py states the algebra; these only name the kernel's values -----
def tile_frame(plan: Plan) -> tiles.Frame:
    """The plan's problem in the kernel's names, with what is known of each value: kv_len >= 1 in a
    bshd kernel (0 where a sequence or a split may have no key), and the offset's value for a static
    shape whose every row sees a key (the plan's guard_empty_rows is off)."""
    static = plan.shape is not None and not per_sequence(plan)
    kv_lo = 0 if per_sequence(plan) or plan.split_kv else (plan.shape.kv_len if static else 1)
    off_lo = plan.shape.kv_len - plan.shape.q_len if static and not plan.guard_empty_rows else None
    return tiles.Frame(q_len=tiles.Sym("q_len", 1), kv_len=tiles.Sym("kv_len", kv_lo),
                       offset=tiles.Sym("causal_offset", off_lo), edges=tiles.Edges(plan.window_left, plan.window_right),
                       block_m=tiles.Sym("BLOCK_M", 1), block_n=tiles.Sym("BLOCK_N", 1))


_Q0, _ROW0, _FIRST = tiles.Sym("q0", 0), tiles.Sym("row0", 0), tiles.Sym("first_tile", 0)


def _row(plan: Plan, x) -> tiles.Expr:
    return tiles.rowdiv(x, tiles.Sym("GQA_GROUP", 1)) if plan.pack_gqa else x


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


def split_exprs(plan: Plan) -> dict:
    """A split's share of the block's n_block_tiles visits (names the template binds)."""
    if not plan.split_kv:
        return {}
    n, per = tiles.Sym("n_block_tiles", 1), tiles.Sym("tiles_per_split", 1)
    return {"split_tiles_per": tiles.text(tiles.split_tiles_per(n, tiles.Sym("num_splits", 1))),
            "split_first": tiles.text(tiles.split_first(tiles.Sym("split_idx", 0), per)),
            "split_n_tiles": tiles.text(tiles.at_least_one(tiles.split_count(n, _FIRST, per)))}


def per_sequence(plan: Plan) -> bool:
    """Lengths differ by sequence (packed q, or a paged cache's seqused_k): each block reads its own."""
    return plan.varlen or plan.page_size > 0


def kernel_dims(plan: Plan) -> dict:
    """T.dynamic extents of the main kernel (name -> int for a static shape, else None)."""
    if plan.shape is not None:
        return {d: getattr(plan.shape, d) for d in DIMS}
    names = ["batch"]
    names += ["total_q"] if plan.varlen else ["q_len"]
    if not plan.page_size:
        names += ["total_k"] if plan.varlen else ["kv_len"]
    names.append("kv_heads")
    if plan.page_size:
        names += ["num_pages", "max_pages"]
    if plan.split_kv:
        names.append("num_splits")
    return {n: None for n in names}


def kernel_params(plan: Plan, dv: str) -> list[str]:
    """The main prim_func's parameter lines, in the order of docs/serving.md's ABI."""
    lines = [tensor_param("Q", q_shape(plan), "DTYPE"), tensor_param("K", kv_shape(plan, "HEAD_DIM"), "DTYPE"),
             tensor_param("V", kv_shape(plan, dv), "DTYPE")]
    if plan.split_kv:
        lines.append(tensor_param("O_partial", ["num_splits"] + q_shape(plan, dv), '"float32"',
                             "output: each split's normalised partial O (the combine kernel merges them)"))
        lines.append(tensor_param("LSE_partial", ["num_splits"] + lse_shape(plan), '"float32"',
                             "output: each split's log-sum-exp per row, natural log (-inf: no key)"))
    else:
        lines.append(tensor_param("O", q_shape(plan, dv), "DTYPE"))
    for t in plan.extra:
        if t.output and plan.split_kv:
            continue  # the combine kernel writes the LSE
        dims = [t.dim(a) for a in range(len(t.shape))]
        lines.append(tensor_param(t.param, dims, f'"{t.dtype}"',
                             "output: log-sum-exp per row, natural log" if t.output else f"call time: {t.name}"))
    if plan.varlen:
        lines.append(tensor_param("cu_seqlens_q", ["batch + 1"], '"int32"', "sequence b's rows of q and out: [cu_seqlens_q[b], cu_seqlens_q[b + 1])"))
        if not plan.page_size:
            lines.append(tensor_param("cu_seqlens_k", ["batch + 1"], '"int32"', "sequence b's rows of k and v"))
    if plan.page_size:
        lines.append(tensor_param("block_table", ["batch", "max_pages"], '"int32"', "sequence b's key t lives in page block_table[b, t // PAGE_SIZE]"))
        lines.append(tensor_param("seqused_k", ["batch"], '"int32"', "keys of sequence b"))
    if plan.varlen:
        lines.append("max_seqlen_q: T.int32,  # the longest sequence's rows: sizes the grid")
    lines.append("softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))")
    return lines


def grid(plan: Plan) -> str:
    rows = "max_seqlen_q" if plan.varlen else "q_len"
    if plan.pack_gqa:
        rows = f"{rows} * GQA_GROUP"
    return ", ".join([f"T.ceildiv({rows}, BLOCK_M)", "kv_heads" if plan.pack_gqa else "heads",
                      "batch * num_splits" if plan.split_kv else "batch"])


def block_vars(plan: Plan) -> str:
    return ", ".join(["q_block", "kv_head" if plan.pack_gqa else "head", "batch_split" if plan.split_kv else "batch_idx"])


def block_setup(plan: Plan) -> list[str]:
    """Lines that give a block its head, sequence and lengths (before q0)."""
    if plan.pack_gqa:
        lines = ["head = kv_head * GQA_GROUP  # packed GQA: row r is query r // GQA_GROUP of head head + r % GQA_GROUP"]
    else:
        lines = ["kv_head = head // GQA_GROUP"]
    if plan.split_kv:
        lines += ["batch_idx = T.truncdiv(batch_split, num_splits)  # truncdiv: both >= 0, no floor fix-up code",
                  "split_idx = T.truncmod(batch_split, num_splits)  # which share of the K tiles this block visits"]
    if plan.varlen:
        lines += ["q_start = cu_seqlens_q[batch_idx]  # this sequence's first row of q and out",
                  "q_len = cu_seqlens_q[batch_idx + 1] - q_start"]
        if not plan.page_size:
            lines += ["k_start = cu_seqlens_k[batch_idx]", "kv_len = cu_seqlens_k[batch_idx + 1] - k_start"]
    if plan.page_size:
        lines += ["kv_len = seqused_k[batch_idx]",
                  "last_page = T.max(T.ceildiv(kv_len, PAGE_SIZE) - 1, 0)  # tiles past the sequence (masked) reread its last page"]
    if per_sequence(plan) and has_offset(plan):
        lines.append("causal_offset = kv_len - q_len  # bottom-right alignment, per sequence")
    return lines + ForwardVisits.of(plan).setup()


def q_box(plan: Plan, g: int) -> str:
    """The TMA box of consumer g's Q rows."""
    rows = q_rows(plan, g)
    if plan.varlen:
        lo, hi = rows.split(":")
        return f"q_start + {lo}:q_start + {hi}, head, :"
    return f"batch_idx, {rows}, head, :"


def kv_tile_setup(plan: Plan, tile: str) -> list[str]:
    if plan.block_mask:
        return ForwardVisits.of(plan).lines()
    if not plan.page_size:
        return []
    t = key_tile(plan, tile)
    return [f"page = block_table[batch_idx, T.min({t} // TILES_PER_PAGE, last_page)]  # the page holding this tile",
            f"page_row = {t} % TILES_PER_PAGE * BLOCK_N"]


def kv_box(plan: Plan, tile: str) -> str:
    """The TMA box of visit `tile`'s K (or V) rows."""
    if plan.page_size:
        return "page, page_row:page_row + BLOCK_N, kv_head, :"
    t = key_tile(plan, tile)
    if plan.varlen:
        return f"k_start + {t} * BLOCK_N:k_start + ({t} + 1) * BLOCK_N, kv_head, :"
    return f"batch_idx, {t} * BLOCK_N:({t} + 1) * BLOCK_N, kv_head, :"


def consumer_args(plan: Plan) -> str:
    """The consumer macro's parameters after (g, wait_bar, signal_bar); the call passes the same names."""
    names = ["Q_shared", "K_shared", "V_shared"]
    if not plan.split_kv:
        names.append("O_shared")
    names.append("O_partial" if plan.split_kv else "O")
    if not plan.pack_gqa:
        names.append("q_full")
    names += ["k_full", "k_empty", "v_full", "v_empty", "q0", "n_tiles", "head", "batch_idx"]
    names += ["LSE_partial" if (t.output and plan.split_kv) else t.param for t in plan.extra]
    if plan.split_kv and not plan.spec.lse:
        names.append("LSE_partial")
    if has_first_tile(plan):
        names.append("first_tile")
    if plan.pack_gqa:
        names.append("Q")
    if per_sequence(plan):
        names += ["q_len", "kv_len"] + (["causal_offset"] if has_offset(plan) else [])
    if plan.varlen:
        names.append("q_start")
    if plan.split_kv:
        names.append("split_idx")
    if plan.block_mask:
        names += ["q_block", "bm_b", "bm_h", "bm_partial_n", "bm_full_n"]
    names.append("softmax_scale")
    return ", ".join(names)


def row_valid(plan: Plan) -> str:
    return f"{row_pos(plan)} < q_len"


def out_index(plan: Plan, rows: str, head: str) -> str:
    """Index of O (or a split's O_partial) at query position `rows`, head `head`, column j."""
    idx = f"q_start + {rows}, {head}, j" if plan.varlen else f"batch_idx, {rows}, {head}, j"
    return f"split_idx, {idx}" if plan.split_kv else idx


def lse_index(plan: Plan, rows: str, head: str) -> str:
    idx = f"{head}, q_start + {rows}" if plan.varlen else f"batch_idx, {head}, {rows}"
    return f"split_idx, {idx}" if plan.split_kv else idx


def q_pack_index(plan: Plan) -> str:
    """Packed GQA: row r's query (clamped: rows past the sequence are computed, never stored)."""
    pos = "(q0 + row0 + r) // GQA_GROUP"
    row = f"T.min(q_start + {pos}, total_q - 1)" if plan.varlen else f"batch_idx, T.min({pos}, q_len - 1)"
    return f"{row}, head + (q0 + row0 + r) % GQA_GROUP, d"


def serving_constants(plan: Plan) -> list[str]:
    if not plan.page_size:
        return []
    return [f"PAGE_SIZE = {plan.page_size}  # keys per page of the K/V cache",
            f"TILES_PER_PAGE = {plan.page_size // plan.spec.block_n}  # a K/V tile is one TMA box inside one page"]


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
    shape = f"static B,H,HKV,SQ,SKV = {plan.shape}" if plan.shape else f"dynamic: {', '.join(kernel_dims(plan))} are runtime values"
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
    return {
        "header": header_lines(plan),
        "kernel_name": plan.name,
        "spec_hash": plan.hash,
        "head_dim": spec.head_dim,
        "dv": dv,
        "dtype": spec.dtype,
        "gqa_group": spec.gqa_group,
        "consumers": spec.consumers,
        "block_m": spec.block_m,
        "block_n": spec.block_n,
        "wg_rows": plan.wg_rows,
        "k_stages": spec.k_stages,
        "v_stages": spec.v_stages,
        "log2e": hw.LOG2E,
        "threads": plan.threads,
        "consumer_threads": plan.consumer_threads,
        "tma_thread_end": plan.tma_thread_end,
        "tma_threads": plan.tma_threads,
        "producer_regs": plan.producer_regs,
        "consumer_regs": plan.consumer_regs,
        "pingpong": spec.pingpong,
        "pingpong_threads": plan.pingpong_threads,
        "primer": plan.primer,
        "warpgroup_threads": plan.warpgroup_threads,
        "epilogue_bar": plan.epilogue_bar,
        "compile_flags": plan.compile_flags,
        "dims": kernel_dims(plan),
        "free_dims": free_dims,
        "offset": has_offset(plan) and not per_sequence(plan),
        "offset_comment": offset_comment(plan),
        "has_masked": has_masked,
        "all_masked": plan.mask_expr is not None,
        "barriers": plan.consumer_barriers,
        "first_tile": first_tile_expr(plan),
        "n_tiles": n_tiles_expr(plan),
        "full_tiles": full_tiles_expr(plan) if has_masked else "",
        "lead_tiles": lead_tiles_expr(plan),
        "masked_visit": masked_visit,
        "masked_visit_comment": masked_visit_comment,
        "steady_setup": loop_setup,
        "steady_loops": loops,
        "params": kernel_params(plan, dv),
        "consumer_args": consumer_args(plan),
        "block_mask": plan.block_mask,
        "grid": grid(plan),
        "block_vars": block_vars(plan),
        "block_setup": block_setup(plan),
        "q_box": lambda g: q_box(plan, g),
        "kv_tile_setup": lambda tile: kv_tile_setup(plan, tile),
        "kv_box": lambda tile: kv_box(plan, tile),
        "split_kv": plan.split_kv,
        "epilogue_store": ("store this split's float32 O and LSE (this block's rows only)" if plan.split_kv else
                           "stage in shared memory, store this sequence's rows only" if plan.varlen else
                           "stage in shared memory, one TMA store"),
        "pack_gqa": plan.pack_gqa,
        "clip_rows": plan.varlen or plan.split_kv,
        "varlen": plan.varlen,
        "row_valid": row_valid(plan),
        "out_index": out_index(plan, row_pos(plan), row_head(plan)),
        "lse_param": "LSE_partial" if plan.split_kv else "LSE",
        "lse_index": lse_index(plan, row_pos(plan), row_head(plan)),
        "q_pack_index": q_pack_index(plan),
        **(combine_context(plan, dv) if plan.split_kv else {}),
        **split_exprs(plan),
        "key_tile": lambda tile: key_tile(plan, tile),
        "q_rows": lambda g: q_rows(plan, g),
        "variant": Variant.of(plan),
        "serving_constants": serving_constants(plan),
        "bmask": ForwardVisits.of(plan),
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
