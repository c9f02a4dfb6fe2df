"""BackwardPlan -> the emitted backward module (templates/bwd/fa3_bwd.py.j2): preprocess, main, postprocess.

The backward shares with the forward what the two passes say the same way: the variant's hooks
(kernels/common/variants.py: the score chain and its derivative, the masks in the backward's
orientations, the constants) and the tile-range algebra (tiles.Frame's transposed direction,
q_first .. q_full_stop). The main kernel's fragments are [keys, query rows] (element (i, j) is
key key0 + i, query row m0 + j): variants.MAIN names its rows and keys that way. docs/backward.md describes each kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attngen import hw, tiles
from attngen.kernels.bwd.plan import BackwardPlan, plan_backward
from attngen.kernels.common.plan import BLOCK_MASK_AXES, BLOCK_MASK_TENSORS, KernelNumbers
from attngen.kernels.common.block_mask import backward_walk
from attngen.kernels.common.emit import render_template, tensor_param, write_if_different
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.bwd import persistent
from attngen.kernels.common.schedulers import BLOCK_PARAMS, COUNTER_PARAMS, schedule_of, varlen_tile_param
from attngen.kernels.common.variants import Variant, has_offset
from attngen.spec import Spec, to_toml
from attngen.version import __version__

TEMPLATE = "bwd/fa3_bwd.py.j2"
PRE_ROWS = 64  # rows of one head per preprocess / postprocess block
PRE_THREADS = 128

def frame(bp: BackwardPlan) -> tiles.Frame:
    """The backward's problem in the kernel's names (kv_len, q_len >= 1 in a bshd kernel; a packed
    sequence may have none)."""
    f = bp.forward
    lo = 0 if layout_of(f).per_sequence else 1
    return tiles.Frame(q_len=tiles.Sym("q_len", lo), kv_len=tiles.Sym("kv_len", lo), offset=tiles.Sym("causal_offset"),
                       edges=tiles.Edges(f.window_left, f.window_right), block_m=tiles.Sym("BLOCK_M", 1),
                       block_n=tiles.Sym("BLOCK_N", 1))


_KV_TILE = tiles.Sym("kv_block", 0)


def q_range(bp: BackwardPlan) -> dict:
    """The Q tiles the CTA's KV tile visits, and those it sees whole (tiles.Frame.q_span's bounds)."""
    if bp.forward.block_mask:  # the listed Q tiles, partial and full (0: none; dK = dV = 0 are still written)
        return {"q_first": "0", "n_q": "bm_partial_n + bm_full_n", "full_first": "", "full_stop": ""}
    fr = frame(bp)
    first = fr.q_first(_KV_TILE)
    n_q = tiles.text(tiles.max_(tiles.sub(fr.q_stop(_KV_TILE), tiles.Sym("q_first", 0)), 0))
    return {"q_first": tiles.text(first),
            "n_q": layout_of(bp.forward).guard_count(n_q, "kv0", "kv_len"),
            "full_first": tiles.text(fr.q_full_first(_KV_TILE)),
            "full_stop": tiles.text(fr.q_full_stop(_KV_TILE))}


def has_edges(bp: BackwardPlan) -> bool:
    return bp.forward.window_left is not None or bp.forward.window_right is not None


def masked_visit(bp: BackwardPlan) -> str:
    """Is Q tile q_tile of this KV tile masked? Outside the tiles every row sees whole, the last Q
    tile when it passes q_len, and every visit of a KV tile that passes kv_len. A mask_mod masks all."""
    if bp.forward.block_mask:  # a tile past a length is never full (tiles.tile_states, retile_states)
        return "partial"
    if bp.forward.mask_expr is not None:
        return "True"
    parts = []
    if has_edges(bp):
        parts.append("q_tile < full_first or q_tile >= full_stop")
    parts += ["m0 + BLOCK_M > q_len", "kv_partial"]
    return " or ".join(parts)


def dq_range(bp: BackwardPlan) -> dict:
    """The dq kernel's KV tiles (the forward's direction: tiles.Frame.kv_first .. kv_full_stop)."""
    f = bp.forward
    if f.block_mask:  # the listed KV tiles of the block's rows, ascending (common/block_mask.py backward_walk)
        return {"dq_kv_first": "0", "dq_n_kv": "bm_partial_n + bm_full_n", "dq_full_first": "", "dq_full_stop": "",
                "dq_masked_visit": "partial"}
    layout = layout_of(f)
    lo = 0 if layout.per_sequence else 1
    fr = tiles.Frame(q_len=tiles.Sym("q_len", lo), kv_len=tiles.Sym("kv_len", lo), offset=tiles.Sym("causal_offset"),
                     edges=tiles.Edges(f.window_left, f.window_right), block_m=tiles.Sym("DQ_BLOCK_M", 1),
                     block_n=tiles.Sym("DQ_BLOCK_N", 1))
    q0, row0 = tiles.Sym("q0", 0), tiles.Sym("row0", 0)
    block = tiles.Rows(q0, tiles.add(q0, tiles.Sym("DQ_BLOCK_M", 1), -1))
    wg = tiles.Rows(tiles.add(q0, row0), tiles.add(q0, row0, tiles.Sym("WG_ROWS", 1), -1))
    first = fr.kv_first(block)
    full_first = fr.kv_full_first(wg)
    masked = "True" if f.mask_expr is not None else " or ".join(
        ([] if full_first == 0 else ["kv_tile < full_first"]) + ["kv_tile >= full_stop"])
    n_kv = tiles.text(tiles.max_(tiles.sub(fr.kv_stop(block), tiles.Sym("kv_first", 0)), 0))
    return {"dq_kv_first": tiles.text(first),
            "dq_n_kv": layout.guard_count(n_kv, "q0", "q_len"),
            "dq_full_first": "" if full_first == 0 or masked == "True" else tiles.text(full_first),
            "dq_full_stop": "" if masked == "True" else tiles.text(fr.kv_full_stop(wg)),
            "dq_masked_visit": masked}


def grouped_visits(bp: BackwardPlan) -> bool:
    """Deterministic GQA: a block owns a KV head and visits its group's query heads in turn."""
    return bp.deterministic and bp.spec.gqa_group > 1


