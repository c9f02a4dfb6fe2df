"""Autograd through the torch ops (attngen/ops.py, docs/torch.md) on the CPU backend: the forward
kernel and the emitted backward kernels (preprocess, main, postprocess) on the CPU model.

Gradients against reference.backward's fp64 ones under its tolerance rule, torch.compile of forward
plus backward (0 graph breaks, eager's values, one compilation over three lengths), opcheck of
both ops with autograd, the backward op's fake against the real gradients (every preset the
backward takes, hypothesis-drawn specs and shapes), the call-time tensors' gradients, the inference
layouts' refusal, the CPU-time refusal, and the front doors. Shapes stay tiny: a backward on the
CPU model costs about 2.5 forwards.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen.interfaces import op_arguments, ops
from attngen.emulator.driver import variant_inputs
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError, variant_of
from attngen.reference.backward import check_grads
from attngen.kernels.bwd.render import render_backward_source
from attngen.spec import Spec, SpecError, load

from compile_count import child_env
from gpu_marks import GPU_ONLY, NEEDS_TOOLKIT
from strategies import valid_specs

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "examples").glob("*.toml"))
DERIVED = ("head_dim", "dtype", "gqa_group", "head_dim_v", "alibi", "sinks", "layout", "paged_kv", "page_size", "lse")


def qkv(q_len=40, kv_len=None, heads=2, kv_heads=2, head_dim=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_len = kv_len or q_len
    q = torch.randn(1, q_len, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    return tuple(t.requires_grad_() for t in (q, k, v))


def cotangent(out, seed=7):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)


def grads_of(*tensors):
    return {"dq": tensors[0].grad, "dk": tensors[1].grad, "dv": tensors[2].grad} | (
        {"dsinks": tensors[3].grad} if len(tensors) > 3 else {})


def failures(checks):
    return {n: str(c) for n, c in checks.items() if not c.ok}


def metadata(t):
    return tuple(t.shape), t.dtype, t.device, t.stride()


# -- eager autograd: the emitted backward on the CPU model against the fp64 reference -------------

CASES = {  # name: (q_len, kv_len, heads, kv_heads, attention keywords)
    "non-causal": (33, 57, 2, 2, {}),
    "causal, q_len > kv_len": (50, 20, 2, 2, {"causal": True}),
    "GQA causal": (40, 40, 4, 2, {"causal": True}),
    "sinks and a scale": (24, 40, 2, 2, {"sinks": True, "softmax_scale": 0.2}),
    "deterministic GQA sinks": (30, 35, 4, 2, {"sinks": True, "deterministic": True, "causal": True}),
}


def case_inputs(sq, skv, heads, kv_heads, kw):
    """A case's q, k, v, its attention keywords (sinks drawn when it asks for them) and the leaves
    that get gradients."""
    q, k, v = qkv(sq, skv, heads, kv_heads)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(heads, generator=torch.Generator().manual_seed(3)).requires_grad_()
    return q, k, v, kw, (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())


@pytest.mark.parametrize("name", list(CASES))
def test_backward_gives_the_reference_gradients(name):
    q, k, v, kw, leaves = case_inputs(*CASES[name])
    sinks = kw.get("sinks")
    out = attngen.attention(q, k, v, **kw)
    dout = cotangent(out)
    out.backward(dout)
    got = grads_of(*leaves)
    assert all(g is not None and g.dtype == t.dtype and g.shape == t.shape for g, t in zip(got.values(), leaves))
    checks = check_grads(got, q.detach(), k.detach(), v.detach(), dout, kw.get("causal", False), dtype="float16",
                         scale=kw.get("softmax_scale"), sinks=None if sinks is None else sinks.detach())
    assert set(checks) == {"dq", "dk", "dv"} | ({"dsinks"} if sinks is not None else set())
    assert not failures(checks), failures(checks)
    if name == "non-causal":  # the op's gradients are the emitted kernels' own, schedule seed 0
        plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": False, "lse": True}))
        direct = attngen.emulate_backward(plan, q.detach(), k.detach(), v.detach(), dout)
        assert all(torch.equal(a, b) for a, b in zip(direct, got.values()))


def test_a_broken_backward_kernel_shows_through_the_op(monkeypatch):
    """The op runs the emitted backward: a mutated text (dPsum not subtracted) fails the check."""
    q, k, v = qkv(33, 40)
    real = ops.emulate_backward

    def mutated(plan, *a, **kw):
        text = render_backward_source(plan)
        old = "(acc_dp[i, j] - dPsum_shared[stage, j])"
        assert old in text
        return real(plan, *a, **dict(kw, source=text.replace(old, "acc_dp[i, j]", 1)))

    monkeypatch.setattr(ops, "emulate_backward", mutated)
    out = attngen.attention(q, k, v)
    dout = cotangent(out)
    out.backward(dout)
    checks = check_grads(grads_of(q, k, v), q.detach(), k.detach(), v.detach(), dout, False, dtype="float16")
    assert "dq" in failures(checks)


def test_only_inputs_that_require_grad_get_one_and_an_unused_lse_output_costs_nothing():
    q, k, v = qkv(20)
    k.requires_grad_(False)
    out, lse = attngen.attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (1, 2, 20) and lse.grad_fn is not None
    out.float().sum().backward()  # the LSE returned and not read: no error, and its gradient is None
    assert q.grad is not None and v.grad is not None and k.grad is None
    first = q.grad.clone()
    q.grad = None
    attngen.attention(q, k, v, causal=True).float().sum().backward()
    assert torch.equal(q.grad, first)
    q.grad = None  # compiled, a returned LSE gets a zero tangent: read once, no error
    out, lse = torch.compile(lambda *t: attngen.attention(*t, causal=True, return_lse=True), backend="aot_eager",
                             fullgraph=True)(q, k, v)
    out.float().sum().backward()
    assert torch.equal(q.grad, first)
    sinks = torch.zeros(2, requires_grad=True)  # a sink alone that needs a gradient asks for the LSE too
    assert '"lse": true' in ops.fwd_arguments(q.detach(), k, v.detach(), sinks=sinks)[0][3]


LSE_CASES = {  # name: (q_len, kv_len, heads, kv_heads, attention keywords)
    "plain": (33, 40, 2, 2, {}),
    "causal, q_len > kv_len": (40, 20, 2, 2, {"causal": True}),  # rows 0..19 see no key: their dLSE reaches nothing
    "GQA": (30, 36, 4, 2, {"causal": True}),
    "sinks": (24, 40, 2, 2, {"sinks": True, "softmax_scale": 0.2}),
    "softcap": (30, 30, 2, 2, {"softcap": 3.0}),
    "deterministic GQA sinks": (30, 35, 4, 2, {"sinks": True, "deterministic": True, "causal": True}),
}


@pytest.mark.parametrize("lse_alone", [False, True], ids=["out and lse", "lse alone"])
@pytest.mark.parametrize("name", list(LSE_CASES))
def test_a_loss_that_reads_the_lse_gets_its_gradient(name, lse_alone):
    """The LSE output's gradient folds into the backward's row term (issue 27; before, a nonzero
    one was an InputError, and before that dropped): lse.sum() alone (dout None) or a loss mixing
    out and lse, the emitted kernels on the CPU model against the fp64 reference with that dLSE."""
    q, k, v, kw, leaves = case_inputs(*LSE_CASES[name])
    sinks = kw.get("sinks")
    out, lse = attngen.attention(q, k, v, return_lse=True, **kw)
    dout = torch.zeros_like(out) if lse_alone else cotangent(out)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5))
    loss = (lse * dlse).sum() if lse_alone else (out.float() * dout.float()).sum() + (lse * dlse).sum()
    loss.backward()
    got = grads_of(*leaves)
    checks = check_grads(got, q.detach(), k.detach(), v.detach(), dout, kw.get("causal", False), dtype="float16",
                         scale=kw.get("softmax_scale"), softcap=kw.get("softcap", 0.0), dlse=dlse,
                         sinks=None if sinks is None else sinks.detach())
    assert not failures(checks), failures(checks)
    assert got["dq"].abs().max() > 0.05  # the LSE term is no small correction here
    if name.startswith("causal"):  # rows that see no key: dq exactly 0, never NaN
        assert torch.equal(q.grad[:, :20], torch.zeros_like(q.grad[:, :20]))


def test_a_compiled_loss_that_reads_the_lse_matches_eager():
    """torch.compile (fullgraph, AOT autograd) of a loss through out and lse: the LSE's tangent
    reaches attngen::bwd as dlse in the traced backward, and the gradients are eager's, bit for bit."""
    q, k, v = qkv(30, 45, heads=4, kv_heads=2)
    w = torch.randn(1, 4, 30, generator=torch.Generator().manual_seed(4))

    def loss(q, k, v):
        out, lse = attngen.attention(q, k, v, causal=True, return_lse=True)
        return out.float().square().sum() + (lse * w).sum()

    loss(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert all(torch.equal(t.grad, e) for t, e in zip((q, k, v), eager))


def torch_attention_lse(q, k, v):
    """float64 attention over [B, H, S, D] and its natural-log LSE, by torch's own logsumexp."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def test_two_attentions_merged_through_their_lses_give_the_whole_attentions_gradients():
    """torch's test_lse_masked_output pattern through the Flex door: attention over keys [0, 10)
    and over [10, 24), merged by their LSEs, is attention over all 24; its gradients, which flow
    through both LSEs, against torch float64 autograd of the same merge (and of the whole)."""
    q, k, v = (t.detach().transpose(1, 2).contiguous() for t in qkv(20, 24))  # [B, H, S, D]
    halves = (slice(0, 10), slice(10, 24))
    dout = cotangent(torch.empty(1, 2, 20, 64), seed=11).double()

    def merged(attend, q, k, v):
        (o1, l1), (o2, l2) = (attend(q, k[:, :, s], v[:, :, s]) for s in halves)
        w = torch.sigmoid(l1 - l2).unsqueeze(-1)  # exp(l1) / (exp(l1) + exp(l2))
        return w * o1.double() + (1 - w) * o2.double()

    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    (merged(lambda *t: attngen.flex_attention(*t, return_lse=True), *ours) * dout).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    (merged(torch_attention_lse, *ref) * dout).sum().backward()
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    (torch_attention_lse(*whole)[0] * dout).sum().backward()
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    got = {n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), ours)}
    checks = check_grads(got, *bshd, dout.transpose(1, 2), False, dtype="float16")  # the whole attention's rule
    assert not failures(checks), failures(checks)
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, ref, whole):
        torch.testing.assert_close(b.grad, c.grad)  # the merge is the whole attention, in float64
        err = (a.grad.double() - b.grad).abs().max()
        assert err <= checks[name].bound, (name, float(err), checks[name].bound)


def test_fa3s_returned_lse_is_differentiable():
    """flash_attn_func(return_attn_probs=True) returns (out, softmax_lse); a loss through both."""
    from attngen.interfaces.flash_attn_interface import flash_attn_func

    q, k, v = qkv(30, 40, heads=4, kv_heads=2)
    out, lse = flash_attn_func(q, k, v, causal=True, softmax_scale=0.15, return_attn_probs=True)
    dout, dlse = cotangent(out), torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * dout.float()).sum().add((lse * dlse).sum()).backward()
    checks = check_grads(grads_of(q, k, v), q.detach(), k.detach(), v.detach(), dout, True, dtype="float16",
                         scale=0.15, dlse=dlse)
    assert not failures(checks), failures(checks)


def test_a_varlen_lse_gets_its_gradient():
    """Packed sequences: lse [H, total_q] and its gradient, each sequence against its own reference."""
    from attngen.reference.backward import attention_grad_varlen

    lq, lk = [10, 0, 23], [20, 7, 30]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 64, generator=g).half().requires_grad_()
    k, v = (torch.randn(sum(lk), 2, 64, generator=g).half().requires_grad_() for _ in range(2))
    cq, ck = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lq, lk))
    out, lse = attngen.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), causal=True,
                                 return_lse=True)
    dlse = torch.randn(lse.shape, generator=g)
    (lse * dlse).sum().backward()
    dout = torch.zeros(out.shape)
    for b in range(len(lq)):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if lq[b] == 0:
            continue
        got = {"dq": q.grad[None, qs], "dk": k.grad[None, ks], "dv": v.grad[None, ks]}
        checks = check_grads(got, q.detach()[None, qs], k.detach()[None, ks], v.detach()[None, ks], dout[None, qs],
                             True, dtype="float16", dlse=dlse[None, :, qs])
        assert not failures(checks), (b, failures(checks))
    ref = attention_grad_varlen(q.detach(), k.detach(), v.detach(), dout, cq, ck, True, dlse=dlse)
    assert np.abs(ref.dq).max() > 0.05 and torch.equal(v.grad, torch.zeros_like(v.grad))  # dV = P^T dO: dO is 0


@pytest.mark.parametrize("kw, name", [
    ({"alibi_slopes": torch.tensor([0.5, 0.25])}, "alibi_slopes"),
    ({"score_mod": "score + bias[h]", "bias": torch.tensor([0.1, -0.2])}, "bias"),
])
def test_a_call_time_tensor_that_requires_grad_gets_the_kernels_gradient(kw, name):
    """alibi_slopes and a score_mod's tensor that require grad were refused at backward() (issue 17);
    they are learnable now (issue 27): the backward kernels scatter their gradients (the spec field
    learnable; tests/test_learnable.py holds them to the reference), the same as emulate_backward's."""
    q, k, v = qkv(20)
    kw = {n: x.clone().requires_grad_() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = attngen.attention(q, k, v, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out.float() * dout.float()).sum().backward()
    spec = attngen.Spec(head_dim=q.shape[-1], alibi="alibi_slopes" in kw, score_mod=kw.get("score_mod", ""),
                        learnable=[name])
    tensors = {n: x.detach() for n, x in kw.items() if isinstance(x, torch.Tensor)}
    want = attngen.emulate_backward(spec, q.detach(), k.detach(), v.detach(), dout, **tensors)[-1]
    assert kw[name].grad.abs().max() > 0 and torch.equal(kw[name].grad, want)


def test_flex_attention_gives_a_captured_tensor_that_requires_grad_its_gradient():
    """A learnable bias captured by a score_mod was detached by the Flex door and given no gradient
    without a word (issue 25), then refused at backward(); it gets its gradient now (issue 27)."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in qkv(20))  # [B, H, S, D]
    bias = torch.tensor([0.1, -0.2], requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    out = attngen.flex_attention(q, k, v, score_mod=score_mod)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape and bias.grad.abs().max() > 0
    with torch.no_grad():  # inference with the parameter
        attngen.flex_attention(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("bad, deterministic", [(float("inf"), False), (float("nan"), False), (float("inf"), True)])
def test_a_non_finite_cotangent_reaches_the_gradients_sdpa_gives_it(bad, deterministic):
    """fp16 loss scaling (GradScaler) skips a step on an inf/NaN gradient: the CPU model refused
    such a dout (issue 25) while the GPU path ran it. Both run it now; the CPU model's backward
    kernels make exactly the rows non-finite that torch's SDPA does (not causal, so every key sees
    the bad row and the pattern is the maths', not a tiling's): dq of that query row and head, dk
    and dv of every key of its KV head; the other heads stay finite."""
    import torch.nn.functional as F

    q, k, v = qkv(40, heads=4, kv_heads=2)
    out = attngen.attention(q, k, v, deterministic=deterministic)
    dout = cotangent(out)
    dout[0, 7, 1, 3] = bad
    out.backward(dout)
    bhsd = [t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*bhsd, enable_gqa=True).backward(dout.float().transpose(1, 2))
    for name, ours, sdpa in zip(("dq", "dk", "dv"), (q, k, v), bhsd):
        rows = (~torch.isfinite(ours.grad.float())).any(-1)  # [B, S, H]: rows holding a non-finite value
        assert torch.equal(rows, (~torch.isfinite(sdpa.grad.transpose(1, 2))).any(-1)), name
        assert rows.sum() == (1 if name == "dq" else 40), name  # (7, head 1); every key of KV head 0


def test_a_second_order_gradient_is_one_attngen_error_when_asked_for():
    """torch said "no autograd formula was registered for attngen.bwd" (issue 25)."""
    q, k, v = qkv(20)
    dq, = torch.autograd.grad(attngen.attention(q, k, v).float().sum(), q, create_graph=True)
    assert dq.requires_grad  # create_graph alone is no error: only the second backward is
    with pytest.raises(InputError, match=r"^a second-order gradient = asked of attngen's backward .*: expected "
                                         r"first-order gradients only: attngen's backward is not differentiable twice"):
        dq.float().square().sum().backward()


def test_a_backward_the_plan_refuses_is_refused_before_the_forward_runs(monkeypatch):
    """A paged cache, and deterministic varlen GQA with ALiBi (plan_backward's refusals), were run
    forward and refused only at backward() (issue 25): a call that needs a gradient is refused
    first, with the same one-line SpecError; without one (no_grad, or nothing requires grad) it runs."""
    from attngen.reference.serving import random_serving_inputs

    x = random_serving_inputs("bshd", True, 64, "float16", 64, None, [5], [70], 2, 2, seed=1)
    q = torch.from_numpy(np.array(x.q)).half().requires_grad_()
    k, v = (torch.from_numpy(np.array(t)).half() for t in (x.k, x.v))
    paged = {n: torch.from_numpy(np.array(a)) for n, a in x.keywords.items()}
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    qp, kp, vp = (torch.randn(20, h, 64).half() for h in (4, 2, 2))
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, deterministic=True,
                  alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    ran = []
    monkeypatch.setattr(ops, "emulate", lambda *a, **kw: ran.append(1) or pytest.fail("ran a refused training call"))
    with pytest.raises(SpecError, match=r"^spec field `paged_kv` = true: a paged KV cache is an inference layout"):
        attngen.attention(q, k, v, **paged)
    with pytest.raises(SpecError, match=r"^spec field `deterministic` = true: .*layout .varlen., alibi.*gqa_group 2"):
        attngen.attention(qp.requires_grad_(), kp, vp, **varlen)
    assert not ran
    monkeypatch.undo()
    with torch.no_grad():
        attngen.attention(q, k, v, **paged)
    attngen.attention(qp.detach(), kp, vp, **varlen)


def test_the_cpu_time_refusal_covers_the_backward(monkeypatch):
    q, k, v = qkv(70, 90)
    args = ops.fwd_arguments(q, k, v, causal=True)[0]
    plan = op_arguments.resolve(q, k, v, args[3])
    from attngen.emulator.driver import estimate_seconds

    forward = estimate_seconds(plan, 1, 2, 2, [70], [90]).seconds
    # a limit the forward fits and forward + backward (3.5 forwards) does not: refused before either runs
    monkeypatch.setenv("ATTNGEN_CPU_MAX_SECONDS", f"{forward * 2:.6f}")
    monkeypatch.setattr(ops, "emulate", lambda *a, **kw: pytest.fail("ran a refused training call"))
    with pytest.raises(InputError, match=r"this forward and its backward would take about .* \(3.5x a forward's"):
        attngen.attention(q, k, v, causal=True)
    monkeypatch.undo()
    with torch.no_grad():  # inference alone fits under the same limit
        monkeypatch.setenv("ATTNGEN_CPU_MAX_SECONDS", f"{forward * 2:.6f}")
        attngen.attention(q, k, v, causal=True)
    # the backward op checks its own pass (2.5 forwards), as under torch.compile
    monkeypatch.setenv("ATTNGEN_CPU_MAX_SECONDS", f"{forward * 2:.6f}")
    out, lse = ops.fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    monkeypatch.setattr(ops, "emulate_backward", lambda *a, **kw: pytest.fail("ran a refused backward"))
    with pytest.raises(InputError, match=r"this backward would take about .* \(2.5x a forward's"):
        ops.bwd(cotangent(out), out, lse, *(a.detach() if isinstance(a, torch.Tensor) else a for a in args))


# -- torch.compile of forward and backward ----------------------------------------------------------


def loss_fn(q, k, v):
    return attngen.attention(q, k, v, causal=True).float().square().sum()


def test_compiled_forward_and_backward_have_no_graph_break_and_match_eager():
    import torch._dynamo

    q, k, v = qkv(30, 45, heads=4, kv_heads=2)
    torch._dynamo.reset()
    report = torch._dynamo.explain(loss_fn)(q, k, v)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons
    loss_fn(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    targets = []

    def backend(gm, example_inputs):  # AOT autograd's forward and backward graphs, what they call
        from torch._dynamo.backends.common import aot_autograd

        def record(g, _):
            targets.extend(n.target for n in g.graph.nodes if n.op == "call_function")
            return g

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    value = torch.compile(loss_fn, fullgraph=True, backend=backend)(q, k, v)
    value.backward()
    assert torch.ops.attngen.fwd.default in targets and torch.ops.attngen.bwd.default in targets
    assert torch.equal(value, loss_fn(q, k, v).detach())
    assert all(torch.equal(t.grad, e) for t, e in zip((q, k, v), eager))


def test_compiled_backward_with_inductor_matches_eager():
    q, k, v = qkv(20)
    loss_fn(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    torch.compile(loss_fn, fullgraph=True)(q, k, v).backward()
    assert all(torch.equal(t.grad, e) for t, e in zip((q, k, v), eager))


def test_dynamic_compile_of_forward_and_backward_serves_three_lengths_and_scales_with_one_compilation():
    from torch._dynamo.testing import CompileCounterWithBackend

    def scaled_loss(q, k, v, s):
        return attngen.attention(q, k, v, causal=True, softmax_scale=s).float().square().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(scaled_loss, fullgraph=True, dynamic=True, backend=counter)
    # three lengths at one scale, then two more scales: lengths never recompile; a scale does only
    # where dynamo specializes every float input (torch 2.4's specialize_float, as tests/test_ops.py says)
    per_value = getattr(torch._dynamo.config, "specialize_float", True)
    for i, (n, s) in enumerate(((17, 0.1), (33, 0.1), (50, 0.1), (21, 0.2), (40, 0.3))):
        if i == 3:
            assert counter.frame_count == 1  # three lengths, one graph
        q, k, v = qkv(n, n + 5, seed=n)
        compiled(q, k, v, s).backward()
        out = attngen.attention(q.detach(), k.detach(), v.detach(), causal=True, softmax_scale=s)
        dout = (2 * out.float()).half()  # d(sum out^2)/d out
        checks = check_grads(grads_of(q, k, v), q.detach(), k.detach(), v.detach(), dout, True, dtype="float16", scale=s)
        assert not failures(checks), (n, failures(checks))
    assert counter.frame_count == (3 if per_value else 1)


def test_dynamic_compile_of_a_packed_batch_backward_serves_three_batches_with_one_compilation():
    from torch._dynamo.testing import CompileCounterWithBackend

    from attngen.reference.serving import random_serving_inputs

    def loss(q, k, v, cu_q, cu_k, max_q):
        return attngen.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max_q).float().square().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend=counter)
    for lq, lk in (([5, 17], [20, 30]), ([9, 2, 12], [9, 30, 25]), ([24, 1], [24, 40])):
        x = random_serving_inputs("varlen", False, None, "float16", 64, None, lq, lk, 2, 2, seed=len(lq))
        q, k, v = (torch.from_numpy(np.array(t)).half().requires_grad_() for t in (x.q, x.k, x.v))
        ints = [torch.from_numpy(np.array(x.cu_seqlens_q)), torch.from_numpy(np.array(x.cu_seqlens_k))]
        compiled(q, k, v, *ints, x.max_seqlen_q).backward()
        eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        loss(*eager, *ints, x.max_seqlen_q).backward()
        assert all(torch.equal(t.grad, e.grad) for t, e in zip((q, k, v), eager))
    assert counter.frame_count == 1


# -- opcheck ---------------------------------------------------------------------------------------


def bwd_arguments(q, k, v, **kw):
    """The backward op's arguments after a real forward: (dout, out, lse, the forward's arguments)."""
    args = ops.fwd_arguments(q, k, v, **kw)[0]  # q requires grad: lse true in fields
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = ops.fwd(*args)
    return (cotangent(out), out, lse) + args


def test_opcheck_backward_op():
    q, k, v = qkv(16, 24, heads=2, kv_heads=1)
    result = torch.library.opcheck(ops.bwd, bwd_arguments(q, k, v, causal=True, sinks=torch.ones(2)))
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_forward_with_autograd():
    """All four of opcheck's checks on inputs that need a gradient, the AOT dispatch one running
    forward and backward through the op's autograd formula with a random tangent for every output,
    the LSE's too (failed with the LSE refusal before its gradient was folded in)."""
    q, k, v = qkv(16, 20)
    sinks = torch.zeros(2, requires_grad=True)
    args = ops.fwd_arguments(q, k, v, causal=True, sinks=sinks)[0]
    result = torch.library.opcheck(ops.fwd, args)
    assert set(result.values()) == {"SUCCESS"}, result


# -- the backward op's fake against the real gradients -----------------------------------------------


def fake_bwd(args):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor)
                else [mode.from_tensor(x) for x in a] if isinstance(a, list) else a for a in args]
        return ops.bwd(*fake)


