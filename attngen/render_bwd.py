"""BackwardPlan -> the emitted backward module (templates/fa3_bwd.py.j2): preprocess, main, postprocess.

The backward reuses the forward's pieces where the two passes say the same thing: the score
chain (render.score_text: softcap, ALiBi, score_mod), a mod's text (render.mod_at), the
variant constants and the tile-range algebra (tiles.Frame's transposed direction, q_first ..
q_full_stop). What is new here is the transposed tile: the main kernel's fragments are
[keys, query rows] (element (i, j) is key key0 + i, query row m0 + j), so its masks and
scores name their rows and keys that way. docs/backward.md describes each kernel.
"""

from __future__ import annotations

from attngen import expr, hw, tiles
from attngen.plan import BackwardPlan, plan_backward
from attngen.render import (TemplateError, _numbered, _tensor, environment, has_offset, mod_at, score_text,
                            variant_constants, write_if_different)
from attngen.spec import Spec, to_toml
from attngen.version import __version__

TEMPLATE = "fa3_bwd.py.j2"
PRE_ROWS = 64  # rows of one head per preprocess / postprocess block
PRE_THREADS = 128

_ROW, _KEY = "m0 + j", "key0 + i"  # the main kernel's element (i, j): key key0 + i, query row m0 + j


def frame(bp: BackwardPlan) -> tiles.Frame:
    """The backward's problem in the kernel's names (kv_len, q_len >= 1: a bshd kernel)."""
    f = bp.forward
    return tiles.Frame(q_len=tiles.Sym("q_len", 1), kv_len=tiles.Sym("kv_len", 1), offset=tiles.Sym("causal_offset"),
                       edges=tiles.Edges(f.window_left, f.window_right), block_m=tiles.Sym("BLOCK_M", 1),
                       block_n=tiles.Sym("BLOCK_N", 1))


_KV_TILE = tiles.Sym("kv_block", 0)


def q_range(bp: BackwardPlan) -> dict:
    """The Q tiles the CTA's KV tile visits, and those it sees whole (tiles.Frame.q_span's bounds)."""
    fr = frame(bp)
    first = fr.q_first(_KV_TILE)
    return {"q_first": tiles.text(first),
            "n_q": tiles.text(tiles.max_(tiles.sub(fr.q_stop(_KV_TILE), tiles.Sym("q_first", 0)), 0)),
            "full_first": tiles.text(fr.q_full_first(_KV_TILE)),
            "full_stop": tiles.text(fr.q_full_stop(_KV_TILE))}


def has_edges(bp: BackwardPlan) -> bool:
    return bp.forward.window_left is not None or bp.forward.window_right is not None


def masked_visit(bp: BackwardPlan) -> str:
    """Is Q tile q_tile of this KV tile masked? Outside the tiles every row sees whole, the last Q
    tile when it passes q_len, and every visit of a KV tile that passes kv_len. A mask_mod masks all."""
    if bp.forward.mask_expr is not None:
        return "True"
    parts = []
    if has_edges(bp):
        parts.append("q_tile < full_first or q_tile >= full_stop")
    parts += ["m0 + BLOCK_M > q_len", "kv_partial"]
    return " or ".join(parts)


def mask_binding(bp: BackwardPlan) -> str:
    if not has_edges(bp):
        return ""
    return "diag = m0 + causal_offset - key0  # row m0 + j's diagonal key is key0 + j + diag"


def mask_condition(bp: BackwardPlan) -> str:
    """Does query row m0 + j see key key0 + i (the edges of tiles.visible, written for the
    transposed tile), and is the row a real one (< q_len)?"""
    f = bp.forward
    left, right = f.window_left, f.window_right
    parts = []
    if left is not None:
        parts.append(f"i >= j + diag - {left}" if left else "i >= j + diag")
    if right is not None:
        parts.append(f"j + diag + {right} >= i" if right else "j + diag >= i")
    if right != 0:  # right == 0 keeps a real row's keys below kv_len
        parts.append(f"{_KEY} < kv_len")
    parts.append(f"{_ROW} < q_len")
    if f.mask_expr is not None:
        parts.append(mod_at(f, f.mask_expr, _ROW, _KEY, "head", None))
    return " and ".join(f"({p})" if " and " in p or " or " in p else p for p in parts)


def log2_score(bp: BackwardPlan) -> str:
    """acc_s[i, j] (k . q) -> the forward's final score in base-2 units (what LSE2 is in)."""
    f = bp.forward
    if not f.prescaled:
        return "acc_s[i, j] * scale_log2"
    return f"({score_text(f, 'acc_s[i, j]', _ROW, _KEY, 'head')}) * LOG2E"