def visits(bp: BackwardPlan) -> dict:
    if grouped_visits(bp):
        return {"visit": "v", "n_visits": "GQA_GROUP * n_q",
                "visit_comment": "  # each query head of the group in turn: dK and dV summed in registers, in order",
                "visit_lines": ["head = kv_head * GQA_GROUP + v // n_q", "m = v % n_q"]}
    return {"visit": "m", "n_visits": "n_q", "visit_comment": "", "visit_lines": []}


def consumer_args(bp: BackwardPlan) -> str:
    names = ["K_shared", "V_shared", "Q_shared", "dO_shared", "LSE_shared", "dPsum_shared"]
    if not bp.deterministic:
        names += ["dS_shared", "dQ_shared"]
    names += ["kv_full", "q_full", "q_empty", "do_full", "do_empty"]
    if not bp.deterministic:
        names.append("dQ_accum")
    names += ["dK_accum", "dV_accum"] if bp.kv_accum else ["dK", "dV"]
    if varlen_persistent(bp):  # ... from the launcher's list of (sequence, KV tile) pairs
        names += ["tile_shared", "tile_full", "tile_empty", persistent.MAIN_LIST[0], "total_tiles"]
    elif schedule_of(bp.forward).persistent:  # a persistent consumer binds its tile itself, from the index handed over
        names += ["tile_shared", "tile_full", "tile_empty", "kv_blocks", "heads_total", "total_tiles", "section"]
    else:
        names += ["kv_block"] + ([] if grouped_visits(bp) else ["head"]) + ["kv_head", "batch_idx", "q_first", "n_q"]
        names += ["full_first", "full_stop"] if has_edges(bp) else []
        names.append("kv_partial")
    names += seq_names(bp)
    names += [t.param for t in call_tensors(bp)]
    names += term_names(bp) if bp.deterministic else ["d" + t.param for t in learnable_tensors(bp)]
    names += block_mask_args(bp)
    return ", ".join(names + ["softmax_scale"])