def check_bwd_fake(args):
    real = ops.bwd(*args)
    assert [metadata(t) for t in fake_bwd(args)] == [metadata(t) for t in real]
    return real


def backward_presets():
    for path in PRESETS:
        try:
            plan_backward(load(path))
        except SpecError:
            continue
        yield path


@pytest.mark.parametrize("path", list(backward_presets()), ids=lambda p: p.stem)
def test_backward_fake_matches_the_real_gradients_for_every_preset_it_takes(path):
    from attngen.reference.serving import random_serving_inputs

    spec = load(path)
    plan = make_plan(spec)
    kw = {n: x for n, x in spec.to_dict().items() if n not in DERIVED}
    heads, kv_heads = spec.gqa_group * (1 if spec.gqa_group > 2 else 2), 1 if spec.gqa_group > 2 else 2
    dtype = getattr(torch, spec.dtype)
    if plan.varlen:  # packed sequences, one of them a single row
        x = random_serving_inputs("varlen", False, None, spec.dtype, spec.head_dim, None, [17, 1], [30, 5],
                                          heads, kv_heads, seed=2)
        q, k, v = (torch.from_numpy(np.array(t)).to(dtype).requires_grad_() for t in (x.q, x.k, x.v))
        named = {n: (torch.from_numpy(np.array(a)) if not isinstance(a, int) else a) for n, a in x.keywords.items()}
    else:
        n = spec.block_m if spec.aligned else 21
        q, k, v, tensors = variant_inputs(plan, 1, heads, kv_heads, n, n if spec.aligned else 2 * n)
        q, k, v = (torch.from_numpy(np.array(t)).to(dtype).requires_grad_() for t in (q, k, v))
        named = {t: torch.from_numpy(np.array(x)) for t, x in tensors.items()}
    args = bwd_arguments(q, k, v, **kw, **named)
    resolved = op_arguments.resolve(q, k, v, args[6], args[7:9], args[9], args[11], args[13], args[16])
    with_lse = make_plan(Spec(**{**spec.to_dict(), "lse": True}))
    assert resolved.name == with_lse.name  # the preset's own kernel, with the LSE the backward reads
    dq, dk, dv, dsinks = check_bwd_fake(args)
    assert (dsinks.numel() > 0) == spec.sinks
    if plan.varlen:  # each sequence against its own reference
        cq, ck = named["cu_seqlens_q"], named["cu_seqlens_k"]
        cases = [(slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))) for b in range(len(cq) - 1)]
        tensors = {}
    else:
        cases, tensors = [(slice(None), slice(None))], named
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    for qs, ks in cases:
        pick = (lambda t, s: t[None, s]) if plan.varlen else (lambda t, s: t)
        got = {"dq": pick(dq, qs), "dk": pick(dk, ks), "dv": pick(dv, ks)} | ({"dsinks": dsinks} if spec.sinks else {})
        checks = check_grads(got, pick(q.detach(), qs), pick(k.detach(), ks), pick(v.detach(), ks), pick(args[0], qs),
                             spec.causal, dtype=spec.dtype, **variant)
        assert not failures(checks), failures(checks)


