"""Learnable call-time tensors (issue 27, item 3): the backward's d(loss)/d(tensor) for the score_mod's
float tensors and ALiBi's slopes (spec field `learnable`).

The oracle chain: reference.backward.tensor_grads (fp64, from expr.derivative with `wrt`) against
torch's autograd of the same attention written out in float64; then the emitted backward kernels on
the CPU model (emulate_backward: the main kernel's element atomics into dT) against that reference
under the backward's tolerance rule (2 x the twin's error + one ulp). tests/test_flex_peer.py holds
the Flex door against torch's flex_attention.
"""

import json
import re

import numpy as np
import pytest
import torch

import attngen
from attngen import expr
from attngen.emulator.errors import HazardError
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.bwd.render import render_backward_source
from attngen.reference.backward import tensor_grads
from attngen.reference.forward import InputError, round_to, tolerance
from attngen.spec import SpecError

D = 64


def _inputs(seed, B=1, S=40, KV=None, H=2, HKV=None, d=D):
    g = torch.Generator().manual_seed(seed)
    KV, HKV = KV or S, HKV or H
    mk = lambda *s: torch.randn(*s, generator=g).half()  # noqa: E731
    return mk(B, S, H, d), mk(B, KV, HKV, d), mk(B, KV, HKV, d), mk(B, S, H, d)


def _variant(spec, named):
    named = dict(named)
    return dict(score_mod=spec.score_mod, mask_mod=spec.mask_mod, softcap=spec.softcap, window=spec.window,
                alibi_slopes=named.pop("alibi_slopes", None), tensors=named)