# -- a block mask (FlexAttention's BlockMask): each kernel walks its lists (common/block_mask.py) ---------
def block_mask_args(bp: BackwardPlan, dq: bool = False) -> list:
    """What a consumer macro's walk reads (the dq macro also takes its q_block; the main one has kv_block)."""
    walk = backward_walk(bp.forward, dq)
    return (["q_block"] if dq else []) + walk.args() if walk else []


def tile_lines(bp: BackwardPlan, dq: bool = False, producer: bool = False) -> tuple[list, list]:
    """(before the loop, at the top of each visit): the visit's tile, kept as the dense kernel names it
    (consumers: q_tile / kv_tile; the producer: m0 / kv0), walked from the lists with a block mask."""
    tile, first, step, start = ("kv_tile", "kv_first", "k", "kv0") if dq else ("q_tile", "q_first", "m", "m0")
    size = "DQ_BLOCK_N" if dq else "BLOCK_M"
    walk = backward_walk(bp.forward, dq)
    if not walk:
        return [], [f"{start} = ({first} + {step}) * {size}" if producer else f"{tile} = {first} + {step}"]
    return walk.cursors(), walk.step() + ([f"{start} = {tile} * {size}"] if producer else [])


def block_mask_params(bp: BackwardPlan, dq: bool = False) -> list:
    walk = backward_walk(bp.forward, dq)
    return [tensor_param(param, list(axes), '"int32"', f"call time: {name} (the {'dq' if dq else 'main'} kernel's tiles)")
            for name, param, axes in (walk.tensors if walk else ())]


# -- packed sequences (layout = "varlen"): each block reads its sequence's rows and lengths ------
SEQUENCE_NOTES = {"q_note": "this sequence's rows of q, dO, dQ", "k_note": "... and of k, v, dK, dV"}


def seq_names(bp: BackwardPlan) -> list:
    """The block's per-sequence values a macro needs (none for bshd, whose lengths are the kernel's; a
    varlen persistent macro reads each tile's bounds itself, from the prefix sums)."""
    layout = layout_of(bp.forward)
    if varlen_persistent(bp):
        return layout.sequence_tensors()
    return layout.sequence_args(has_offset(bp.forward)) + layout.key_start_args()


def varlen_persistent(bp: BackwardPlan) -> bool:
    """A persistent varlen backward: its kernels take their tiles from call-time lists (schedulers.varlen_pairs)."""
    return schedule_of(bp.forward).persistent and layout_of(bp.forward).per_sequence




def call_tensors(bp: BackwardPlan) -> list:
    """The forward's call-time tensors (ALiBi slopes, score_mod/mask_mod tensors): the main kernel reads them too."""
    lists = {n for n, _, _ in BLOCK_MASK_TENSORS}  # the forward's own block-mask lists: the backward has its own
    return [t for t in bp.forward.extra if not t.output and t.name != "sinks" and t.name not in lists]


def learnable_tensors(bp: BackwardPlan) -> list:
    """The call-time tensors whose gradients the main kernel scatters (spec.learnable), in kernel order."""
    return [t for t in call_tensors(bp) if t.name in bp.spec.learnable]


def term_names(bp: BackwardPlan) -> list:
    """Deterministic: the main kernel stores each learnable read's term per (batch, head, row, key)
    in one of these (no atomics); build_dtensors_kernel sums them in one order."""
    if not (bp.deterministic and bp.spec.learnable):
        return []
    return [f"Terms{k}" for k in range(len(Variant.of(bp.forward).tensor_grads(bp.spec.learnable)))]