@settings(max_examples=6, deadline=None)
@given(spec=valid_specs(head_dims=(64, 128)), data=st.data())
def test_backward_fake_matches_the_real_gradients_for_drawn_specs_and_shapes(spec, data):
    try:
        plan_backward(spec)
    except SpecError:
        return  # the backward refuses it (its own tests cover the refusals)
    step_q, step_k = (spec.block_m, spec.block_n) if spec.aligned else (1, 1)
    q_len = step_q * data.draw(st.integers(1, max(1, 48 // step_q)))
    kv_len = step_k * data.draw(st.integers(1, max(1, 48 // step_k)))
    kv_heads = data.draw(st.integers(1, 2))
    q, k, v = qkv(q_len, kv_len, heads=kv_heads * spec.gqa_group, kv_heads=kv_heads, head_dim=spec.head_dim,
                  dtype=getattr(torch, spec.dtype))
    schedule = {n: getattr(spec, n) for n in ("consumers", "k_stages", "v_stages", "block_n", "pingpong", "aligned")}
    sinks = {"sinks": torch.randn(q.shape[2])} if data.draw(st.booleans()) else {}
    check_bwd_fake(bwd_arguments(q, k, v, causal=spec.causal, **schedule, **sinks))


def test_the_backward_op_checks_dout():
    q, k, v = qkv(16)
    dout, out, lse, *args = bwd_arguments(q, k, v)
    with pytest.raises(InputError, match=r"^dout = torch.float32 \[1, 16, 2, 64\]: expected a torch.float16 tensor"):
        ops.bwd(dout.float(), out, lse, *args)
    strided = torch.empty(1, 2, 16, 64, dtype=torch.float16).transpose(1, 2).copy_(dout)
    with pytest.raises(InputError, match=r"^dout.stride\(\) = .*: expected a contiguous tensor"):
        ops.bwd(strided, out, lse, *args)
    with pytest.raises(InputError, match=r"^lse = shape \[0\]: expected the forward's LSE"):
        ops.bwd(dout, out, torch.empty(0), *args[:3], args[3].replace('"lse": true', '"lse": false'), *args[4:])
    with pytest.raises(InputError, match=r"^dlse = torch.float32 \[1, 16, 2\]: expected a torch.float32 tensor of "
                                         r"shape \[1, 2, 16\], the LSE's"):
        ops.bwd(dout, out, lse, *args, lse.transpose(1, 2))


def test_a_wrong_backward_fake_is_caught():
    """The comparison can fail: a dk with q's shape (as a fake that forgot GQA would give)."""
    q, k, v = qkv(16, 16, heads=2, kv_heads=1)
    real = ops.bwd(*bwd_arguments(q, k, v))
    with FakeTensorMode() as mode:
        wrong = [mode.from_tensor(real[0]), mode.from_tensor(real[0]), mode.from_tensor(real[2]),
                 mode.from_tensor(real[3])]
    assert [metadata(t) for t in wrong] != [metadata(t) for t in real]


# -- the front doors ---------------------------------------------------------------------------------


def test_flash_attn_func_is_differentiable():
    from attngen.interfaces.flash_attn_interface import flash_attn_func

    q, k, v = qkv(30, 40, heads=4, kv_heads=2)
    out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.15)
    dout = cotangent(out)
    out.backward(dout)
    checks = check_grads(grads_of(q, k, v), q.detach(), k.detach(), v.detach(), dout, True, dtype="float16", scale=0.15)
    assert not failures(checks), failures(checks)


def test_flash_attn_func_deterministic_runs_the_deterministic_backward():
    """deterministic=True (FA3's flag) is the spec field: the op's gradients are bit-identical to
    the deterministic backward's under another schedule policy and seed (the atomic one's are not
    promised to be), and still pass the reference."""
    from attngen.interfaces.flash_attn_interface import flash_attn_func

    q, k, v = qkv(40, 50, heads=4, kv_heads=2)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)  # (with sinks: CASES' deterministic case)
    dout = cotangent(out)
    out.backward(dout)
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "deterministic": True, "lse": True}))
    assert plan.spec.deterministic
    other = attngen.emulate_backward(plan, q.detach(), k.detach(), v.detach(), dout, seed=5, policy="producer-first")
    assert all(torch.equal(a, b) for a, b in zip(other, (q.grad, k.grad, v.grad)))
    checks = check_grads(grads_of(q, k, v), q.detach(), k.detach(), v.detach(), dout, True, dtype="float16")
    assert not failures(checks), failures(checks)


def test_flash_attn_varlen_func_is_differentiable():
    """Packed sequences (one of them empty): each sequence's gradients against its own fp64
    reference (a sequence's k and v are read by its own queries only)."""
    from attngen.interfaces.flash_attn_interface import flash_attn_varlen_func

    lq, lk = [10, 0, 23], [20, 7, 30]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 64, generator=g).half().requires_grad_()
    k, v = (torch.randn(sum(lk), 2, 64, generator=g).half().requires_grad_() for _ in range(2))
    cq, ck = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lq, lk))
    out = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, softmax_scale=0.2)
    dout = cotangent(out)
    out.backward(dout)
    for b in range(len(lq)):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if lq[b] == 0:  # keys no query reads: zero gradients
            assert not k.grad[ks].any() and not v.grad[ks].any()
            continue
        got = {"dq": q.grad[None, qs], "dk": k.grad[None, ks], "dv": v.grad[None, ks]}
        checks = check_grads(got, q.detach()[None, qs], k.detach()[None, ks], v.detach()[None, ks], dout[None, qs],
                             True, dtype="float16", scale=0.2)
        assert not failures(checks), (b, failures(checks))


