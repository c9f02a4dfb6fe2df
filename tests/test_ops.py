"""The torch ops (attngen/ops.py, docs/torch.md) on the CPU backend: the emitted kernel on the CPU
model. torch.compile with no graph break, one compilation over three lengths, torch.export,
opcheck, fakes against the real outputs' metadata (every preset, hypothesis-drawn specs and
serving calls), the CPU-time refusal; autograd's gradients are tests/test_ops_backward.py's.

Shapes stay tiny (batch 1-2, a few heads, lengths up to ~130): each call runs the CPU model.
Compiles use the aot_eager backend (dynamo, AOT autograd and the fakes, which is all the op is
asked to serve) but for one fullgraph compile with the default backend, Inductor.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen.interfaces import op_arguments, ops
from attngen.reference.serving import random_serving_inputs
from attngen.run import serving
from attngen.emulator import driver
from attngen.emulator.driver import variant_inputs
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import InputError, check_close, check_lse
from attngen.spec import SpecError, load

from gpu_marks import GPU_ONLY
from strategies import ragged_batches, valid_specs

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "examples").glob("*.toml"))
# spec fields the op derives from the tensors (attngen.attention never needs them as keywords)
DERIVED = ("head_dim", "dtype", "gqa_group", "head_dim_v", "alibi", "sinks", "layout", "paged_kv", "page_size")


def qkv(q_len=40, kv_len=None, heads=2, kv_heads=2, head_dim=64, dtype=torch.float16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    kv_len = kv_len or q_len
    q = torch.randn(1, q_len, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    return tuple(t.requires_grad_() for t in (q, k, v)) if grad else (q, k, v)


def as_torch(x, dtype=None):
    if x is None or isinstance(x, (int, np.integer)):
        return x
    t = torch.from_numpy(np.ascontiguousarray(x))
    return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t)  # packed strides, even for an empty array


def metadata(t):
    return tuple(t.shape), t.dtype, t.device, t.stride()


def fake_of(args):
    """The op's outputs under FakeTensorMode for the same arguments (the fake kernel alone)."""
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor)
                     else [mode.from_tensor(x) for x in a] if isinstance(a, list) else a for a in args]
        return ops.fwd(*fake_args)


def check_fake_matches_real(args):
    real = ops.fwd(*args)
    fake = fake_of(args)
    assert [metadata(t) for t in fake] == [metadata(t) for t in real]
    return real


# -- eager: the CPU backend runs the emitted kernel ----------------------------------------------


def test_attention_on_cpu_tensors_runs_the_emitted_kernel_on_the_cpu_model():
    q, k, v = qkv(70, 90)
    out = attngen.attention(q, k, v, causal=True)
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": False}))
    assert torch.equal(out, attngen.emulate(plan, q, k, v))  # the same kernel, the same schedule seed
    assert (out.dtype, out.shape) == (torch.float16, (1, 70, 2, 64))
    assert check_close(out, q, k, v, True).ok


def test_a_broken_kernel_shows_through_the_op(monkeypatch):
    """The op's CPU path is the emitted text: a mutated source changes what the op returns."""
    q, k, v = qkv(40)
    good = attngen.attention(q, k, v)
    real = driver.emulate_stats

    def mutated(plan, *a, **kw):  # drop the softmax's row max subtraction... any edit the tolerance sees
        from attngen.kernels.fwd.render import render_source

        text = render_source(plan).replace("T.exp2(", "T.exp2(0.5 * ", 1)
        return real(plan, *a, **dict(kw, source=text))

    monkeypatch.setattr(driver, "emulate_stats", mutated)
    bad = attngen.attention(q, k, v)
    assert not check_close(bad, q, k, v, False).ok and check_close(good, q, k, v, False).ok