def params(bp: BackwardPlan, dv: str) -> dict:
    """Each kernel's prim_func parameter lines (docs/backward.md, "The kernels' parameters")."""
    layout = layout_of(bp.forward)
    q_shape, kv_shape, rows_shape = layout.q_shape, layout.kv_shape, layout.lse_shape()
    seq = layout.backward_params()
    kv_out = '"float32"' if bp.kv_accum else "DTYPE"
    kv_names = ("dK_accum", "dV_accum") if bp.kv_accum else ("dK", "dV")
    pre = [tensor_param("O", q_shape(dv), "DTYPE", "the forward's output"), tensor_param("dO", q_shape(dv), "DTYPE"),
           tensor_param("LSE", rows_shape, '"float32"', "the forward's log-sum-exp, natural log (-inf: a row with no key)"),
           tensor_param("dLSE", rows_shape, '"float32"', "the LSE output's gradient (zeros when the loss reads no LSE)"),
           tensor_param("dPsum", rows_shape, '"float32"', "output: rowsum(dO * O) - dLSE"),
           tensor_param("LSE2", rows_shape, '"float32"', "output: LSE * log2(e), 0 where LSE is -inf")]
    if not bp.deterministic:
        pre.append(tensor_param("dQ_accum", q_shape("HEAD_DIM"), '"float32"', "output: zeroed (the main kernel reduce-adds into it)"))
    if bp.spec.sinks and not bp.deterministic:
        pre += [tensor_param("Sinks", ["heads"], '"float32"', "call time: sinks"),
                tensor_param("dSinks", ["heads"], '"float32"', "in/out: zeroed by the caller; -= sum_rows exp(sink - LSE) dPsum")]
    dsinks = [tensor_param("LSE", rows_shape, '"float32"'), tensor_param("dPsum", rows_shape, '"float32"'),
              tensor_param("Sinks", ["heads"], '"float32"', "call time: sinks"),
              tensor_param("dSinks", ["heads"], '"float32"', "output: -sum_rows exp(sink - LSE) dPsum")] + seq
    main = [tensor_param("Q", q_shape("HEAD_DIM"), "DTYPE"), tensor_param("K", kv_shape("HEAD_DIM"), "DTYPE"),
            tensor_param("V", kv_shape(dv), "DTYPE"), tensor_param("dO", q_shape(dv), "DTYPE"),
            tensor_param("LSE2", rows_shape, '"float32"'), tensor_param("dPsum", rows_shape, '"float32"')]
    if not bp.deterministic:
        main.append(tensor_param("dQ_accum", q_shape("HEAD_DIM"), '"float32"', "in/out: dS K reduce-added, unscaled"))
    main += [tensor_param(kv_names[0], kv_shape("HEAD_DIM"), kv_out,
                    "in/out: zeroed by the caller; dK of the group's query heads atomically added, scaled" if bp.kv_accum
                    else "output: dK, scaled"),
            tensor_param(kv_names[1], kv_shape(dv), kv_out,
                    "in/out: zeroed by the caller; dV of the group's query heads atomically added" if bp.kv_accum else "output: dV")]
    calls = [tensor_param(t.param, [t.dim(a) for a in range(len(t.shape))], f'"{t.dtype}"', f"call time: {t.name}")
             for t in call_tensors(bp)]
    scale = "softmax_scale: T.float32,  # call time: score = q . k * softmax_scale"
    grads = [tensor_param("d" + t.param, [t.dim(a) for a in range(len(t.shape))], '"float32"',
                          f"in/out: zeroed by the caller; d(loss)/d({t.name}) atomically added") for t in learnable_tensors(bp)]
    terms = [tensor_param(n, ["batch", "heads", "q_len", "kv_len"], '"float32"', "in/out: zeroed by the caller; "
                          "a learnable read's term per element (0 where masked)") for n in term_names(bp)]
    main += calls + (terms if bp.deterministic else grads) + block_mask_params(bp) + seq + [scale]
    counted = schedule_of(bp.forward).persistent
    if varlen_persistent(bp):  # the launcher's lists in the L2 section's place
        main += COUNTER_PARAMS + [BLOCK_PARAMS[0], varlen_tile_param(*persistent.MAIN_LIST, "KV tile", "longest first",
                                                                     "bwd/persistent.varlen_main_list")]
    else:
        main += COUNTER_PARAMS + BLOCK_PARAMS if counted else []
    dq = [tensor_param("Q", q_shape("HEAD_DIM"), "DTYPE"), tensor_param("K", kv_shape("HEAD_DIM"), "DTYPE"),
          tensor_param("V", kv_shape(dv), "DTYPE"), tensor_param("dO", q_shape(dv), "DTYPE"),
          tensor_param("LSE2", rows_shape, '"float32"'), tensor_param("dPsum", rows_shape, '"float32"'),
          tensor_param("dQ", q_shape("HEAD_DIM"), "DTYPE", "output: dQ, scaled")] + calls + block_mask_params(bp, True) + seq + [scale]
    if varlen_persistent(bp):
        dq += [BLOCK_PARAMS[0], varlen_tile_param(*persistent.DQ_LIST, "Q tile", "shortest first",
                                                  "bwd/persistent.varlen_dq_list")]
    else:
        dq += BLOCK_PARAMS if counted else []  # a fixed order: no counter
    post = [tensor_param("dQ_accum", q_shape("HEAD_DIM"), '"float32"'),
            tensor_param("dQ", q_shape("HEAD_DIM"), "DTYPE", "output")] + seq + [scale]
    post_kv = [tensor_param("dK_accum", kv_shape("HEAD_DIM"), '"float32"'), tensor_param("dV_accum", kv_shape(dv), '"float32"'),
               tensor_param("dK", kv_shape("HEAD_DIM"), "DTYPE", "output"), tensor_param("dV", kv_shape(dv), "DTYPE", "output")]
    pre += seq
    post_kv += seq
    dtensors = [p.replace("atomically added", "summed in one order") for p in grads]
    dtensors = [tensor_param(n, ["batch", "heads", "q_len", "kv_len"], '"float32"', "the main kernel's terms")
                for n in term_names(bp)] + calls + dtensors
    return {"pre_params": pre, "main_params": main, "post_params": post, "post_kv_params": post_kv, "dq_params": dq,
            "dsinks_params": dsinks, "dtensors_params": dtensors}


