"""Plan -> the emitted forward module, through templates/fwd/fa3_fwd.py.j2.

The template is thin: it receives the numbers and the expressions built here (masks, tile
counts, guarded maxima, barrier ids), where they can be read and tested as Python, and only
lays them out in the order the GPU executes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from attngen import hw, tiles
from attngen.version import __version__
from attngen.kernels.common.plan import BLOCK_MASK_AXES, BLOCK_MASK_TENSORS, KernelNumbers, Shape
from attngen.kernels.fwd.kv_cache import KvCache
from attngen.kernels.fwd.plan import Plan, as_plan, masks_some_tile
from attngen.spec import Spec, to_toml
from attngen.kernels.combine.render import combine_context
from attngen.kernels.common.block_mask import BLOCK_MASK_TEST, ForwardVisits
from attngen.kernels.common.emit import render_template, tensor_param, write_if_different
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.common.schedulers import (BLOCK_PARAMS, COUNTER_CONSTANT, COUNTER_PARAMS, SLOT_LINE, VARLEN_TILE_PARAM,
                                               VARLEN_TILE_LINES, VARLEN_TOTAL_LINE,
                                               persistent_tile_lines, sample_frame, schedule_of, walks_backwards)
from attngen.kernels.common.variants import Variant, has_first_tile, has_offset, key_tile, row_head, row_pos, windowed

TEMPLATE = "fwd/fa3_fwd.py.j2"


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
        return tiles.text(n) + ("  # tiles [first_tile, first_tile + n_tiles): exactly the window's; >= 1 "
                                "(a block that sees no key runs one masked tile)")
    if n != visits:  # the clamp is not proven redundant: say why it is there
        return tiles.text(n) + "  # >= 1: a block of rows that see no key still runs (fully masked) tile 0"
    return tiles.text(n)


def split_exprs(plan: Plan) -> dict:
    """A split's share of the block's n_block_tiles visits (names the template binds under layout.split_kv)."""
    n, per = tiles.Sym("n_block_tiles", 1), tiles.Sym("tiles_per_split", 1)
    return {"split_tiles_per": tiles.text(tiles.split_tiles_per(n, tiles.Sym("num_splits", 1))),
            "split_first": tiles.text(tiles.split_first(tiles.Sym("split_idx", 0), per)),
            "split_n_tiles": tiles.text(tiles.at_least_one(tiles.split_count(n, _FIRST, per)))}




def kernel_params(plan: Plan, dv: str) -> list[str]:
    """The main prim_func's parameter lines, in the order of docs/serving.md's ABI."""
    layout = layout_of(plan)
    lines = layout.io_params(dv, KvCache.of(plan).k_dtype, "OUT_DTYPE" if plan.fp8 else "DTYPE")
    if v_transposed(plan):  # FA3's V_colmajor: each KV head's V as [dim, keys], a TMA box lands V^T
        lines[2] = tensor_param("V", ["batch", "kv_heads", dv, "kv_len"], "DTYPE")
    for t in plan.extra:
        if t.output and not layout.kernel_writes_lse:
            continue  # the combine kernel writes the LSE
        dims = [t.dim(a) for a in range(len(t.shape))]
        lines.append(tensor_param(t.param, dims, f'"{t.dtype}"',
                             "output: log-sum-exp per row, natural log" if t.output else f"call time: {t.name}"))
    lines += layout.serving_params()
    lines.append("softmax_scale: T.float32,  # call time: score = q . k * softmax_scale (default 1 / sqrt(HEAD_DIM))")
    if schedule_of(plan).persistent:
        # varlen: the host's sorted tile list replaces the L2 section (heads go out together per row tile)
        lines += COUNTER_PARAMS + ([BLOCK_PARAMS[0], VARLEN_TILE_PARAM] if layout.per_sequence else BLOCK_PARAMS)
    return lines


def v_transposed(plan: Plan) -> bool:
    """v_layout = "transposed" (fp8 only, docs/fp8.md): V arrives as [batch, kv_heads, head_dim_v, kv_len]."""
    return plan.spec.v_layout == "transposed"


def consumer_args(plan: Plan) -> str:
    """The consumer macro's parameters after (g, wait_bar, signal_bar); the call passes the same names."""
    layout = layout_of(plan)
    names = ["Q_shared", "K_shared"] + ([] if v_transposed(plan) else ["V_shared"]) + layout.consumer_outputs() + layout.q_barrier_args()
    names += ["k_full", "k_empty"] + ([] if v_transposed(plan) else ["v_full", "v_empty"])
    persistent = schedule_of(plan).persistent
    # a persistent consumer binds its tile's rows, head and visits itself, from the index the producer hands over
    if persistent and layout.per_sequence:
        names += ["tile_shared", "tile_full", "tile_empty", "tile_list", "total_tiles"]
    else:
        names += ["tile_shared", "tile_full", "tile_empty", "m_blocks", "heads_total", "total_tiles", "section"] if persistent \
            else ["q0", "n_tiles", "head", "batch_idx"]
    if plan.fp8:
        names += ["P_shared", "Vt_shared", "vt_full", "vt_empty"]
    names += [layout.lse_param if t.output else t.param for t in plan.extra]
    names += layout.extra_output_args(plan.spec.lse)
    if has_first_tile(plan) and not persistent:
        names.append("first_tile")
    # a per-sequence (varlen, paged) persistent consumer reads its tile's sequence bounds itself
    sequence = layout.sequence_tensors() if persistent and layout.per_sequence else layout.sequence_args(has_offset(plan))
    names += layout.q_load_args() + sequence + layout.split_args()
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


