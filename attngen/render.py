"""Plan -> emitted TileLang source, through one Jinja2 template.

The template is thin: it receives flat numbers and the expressions built here (masks,
tile counts, guarded maxima, barrier ids), where they can be read and tested as Python,
and only lays them out in the order the GPU executes them.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import os
import tempfile
import traceback
from pathlib import Path

import jinja2

from attngen import expr, hw
from attngen.version import __version__
from attngen.plan import Plan, Shape, as_plan
from attngen.spec import Spec, to_toml

TEMPLATE = "fa3_fwd.py.j2"
DIMS = ("batch", "q_len", "kv_len", "kv_heads")


class TemplateError(RuntimeError):
    """A template bug (not a user error): shown with the template's numbered lines."""


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(_template_source)
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _load_template(name: str) -> str:
    # A source checkout's own templates/ first: an editable install elsewhere (another
    # worktree, the GPU machine's PYTHONPATH copy) must not lend this checkout its templates.
    beside = Path(__file__).resolve().parent.parent / "templates" / name
    if beside.is_file():
        return beside.read_text()
    return importlib.resources.files("attngen.templates").joinpath(name).read_text()  # installed wheel


def _template_source(name: str):
    # (source, filename, uptodate): the filename makes Jinja put template line numbers in tracebacks
    return _load_template(name), name, lambda: True


# -- the expressions the template prints ----------------------------------------------
# Kernels of specs without a window keep the expressions below that predate windows, byte for
# byte; `windowed(plan)` switches to the general form (first tile, both edges, visit indices).
def windowed(plan: Plan) -> bool:
    return plan.spec.window != (-1, -1)


def has_first_tile(plan: Plan) -> bool:
    """The block's first visited K tile is not 0 (the window has a left edge)."""
    return plan.window_left is not None


def key_tile(plan: Plan, tile: str) -> str:
    """The K tile index of visit `tile` (the loop variable, or "0" for the prologue)."""
    if not has_first_tile(plan):
        return tile
    return "first_tile" if tile == "0" else f"(first_tile + {tile})"


def key_index(plan: Plan, tile: str) -> str:
    """The key column `j` of visit `tile` as a kernel expression."""
    t = key_tile(plan, tile)
    return "j" if t == "0" else f"{t} * BLOCK_N + j"


def mask_condition(plan: Plan, tile: str) -> str:
    """Is key `tile * BLOCK_N + j` visible to query row `q0 + row0 + i`?"""
    spec = plan.spec
    key = key_index(plan, tile)
    if not windowed(plan) and plan.mask_expr is None:
        if spec.causal:
            # bottom-right alignment already keeps every real row below kv_len: row i < q_len sees
            # keys up to i + kv_len - q_len < kv_len; rows past q_len are never stored
            return f"q0 + row0 + i + causal_offset >= {key}"
        return f"{key} < kv_len"  # the partial last tile (not aligned)
    left, right = plan.window_left, plan.window_right
    parts = []
    if left is not None:
        parts.append(f"{key} >= q0 + row0 + i + causal_offset - {left}")
    if right is not None:
        parts.append(f"q0 + row0 + i + causal_offset + {right} >= {key}" if right else f"q0 + row0 + i + causal_offset >= {key}")
    if right != 0:  # right == 0 keeps every real row's keys below kv_len (see above)
        parts.append(f"{key} < kv_len")
    if plan.mask_expr is not None:
        parts.append(mod_text(plan, plan.mask_expr, tile, score=None))
    return " and ".join(parts) if len(parts) == 1 else " and ".join(f"({p})" if " and " in p else p for p in parts)


def mod_text(plan: Plan, e, tile: str, score: str | None) -> str:
    """A parsed score_mod/mask_mod as TileLang, at row q0 + row0 + i and key `key_index(tile)`."""
    tensors = {t.name: t for t in plan.extra}
    names = {"b": "batch_idx", "h": "head", "q_idx": "(q0 + row0 + i)", "kv_idx": f"({key_index(plan, tile)})"}
    if score is not None:
        names["score"] = f"({score})"
    return expr.emit(e, names, lambda n: tensors[n].param, lambda n, axis: tensors[n].dim(axis))