def _torch_grads(q, k, v, dout, causal, score_mod, named):
    """fp64 autograd of attention whose score_mod is `score_mod` (a torch function of the score, the
    index grids and the named tensors): the reference's independent check."""
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    leaves = {n: t.double().clone().requires_grad_() for n, t in named.items()}
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    grid = dict(b=torch.arange(b)[:, None, None, None], h=torch.arange(h)[None, :, None, None],
                q_idx=torch.arange(sq)[None, None, :, None], kv_idx=torch.arange(skv)[None, None, None, :])
    z = score_mod(s, grid, leaves)
    if causal:
        z = z.masked_fill(grid["q_idx"] + skv - sq < grid["kv_idx"], -float("inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", z.softmax(-1), v)
    (out * dout).sum().backward()
    return {n: t.grad.numpy() for n, t in leaves.items()}


g0 = torch.Generator().manual_seed(11)
REL = torch.randn(79, generator=g0)
HEAD = torch.randn(2, generator=g0)
FULL = torch.randn(1, 2, 40, 40, generator=g0)
SLOPES = torch.rand(2, generator=g0)

# (score_mod text, learnable, its torch form, tensors, causal)
CASES = {
    "bias[h] x score, tanh": ("tanh(score * scl[h]) + bias[h]", ("bias", "scl"),
                             lambda s, i, t: torch.tanh(s * t["scl"][i["h"]]) + t["bias"][i["h"]],
                             {"bias": HEAD, "scl": SLOPES + 0.5}, True),
    "bias[q - kv], negative indices wrapped": ("score + rel[where(q_idx - kv_idx < 0, q_idx - kv_idx + 79, q_idx - kv_idx)]",
                                               ("rel",), lambda s, i, t: s + t["rel"][i["q_idx"] - i["kv_idx"]],
                                               {"rel": REL}, False),
    "bias[b, h, q, kv], read twice": ("score + full[b, h, q_idx, kv_idx] * full[b, h, q_idx, kv_idx]", ("full",),
                                      lambda s, i, t: s + t["full"][i["b"], i["h"], i["q_idx"], i["kv_idx"]] ** 2,
                                      {"full": FULL}, True),
    "a scalar": ("score * c[0]", ("c",), lambda s, i, t: s * t["c"][0], {"c": torch.tensor([0.7])}, False),
    "ALiBi as a mod": ("score + sl[h] * (kv_idx - q_idx)", ("sl",),
                       lambda s, i, t: s + t["sl"][i["h"]] * (i["kv_idx"] - i["q_idx"]), {"sl": SLOPES}, True),
    "where, exp, max, pow, a quotient": (
        "where(q_idx >= kv_idx, score * exp(sl[h]), max(score, bias[h]) - pow(sl[h], 2) / (1 + bias[h] * bias[h]))",
        ("bias", "sl"),
        lambda s, i, t: torch.where(i["q_idx"] >= i["kv_idx"], s * torch.exp(t["sl"][i["h"]]),
                                    torch.maximum(s, t["bias"][i["h"]]) - t["sl"][i["h"]] ** 2
                                    / (1 + t["bias"][i["h"]] ** 2)),
        {"bias": HEAD, "sl": SLOPES}, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_reference_tensor_gradients_are_torch_autograds(case):
    text, learnable, fn, named, causal = CASES[case]
    q, k, v, dout = _inputs(1)
    want = _torch_grads(q, k, v, dout, causal, fn, named)
    got = tensor_grads(q, k, v, dout, causal, learnable=learnable, score_mod=text, tensors=named)
    for n in learnable:
        assert np.abs(got[n] - want[n]).max() <= 1e-9 * max(1.0, np.abs(want[n]).max()), n


def test_the_reference_alibi_slopes_gradient_is_torch_autograds():
    q, k, v, dout = _inputs(2)
    # ALiBi first, then the score_mod: d/d slope = -|q - kv| * 2
    fn = lambda s, i, t: (s - t["alibi_slopes"][i["h"]] * (i["q_idx"] - i["kv_idx"]).abs()) * 2  # noqa: E731
    want = _torch_grads(q, k, v, dout, True, fn, {"alibi_slopes": SLOPES})
    got = tensor_grads(q, k, v, dout, True, learnable=("alibi_slopes",), score_mod="score * 2", alibi_slopes=SLOPES)
    assert np.abs(got["alibi_slopes"] - want["alibi_slopes"]).max() <= 1e-9 * np.abs(want["alibi_slopes"]).max()


def test_the_derivative_with_respect_to_a_read_follows_the_rules():
    e = expr.parse("score * s[h] + tanh(r[q_idx] * 2) + r[kv_idx]", "score_mod")
    (s_site,), r_sites = expr.tensor_reads(e, "s"), expr.tensor_reads(e, "r")
    first, second = sorted(r_sites, key=lambda n: n.col_offset)  # r[q_idx], then r[kv_idx]
    assert expr.derivative(e, s_site).canonical == "score"
    assert expr.derivative(e, first).canonical == "(1 - tanh(r[q_idx] * 2) * tanh(r[q_idx] * 2)) * 2"
    assert expr.derivative(e, second).canonical == "1"
    assert expr.derivative(e).canonical == "s[h]"  # the score's own derivative is unchanged


def _check(spec, seed=3, source=None, *, named, **shape):
    """The emitted backward's dT on the CPU model against the fp64 reference (the twin's bound): {name: (err, bound)}."""
    q, k, v, dout = _inputs(seed, **shape)
    grads = attngen.emulate_backward(spec, q, k, v, dout, source=source, **named)
    got = dict(zip(spec.learnable, grads[len(grads) - len(spec.learnable):]))
    rounded = [round_to(x.numpy(), spec.dtype) for x in (q, k, v, dout)]
    ref = tensor_grads(*rounded, spec.causal, learnable=spec.learnable, **_variant(spec, named))
    low = tensor_grads(*rounded, spec.causal, learnable=spec.learnable, lowprec=spec.dtype, **_variant(spec, named))
    out = {}
    for n in spec.learnable:
        assert got[n].dtype == torch.float32 and got[n].shape == named[n].shape, n
        out[n] = (float(np.abs(got[n].numpy() - ref[n]).max()), tolerance(ref[n], low[n], spec.dtype))
    return out


KERNEL_CASES = {
    "bias[h] x score, causal": (dict(score_mod="tanh(score * scl[h]) + bias[h]", causal=True, learnable=["bias", "scl"]),
                                dict(named={"bias": HEAD, "scl": SLOPES + 0.5})),
    "bias[q - kv], kv longer, window": (dict(score_mod="score + rel[where(q_idx - kv_idx < 0, q_idx - kv_idx + 79, "
                                                       "q_idx - kv_idx)]", window=(20, 3), learnable=["rel"]),
                                        dict(KV=70, named={"rel": REL})),
    "bias[b, h, q, kv], GQA, a mask_mod": (dict(score_mod="score + full[b, h, q_idx, kv_idx]", gqa_group=2,
                                               mask_mod="kv_idx % 3 != 1", learnable=["full"]),
                                          dict(H=2, HKV=1, named={"full": FULL})),
    "ALiBi slopes, softcap, a score_mod": (dict(alibi=True, softcap=15.0, score_mod="score * 1.5", causal=True,
                                               learnable=["alibi_slopes"]),
                                          dict(named={"alibi_slopes": SLOPES})),
    "a scalar, head_dim 256 (warpgroups split columns)": (dict(head_dim=256, score_mod="score * c[0]", learnable=["c"]),
                                                         dict(d=256, named={"c": torch.tensor([0.7])})),
    "where, exp, max, pow, a quotient": (dict(score_mod=CASES["where, exp, max, pow, a quotient"][0],
                                              learnable=["bias", "sl"]), dict(named={"bias": HEAD, "sl": SLOPES})),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_emitted_backward_scatters_each_learnable_tensors_gradient(case):
    fields, shape = KERNEL_CASES[case]
    spec = attngen.Spec(**{"head_dim": D, **fields})
    for n, (err, bound) in _check(spec, **dict(shape)).items():
        assert err <= bound, f"{n}: {err:.3g} > {bound:.3g}"


def _scatter_line(text: str, param: str) -> str:
    return next(line for line in text.splitlines() if f"T.atomic_add(d{param}" in line)


def test_a_dropped_factor_of_the_derivative_fails_the_check():
    """d(score * scl[h] + bias[h])/d(scl[h]) is the score: the kernel without that factor is caught."""
    spec = attngen.Spec(head_dim=D, score_mod="score * scl[h] + bias[h]", causal=True, learnable=["bias", "scl"])
    named = dict(named={"bias": HEAD, "scl": SLOPES + 0.5})
    text = render_backward_source(spec)
    line = _scatter_line(text, "X_scl")
    assert line.endswith(" * ((acc_s[i, j] * softmax_scale)), 0))")
    broken = text.replace(line, line.replace(" * ((acc_s[i, j] * softmax_scale)), 0))", ", 0))"))
    honest = _check(spec, **dict(named))
    dropped = _check(spec, source=broken, **dict(named))
    assert all(err <= bound for err, bound in honest.values())
    err, bound = dropped["scl"]
    assert err > 10 * bound
    assert dropped["bias"][0] <= dropped["bias"][1]  # the other tensor's scatter is untouched


def test_a_plain_store_in_place_of_the_atomic_add_is_a_race():
    """The scatter's atomics are what make it race-free: two warpgroups (keys past kv_len clamp to one
    column) and two heads write the same entries of dT; as plain stores the race detector reports them."""
    spec = attngen.Spec(head_dim=D, score_mod="score + bias[q_idx, kv_idx]", learnable=["bias"])
    text = render_backward_source(spec)
    line = _scatter_line(text, "X_bias")
    m = re.match(r"(\s*)T\.atomic_add\((dX_bias\[.*?\]), (T\.if_then_else.*)\)$", line)
    racy = text.replace(line, f"{m.group(1)}{m.group(2)} = {m.group(2)} + {m.group(3)}")
    q, k, v, dout = _inputs(4)
    bias = torch.randn(40, 40)
    attngen.emulate_backward(spec, q, k, v, dout, bias=bias)  # the emitted kernel: no hazard
    with pytest.raises(HazardError, match="writes dX_bias"):
        attngen.emulate_backward(spec, q, k, v, dout, bias=bias, source=racy)


def test_learnable_names_what_has_a_derivative_and_the_rest_is_refused_in_one_line():
    ok = attngen.Spec(head_dim=D, score_mod="score + bias[h]", mask_mod="keep[kv_idx] > 0", alibi=True,
                      learnable=("bias", "alibi_slopes", "bias"))
    assert ok.learnable == ("alibi_slopes", "bias") and ok.canonical_dict()["learnable"] == ["alibi_slopes", "bias"]
    assert "learnable" not in attngen.Spec(head_dim=D, score_mod="score + bias[h]").canonical_dict()  # default: no change
    for bad in (["keep"], ["ids"], ["sinks"], "bias"):
        with pytest.raises(SpecError, match="learnable") as e:
            attngen.Spec(head_dim=D, score_mod="score + bias[h] + ids.int32[h]", mask_mod="keep[kv_idx] > 0",
                         learnable=bad)
        assert "\n" not in str(e.value)
    spec = attngen.Spec(head_dim=D, score_mod="score + bias[h]", learnable=["bias"], deterministic=True, layout="varlen")
    with pytest.raises(SpecError, match=r"deterministic.*learnable.*varlen") as e:
        plan_backward(spec)
    assert "\n" not in str(e.value)


def test_a_learnable_spec_keeps_the_forward_and_names_its_backward_apart():
    plain = attngen.Spec(head_dim=D, score_mod="score + bias[h]")
    learn = attngen.Spec(head_dim=D, score_mod="score + bias[h]", learnable=["bias"])
    assert plan_backward(learn).forward == plan_backward(plain).forward
    assert plan_backward(learn).name != plan_backward(plain).name
    assert plan_backward(learn).hash != plan_backward(plain).hash
    assert "T.atomic_add(dX_bias" not in render_backward_source(plain)
    # at the register edge the scatter's loop spilled by keys (hd128: 8 B): the learnable kernel splits columns
    wide = dict(head_dim=128, dtype="bfloat16", causal=True, score_mod="score + bias[b, h, q_idx, kv_idx]")
    assert not plan_backward(attngen.Spec(**wide)).columns
    assert plan_backward(attngen.Spec(**wide, learnable=["bias"])).columns


def test_attention_gives_the_score_mods_tensors_and_alibi_slopes_their_gradients():
    """attngen.attention (the op, on the CPU model): the tensors that require grad get the kernels'
    gradients; a mask_mod's tensor gets 0; emulate_backward refuses a tensor that
    requires grad unless the spec names it learnable."""
    q, k, v, dout = _inputs(5)
    bias = HEAD.clone().requires_grad_()
    slopes, keep = SLOPES.clone().requires_grad_(), torch.randn(40).requires_grad_()
    kw = dict(causal=True, score_mod="score * 1.25 + bias[h]", mask_mod="keep[kv_idx] > -1.0")
    out = attngen.attention(q, k, v, alibi_slopes=slopes, bias=bias, keep=keep, **kw)
    (out.float() * dout.float()).sum().backward()
    assert bias.grad.dtype == slopes.grad.dtype == torch.float32
    assert torch.equal(keep.grad, torch.zeros_like(keep))
    spec = attngen.Spec(head_dim=D, alibi=True, learnable=["alibi_slopes", "bias"], **kw)
    named = {"bias": bias.detach(), "keep": keep.detach(), "alibi_slopes": slopes.detach()}
    _, _, _, dslopes, dbias = attngen.emulate_backward(spec, q, k, v, dout, **named)
    assert torch.equal(slopes.grad, dslopes) and torch.equal(bias.grad, dbias)
    rounded = [round_to(x.numpy(), "float16") for x in (q, k, v, dout)]
    ref = tensor_grads(*rounded, True, learnable=spec.learnable, **_variant(spec, named))
    low = tensor_grads(*rounded, True, learnable=spec.learnable, lowprec="float16", **_variant(spec, named))
    for n, got in (("alibi_slopes", slopes.grad), ("bias", bias.grad)):
        assert np.abs(got.numpy() - ref[n]).max() <= tolerance(ref[n], low[n], "float16"), n
    with pytest.raises(InputError, match="learnable"):
        attngen.emulate_backward(attngen.Spec(head_dim=D, score_mod="score + bias[h]"), q, k, v, dout,
                                 bias=HEAD.clone().requires_grad_())


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_deterministic_learnable_gradients_pass_the_same_check(case):
    fields, shape = KERNEL_CASES[case]
    spec = attngen.Spec(**{"head_dim": D, **fields, "deterministic": True})
    assert "build_dtensors_kernel" in render_backward_source(spec)
    for n, (err, bound) in _check(spec, **dict(shape)).items():
        assert err <= bound, f"{n}: {err:.3g} > {bound:.3g}"


def _bits(spec, named, source=None):
    """The learnable gradients' bit patterns over schedules (every policy, two seeds, both block orders)."""
    q, k, v, dout = _inputs(7)
    seen = set()
    for policy in ("random", "producer-first", "consumers-first"):
        for seed in (0, 1):
            for order in ("grid", "shuffled"):
                grads = attngen.emulate_backward(spec, q, k, v, dout, seed=seed, policy=policy, block_order=order,
                                                 source=source, **named)
                seen.add(b"".join(g.numpy().tobytes() for g in grads[len(grads) - len(spec.learnable):]))
    return seen


def test_deterministic_learnable_gradients_are_bit_identical_and_the_check_sees_an_unordered_sum():
    """deterministic = true: the main kernel stores each element's term once, one thread walks them in
    (batch, head, row, key) order: one bit pattern over every schedule. The same check over the atomics
    (deterministic = false) sees two, and a walk in another order (rows outside heads) other bits: the check
    would catch an order that moved with the schedule."""
    fields = dict(head_dim=D, score_mod="score + rel[q_idx - kv_idx + 39]", learnable=["rel"], causal=True)
    named = {"rel": torch.randn(79, generator=torch.Generator().manual_seed(8))}
    det = attngen.Spec(**fields, deterministic=True)
    ordered = _bits(det, named)
    assert len(ordered) == 1
    assert len(_bits(attngen.Spec(**fields), named)) > 1  # atomics: the order the schedule runs them
    text = render_backward_source(det)
    heads, rows = "for hi in T.serial(heads):", "for qi in T.serial(q_len):"
    swapped = text.replace(heads, "@@").replace(rows, heads).replace("@@", rows)
    assert swapped != text and _bits(det, named, swapped) != ordered


def test_deterministic_with_a_learnable_tensor_runs_through_attention():
    q, k, v, dout = _inputs(6)
    bias = HEAD.clone().requires_grad_()
    out = attngen.attention(q, k, v, score_mod="score + bias[h]", bias=bias, deterministic=True)
    (out.float() * dout.float()).sum().backward()
    spec = attngen.Spec(head_dim=D, score_mod="score + bias[h]", learnable=["bias"], deterministic=True)
    assert torch.equal(bias.grad, attngen.emulate_backward(spec, q, k, v, dout, bias=HEAD)[-1])


def test_packed_sequences_scatter_each_sequences_terms():
    """layout varlen: the main kernel's (batch_idx, rows, keys) are the sequence's own; dT sums the
    sequences' terms, as two bshd runs of the sequences added."""
    text = "score + rel[q_idx - kv_idx + 39]"
    q, k, v, dout = _inputs(9)
    rel = REL[:79]
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    packed = attngen.emulate_backward(attngen.Spec(head_dim=D, score_mod=text, learnable=["rel"], causal=True,
                                                   layout="varlen"), q[0], k[0], v[0], dout[0], rel=rel,
                                      cu_seqlens_q=cu, cu_seqlens_k=cu)[-1]
    spec = attngen.Spec(head_dim=D, score_mod=text, learnable=["rel"], causal=True)
    apart = sum(attngen.emulate_backward(spec, *(x[:, a:b] for x in (q, k, v, dout)), rel=rel)[-1]
                for a, b in ((0, 25), (25, 40)))
    assert packed.abs().max() > 1 and (packed - apart).abs().max() <= 1e-5 * packed.abs().max()


def test_the_command_line_checks_each_learnable_gradient():
    """`attngen emulate --backward` / `attngen check` hold dT to the reference beside dq, dk, dv
    (reference.backward.check_grads with learnable), and a kernel that scatters nothing fails there."""
    from attngen.cli.backward import emulated_grads

    spec = attngen.Spec(head_dim=D, score_mod="score * scl[h] + rel[q_idx - kv_idx + 63]", learnable=["rel", "scl"],
                        causal=True)
    bp = plan_backward(spec)
    checks, *_ = emulated_grads(bp, 1, 2, 2, 50, 64)
    assert {"drel", "dscl"} <= set(checks) and all(c.ok for c in checks.values()), checks
    text = render_backward_source(spec)
    silent = text.replace(_scatter_line(text, "X_rel"), "")
    checks, *_ = emulated_grads(bp, 1, 2, 2, 50, 64, source=silent)
    assert not checks["drel"].ok and checks["dscl"].ok and checks["dq"].ok


def test_opcheck_the_backward_op_with_learnable_tensors_and_the_forward_with_their_autograd():
    """attngen::bwd_tensors (bwd plus the learnable tensors' gradients): schema, fake against the real
    outputs, dispatch; and attngen::fwd's autograd formula with a bias and ALiBi slopes that require grad."""
    from attngen.interfaces import ops
    from attngen.interfaces.op_arguments import encode_fields

    q, k, v, dout = _inputs(10, S=16)
    bias, slopes = HEAD.clone().requires_grad_(), SLOPES.clone().requires_grad_()
    args = ops.fwd_arguments(q.requires_grad_(), k, v, causal=True, score_mod="score + bias[h]", alibi_slopes=slopes,
                             bias=bias)[0]
    assert set(torch.library.opcheck(ops.fwd, args).values()) == {"SUCCESS"}
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else [x.detach() for x in a] if isinstance(a, list) else a
                 for a in args)
    out, lse = ops.fwd(*args)
    fields = encode_fields({**json.loads(args[3]), "learnable": ["alibi_slopes", "bias"]})
    bwd_args = (dout, out, lse) + args[:3] + (fields,) + args[4:]
    result = torch.library.opcheck(ops.bwd_tensors, bwd_args)
    assert set(result.values()) == {"SUCCESS"}, result
    *_, dtensors = ops.bwd_tensors(*bwd_args)
    assert [t.shape for t in dtensors] == [slopes.shape, bias.shape] and all(t.dtype == torch.float32 for t in dtensors)