def test_a_varlen_call_without_query_rows_has_zero_gradients():
    q = torch.zeros(0, 2, 64, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(9, 2, 64).half().requires_grad_() for _ in range(2))
    cq, ck = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    out = attngen.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=0)
    out.float().sum().backward()
    assert k.grad.shape == k.shape and not k.grad.any() and not v.grad.any() and q.grad.shape == (0, 2, 64)


def test_flex_attention_is_differentiable_through_its_transposes():
    """[B, H, S, D] in and out: the gradient reaching the op is a transposed view (made packed there)."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in qkv(24, 36))  # [B, H, S, D]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5

    out = attngen.flex_attention(q, k, v, score_mod=score_mod, scale=0.2)
    dout = cotangent(out)
    out.backward(dout)
    bshd = [t.detach().transpose(1, 2) for t in (q, k, v)]
    got = {n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), (q, k, v))}
    checks = check_grads(got, *bshd, dout.transpose(1, 2), False, dtype="float16", scale=0.2, score_mod="score * 0.5")
    assert not failures(checks), failures(checks)


# -- CUDA (an sm_90 GPU): the same autograd over runtime's compiled backward ---------------------------


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_cuda_backward_matches_the_reference_and_the_cpu_model():
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(300, 517, heads=4, kv_heads=2, head_dim=128))
    sinks = torch.randn(4, device="cuda").requires_grad_()
    out = attngen.attention(q, k, v, causal=True, sinks=sinks)
    dout = cotangent(out.cpu()).cuda()
    out.backward(dout)
    got = {n: g.cpu() for n, g in grads_of(q, k, v, sinks).items()}
    assert all(torch.isfinite(g).all() for g in got.values())
    checks = check_grads(got, q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), dout.cpu(), True,
                         dtype="float16", sinks=sinks.detach().cpu())
    assert not failures(checks), failures(checks)
    compiled = torch.compile(loss_fn, fullgraph=True)
    for t in (q, k, v):
        t.grad = None
    compiled(q, k, v).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_cuda_lse_gradient_matches_the_reference():
    """The LSE's gradient through runtime's compiled backward (the preprocess's dLSE read on sm_90a)."""
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(300, 517, heads=4, kv_heads=2, head_dim=128))
    sinks = torch.randn(4, device="cuda").requires_grad_()
    out, lse = attngen.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    dout = cotangent(out.cpu()).cuda()
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5)).cuda()
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    got = {n: g.cpu() for n, g in grads_of(q, k, v, sinks).items()}
    checks = check_grads(got, q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), dout.cpu(), True,
                         dtype="float16", sinks=sinks.detach().cpu(), dlse=dlse.cpu())
    assert not failures(checks), failures(checks)