def test_lse_gqa_and_variant_tensors_through_the_op():
    q, k, v = qkv(33, 70, heads=4, kv_heads=2)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out, lse = attngen.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True, softcap=20)
    assert lse.shape == (1, 4, 33) and lse.dtype == torch.float32
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": True}), softcap=20.0,
                       tensor_names="alibi_slopes")
    assert (plan.spec.alibi, plan.spec.softcap, plan.spec.gqa_group) == (True, 20.0, 2)
    want_out, want_lse = attngen.emulate(plan, q, k, v, alibi_slopes=slopes)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_a_tiny_softcap_through_the_op_matches_the_reference():
    """softcap 1e-5 is valid (a finite number >= 0): its kernel's name must be an identifier (it was `_sc1e-05`)."""
    q, k, v = qkv(20)
    out = attngen.attention(q, k, v, softcap=1e-5)
    assert check_close(out, q, k, v, False, softcap=1e-5).ok
    assert not check_close(out, q, k, v, False).ok  # the cap flattens every score: another answer than none


def test_a_non_default_scale_through_the_op_matches_the_reference():
    """softmax_scale (or scale) reaches the emitted kernel on the CPU model and the reference at the same scale."""
    q, k, v = qkv(70, 90, heads=4, kv_heads=2)
    default = attngen.attention(q, k, v, causal=True)
    out, lse = attngen.attention(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)
    assert check_close(out, q, k, v, True, scale=0.3).ok
    assert check_lse(lse, q, k, v, True, scale=0.3).ok
    assert not check_close(out, q, k, v, True).ok  # the default's reference is another answer
    assert (out - default).abs().max() > 1e-2
    assert torch.equal(attngen.attention(q, k, v, causal=True, scale=0.3), out)  # SDPA's name, the same argument
    assert torch.equal(attngen.attention(q, k, v, causal=True, softmax_scale=64 ** -0.5), default)  # the default is 1/sqrt(D)
    args, _ = ops.fwd_arguments(q, k, v, causal=True, softmax_scale=0.3)
    assert float(args[7]) == 0.3 and ops.fwd_arguments(q, k, v)[0][7] is None  # the op's slot; None: the op's default
    assert args[7].dim() == 0 and args[7].dtype == torch.float64  # a 0-d tensor: symbolic under torch.compile
    assert torch.equal(attngen.attention(q, k, v, causal=True, softmax_scale=torch.tensor(0.3)), out)  # a 0-d tensor too
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": False}))
    assert torch.equal(attngen.attention(q, k, v, causal=True, softmax_scale=1.0),
                       attngen.emulate(plan, q, k, v, softmax_scale=1.0))


def test_resolve_is_memoized_on_what_selects_the_kernel():
    q, k, v = qkv(20)
    plain = op_arguments.encode_fields({"causal": False, "lse": False})
    first = op_arguments.resolve(q, k, v, plain)
    assert op_arguments.resolve(*qkv(21, 30, seed=1), plain) is first  # another length, the same kernel: no new plan
    assert op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": False})).spec.causal
    assert op_arguments.resolve(q, k, v, plain, softcap=5.0).spec.softcap == 5.0
    assert op_arguments.resolve(q.bfloat16(), k.bfloat16(), v.bfloat16(), plain).spec.dtype == "bfloat16"
    assert op_arguments.resolve(q, k, v[..., :32].repeat(1, 1, 1, 4).contiguous(), plain).spec.head_dim_v == 128


def test_out_buffer_receives_the_result():
    q, k, v = qkv(20)
    buf = torch.full_like(q, float("nan"))
    got = attngen.attention(q, k, v, out=buf)
    assert got is buf and torch.equal(buf, attngen.attention(q, k, v))
    with pytest.raises(InputError, match="out = torch.float32"):
        attngen.attention(q, k, v, out=q.float())