def dz_ds(bp: BackwardPlan) -> str:
    """d(final score)/d(q . k * scale) at element (i, j) from the raw acc_s, or "" where it is 1:
    softcap's 1 - tanh^2 times the score_mod's derivative (expr.derivative) at the softcapped score."""
    f = bp.forward
    factors = []
    if f.spec.softcap:
        t = "T.tanh(acc_s[i, j] * softcap_scale)"
        factors.append(f"(1.0 - {t} * {t})")
    if f.score_expr is not None:
        d = expr.derivative(f.score_expr)
        if d.canonical.strip() != "1":
            u = score_text(f, "acc_s[i, j]", _ROW, _KEY, "head", mods=False)
            factors.append(f"({mod_at(f, d, _ROW, _KEY, 'head', u)})")
    return " * ".join(factors)


def scale_setup(bp: BackwardPlan) -> list[str]:
    f = bp.forward
    if not f.prescaled:
        return ["scale_log2 = softmax_scale * LOG2E  # P = exp2(k . q * scale_log2 - LSE2)"]
    if f.spec.softcap:
        return ["softcap_scale = softmax_scale / SOFTCAP  # tanh's argument: the scaled score / SOFTCAP"]
    return []


def q_shape(dim: str) -> list:
    return ["batch", "q_len", "heads", dim]


def kv_shape(dim: str) -> list:
    return ["batch", "kv_len", "kv_heads", dim]


ROWS = ["batch", "heads", "q_len"]


def call_tensors(bp: BackwardPlan) -> list:
    """The forward's call-time tensors (ALiBi slopes, score_mod/mask_mod tensors): the main kernel reads them too."""
    return [t for t in bp.forward.extra if not t.output and t.name != "sinks"]


def params(bp: BackwardPlan, dv: str) -> dict:
    """Each kernel's prim_func parameter lines (docs/backward.md, "The kernels' parameters")."""
    kv_out = '"float32"' if bp.kv_accum else "DTYPE"
    kv_names = ("dK_accum", "dV_accum") if bp.kv_accum else ("dK", "dV")
    pre = [_tensor("O", q_shape(dv), "DTYPE", "the forward's output"), _tensor("dO", q_shape(dv), "DTYPE"),
           _tensor("LSE", ROWS, '"float32"', "the forward's log-sum-exp, natural log (-inf: a row with no key)"),
           _tensor("dPsum", ROWS, '"float32"', "output: rowsum(dO * O)"),
           _tensor("LSE2", ROWS, '"float32"', "output: LSE * log2(e), 0 where LSE is -inf"),
           _tensor("dQ_accum", q_shape("HEAD_DIM"), '"float32"', "output: zeroed (the main kernel reduce-adds into it)")]
    if bp.spec.sinks:
        pre += [_tensor("Sinks", ["heads"], '"float32"', "call time: sinks"),
                _tensor("dSinks", ["heads"], '"float32"', "in/out: zeroed by the caller; -= sum_rows exp(sink - LSE) dPsum")]
    main = [_tensor("Q", q_shape("HEAD_DIM"), "DTYPE"), _tensor("K", kv_shape("HEAD_DIM"), "DTYPE"),
            _tensor("V", kv_shape(dv), "DTYPE"), _tensor("dO", q_shape(dv), "DTYPE"),
            _tensor("LSE2", ROWS, '"float32"'), _tensor("dPsum", ROWS, '"float32"'),
            _tensor("dQ_accum", q_shape("HEAD_DIM"), '"float32"', "in/out: dS K reduce-added, unscaled"),
            _tensor(kv_names[0], kv_shape("HEAD_DIM"), kv_out,
                    "in/out: zeroed by the caller; dK of the group's query heads atomically added, scaled" if bp.kv_accum
                    else "output: dK, scaled"),
            _tensor(kv_names[1], kv_shape(dv), kv_out,
                    "in/out: zeroed by the caller; dV of the group's query heads atomically added" if bp.kv_accum else "output: dV")]
    for t in call_tensors(bp):
        main.append(_tensor(t.param, [t.dim(a) for a in range(len(t.shape))], '"float32"', f"call time: {t.name}"))
    scale = "softmax_scale: T.float32,  # call time: score = q . k * softmax_scale"
    main.append(scale)
    post = [_tensor("dQ_accum", q_shape("HEAD_DIM"), '"float32"'), _tensor("dQ", q_shape("HEAD_DIM"), "DTYPE", "output"), scale]
    post_kv = [_tensor("dK_accum", kv_shape("HEAD_DIM"), '"float32"'), _tensor("dV_accum", kv_shape(dv), '"float32"'),
               _tensor("dK", kv_shape("HEAD_DIM"), "DTYPE", "output"), _tensor("dV", kv_shape(dv), "DTYPE", "output")]
    return {"pre_params": pre, "main_params": main, "post_params": post, "post_kv_params": post_kv}