def longest_first(plan: Plan) -> bool:
    """Whether the persistent order walks the row tiles backwards, so that those that see the most keys
    go first (FA3's LPT): under causal attention the last row tile sees the most; under a left-only
    window the first. Read from tiles.Frame's ranges, as the backward's orders are."""
    fr = sample_frame(plan, plan.spec.block_m, plan.spec.block_n)
    return walks_backwards(lambda t: fr.row_tile_visits(t), fr.q_tiles(), "longest")


def held_in_vars(lines: list[str]) -> list[str]:
    """`name = value` lines as T.alloc_var stores. A persistent kernel's steady-loop split points as
    plain names (lets) inside the tile loop failed to lower with 3 consumers and the split loop
    ("Let cannot bind the same var to two different values", TileLang 0.1.15); held in vars they lower."""
    out = []
    for line in lines:
        out += [f'{line.split(" = ", 1)[0]} = T.alloc_var("int32", 0)', line]
    return out


def persistent_context(plan: Plan) -> dict:
    """The persistent scheduler's lines (the template's `persistent`): `setup`, the block's tile
    count and counter slot; `tile`, what each tile binds from its index `tile` (persistent_steps'
    rule, a line per step, then the lines a single-tile block binds from its grid position)."""
    varlen = layout_of(plan).per_sequence
    if varlen:  # the launcher listed the (sequence, row tile) pairs longest first (schedulers.varlen_tile_list)
        lines = list(VARLEN_TILE_LINES)
    else:
        lines = persistent_tile_lines("m_blocks", longest_first(plan))
        lines[-1] += "  # longest first: the last row tile sees the most keys" if longest_first(plan) else ""
        lines += ["batch_idx = T.truncdiv(bh, heads)  # truncdiv: both >= 0, no floor fix-up code", "head = T.truncmod(bh, heads)"]
    lines += layout_of(plan).block_setup(has_offset(plan))
    lines.append(schedule_of(plan).tile_start("q0", "q_block", "BLOCK_M"))
    if first_tile_expr(plan):
        lines.append(f"first_tile = {first_tile_expr(plan)}  # the window's left edge for the block's first row")
    lines.append(f"n_tiles = {n_tiles_expr(plan)}")
    # what the loads, masks and epilogue read, held in T.alloc_vars: computed once per tile. As plain
    # names (lets) TileLang inlined the decoding into every use: a window with softcap and ALiBi built to
    # 105801 SASS lines and 64 B of spills, against 12153 lines and none for the single-tile kernel
    held = ["batch_idx", "head", "kv_head", "q0", "n_tiles"] + (["first_tile"] if first_tile_expr(plan) else [])
    if varlen:  # the tile's sequence bounds change from tile to tile too
        bound = [line.split(" = ", 1)[0] for line in layout_of(plan).block_setup(has_offset(plan))]
        held[2:2] = [name for name in bound if name not in held]
    setup = ["m_blocks = T.ceildiv(q_len, BLOCK_M)  # row tiles per head",
             "heads_total = batch * heads  # tile t's (batch, head) pair is bh = batch_idx * heads + head",
             "total_tiles = m_blocks * heads_total  # the counter hands out [0, total_tiles), then an end mark per block",
             SLOT_LINE]
    if varlen:  # total_tiles: the tile list's real pairs, times the heads
        setup = [VARLEN_TOTAL_LINE, SLOT_LINE]
    return {"setup": setup, "tile": lines, "vars": [f'{name} = T.alloc_var("int32", 0)' for name in held],
            "constants": [COUNTER_CONSTANT], "consumer_tile": tile_scale_setup(plan)}