CHILD = """
import json, sys

from compile_count import count_compiles

calls = count_compiles()
from attngen import Spec
from attngen.run import backward, runtime

spec = Spec(head_dim=64, causal=True, gqa_group=2)
if sys.argv[1] == "precompile":
    done = backward.precompile_backward(spec)
    print(json.dumps({"calls": calls, "path": str(done.path), "cached": done.cached}))
else:
    kernel = backward.compile_backward(spec)
    print(json.dumps({"calls": calls, "path": kernel.cache_path, "origin": kernel.origin, "parts": sorted(kernel.jits)}))
"""


@pytest.mark.slow
@NEEDS_TOOLKIT
def test_the_backward_module_precompiles_into_one_entry_that_a_later_process_loads(tmp_path):
    """Every part (preprocess, main, postprocess, GQA's dK/dV postprocess) built for sm_90a into one
    runtime entry; a fresh process with an empty TileLang cache loads it: no lowering, no nvcc."""
    import json
    import subprocess
    import sys

    def child(mode, tilelang_cache):
        env = child_env(ATTNGEN_CACHE=str(tmp_path / "cache"), TILELANG_CACHE_DIR=str(tilelang_cache))
        run = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    cold = child("precompile", tmp_path / "tl-1")
    assert not cold["cached"] and {"tilelang.compile", "process nvcc"} <= set(cold["calls"]), cold
    warm = child("load", tmp_path / "tl-2")
    assert warm["calls"] == [] and warm["origin"] == "disk" and warm["path"] == cold["path"], warm
    assert warm["parts"] == ["main", "postprocess", "postprocess_kv", "preprocess"]