def header_lines(bp: BackwardPlan) -> list[str]:
    spec = bp.spec
    shape = f"static B,H,HKV,SQ,SKV = {bp.shape}" if bp.shape else "dynamic: batch, q_len, kv_len, kv_heads are runtime values"
    lines = [
        "=" * 78,
        "attngen auto-generated backward kernels: do not edit; regenerate with attngen.",
        f"kernel:    {bp.name}",
        f"spec hash: {bp.hash}",
        f"generator: attngen {__version__}, template {Path(TEMPLATE).name}",
        f"shape:     {shape}",
        f"schedule:  1 TMA producer warpgroup + {bp.consumers} MMA warpgroup(s) of {bp.wg_keys} keys, {bp.threads} threads, "
        f"setmaxnreg {bp.producer_regs}/{bp.consumer_regs}; FA3's tile {bp.fa3_tile[0]}x{bp.fa3_tile[1]} ({bp.fa3_tile[2]} WGs)",
        f"smem:      {bp.smem_bytes} bytes dynamic (" + ", ".join(f"{k} {v}" for k, v in bp.smem.items()) + ")",
        "entries:   " + ", ".join(entries(bp)),
        "spec:",
    ]
    lines += ["  " + line for line in to_toml(spec).splitlines()]
    lines.append("=" * 78)
    return lines