def test_bad_calls_name_the_argument():
    q, k, v = qkv(20)
    with pytest.raises(SpecError, match="did you mean `causal`"):
        attngen.attention(q, k, v, casual=True)
    with pytest.raises(InputError, match=r"^q = list: expected a torch.Tensor"):
        attngen.attention([1], k, v)
    with pytest.raises(SpecError, match="window"):
        attngen.attention(q, k, v, window=5)
    with pytest.raises(SpecError, match="softcap"):
        attngen.attention(q, k, v, softcap="big")
    with pytest.raises(InputError, match="num_splits"):
        attngen.attention(q, k, v, num_splits=-2)
    with pytest.raises(InputError, match="k.dtype"):
        attngen.attention(q, k.bfloat16(), v)
    with pytest.raises(InputError, match="bias = a tensor of shape"):  # a tensor no expression reads
        attngen.attention(q, k, v, bias=torch.zeros(2))
    args, _ = ops.fwd_arguments(q, k, v)
    for bad in (0.0, -0.5, float("nan"), float("inf"), 1e-40):  # the op checks its slot: positive normal float32
        with pytest.raises(InputError, match=r"^softmax_scale = "):
            ops.fwd(*args[:7], torch.tensor(bad, dtype=torch.float64), *args[8:])
    with pytest.raises(InputError, match=r"^softmax_scale = a tensor that requires grad: expected a constant"):
        attngen.attention(q, k, v, softmax_scale=torch.tensor(0.5, requires_grad=True))
    with pytest.raises(InputError, match=r"^scale = a torch.float32 tensor of shape \[2\]"):
        attngen.attention(q, k, v, scale=torch.ones(2))
    with pytest.raises(InputError, match=r"^softmax_scale, scale = 0.5, 0.25"):
        attngen.attention(q, k, v, softmax_scale=0.5, scale=0.25)
    with pytest.raises(InputError, match=r"^scale = str: expected a finite positive float"):
        attngen.attention(q, k, v, scale="big")
    with pytest.raises(InputError, match=r"fields\['window'\]"):
        ops.fwd(q, k, v, '{"window": [1, 1]}', *args[4:])


def test_import_attngen_does_not_import_torch():
    """The CLI's commands start without torch: attngen.attention imports the ops on first use."""
    code = "import sys, attngen; assert 'torch' not in sys.modules and 'attngen.interfaces.ops' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


# -- torch.compile ----------------------------------------------------------------------------------


def explain(fn, *args):
    import torch._dynamo

    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


def test_fullgraph_compile_has_no_graph_break_and_matches_eager():
    q, k, v = qkv(50, 70, heads=4, kv_heads=2)
    slopes = torch.linspace(0.1, 0.5, 4)

    def f(q, k, v):
        out, lse = attngen.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True, window=(32, 0))
        return out.float() * 2, lse

    report = explain(f, q, k, v)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_fullgraph_compile_with_inductor():
    q, k, v = qkv(40)

    def f(q, k, v):
        return attngen.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def test_a_graph_break_is_counted():
    """The checker above can fail: a function that leaves the graph shows its break."""
    q, k, v = qkv(20)

    def f(q, k, v):
        out = attngen.attention(q, k, v)
        torch._dynamo.graph_break()
        return out * 2

    assert explain(f, q, k, v).graph_break_count == 1


def counted(dynamic):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v):
        return attngen.attention(q, k, v, causal=True)

    return torch.compile(f, fullgraph=True, dynamic=dynamic, backend=counter), f, counter


def test_dynamic_compile_serves_three_lengths_with_one_compilation():
    compiled, f, counter = counted(dynamic=True)
    for n in (33, 70, 129):
        q, k, v = qkv(n, n + 7, seed=n)
        assert torch.equal(compiled(q, k, v), f(q, k, v))
    assert counter.frame_count == 1
    static, _, counter = counted(dynamic=False)  # the count can fail: static shapes compile per length
    for n in (33, 70, 129):
        static(*qkv(n))
    assert counter.frame_count > 1