def header_lines(bp: BackwardPlan) -> list[str]:
    spec = bp.spec
    shape = f"static B,H,HKV,SQ,SKV = {bp.shape}" if bp.shape else "dynamic: batch, q_len, kv_len, kv_heads are runtime values"
    lines = [
        "=" * 78,
        "attngen auto-generated backward kernels: do not edit; regenerate with attngen.",
        f"kernel:    {bp.name}",
        f"spec hash: {bp.hash}",
        f"generator: attngen {__version__}, template {TEMPLATE}",
        f"shape:     {shape}",
        f"schedule:  1 TMA producer warpgroup + {bp.consumers} MMA warpgroup(s) of {bp.wg_keys} keys, {bp.threads} threads, "
        f"setmaxnreg {bp.producer_regs}/{bp.consumer_regs}; FA3's tile {bp.fa3_tile[0]}x{bp.fa3_tile[1]} ({bp.fa3_tile[2]} WGs)",
        f"smem:      {bp.smem_bytes} bytes dynamic (" + ", ".join(f"{k} {v}" for k, v in bp.smem.items()) + ")",
        "entries:   build_preprocess_kernel, build_kernel, build_postprocess_kernel"
        + (", build_postprocess_kv_kernel" if bp.kv_accum else ""),
        "spec:",
    ]
    lines += ["  " + line for line in to_toml(spec).splitlines()]
    lines.append("=" * 78)
    return lines


def template_context(bp: BackwardPlan) -> dict:
    f = bp.forward
    spec = bp.spec
    dv = "HEAD_DIM" if f.head_dim_v == spec.head_dim else "HEAD_DIM_V"
    dims = {d: (getattr(bp.shape, d) if bp.shape else None) for d in ("batch", "q_len", "kv_len", "kv_heads")}
    free = [t.dim(a) for t in call_tensors(bp) for a in range(len(t.shape)) if t.shape[a] is None]
    return {
        "header": header_lines(bp),
        "kernel_name": bp.name,
        "spec_hash": bp.hash,
        "head_dim": spec.head_dim,
        "dv": dv,
        "dtype": spec.dtype,
        "gqa_group": spec.gqa_group,
        "block_m": bp.block_m,
        "block_n": bp.block_n,
        "wg_keys": bp.wg_keys,
        "consumers": bp.consumers,
        "q_stages": bp.q_stages,
        "log2e": hw.LOG2E,
        "variant_constants": [line for line in variant_constants(f) if not line.startswith("LN2")],
        "threads": bp.threads,
        "consumer_threads": bp.consumer_threads,
        "tma_thread_end": bp.tma_thread_end,
        "tma_threads": bp.tma_threads,
        "producer_regs": bp.producer_regs,
        "consumer_regs": bp.consumer_regs,
        "warpgroup_threads": bp.warpgroup_threads,
        "ds_bar": bp.ds_bar,
        "dq_bar": bp.dq_bar,
        "pre_rows": PRE_ROWS,
        "pre_threads": PRE_THREADS,
        "compile_flags": bp.compile_flags,
        "dims": dims,
        "free_dims": free,
        "offset": has_offset(f),
        "kv_accum": bp.kv_accum,
        "sinks": spec.sinks,
        **q_range(bp),
        "has_edges": has_edges(bp),
        "masked_visit": masked_visit(bp),
        "mask_bind": mask_binding(bp),
        "mask_cond": mask_condition(bp),
        "log2_score": log2_score(bp),
        "dz_ds": dz_ds(bp),
        "scale_setup": scale_setup(bp),
        "extra_args": "".join(f", {t.param}" for t in call_tensors(bp)),
        **params(bp, dv),
    }


def as_backward_plan(spec_or_plan, shape=None) -> BackwardPlan:
    if isinstance(spec_or_plan, BackwardPlan):
        return spec_or_plan
    if isinstance(spec_or_plan, Spec):
        return plan_backward(spec_or_plan, shape)
    return plan_backward(spec_or_plan.spec, shape if shape is not None else spec_or_plan.shape)  # a forward Plan


def render_backward_source(spec_or_plan, shape=None) -> str:
    """The emitted backward module (dynamic shapes unless the plan has a static shape)."""
    bp = as_backward_plan(spec_or_plan, shape)
    template = environment().get_template(TEMPLATE)
    try:
        return template.render(**template_context(bp))
    except Exception as e:  # a bug in attngen, never the user's input
        import jinja2

        if isinstance(e, jinja2.TemplateError):
            raise TemplateError(_numbered(TEMPLATE, e)) from e
        raise


def generate_backward(spec_or_plan, out_dir="generated", shape=None):
    from pathlib import Path

    bp = as_backward_plan(spec_or_plan, shape)
    path = Path(out_dir) / f"{bp.name}.py"
    write_if_different(path, render_backward_source(bp))
    return path