def entries(bp: BackwardPlan) -> list:
    """The module's kernel builders, in launch order."""
    out = ["build_preprocess_kernel", "build_kernel"]
    out.append("build_dq_kernel" if bp.deterministic else "build_postprocess_kernel")
    if bp.deterministic and bp.spec.sinks:
        out.append("build_dsinks_kernel")
    if term_names(bp):
        out.append("build_dtensors_kernel")
    if bp.kv_accum:
        out.append("build_postprocess_kv_kernel")
    return out


def layout_context(bp: BackwardPlan, dv: str) -> dict:
    """How the main kernel's MMA warpgroups share the KV tile: by keys (each its 64 keys, every head-dim
    column; K and V slices are key rows) or, where dK and dV of 64 keys would not fit in registers, by
    columns (each all 64 keys, 1/n of the head dims of dK, dV and dQ; S^T and dP^T summed over the
    column slices of K, Q, V and dO, every warpgroup computing them whole)."""
    n = bp.consumers
    layout = layout_of(bp.forward)
    if not bp.columns:
        kv_loads = []
        for g in range(n):
            lo = f"kv0 + {g * bp.wg_keys}" if g else "kv0"
            rows = layout.k_box(lo, f"kv0 + {(g + 1) * bp.wg_keys}")
            kv_loads += [(f"K[{rows}, :]", f"K_shared[{g}, :, :]"), (f"V[{rows}, :]", f"V_shared[{g}, :, :]")]
        return {"columns": False, "wg_doc": "keys [key0, key0 + WG_KEYS) of the KV tile, every head-dim column",
                "key0": "kv_block * BLOCK_N + g * WG_KEYS", "dk_w": "HEAD_DIM", "dv_w": dv,
                "dq_doc": "this warpgroup's keys' share of dQ",
                "s_gemms": [("K_shared[g, :, :]", "Q_shared[stage, 0, :, :]", True)],
                "dp_gemms": [("V_shared[g, :, :]", "dO_shared[stage, 0, :, :]", True)],
                "own_slice": "0", "dk_cols": ":", "dv_cols": ":", "dk_col": lambda d: d, "dv_col": lambda d: d,
                "kv_slice_doc": "one slice of keys per MMA warpgroup", "q_slices": 1, "q_slice_doc": "",
                "kv_loads": kv_loads, "slice_cols": lambda c, w: ":"}
    rows = layout.k_box("kv0", "kv0 + BLOCK_N")
    cols = lambda c, w: f"{c} * {w}:{c + 1} * {w}" if c else f"0:{w}"  # noqa: E731
    kv_loads = []
    for c in range(n):
        kv_loads += [(f"K[{rows}, {cols(c, 'DK_COLS')}]", f"K_shared[{c}, :, :]"),
                     (f"V[{rows}, {cols(c, 'DV_COLS')}]", f"V_shared[{c}, :, :]")]
    return {"columns": True, "wg_doc": "every key of the KV tile, head-dim columns [g DK_COLS, (g + 1) DK_COLS) of dK and dQ (dV: DV_COLS)",
            "key0": "kv_block * BLOCK_N", "dk_w": "DK_COLS", "dv_w": "DV_COLS",
            "dq_doc": "this warpgroup's columns of dQ",
            "s_gemms": [(f"K_shared[{c}, :, :]", f"Q_shared[stage, {c}, :, :]", c == 0) for c in range(n)],
            "dp_gemms": [(f"V_shared[{c}, :, :]", f"dO_shared[stage, {c}, :, :]", c == 0) for c in range(n)],
            "own_slice": "g", "dk_cols": "g * DK_COLS:(g + 1) * DK_COLS", "dv_cols": "g * DV_COLS:(g + 1) * DV_COLS",
            "dk_col": lambda d: f"g * DK_COLS + {d}", "dv_col": lambda d: f"g * DV_COLS + {d}",
            "kv_slice_doc": "column slices of the tile's keys (S^T sums over them)", "q_slices": n,
            "q_slice_doc": "  # column slices, as K's", "kv_loads": kv_loads, "slice_cols": cols}


