"""Plan -> emitted TileLang source, through one Jinja2 template.

The template is thin: it receives flat numbers and the expressions built here (masks,
tile counts, guarded maxima, barrier ids), where they can be read and tested as Python,
and only lays them out in the order the GPU executes them.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import tempfile
import traceback
from pathlib import Path

import jinja2

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
def mask_condition(spec: Spec, tile: str) -> str:
    """Is key `tile * BLOCK_N + j` visible to query row `q0 + row0 + i`?"""
    key = "j" if tile == "0" else f"{tile} * BLOCK_N + j"
    if spec.causal:
        # bottom-right alignment already keeps every real row below kv_len: row i < q_len sees
        # keys up to i + kv_len - q_len < kv_len; rows past q_len are never stored
        return f"q0 + row0 + i + causal_offset >= {key}"
    return f"{key} < kv_len"  # the partial last tile (not aligned)


def full_tiles_expr(spec: Spec) -> str:
    """Leading K tiles that every row of the warpgroup sees whole (no mask needed)."""
    if spec.causal:  # tile t is whole for row r when (t + 1) * BLOCK_N - 1 <= r + causal_offset (< kv_len)
        return "T.floordiv(q0 + row0 + causal_offset + 1, BLOCK_N)"
    return "T.floordiv(kv_len, BLOCK_N)"  # the last tile is partial unless kv_len is a multiple of BLOCK_N


def n_tiles_expr(plan: Plan) -> str:
    """K tiles a block of query rows visits (with its comment): causal blocks stop at the diagonal."""
    if not plan.spec.causal:
        return "T.ceildiv(kv_len, BLOCK_N)"
    if plan.guard_empty_rows:
        return ("T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))"
                "  # >= 1: a block of rows that see no key still runs (fully masked) tile 0")
    return "T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(q0 + BLOCK_M + causal_offset, BLOCK_N))"


def scaled_max_expr(plan: Plan, masked: bool) -> str:
    """Row max times SCALE_LOG2; a fully masked row has max -inf and uses 0 so exp2 gives 0, not NaN."""
    plain = "m_cur[i] * SCALE_LOG2"
    if masked and plan.guard_empty_rows:
        return f"T.if_then_else(m_cur[i] == -T.infinity(ACCUM), 0.0, {plain})"
    return plain


def normalize_stmt(plan: Plan) -> str:
    """The epilogue's division by the row sum (guarded when a row may see no key)."""
    if plan.guard_empty_rows:
        return "acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0"
    return "acc_o[i, j] /= row_sum[i]"


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
    has_masked = spec.causal or not spec.aligned  # some K tile may be diagonal or partial
    dims = {d: None for d in DIMS}
    if plan.shape is not None:
        dims = {d: getattr(plan.shape, d) for d in DIMS}
    return {
        "header": header_lines(plan),
        "kernel_name": plan.name,
        "spec_hash": plan.hash,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
        "gqa_group": spec.gqa_group,
        "consumers": spec.consumers,
        "block_m": spec.block_m,
        "block_n": spec.block_n,
        "wg_rows": plan.wg_rows,
        "k_stages": spec.k_stages,
        "v_stages": spec.v_stages,
        "scale_log2": plan.scale_log2,
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
        "causal": spec.causal,
        "has_masked": has_masked,
        "barriers": plan.consumer_barriers,
        "n_tiles": n_tiles_expr(plan),
        "full_tiles": full_tiles_expr(spec) if has_masked else "",
        "normalize": normalize_stmt(plan),
        "mask_cond": lambda tile: mask_condition(spec, tile),
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