def tile_scale_setup(plan: Plan) -> list[str]:
    """The consumer's scale lines that read the tile's (batch, KV head): fp8's descales. A single-tile block
    derives them once; a persistent block's tile changes both, so it derives them per tile."""
    return Variant.of(plan).scale_setup() if plan.fp8 and schedule_of(plan).persistent else []


def block_scale_setup(plan: Plan) -> list[str]:
    """The consumer's scale lines derived once per block (all of them, unless a tile rederives them)."""
    return [] if tile_scale_setup(plan) else Variant.of(plan).scale_setup()


def template_context(plan: Plan) -> dict:
    """Every name the template uses (documented at the top of the template)."""
    spec = plan.spec
    has_masked = masks_some_tile(spec)
    dv = "HEAD_DIM" if plan.head_dim_v == spec.head_dim else "HEAD_DIM_V"
    free_dims = [t.dim(a) for t in plan.extra for a in range(len(t.shape)) if t.shape[a] is None]
    if plan.block_mask:
        free_dims += list(BLOCK_MASK_AXES)
    if schedule_of(plan).persistent and layout_of(plan).per_sequence:
        free_dims.append("tile_rows")  # the tile list's rows (pairs bound + 1)
    masked_visit, masked_visit_comment = masked_visit_expr(plan) if has_masked else ("", "")
    loop_setup, loops = steady_loops(plan)
    layout = layout_of(plan)
    visits = ForwardVisits.of(plan)
    return {
        "layout": layout,
        "schedule": schedule_of(plan),
        "row_pos": row_pos(plan),  # a row's query position and head, as the layout's indexes take them
        "row_head": row_head(plan),
        "q_rows": lambda g: q_rows(plan, g),
        "key_tile": lambda tile: key_tile(plan, tile),
        "block_setup": layout.block_setup(has_offset(plan)) + visits.setup(),
        "dv": dv,
        "kernel": ForwardNumbers.of(plan),
        "dims": layout.kernel_dims(plan.shape),
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
        "steady_setup": held_in_vars(loop_setup) if schedule_of(plan).persistent else loop_setup,
        "steady_loops": loops,
        "params": kernel_params(plan, dv),
        "block_mask": plan.block_mask,
        **(combine_context(plan, dv) if layout.split_kv else {}),
        **(split_exprs(plan) if layout.split_kv else {}),
        "variant": Variant.of(plan),
        "scale_setup": block_scale_setup(plan),
        "serving_constants": layout.constants(),
        "bmask": visits,
        "kv_cache": KvCache.of(plan),
        **({"persistent": persistent_context(plan)} if schedule_of(plan).persistent else {}),
        "fp8": plan.fp8,
        "v_transposed": v_transposed(plan),
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