def transform_expr(plan: Plan, tile: str) -> str:
    """acc_s[i, j] (q . k) -> the final score in base-2 units: softcap, ALiBi, score_mod, then * log2(e).

    The mods are defined on the natural-units score q . k / sqrt(d) (FlexAttention's `score`);
    the result is multiplied by log2(e) once, so the softmax below needs no SCALE_LOG2.
    """
    spec = plan.spec
    s = "acc_s[i, j] * SCALE"
    if spec.softcap:
        s = "SOFTCAP * T.tanh(acc_s[i, j] * SOFTCAP_SCALE)"  # SOFTCAP_SCALE = SCALE / SOFTCAP, folded
    if spec.alibi:
        s = f'{s} - Alibi[head] * T.Cast("float32", T.abs(q0 + row0 + i + causal_offset - ({key_index(plan, tile)})))'
    if plan.score_expr is not None:
        s = mod_text(plan, plan.score_expr, tile, s)
    return f"({s}) * LOG2E"


def scaled(plan: Plan, x: str) -> str:
    """A raw score or row max in the softmax's base-2 units."""
    return x if plan.prescaled else f"{x} * SCALE_LOG2"


def full_tiles_expr(plan: Plan) -> str:
    """Leading K tiles (visits) that every row of the warpgroup sees whole on the right (no mask needed)."""
    spec = plan.spec
    if plan.mask_expr is not None:
        return "0"  # a custom mask_mod masks every tile
    if not windowed(plan):
        if spec.causal:  # tile t is whole for row r when (t + 1) * BLOCK_N - 1 <= r + causal_offset (< kv_len)
            return "T.floordiv(q0 + row0 + causal_offset + 1, BLOCK_N)"
        return "T.floordiv(kv_len, BLOCK_N)"  # the last tile is partial unless kv_len is a multiple of BLOCK_N
    right = plan.window_right
    if right is None:
        tiles = "T.floordiv(kv_len, BLOCK_N)"
    else:
        tiles = f"T.floordiv(T.max(q0 + row0 + causal_offset + {right + 1}, 0), BLOCK_N)"
        if right:
            tiles = f"T.min({tiles}, T.floordiv(kv_len, BLOCK_N))"
    return f"{tiles} - first_tile" if has_first_tile(plan) else tiles


def lead_tiles_expr(plan: Plan) -> str:
    """Leading visits the window's left edge cuts for some row of this warpgroup (masked)."""
    if not has_first_tile(plan) or plan.mask_expr is not None:
        return ""
    return (f"T.max(T.ceildiv(T.max(q0 + row0 + WG_ROWS - 1 + causal_offset - {plan.window_left}, 0), BLOCK_N)"
            " - first_tile, 0)")


def first_tile_expr(plan: Plan) -> str:
    """The block's first visited K tile: the window's left edge for its first row."""
    if not has_first_tile(plan):
        return ""
    return f"T.floordiv(T.max(q0 + causal_offset - {plan.window_left}, 0), BLOCK_N)"


def n_tiles_expr(plan: Plan) -> str:
    """K tiles a block of query rows visits (with its comment): causal blocks stop at the diagonal."""
    if windowed(plan):
        end = "T.ceildiv(kv_len, BLOCK_N)"
        if plan.window_right is not None:
            end = f"T.min({end}, T.ceildiv(T.max(q0 + BLOCK_M + causal_offset + {plan.window_right}, 1), BLOCK_N))"
        if not has_first_tile(plan):
            return end + "  # >= 1: a block of rows that see no key still runs (fully masked) tile 0"
        return (f"T.max({end} - first_tile, 1)"
                "  # tiles [first_tile, first_tile + n_tiles): exactly the window's; >= 1 (a block that sees no key runs one masked tile)")
    if not plan.spec.causal:
        return "T.ceildiv(kv_len, BLOCK_N)"
    if plan.guard_empty_rows:
        return ("T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))"
                "  # >= 1: a block of rows that see no key still runs (fully masked) tile 0")
    return "T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(q0 + BLOCK_M + causal_offset, BLOCK_N))"