@dataclass(frozen=True, kw_only=True)
class BackwardNumbers(KernelNumbers):
    """The backward plan's numbers the templates print (fa3_bwd.py.j2's and fa3_bwd_dq.py.j2's
    `kernel`): the resolved spec, tile sizes, thread ranges, register split, barrier ids."""

    wg_keys: int
    """keys of the KV tile per MMA warpgroup (split by keys)"""
    q_stages: int
    """Q/dO tiles in flight"""
    ds_bar: int
    """named barrier: dS staged in shared memory"""
    dq_bar: int
    """named barrier: the dQ tile's accumulation"""
    pre_rows: int
    """rows of one head per preprocess / postprocess block"""
    pre_cols: int
    """the preprocess's O * dO tile width (0: the head dim itself; TileLang 0.1.15 finds no fragment layout for 96 columns)"""
    pre_threads: int
    """threads per preprocess / postprocess block"""
    dq_block_m: int
    """the deterministic dq kernel's query rows per block (0 without it)"""
    dq_block_n: int
    """... its keys per K/V tile"""
    dq_kv_stages: int
    """... and its K/V stages"""

    @classmethod
    def of(cls, bp: BackwardPlan) -> BackwardNumbers:
        spec, f = bp.spec, bp.forward
        return cls(header=header_lines(bp), name=bp.name, spec_hash=bp.hash, head_dim=spec.head_dim,
                   dtype=spec.dtype, gqa_group=spec.gqa_group, block_m=bp.block_m, block_n=bp.block_n,
                   wg_keys=bp.wg_keys, consumers=bp.consumers, q_stages=bp.q_stages, log2e=hw.LOG2E,
                   threads=bp.threads, consumer_threads=bp.consumer_threads, tma_thread_end=bp.tma_thread_end,
                   tma_threads=bp.tma_threads, producer_regs=bp.producer_regs, consumer_regs=bp.consumer_regs,
                   warpgroup_threads=bp.warpgroup_threads, ds_bar=bp.ds_bar, dq_bar=bp.dq_bar,
                   pre_rows=PRE_ROWS,
                   # the preprocess's O * dO tile: TileLang 0.1.15 finds no fragment layout for 96 columns
                   pre_cols=0 if f.head_dim_v & (f.head_dim_v - 1) == 0 else 1 << f.head_dim_v.bit_length(),
                   pre_threads=PRE_THREADS, compile_flags=bp.compile_flags, consumer_args=consumer_args(bp),
                   dq_block_m=bp.dq_block_m, dq_block_n=bp.dq_block_n, dq_kv_stages=bp.dq_kv_stages)