def test_dynamic_compile_serves_three_varlen_batches_with_one_compilation():
    """Packed batches of other sizes, lengths and max_seqlen_q (a SymInt in the schema): one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(q, k, v, cu_q, cu_k, max_q):
        return attngen.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for lq, lk in (([5, 33], [40, 70]), ([17, 2, 9], [17, 30, 100]), ([64, 1], [64, 129])):
        x = random_serving_inputs("varlen", False, None, "float16", 64, None, lq, lk, 2, 2, seed=1)
        args = (as_torch(x.q, torch.float16), as_torch(x.k, torch.float16), as_torch(x.v, torch.float16),
                as_torch(x.cu_seqlens_q), as_torch(x.cu_seqlens_k), x.max_seqlen_q)
        assert torch.equal(compiled(*args), f(*args))
    assert counter.frame_count == 1


def test_a_dynamic_compile_serves_three_scales_with_one_compilation():
    """The scale is an argument of the op (a 0-d tensor made from the number, not a float: dynamo
    specializes a custom op's float argument, one graph per value). dynamic=True: three scales,
    one graph, no break, the eager values. The count can fail: a static compile specializes the
    number (one graph each), and the default (automatic dynamic) takes two, the second dynamic.
    A 0-d tensor scale is a graph input even in a static compile."""
    q, k, v = qkv(40, 60)
    scales = (0.3, 0.5, 2.0)

    def f(q, k, v, s):
        return attngen.attention(q, k, v, causal=True, softmax_scale=s)

    report = explain(f, q, k, v, 0.3)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons
    eager = {s: f(q, k, v, s) for s in scales}
    for s, out in eager.items():
        assert check_close(out, q, k, v, True, scale=s).ok
    assert not torch.equal(eager[0.3], eager[2.0])
    # torch 2.4 specializes every float input (specialize_float): there each scale is a graph
    per_value = getattr(torch._dynamo.config, "specialize_float", True)
    for dynamic, want in ((True, 3 if per_value else 1), (None, 3 if per_value else 2), (False, 3)):
        assert compilations(f, dynamic, [(q, k, v, s) for s in scales], [eager[s] for s in scales]) == want, dynamic
    tensors = [(q, k, v, torch.tensor(s, dtype=torch.float64)) for s in scales]
    assert compilations(f, False, tensors, [eager[s] for s in scales]) == 1


def compilations(f, dynamic, calls, want) -> int:
    """The graphs dynamo keeps for f after the calls (its cache entries: a restarted analysis,
    which a backend's call counter counts twice, is one), each call's value checked."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for args, value in zip(calls, want):
        assert torch.equal(compiled(*args), value)
    return len(_debug_get_cache_entry_list(f.__code__))


# -- autograd (the gradients themselves: tests/test_ops_backward.py) --------------------------------------------------------------


def test_a_call_that_needs_a_gradient_asks_the_forward_for_its_lse():
    q, k, v = qkv(30, grad=True)
    args, asked = ops.fwd_arguments(q, k, v, causal=True)
    assert '"lse": true' in args[3] and not asked  # the backward's input; the caller still gets out alone
    with torch.no_grad():
        assert '"lse": false' in ops.fwd_arguments(q, k, v)[0][3]
    out = attngen.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.grad_fn is not None
    plan = op_arguments.resolve(q, k, v, args[3])
    want_out, _ = attngen.emulate(plan, q.detach(), k.detach(), v.detach())
    assert torch.equal(out.detach(), want_out)


def test_a_call_whose_tensors_are_on_two_devices_names_the_odd_one():
    """A meta tensor among CPU ones sends the op to its fake (Meta outranks CPU in the dispatcher),
    which returned an uninitialised CPU tensor as the answer (issue 25). Every tensor of a call
    shares q's device, or an InputError names the argument, its device and q's; all-meta calls keep
    their shapes-only answer."""
    q, k, v = qkv(20)
    meta = {"k": (q, k.to("meta"), v), "v": (q, k, v.to("meta"))}
    for name, args in meta.items():
        with pytest.raises(InputError, match=rf"^{name}.device = meta: expected cpu, the device of q$"):
            attngen.attention(*args)
    with pytest.raises(InputError, match=r"^k.device = cpu: expected meta, the device of q$"):
        attngen.attention(q.to("meta"), k, v)
    with pytest.raises(InputError, match=r"^sinks.device = meta: expected cpu, the device of q$"):
        attngen.attention(q, k, v, sinks=torch.zeros(2, device="meta"))
    out, lse = (torch.empty(1, 20, 2, 64, dtype=torch.float16), torch.empty(1, 2, 20))
    args, _ = ops.fwd_arguments(q, k, v, return_lse=True)
    with pytest.raises(InputError, match=r"^dout.device = meta: expected cpu, the device of q$"):
        ops.bwd(out.to("meta"), out, lse, *args)
    shapes = attngen.attention(*(t.to("meta") for t in (q, k, v)))
    assert metadata(shapes) == ((1, 20, 2, 64), torch.float16, torch.device("meta"), (2560, 128, 64, 1))


def test_backward_op_fakes_give_each_gradient_the_shape_of_its_input():
    q = torch.empty(7, 4, 64, dtype=torch.bfloat16)  # varlen q against a paged cache
    k = torch.empty(3, 64, 2, 64, dtype=torch.bfloat16)
    v = torch.empty(3, 64, 2, 128, dtype=torch.bfloat16)
    out, lse = torch.empty(7, 4, 128, dtype=torch.bfloat16), torch.empty(4, 7)
    cu, table, used = torch.tensor([0, 7], dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    args = (out, out, lse, q, k, v, '{"lse": true}', -1, -1, 0.0, None, "sinks", [torch.zeros(4)], cu, None, 7, table,
            used, -1)
    with FakeTensorMode() as mode:
        grads = ops.bwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor)
                          else [mode.from_tensor(x) for x in a] if isinstance(a, list) else a for a in args))
    assert [metadata(g) for g in grads] == [metadata(t) for t in (q, k, v, torch.zeros(4))]
    with pytest.raises(SpecError, match="inference layout"):  # the backward takes no paged cache
        ops.bwd(*args)