def scaled_max_expr(plan: Plan, masked: bool) -> str:
    """Row max times SCALE_LOG2; a fully masked row has max -inf and uses 0 so exp2 gives 0, not NaN."""
    plain = scaled(plan, "m_cur[i]")
    if masked and plan.guard_empty_rows:
        return f"T.if_then_else(m_cur[i] == -T.infinity(ACCUM), 0.0, {plain})"
    return plain


def normalize_stmt(plan: Plan) -> str:
    """The epilogue's division by the row sum (guarded when a row may see no key)."""
    if plan.guard_empty_rows and not plan.spec.sinks:  # with a sink every row sum is >= exp(0)
        return "acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0"
    return "acc_o[i, j] /= row_sum[i]"


def lse_expr(plan: Plan) -> str:
    """Natural-log log-sum-exp of a row: (m * scale_log2 + log2(row sum)) * ln 2; -inf for a row with no key."""
    if not plan.spec.lse:
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
    return "Sinks[head] * SINK_TO_RAW"


def variant_constants(plan: Plan) -> list[str]:
    spec = plan.spec
    lines = []
    if plan.head_dim_v != spec.head_dim:
        lines.append(f"HEAD_DIM_V = {plan.head_dim_v}  # V and O head dim")
    if plan.prescaled or spec.sinks or spec.lse:
        lines.append(f"LOG2E = {hw.LOG2E}")
    if plan.prescaled:
        lines.append(f"SCALE = {(1.0 / spec.head_dim) ** 0.5!r}  # 1 / sqrt(HEAD_DIM): score = q . k * SCALE, as in FlexAttention")
    if spec.softcap:
        lines.append(f"SOFTCAP = {spec.softcap!r}  # score = SOFTCAP * tanh(score / SOFTCAP)")
        lines.append(f"SOFTCAP_SCALE = {(1.0 / spec.head_dim) ** 0.5 / spec.softcap!r}  # SCALE / SOFTCAP")
    if spec.sinks and not plan.prescaled:
        lines.append(f"SINK_TO_RAW = {hw.LOG2E / plan.scale_log2!r}  # a natural-log logit in the units of q . k (sqrt(HEAD_DIM))")
    if spec.lse:
        lines.append(f"LN2 = {math.log(2)!r}  # the LSE is returned in natural log")
    return lines


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
    shape = f"static B,H,HKV,SQ,SKV = {plan.shape}" if plan.shape else "dynamic: batch, q_len, kv_len, kv_heads are runtime values"
    lines = [
        "=" * 78,
        "attngen auto-generated kernel: do not edit; regenerate with `attngen generate`.",
        f"kernel:    {plan.name}",
        f"spec hash: {plan.hash}",
        f"generator: attngen {__version__}, template {TEMPLATE}",
        f"shape:     {shape}",
        f"schedule:  1 TMA producer warpgroup + {spec.consumers} consumer warpgroup(s)"
        + (", ping-pong" if spec.pingpong else "")
        + f", {plan.threads} threads, setmaxnreg {plan.producer_regs}/{plan.consumer_regs}",
        f"smem:      {plan.smem_bytes} bytes dynamic (" + ", ".join(f"{k} {v}" for k, v in plan.smem.items()) + ")",
        "spec:",
    ]
    lines += ["  " + line for line in to_toml(spec).splitlines()]
    lines.append("=" * 78)
    return lines


