"""The split-KV combine kernel's names (templates/combine/fa3_combine.py.j2): it merges each
split's partial O and LSE per row. The forward's module includes it when the spec has splits != 1.
"""

from __future__ import annotations

from dataclasses import dataclass



from attngen.kernels.common.emit import tensor_param
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.common.schedulers import schedule_of



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
    layout, schedule = layout_of(plan), schedule_of(plan)
    rows = layout.q_total
    params = [tensor_param("O_partial", ["num_splits"] + layout.q_shape(dv), '"float32"'),
              tensor_param("LSE_partial", ["num_splits"] + layout.lse_shape(), '"float32"'),
              tensor_param("O", layout.q_shape(dv), "DTYPE")]
    if plan.spec.lse:
        params.append(tensor_param("LSE", layout.lse_shape(), '"float32"', "output: log-sum-exp per row, natural log"))
    row = "r0 + i"
    clamped = f"T.min(r0 + i, {rows} - 1)"
    return {
        "combine_dims": ["batch", rows, "kv_heads", "num_splits"],
        "combine": CombineNumbers(name=f"{plan.name}_combine", rows_per_block=COMBINE_ROWS, threads=COMBINE_THREADS),
        "combine_params": params + layout.flat_params(),
        "combine_grid": schedule.grid(rows, "COMBINE_ROWS", "heads", layout.flat_batch),
        "combine_vars": schedule.block_vars("row_block", "head", layout.flat_batch_var),
        "combine_rows": layout.flat_rows(),
        "combine_setup": layout.flat_setup(),
        "partial_o": f"O_partial[s, {layout.q_index(clamped)}, j]",
        "partial_lse": f"LSE_partial[s, {layout.stat_index(clamped)}]",
        "out_o": f"O[{layout.q_index(row)}, j]",
        "out_lse": f"LSE[{layout.stat_index(row)}]" if plan.spec.lse else "",
    }