# -- torch.export and opcheck ------------------------------------------------------------------------


class Attention(torch.nn.Module):
    def __init__(self, window=(-1, -1), softcap=0.0):
        super().__init__()
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v):
        return attngen.attention(q, k, v, causal=True, window=self.window, softcap=self.softcap)


def test_spec_fields_from_module_attributes_compile_dynamic():
    """window, softcap and a schedule field read from the module, under dynamic=True."""
    class Scheduled(Attention):
        consumers = 1

        def forward(self, q, k, v):
            return attngen.attention(q, k, v, causal=True, window=self.window, softcap=self.softcap,
                                     consumers=self.consumers)

    module = Scheduled(window=(16, 0), softcap=7.5)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    q, k, v = qkv(33)
    assert torch.equal(compiled(q, k, v), module(q, k, v))


def test_spec_fields_passed_into_a_fullgraph_compile_run_or_are_refused_by_attngen():
    """issue 25: a schedule field given as the compiled function's argument turns symbolic once its value
    changes (dynamo's automatic dynamic) and its JSON text could not be traced; a bad softmax_scale
    argument showed dynamo's "repr_impl not implemented". Each value now gets its graph, and a bad
    value attngen's own error from the op."""
    q, k, v = qkv(20)

    def f(q, k, v, consumers, scale):
        return attngen.attention(q, k, v, causal=True, consumers=consumers, softmax_scale=scale)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for consumers, scale in ((1, 0.2), (2, 0.3), (1, 0.25)):
        assert torch.equal(compiled(q, k, v, consumers, scale), f(q, k, v, consumers, scale))
    with pytest.raises(InputError, match=r"^softmax_scale = -1.0: expected a positive float"):
        compiled(q, k, v, 2, -1.0)
    with pytest.raises(SpecError, match=r"^spec field `consumers` = 4: expected an integer from 1 to 3"):
        compiled(q, k, v, 4, 0.3)