def template_context(plan: Plan) -> dict:
    """Every name the template uses (documented at the top of the template)."""
    spec = plan.spec
    has_masked = spec.causal or not spec.aligned or windowed(plan) or plan.mask_expr is not None
    dims = {d: None for d in DIMS}
    if plan.shape is not None:
        dims = {d: getattr(plan.shape, d) for d in DIMS}
    extra_params = [t.param for t in plan.extra]
    consumer_extra = "".join(f", {p}" for p in extra_params) + (", first_tile" if has_first_tile(plan) else "")
    free_dims = [t.dim(a) for t in plan.extra for a in range(len(t.shape)) if t.shape[a] is None]
    tensor_params = [f"{t.param}: T.Tensor([{', '.join(t.dim(a) for a in range(len(t.shape)))}], \"float32\"),"
                     + ("  # output: log-sum-exp per row, natural log" if t.output else f"  # call time: {t.name}")
                     for t in plan.extra]
    return {
        "header": header_lines(plan),
        "kernel_name": plan.name,
        "spec_hash": plan.hash,
        "head_dim": spec.head_dim,
        "dv": "HEAD_DIM" if plan.head_dim_v == spec.head_dim else "HEAD_DIM_V",
        "dtype": spec.dtype,
        "gqa_group": spec.gqa_group,
        "consumers": spec.consumers,
        "block_m": spec.block_m,
        "block_n": spec.block_n,
        "wg_rows": plan.wg_rows,
        "k_stages": spec.k_stages,
        "v_stages": spec.v_stages,
        "scale_log2": plan.scale_log2,
        "variant_constants": variant_constants(plan),
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
        "dims": dims,
        "free_dims": free_dims,
        "offset": spec.causal or windowed(plan) or spec.alibi,
        "offset_comment": offset_comment(plan),
        "has_masked": has_masked,
        "all_masked": plan.mask_expr is not None,
        "barriers": plan.consumer_barriers,
        "first_tile": first_tile_expr(plan),
        "n_tiles": n_tiles_expr(plan),
        "full_tiles": full_tiles_expr(plan) if has_masked else "",
        "lead_tiles": lead_tiles_expr(plan),
        "normalize": normalize_stmt(plan),
        "tensor_params": tensor_params,
        "consumer_extra": consumer_extra,
        "sink_init": sink_init(plan),
        "lse": lse_expr(plan),
        "prescaled": plan.prescaled,
        "transform": lambda tile: transform_expr(plan, tile),
        "scaled": lambda x: scaled(plan, x),
        "key_tile": lambda tile: key_tile(plan, tile),
        "mask_cond": lambda tile: mask_condition(plan, tile),
        "scaled_max": lambda masked: scaled_max_expr(plan, masked),
        "q_rows": lambda g: q_rows(plan, g),
    }


def render_source(spec_or_plan: Spec | Plan, shape: Shape | None = None) -> str:
    """The emitted TileLang source (dynamic shapes unless the plan has a static shape)."""
    plan = as_plan(spec_or_plan, shape)
    template = environment().get_template(TEMPLATE)
    try:
        return template.render(**template_context(plan))
    except jinja2.TemplateError as e:  # a bug in attngen, never the user's input
        raise TemplateError(_numbered(TEMPLATE, e)) from e


def _numbered(name: str, err: jinja2.TemplateError) -> str:
    lineno = getattr(err, "lineno", None)
    if lineno is None:  # errors raised while rendering carry the line in the traceback
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == name]
        lineno = frames[-1].lineno if frames else None
    text = _load_template(name).splitlines()
    lo, hi = (max(0, lineno - 4), min(len(text), lineno + 3)) if lineno else (0, 0)
    shown = "\n".join(f"{'>' if i + 1 == lineno else ' '}{i + 1:5d} | {text[i]}" for i in range(lo, hi))
    return f"{name}:{lineno}: {err}\n{shown}"


def output_path(plan: Plan, out_dir: str | Path) -> Path:
    return Path(out_dir) / f"{plan.name}.py"


def write_if_different(path: Path, text: str) -> bool:
    """Atomic write that leaves the file (and its mtime) alone when the content is unchanged."""
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def generate(spec_or_plan: Spec | Plan, out_dir: str | Path = "generated", shape: Shape | None = None) -> Path:
    """Write the emitted kernel under `out_dir`; return its path."""
    plan = as_plan(spec_or_plan, shape)
    path = output_path(plan, out_dir)
    write_if_different(path, render_source(plan))
    return path
