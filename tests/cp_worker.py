"""The ranks of tests/test_distributed.py: W processes on gloo (CPU tensors, the CPU model), one
process group for many cases. Rank 0 saves each case's full tensors (out, LSE, dq, dk, dv,
reassembled by unshard_sequence) for the parent, which checks them against the fp64 reference."""

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(case: dict):
    """The full q, k, v and dout of a case (every rank makes the same ones from the seed)."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case.get("dtype", "float16"))
    b, s, h, hkv, d = case.get("batch", 1), case["seq"], case["heads"], case["kv_heads"], case.get("head_dim", 64)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv, h))
    return q, k, v, dout


def lse_cotangent(case: dict) -> torch.Tensor:
    """The full float32 [B, H, S] gradient of a case's loss at the LSE (lse_grad cases)."""
    g = torch.Generator().manual_seed(1000 + case.get("seed", 0))
    return torch.randn(case.get("batch", 1), case["heads"], case["seq"], generator=g)


def masks(case: dict) -> dict:
    """A case's mask_mod (over global positions), its tensors, and cu_seqlens, as keywords."""
    given = {n: case[n] for n in ("mask_mod", "cu_seqlens") if n in case}
    if "cu_seqlens" in given:
        given["cu_seqlens"] = torch.tensor(given["cu_seqlens"], dtype=torch.int32)
    return given | {n: torch.tensor(t, dtype=torch.float32) for n, t in case.get("tensors", {}).items()}


def run_layout(case: dict, group=None) -> dict:
    """Every rank's shard of positions 0..S-1, and the gradient unshard_sequence gives each part when
    every rank's loss is sum(full * (position + 1))."""
    from attngen.interfaces import distributed as cp

    lb = case.get("load_balance", "zigzag")
    positions = torch.arange(case["seq"], dtype=torch.float32).view(1, -1, 1, 1)
    part = cp.shard_sequence(positions, load_balance=lb, group=group).requires_grad_()
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.detach(), group=group)
    full = cp.unshard_sequence(part, load_balance=lb, group=group)
    (full * (positions + 1)).sum().backward()
    grads = [torch.empty_like(part) for _ in parts]
    dist.all_gather(grads, part.grad, group=group)
    return {"parts": [p.flatten() for p in parts], "full": full.detach().flatten(), "grads": [g.flatten() for g in grads]}


def run_compiled(case: dict, group=None) -> dict:
    """The case under torch.compile (a recording backend: dynamo's graphs, run as traced) against eager:
    torch._dynamo.explain's graph and break counts and reasons, the attngen ops in each graph, and
    whether out and the gradients equal eager's."""
    from attngen.interfaces import distributed as cp

    lb, method = case.get("load_balance", "zigzag"), case.get("method", "ring")
    q, k, v, dout = (cp.shard_sequence(t, load_balance=lb, group=group) for t in inputs(case))

    def f(q, k, v):
        return cp.context_parallel_attention(q, k, v, group=group, method=method, load_balance=lb,
                                             causal=case.get("causal", False))

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(case.get("grad", False)) for t in (q, k, v)]
        out = fn(*leaves)
        if case.get("grad"):
            out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves if t.grad is not None]

    graphs = []

    def backend(gm, example_inputs):
        # with inputs that need a gradient an autograd.Function may be traced whole, its forward and
        # backward as subgraphs (modules of gm): count in those too
        graphs.append(sum("attngen" in str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                          for n in m.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(*(t.detach().clone().requires_grad_(case.get("grad", False)) for t in (q, k, v)))
    torch._dynamo.reset()
    same = all(torch.equal(a, b) for a, b in zip(run(f), run(torch.compile(f, backend=backend))))
    reasons = sorted({str(b.reason).split("\n")[0][:120] for b in explained.break_reasons})
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count, "reasons": reasons,
            "attngen_ops_per_graph": graphs, "same_as_eager": same}


def run_case(case: dict, group=None) -> dict:
    from attngen.interfaces import distributed as cp

    if case.get("kind") == "layout":
        return run_layout(case, group)
    if case.get("kind") == "compile":
        return run_compiled(case, group)
    cp._TEST_ONLY_MUTANT = case.get("mutant")
    lb = case.get("load_balance", "zigzag")
    q, k, v, dout = inputs(case)
    parts = [cp.shard_sequence(t, load_balance=lb, group=group).requires_grad_() for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(
        *parts, group=group, method=case.get("method", "ring"), load_balance=lb, causal=case.get("causal", False),
        window_size=tuple(case.get("window", (-1, -1))), softcap=case.get("softcap", 0.0),
        softmax_scale=case.get("scale"), return_lse=True, **masks(case))
    outputs, cotangents = [out], [cp.shard_sequence(dout, load_balance=lb, group=group)]
    if case.get("lse_grad"):  # a loss that reads the LSE too (every rank draws the same full dLSE)
        outputs.append(lse)
        cotangents.append(cp.shard_sequence(lse_cotangent(case), dim=2, load_balance=lb, group=group))
    torch.autograd.backward(outputs, cotangents)

    def full(t, dim=1):
        return cp.unshard_sequence(t.detach(), dim=dim, load_balance=lb, group=group)

    result = {"out": full(out), "lse": full(lse, 2), "dq": full(parts[0].grad), "dk": full(parts[1].grad),
              "dv": full(parts[2].grad)}
    cp._TEST_ONLY_MUTANT = None
    return result


def _worker(rank: int, world: int, port: int, cases: list, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            try:
                result = run_case(case)
            except Exception as e:  # recorded for the parent; every rank raises the same check errors
                result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            if rank == 0:
                torch.save(result, os.path.join(outdir, f"case{i}.pt"))
        dist.barrier()  # no rank closes its connections while another still reads from them
    finally:
        dist.destroy_process_group()


def run(world: int, cases: list) -> list[dict]:
    """Run `cases` on `world` gloo ranks (spawned once); rank 0's result per case."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(world, free_port(), cases, outdir), nprocs=world, join=True)
        return [torch.load(os.path.join(outdir, f"case{i}.pt")) for i in range(len(cases))]
