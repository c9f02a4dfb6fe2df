"""attngen.flex_attention against torch's own flex_attention, the mods of PyTorch's flex tests.

The mods below are written here after the score_mods and mask_mods of PyTorch's
test/inductor/test_flex_attention.py and test_flex_decoding.py (docs/interfaces.md, "PyTorch's
test mods", lists every construct they use). Each runs through attngen.flex_attention on the CPU
model (float16 inputs) and through torch.nn.attention.flex_attention in float64 on the same
values (the oracle; its CPU backward guard, _validate_device, is lifted here): output, LSE and
the gradients of q, k and v must agree within fp16 tolerances. Shapes are tiny (B <= 2, H = 2,
lengths <= 80, head_dim 64); each distinct mod is one kernel pair on the CPU model.
"""

import functools
import math

import pytest
import torch

import attngen
from attngen import flex

F = pytest.importorskip("torch.nn.attention.flex_attention")

D = 64
S = 48


@pytest.fixture(autouse=True)
def _torch_cpu_backward(monkeypatch):
    monkeypatch.setattr(F, "_validate_device", lambda *a, **k: None)


def _inputs(B, H, Q, KV, seed, HKV=None, BKV=None):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.float16)  # noqa: E731
    HKV, BKV = HKV or H, BKV or B
    return mk(B, H, Q, D), mk(BKV, HKV, KV, D), mk(BKV, HKV, KV, D), mk(B, H, Q, D)


def _close(name, got, want, tol):
    got, want = got.double(), want.double()
    assert got.shape == want.shape, name
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: -inf at other places"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol * scale:.3g}"


def peer(score_mod=None, mask_mod=None, *, B=1, H=2, Q=S, KV=None, seed=0, HKV=None, BKV=None, grad=True,
         block_size=128, **kw):
    """attngen.flex_attention vs torch's flex_attention (float64) on one call: out, lse, dq, dk, dv."""
    KV = KV or Q
    q, k, v, dout = _inputs(B, H, Q, KV, seed, HKV, BKV)
    gqa = (HKV or H) != H
    ours = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    theirs = [x.double().requires_grad_(grad) for x in (q, k, v)]
    bm = attngen.create_block_mask(mask_mod, B, None, Q, KV, BLOCK_SIZE=block_size) if mask_mod else None
    tbm = F.create_block_mask(mask_mod, B, None, Q, KV, device="cpu", BLOCK_SIZE=block_size) if mask_mod else None
    out, lse = attngen.flex_attention(*ours, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True, **kw)
    ref, rlse = F.flex_attention(*theirs, score_mod=score_mod, block_mask=tbm, enable_gqa=gqa, return_lse=True, **kw)
    _close("out", out, ref, 1e-2)
    _close("lse", lse, rlse, 1e-2)
    if grad:
        (out.float() * dout.float()).sum().backward()
        (ref * dout.double()).sum().backward()
        for name, a, b in zip("qkv", ours, theirs):
            assert not torch.isnan(a.grad).any(), f"d{name} has NaN"
            _close(f"d{name}", a.grad, b.grad, 2e-2)
    return out, lse


# -- torch.compile ---------------------------------------------------------------------------------------------
_tbl = torch.linspace(-1.0, 1.0, 2 * S)
_doc = torch.tensor([0] * 20 + [1] * (S - 20))


def _doc_bias(score, b, h, q_idx, kv_idx):
    return torch.where(_doc[q_idx] == _doc[kv_idx], score + _tbl[q_idx - kv_idx], -float("inf"))


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("mods", ["score_mod", "block_mask", "both"])
def test_fullgraph_compile_has_no_graph_break_and_equals_eager_forward_and_backward(mods):
    """The translation runs once while dynamo traces (flex._traced_mods), outside the graph."""
    torch._dynamo.reset()
    score_mod = _doc_bias if mods != "block_mask" else None
    bm = attngen.create_block_mask(_causal, 1, 1, S, S) if mods != "score_mod" else None

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attngen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    q, k, v, dout = _inputs(1, 2, S, S, seed=7)
    explained = torch._dynamo.explain(Attend())(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    grads = []
    for module in (torch.compile(Attend(), fullgraph=True), Attend()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*leaves)
        (out.float() * dout.float()).sum().backward()
        grads.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # one kernel, the same inputs