def template_context(bp: BackwardPlan) -> dict:
    f = bp.forward
    spec = bp.spec
    dv = "HEAD_DIM" if f.head_dim_v == spec.head_dim else "HEAD_DIM_V"
    layout = layout_of(f)
    free = [t.dim(a) for t in call_tensors(bp) for a in range(len(t.shape)) if t.shape[a] is None]
    if f.block_mask:
        free += list(BLOCK_MASK_AXES) + (["bm_dq_q_tiles", "bm_dq_kv_tiles"] if bp.deterministic else [])
    if varlen_persistent(bp):  # the tile lists' rows (pairs bound + 1)
        free += [persistent.MAIN_LIST[1]] + ([persistent.DQ_LIST[1]] if bp.deterministic else [])
    seq_setup = layout.sequence_setup(has_offset(f), **SEQUENCE_NOTES)
    return {
        "layout": layout,
        "schedule": schedule_of(f),
        "seq_setup": seq_setup,
        "dv": dv,
        "kernel": BackwardNumbers.of(bp),
        "dims": layout.kernel_dims(bp.shape),
        "free_dims": free,
        "offset": has_offset(f),  # (varlen: per sequence, in seq_setup)
        "kv_accum": bp.kv_accum,
        "sinks": spec.sinks,
        **q_range(bp),
        "has_edges": has_edges(bp),
        "masked_visit": masked_visit(bp),
        "extra_args": "".join(f", {t.param}" for t in call_tensors(bp)),
        "tile_init": tile_lines(bp)[0],
        "tile_lines": tile_lines(bp)[1],
        "producer_tile_lines": tile_lines(bp, producer=True)[1],
        **layout_context(bp, dv),
        "seq_args": "".join(f", {n}" for n in seq_names(bp)),
        "deterministic": bp.deterministic,
        "grouped_visits": grouped_visits(bp),
        "main_grid_heads": "kv_heads" if grouped_visits(bp) else "heads",
        "main_head_var": "kv_head" if grouped_visits(bp) else "head",
        **visits(bp),
        **(dq_context(bp, seq_setup) if bp.deterministic else {}),
        **params(bp, dv),
        "variant": Variant.of(f),
        "tensor_grads": Variant.of(f).tensor_grads(spec.learnable),
        "terms": term_names(bp),  # (deterministic: the main kernel's stores, the walk's sources)
        "walk_targets": [t for t, _ in Variant.of(f).tensor_grads(spec.learnable, at=("bi", "hi", "qi", "kj"))],
        "tensor_grads_mask": Variant.of(f).bwd_mask_cond(inline=True) if spec.learnable else "",
        "bmask": backward_walk(f),
        "dq_bmask": backward_walk(f, dq=True),
        **({"persistent": persistent.main_context(bp, q_range(bp), has_edges(bp), seq_setup)} if schedule_of(f).persistent
           else {}),
    }


def dq_context(bp: BackwardPlan, seq_setup: list) -> dict:
    tile_args = ("q_empty, q_blocks, heads_total, total_tiles, num_sms, section, sm" if schedule_of(bp.forward).persistent
                 else "q0, head, batch_idx, kv_first, n_kv")
    if varlen_persistent(bp):
        tile_args = f"q_empty, {persistent.DQ_LIST[0]}, total_tiles, num_sms, sm"
    return {**dq_range(bp), "dq_tile_args": tile_args,
            **({"dq_persistent": persistent.dq_context(bp, dq_range(bp), seq_setup)} if schedule_of(bp.forward).persistent
               else {}),
            "dq_bm_args": "".join(f", {a}" for a in block_mask_args(bp, True)),
            "dq_tile_init": tile_lines(bp, True)[0], "dq_tile_lines": tile_lines(bp, True)[1],
            "dq_producer_tile_lines": tile_lines(bp, True, producer=True)[1]}


def as_backward_plan(spec_or_plan, shape=None) -> BackwardPlan:
    if isinstance(spec_or_plan, BackwardPlan):
        return spec_or_plan
    if isinstance(spec_or_plan, Spec):
        return plan_backward(spec_or_plan, shape)
    return plan_backward(spec_or_plan.spec, shape if shape is not None else spec_or_plan.shape)  # a forward Plan


def render_backward_source(spec_or_plan, shape=None) -> str:
    """The emitted backward module (dynamic shapes unless the plan has a static shape)."""
    bp = as_backward_plan(spec_or_plan, shape)
    return render_template(TEMPLATE, template_context(bp))


def generate_backward(spec_or_plan, out_dir="generated", shape=None) -> Path:
    """Write the emitted backward module under `out_dir` (fa3_bwd_<name>.py); return its path."""
    bp = as_backward_plan(spec_or_plan, shape)
    path = Path(out_dir) / f"{bp.name}.py"
    write_if_different(path, render_backward_source(bp))
    return path