def test_export_with_a_dynamic_sequence_length(tmp_path):
    module = Attention(window=(48, 0), softcap=15.0)
    q, k, v = qkv(70)
    n = torch.export.Dim("n", min=2, max=4096)
    program = torch.export.export(module, (q, k, v), dynamic_shapes=({1: n}, {1: n}, {1: n}))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.attngen.fwd.default in targets
    q2, k2, v2 = qkv(100, seed=3)
    assert torch.equal(program.module()(q2, k2, v2), module(q2, k2, v2))
    torch.export.save(program, tmp_path / "attention.pt2")
    assert torch.equal(torch.export.load(tmp_path / "attention.pt2").module()(q, k, v), module(q, k, v))


def opcheck_cases():
    q, k, v = qkv(40, 57, heads=4, kv_heads=2)
    yield "dense", ops.fwd_arguments(q, k, v, causal=True)[0]
    yield "lse, sinks, softcap", ops.fwd_arguments(q, k, v, return_lse=True, sinks=torch.ones(4), softcap=10.0,
                                                   softmax_scale=0.3)[0]
    x = random_serving_inputs("varlen", True, 64, "float16", 64, None, [5, 0, 33], [70, 3, 1], 4, 2, seed=1)
    yield "varlen paged split", ops.fwd_arguments(
        as_torch(x.q, torch.float16), as_torch(x.k, torch.float16), as_torch(x.v, torch.float16), causal=True,
        return_lse=True, cu_seqlens_q=as_torch(x.cu_seqlens_q), max_seqlen_q=x.max_seqlen_q,
        block_table=as_torch(x.block_table), seqused_k=as_torch(x.seqused_k), num_splits=2)[0]


@pytest.mark.parametrize("case", ["dense", "lse, sinks, softcap", "varlen paged split"])
def test_opcheck_forward(case):
    args = dict(opcheck_cases())[case]
    result = torch.library.opcheck(ops.fwd, args)
    assert set(result.values()) == {"SUCCESS"}, result


# -- fakes against the real outputs -----------------------------------------------------------------


def preset_call(path):
    """A small call of the preset's own kernel: its fields as keywords, inputs made to fit."""
    spec = load(path)
    plan = make_plan(spec)
    kw = {n: x for n, x in spec.to_dict().items() if n not in DERIVED}
    kw["return_lse"] = kw.pop("lse")
    f = serving.serving_fields(plan)
    dtype = getattr(torch, spec.dtype)
    kv_dtype = getattr(torch, spec.kv_dtype) if spec.kv_dtype else dtype  # an fp8 KV cache
    heads, kv_heads = spec.gqa_group * (1 if spec.gqa_group > 2 else 2), 1 if spec.gqa_group > 2 else 2
    if f.uses_serving:
        lq = [17, 1] if f.varlen else [9, 9]
        x = random_serving_inputs(spec.layout, f.paged, f.page_size, spec.dtype, spec.head_dim, f.head_dim_v,
                                          lq, [70, 5], heads, kv_heads, seed=2)
        keywords = {n: as_torch(a) for n, a in x.keywords.items()}
        if spec.kv_dtype:  # one descale per (page, KV head): the kernel's own form
            from attngen.reference.kv_cache import random_descales

            keywords |= dict(zip(("k_descale", "v_descale"), map(as_torch, random_descales(x.k.shape[0], kv_heads, seed=3))))
        return (as_torch(x.q, dtype), as_torch(x.k, kv_dtype), as_torch(x.v, kv_dtype)), {**kw, **keywords}
    n = spec.block_m if spec.aligned else 65
    q, k, v, tensors = variant_inputs(plan, 1, heads, kv_heads, n, 2 * n if not spec.aligned else n)
    named = {t: as_torch(x) for t, x in tensors.items()}
    return (as_torch(q, dtype), as_torch(k, kv_dtype), as_torch(v, kv_dtype)), {**kw, **named}


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_fake_matches_the_real_outputs_for_every_preset(path):
    (q, k, v), kw = preset_call(path)
    args, _ = ops.fwd_arguments(q, k, v, **kw)
    plan = op_arguments.resolve(q, k, v, args[3], args[4:6], args[6], args[8], args[10], args[13], args[15])
    assert plan.name == make_plan(load(path)).name  # the preset's own kernel ran
    out, lse = check_fake_matches_real(args)
    assert (lse.numel() > 0) == plan.spec.lse


