"""One mapping from an attention call's keywords to its Spec (issue 26, item 6).

attngen.attention reaches a Spec two ways: runtime.attention (a direct call) and the torch op
(ops.fwd_arguments encodes the keywords, ops.resolve decodes them). Both go through
runtime.call_spec; these tests catch the two paths drifting apart again, by what they build for
a table of calls and by who calls the mapping's parts.
"""

import ast
from pathlib import Path

import pytest
import torch

from attngen.interfaces import ops
from attngen.run import runtime

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"


def dense(hd=64, hd_v=None, heads=4, kv_heads=2, q_len=100, kv_len=150, dtype=torch.bfloat16):
    return (torch.randn(1, q_len, heads, hd, dtype=dtype), torch.randn(1, kv_len, kv_heads, hd, dtype=dtype),
            torch.randn(1, kv_len, kv_heads, hd_v or hd, dtype=dtype))


def varlen():
    q, k, v = (torch.randn(90, h, 64, dtype=torch.float16) for h in (4, 2, 2))
    return (q, k, v), {"cu_seqlens_q": torch.tensor([0, 40, 90], dtype=torch.int32),
                       "cu_seqlens_k": torch.tensor([0, 40, 90], dtype=torch.int32), "max_seqlen_q": 50}


def paged(**kw):
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(6, 64, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    return (q, k, v), {"block_table": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
                       "seqused_k": torch.tensor([150, 130], dtype=torch.int32), **kw}


CALLS = {  # name: ((q, k, v), keywords)
    "plain": (dense(), {}),
    "causal f16": (dense(hd=128, dtype=torch.float16), {"causal": True}),
    "window softcap": (dense(), {"window": (32, 0), "softcap": 30.0}),
    "window as a list": (dense(), {"window": [16, 8], "causal": False}),
    "alibi sinks lse": (dense(), {"alibi_slopes": torch.rand(4), "sinks": torch.rand(4), "return_lse": True}),
    "lse as a field": (dense(), {"lse": True}),
    "head_dim_v": (dense(hd=192, hd_v=128), {"causal": True}),
    "score_mod tensor": (dense(), {"score_mod": "score + bias[h, q_idx - kv_idx + 8]",
                                   "bias": torch.rand(4, 300)}),
    "schedule fields": (dense(hd=128), {"consumers": 1, "block_n": 64, "k_stages": 3}),
    "softmax scale": (dense(), {"softmax_scale": 0.5}),
    "varlen": varlen(),
    "paged": paged(),
    "paged split auto": paged(num_splits="auto"),
    "paged split 3": paged(num_splits=3),
    "one split": (dense(), {"num_splits": 1}),
}


class Planned(Exception):
    pass


def runtime_spec(monkeypatch, tensors, keywords):
    """The Spec runtime.attention plans (it stops there: no kernel compiled or run)."""
    as_plan = runtime.as_plan

    def stop(spec):
        raise Planned(as_plan(spec).spec)

    monkeypatch.setattr(runtime, "as_plan", stop)
    with pytest.raises(Planned) as planned:
        runtime.attention(*tensors, **keywords)
    return planned.value.args[0]


def op_spec(tensors, keywords):
    """The Spec torch.ops.attngen.fwd plans from attngen.attention's arguments."""
    args, _ = ops.fwd_arguments(*tensors, **keywords)
    q, k, v, fields, left, right, softcap, _, tensor_names, _, cu_q, _, _, table, _, splits = args
    return ops.resolve(q, k, v, fields, (left, right), softcap, tensor_names, cu_q, table, splits).spec


@pytest.mark.parametrize("name", CALLS)
def test_both_paths_build_the_same_spec(name, monkeypatch):
    tensors, keywords = CALLS[name]
    assert op_spec(tensors, keywords) == runtime_spec(monkeypatch, tensors, keywords)


def test_the_table_reaches_every_variant():
    """The table above is not all plain calls: each field a keyword sets differs from a plain call's somewhere."""
    specs = [op_spec(*CALLS[name]) for name in CALLS]
    plain = op_spec(*CALLS["plain"])
    assert any(s.head_dim_v != s.head_dim for s in specs)
    for field in ("causal", "window", "softcap", "alibi", "sinks", "lse", "layout", "paged_kv", "splits", "score_mod",
                  "block_n", "k_stages"):
        assert any(getattr(s, field) != getattr(plain, field) for s in specs), field


def callers(names: set) -> set:
    """(module, function) pairs in attngen/ that call any of `names` (as f(...) or x.f(...))."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if called in names:
                        found.add((path.relative_to(PACKAGE).as_posix(), fn.name))
    return found


def test_only_call_spec_maps_keywords():
    """Only runtime.py maps keywords to a Spec: the serving fields and the tensor-derived ones are
    asked for by call_spec and spec_for alone, and the torch op and runtime.attention ask call_spec."""
    assert callers({"_spec_for", "serving_overrides"}) == {("run/runtime.py", "call_spec"), ("run/runtime.py", "spec_for")}
    assert callers({"call_spec"}) == {("run/runtime.py", "attention"), ("interfaces/op_arguments.py", "_resolve")}
