"""Plan -> emitted TileLang source, through one Jinja2 template.

The template is thin: it receives flat numbers and the expressions built here (masks,
tile counts, guarded maxima, barrier ids), where they can be read and tested as Python,
and only lays them out in the order the GPU executes them.
"""

from __future__ import annotations

from dataclasses import dataclass



from attngen.kernels.common.emit import tensor_param
from attngen.kernels.common.layouts import lse_shape, q_shape



# -- serving: packed sequences, paged K/V, split-KV (docs/serving.md) -----------------------
# Every function below returns, for a bshd, dense, unsplit plan, exactly the text the template
# printed before these layouts existed.
COMBINE_ROWS = 64  # rows of one head per combine block
COMBINE_THREADS = 128


@dataclass(frozen=True)
class CombineNumbers:
    """The combine kernel's numbers (fa3_combine.py.j2's `combine`)."""

    name: str
    """the combine prim_func's name: the forward kernel's name + _combine"""
    rows_per_block: int
    """rows of one head per combine block"""
    threads: int
    """threads per combine block"""


def combine_context(plan, dv: str) -> dict:
    """Names of the combine kernel (fa3_combine.py.j2): it merges O_partial/LSE_partial per row.
    Varlen: the grid covers the packed rows (total_q), but only rows before cu_seqlens_q[batch]
    belong to a sequence; the rows after it are padding, which no kernel writes."""
    rows = "total_q" if plan.varlen else "q_len"
    dims = ["batch", "total_q"] if plan.varlen else ["batch", "q_len"]
    params = [tensor_param("O_partial", ["num_splits"] + q_shape(plan, dv), '"float32"'),
              tensor_param("LSE_partial", ["num_splits"] + lse_shape(plan), '"float32"'),
              tensor_param("O", q_shape(plan, dv), "DTYPE")]
    if plan.spec.lse:
        params.append(tensor_param("LSE", lse_shape(plan), '"float32"', "output: log-sum-exp per row, natural log"))
    setup = []
    if plan.varlen:
        params.append(tensor_param("cu_seqlens_q", ["batch + 1"], '"int32"',
                              "rows past cu_seqlens_q[batch] are padding: not written"))
        setup.append("used_rows = cu_seqlens_q[batch]  # the packed rows the sequences own; the rest is padding")
    row = "r0 + i"
    clamped = f"T.min(r0 + i, {rows} - 1)"
    if plan.varlen:
        o_idx, lse_idx = (lambda r: f"{r}, head, j"), (lambda r: f"head, {r}")
    else:
        o_idx, lse_idx = (lambda r: f"batch_idx, {r}, head, j"), (lambda r: f"batch_idx, head, {r}")
    return {
        "combine_dims": dims + ["kv_heads", "num_splits"],
        "combine_params": params,
        "combine_grid": f"T.ceildiv({rows}, COMBINE_ROWS), heads" + ("" if plan.varlen else ", batch"),
        "combine_vars": "row_block, head" + ("" if plan.varlen else ", batch_idx"),
        "combine_rows": "used_rows" if plan.varlen else rows,
        "combine_setup": setup,
        "combine": CombineNumbers(name=f"{plan.name}_combine", rows_per_block=COMBINE_ROWS, threads=COMBINE_THREADS),
        "partial_o": f"O_partial[s, {o_idx(clamped)}]",
        "partial_lse": f"LSE_partial[s, {lse_idx(clamped)}]",
        "out_o": f"O[{o_idx(row)}]",
        "out_lse": f"LSE[{lse_idx(row)}]" if plan.spec.lse else "",
    }
