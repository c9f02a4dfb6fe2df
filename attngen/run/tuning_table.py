"""The tuned table: which schedule `attngen tune` measured fastest for a kind of problem.

`attngen/tuned/h200.json` maps a key (head_dim, dtype, causal, gqa_group and a sequence-length
bucket) to the schedule fields tuning chooses. `attngen.attention` reads it when the caller
names no schedule. An empty table, a missing file, no entry for a key, or an entry the budgets
no longer accept all mean "use the plan's defaults": never an error.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from attngen.hw import DTYPES
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec, SpecError

TABLE = Path(__file__).resolve().parent / "tuned" / "h200.json"
SCHEDULE_FIELDS = ("consumers", "k_stages", "v_stages", "block_n", "pingpong", "steady_loop")  # what tuning chooses
SEQ_BUCKETS = (1024, 2048, 4096, 8192, 16384)  # a length is tuned at the smallest bucket >= it (the last above)


def seq_bucket(seq_len: int) -> int:
    return next((b for b in SEQ_BUCKETS if seq_len <= b), SEQ_BUCKETS[-1])


def table_key(spec: Spec, seq_len: int) -> str:
    causal = "causal" if spec.causal else "full"
    return f"hd{spec.head_dim}_{DTYPES[spec.dtype].tag}_{causal}_g{spec.gqa_group}_s{seq_bucket(seq_len)}"


def load_table(path: Path | None = None) -> dict:
    """{key: entry} of the table at `path` (default TABLE); a missing, empty or malformed table is {}.

    attention() asks on every call: the file is parsed once per change (path, mtime), not per call.
    """
    path = Path(path or TABLE)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    return dict(_parsed(str(path), stamp))


@functools.lru_cache(maxsize=8)
def _parsed(path: str, stamp: int) -> dict:
    try:
        data = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    entries = data.get("entries", {}) if isinstance(data, dict) else {}
    return entries if isinstance(entries, dict) else {}


def tuned_fields(spec: Spec, seq_len: int, path: Path | None = None) -> dict:
    """The schedule the table holds for this problem, or {} (use the plan's defaults)."""
    entry = load_table(path).get(table_key(spec, seq_len), {})
    fields = {k: entry[k] for k in SCHEDULE_FIELDS if isinstance(entry, dict) and k in entry}
    if not fields:
        return {}
    try:
        make_plan(Spec(**{**spec.to_dict(), **fields, "block_m": None}))
    except SpecError:  # a stale entry (the budgets changed since it was written) is ignored
        return {}
    return fields
