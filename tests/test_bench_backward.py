"""bench/bench_backward.py's workspace figures, read from the emitted kernels, are docs/backward.md's."""

import importlib.util
import re
from pathlib import Path

import pytest

import attngen

ROOT = Path(__file__).resolve().parent.parent


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_backward", ROOT / "bench" / "bench_backward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fields, per_query, per_key", [
    ({"causal": True}, 4 * 128 + 8, 0),  # dQ_accum, dPsum, LSE2
    ({"causal": True, "deterministic": True}, 8, 0),  # no dQ_accum
    ({"head_dim": 64, "gqa_group": 4}, 4 * 64 + 8, 4 * (64 + 64)),  # dK_accum, dV_accum per KV head
    ({"head_dim": 128, "head_dim_v": 64, "gqa_group": 2}, 4 * 128 + 8, 4 * (128 + 64)),
])
def test_the_workspace_per_token_is_what_the_docs_state(fields, per_query, per_key):
    w = bench_module().workspace_bytes(attngen.Spec(**fields), (1, 4, 4 // fields.get("gqa_group", 1), 100, 70))
    assert (w["per_query"], w["per_key"]) == (per_query, per_key)
    doc = (ROOT / "docs" / "backward.md").read_text()
    memory = doc[doc.index("### Memory"):doc.index("### What remains")]
    assert re.search(r"dQ_accum 4 x head_dim bytes, dPsum 4, LSE2 4 \(520 bytes at\s+hd128, 264 at hd64\)", memory)
    assert "4 x (head_dim + head_dim_v)" in memory and "(8 bytes per query\ntoken and head)" in memory