@settings(max_examples=12)
@given(spec=valid_specs(head_dims=(64, 128)), data=st.data())
def test_fake_matches_the_real_outputs_for_drawn_specs_and_shapes(spec, data):
    step_q, step_k = (spec.block_m, spec.block_n) if spec.aligned else (1, 1)
    q_len = step_q * data.draw(st.integers(1, max(1, 130 // step_q)))
    kv_len = step_k * data.draw(st.integers(1, max(1, 130 // step_k)))
    kv_heads = data.draw(st.integers(1, 2))
    q, k, v = qkv(q_len, kv_len, heads=kv_heads * spec.gqa_group, kv_heads=kv_heads, head_dim=spec.head_dim,
                  dtype=getattr(torch, spec.dtype))
    schedule = {n: getattr(spec, n) for n in ("consumers", "k_stages", "v_stages", "block_n", "pingpong", "aligned")}
    args, _ = ops.fwd_arguments(q, k, v, causal=spec.causal, return_lse=data.draw(st.booleans()), **schedule)
    out, _ = check_fake_matches_real(args)
    assert check_close(out, q, k, v, spec.causal).ok


@settings(max_examples=10)
@given(batch=ragged_batches(block_m=128, block_n=128, max_tiles=1, groups=(1, 2)), lse=st.booleans())
def test_fake_matches_the_real_outputs_for_drawn_serving_calls(batch, lse):
    x = random_serving_inputs(**batch["inputs"])
    dtype = getattr(torch, batch["inputs"]["dtype"])
    keywords = {n: as_torch(a) for n, a in x.keywords.items()}
    args, _ = ops.fwd_arguments(as_torch(x.q, dtype), as_torch(x.k, dtype), as_torch(x.v, dtype), causal=True,
                                return_lse=lse, num_splits=batch["num_splits"], **keywords)
    check_fake_matches_real(args)


def test_a_wrong_fake_is_caught():
    """The metadata comparison fails for a fake that gets a shape wrong."""
    q, k, v = qkv(20)
    args, _ = ops.fwd_arguments(q, k, v, return_lse=True)
    real = ops.fwd(*args)
    with FakeTensorMode() as mode:
        wrong = (mode.from_tensor(real[0]), mode.from_tensor(real[1]).transpose(1, 2))
    assert [metadata(t) for t in wrong] != [metadata(t) for t in real]


# -- the CPU-time estimate ---------------------------------------------------------------------------


@pytest.mark.parametrize("fields, shape", [
    ({}, (1, 2, 2, 130, 70)), ({"causal": True, "consumers": 3, "head_dim": 64}, (2, 2, 2, 200, 300)),
    ({"causal": True, "gqa_group": 4}, (1, 8, 2, 70, 260)),
])
def test_the_estimate_counts_what_the_cpu_model_does(fields, shape):
    plan = make_plan(attngen.Spec(**fields))
    b, h, hkv, sq, skv = shape
    q, k, v, _ = variant_inputs(plan, b, h, hkv, sq, skv)
    _, stats = driver.emulate_stats(plan, q, k, v)
    est = driver.estimate_seconds(plan, b, h, hkv, [sq] * b, [skv] * b)
    assert (est.ctas, est.wgmma) == (stats.ctas, stats.wgmma)


@pytest.mark.parametrize("preset, lq, lk, splits", [
    ("paged_decode_hd128_bf16_gqa8_splits", [2, 2], [300, 17], 3), ("paged_decode_hd128_bf16_gqa8_splits", [1, 1], [0, 17], 2),
    ("varlen_paged_hd64_f16", [5, 0, 70], [300, 17, 1], None), ("varlen_hd128_bf16_causal", [130, 1], [0, 200], None),
])
def test_the_estimate_counts_a_serving_call(preset, lq, lk, splits):
    plan = make_plan(load(ROOT / "examples" / f"{preset}.toml"))
    f = serving.serving_fields(plan)
    kv_heads = 1 if plan.spec.gqa_group > 1 else 2
    x = random_serving_inputs(plan.spec.layout, f.paged, f.page_size, plan.spec.dtype, plan.spec.head_dim, None,
                                      lq, lk, plan.spec.gqa_group * kv_heads, kv_heads, seed=3)
    keywords = dict(x.keywords, num_splits=splits)
    _, stats = driver.emulate_stats(plan, x.q, x.k, x.v, serving=keywords)
    call = serving.check_serving(plan, x.q, x.k, x.v, **keywords)
    est = driver.estimate_seconds(plan, call.batch, call.heads, call.kv_heads, call.q_lens, call.kv_lens,
                                  call.num_splits, max_seqlen_q=call.max_seqlen_q, total_q=call.total_q)
    assert (est.ctas, est.wgmma) == (stats.ctas, stats.wgmma)


def test_a_long_cpu_run_is_refused_with_its_estimate(monkeypatch):
    monkeypatch.setattr(ops, "emulate", lambda *a, **k: pytest.fail("ran a refused problem"))
    q = torch.zeros(1, 8192, 16, 128, dtype=torch.float16)
    with pytest.raises(InputError, match=r"q.shape = \[1, 8192, 16, 128\]: expected a problem the CPU model runs "
                                         r"within 60 s: this one would take about \d+ s"):
        attngen.attention(q, q, q)
    monkeypatch.setenv("ATTNGEN_CPU_MAX_SECONDS", "0.001")  # the same rule refuses a small one under a tight limit
    q, k, v = qkv(20)
    with pytest.raises(InputError, match="within 0.001 s"):
        attngen.attention(q, k, v)


# -- CUDA (an sm_90 GPU): the same op over runtime's compiled kernel ------------------------------------


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_cuda_op_matches_the_kernel_and_compiles_without_a_break():
    from attngen.run import forward

    q, k, v = (t.cuda() for t in qkv(300, 517, heads=4, kv_heads=4, head_dim=128))  # the default preset's kernel
    out = attngen.attention(q, k, v, causal=True)
    plan = op_arguments.resolve(q, k, v, op_arguments.encode_fields({"causal": True, "lse": False}))
    assert torch.equal(out, forward.compile_kernel(plan)(q, k, v))

    def f(q, k, v):
        return attngen.attention(q, k, v, causal=True)

    assert explain(f, q, k, v).graph_break_count == 0
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), out)


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_cuda_op_runs_a_varlen_call_like_the_runtime():
    from attngen.run import runtime

    x = random_serving_inputs("varlen", False, None, "bfloat16", 128, None, [70, 1, 300], [90, 5, 300], 2, 2)
    q, k, v = (as_torch(a, torch.bfloat16).cuda() for a in (x.q, x.k, x.v))
    keywords = dict(cu_seqlens_q=as_torch(x.cu_seqlens_q).cuda(), cu_seqlens_k=as_torch(x.cu_seqlens_k).cuda(),
                    max_seqlen_q=x.max_seqlen_q)
    out = attngen.attention(q, k, v, causal=True, **keywords)  # the varlen preset's kernel
    assert torch.equal(out, runtime.attention(q, k, v, causal=True, **keywords))
