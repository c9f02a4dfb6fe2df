"""Launch each preset's kernel once, small, each in its own process under a timeout.

A kernel that hangs blocks torch.cuda.synchronize() for good; in its own process it costs
one timeout instead of the whole GPU check. The GPU check runs this before the tests and
the benchmark, and leaves hung kernels out of both (bench/gpu_check.sh).

    python3 bench/gpu_smoke.py [--timeout 60] [--json OUT.json]   # every preset
    python3 bench/gpu_smoke.py --one examples/default.toml            # one launch, in this process
    python3 bench/gpu_smoke.py --dry-run                              # no GPU: load each kernel, launch nothing

A backward preset (cli.BACKWARD_PRESETS) also runs its backward once in the same child, through
attngen.attention and out.backward() (its backward module loaded before the launch timeout starts),
and every gradient must come out finite: a hung backward kernel is caught here too.

Prints one line per preset: ok (max |out - ref| against the fp64 reference), FAIL (a
mismatch, an exception, a NaN left in the poisoned output), HANG (the launch outlived its
timeout and was killed), or SLOW LOAD (building or loading the kernel outlived its own,
longer timeout: not a verdict on the kernel).
"""

from __future__ import annotations

import argparse
import glob
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADED = "LOADED"
DERIVED = ("head_dim", "dtype", "gqa_group", "head_dim_v", "alibi", "sinks", "layout", "paged_kv", "page_size", "lse")
SHAPE = (1, 2, 200, 333)  # batch, kv heads, q_len, kv_len: odd lengths, a few blocks, fast on the fp64 side


def launch_once(preset: str, dry_run: bool = False) -> str:
    """Compile (from the disk cache when warm), launch once into a NaN-poisoned output, compare."""
    from attngen.emulator.driver import check_output
    from attngen.kernels.fwd.plan import make_plan
    from attngen.run.checks import check_written, out_torch_dtype
    from attngen.run.forward import compile_kernel
    from attngen.spec import load

    plan = make_plan(load(preset))
    kernel = compile_kernel(plan)
    backward = backward_kernels(preset)
    print(f"{LOADED} ({kernel.origin})", flush=True)  # the parent's launch timeout starts here
    if dry_run:
        return f"loaded ({kernel.origin}{', backward ' + backward.origin if backward else ''})"
    import torch

    spec = plan.spec
    if plan.varlen or plan.page_size or plan.split_kv:
        return launch_serving_once(plan, kernel)
    q, k, v, tensors = dense_inputs(plan, "cuda")
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=out_torch_dtype(plan), device="cuda")
    got = kernel(q, k, v, out=out, **tensors)
    torch.cuda.synchronize()
    check_written(out)
    ok, text = check_output(spec, out, got[1] if spec.lse else None, q, k, v, tensors)  # fp8: the fp8 rule
    if not ok:
        raise AssertionError(text)
    return f"ok ({text})" + (f"; {backward_once(load(preset), q, k, v)}" if backward else "")


def dense_inputs(plan, device: str):
    """A dense preset's smoke inputs at SHAPE (an aligned spec: whole tiles): q, k, v in the spec's dtype (fp8:
    standard normal values rounded to e4m3) and every call-time tensor it takes (FA3's random descales for
    fp8, ALiBi slopes, sinks, mod tensors: the CPU model's variant_inputs), as torch tensors on `device`."""
    import torch

    from attngen.emulator.driver import variant_inputs
    from attngen.run.checks import torch_dtype

    spec = plan.spec
    b, hkv, sq, skv = SHAPE
    if spec.aligned:
        sq, skv = spec.block_m * 2, spec.block_n * 3
    h = hkv * spec.gqa_group
    gen = torch.Generator(device=device).manual_seed(0)
    dims = ((b, sq, h, spec.head_dim), (b, skv, hkv, spec.head_dim), (b, skv, hkv, plan.head_dim_v))
    q, k, v = (torch.randn(*d, device=device, generator=gen).to(torch_dtype(spec.dtype)) for d in dims)
    *_, tensors = variant_inputs(plan, b, h, hkv, sq, skv)
    return q, k, v, {n: torch.from_numpy(x).to(device) for n, x in tensors.items()}


def backward_kernels(preset: str):
    """A backward preset's loaded backward module and the forward with lse that autograd runs
    first (both from the prebuilt cache), else None."""
    import dataclasses

    from attngen.cli.generate import BACKWARD_PRESETS
    from attngen.run.backward import compile_backward
    from attngen.run.forward import compile_kernel
    from attngen.spec import load

    if Path(preset).stem not in BACKWARD_PRESETS:
        return None
    spec = load(preset)
    compile_kernel(dataclasses.replace(spec, lse=True))
    return compile_backward(spec)


def backward_once(spec, q, k, v) -> str:
    """One backward through the torch op on the forward's inputs: every gradient written and finite."""
    import numpy as np
    import torch

    import attngen
    from attngen.emulator.driver import variant_inputs
    from attngen.kernels.fwd.plan import make_plan
    from attngen.run.checks import check_written

    # every spec field as a keyword but those attngen.attention derives from the tensors
    fields = {n: x for n, x in spec.to_dict().items() if n not in DERIVED}
    s = (q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1])
    *_, tensors = variant_inputs(make_plan(spec), *s)
    named = {n: torch.from_numpy(np.asarray(x)).to(q.device) for n, x in tensors.items()}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if "sinks" in named:
        named["sinks"].requires_grad_()
        leaves.append(named["sinks"])
    out = attngen.attention(*leaves[:3], **fields, **named)
    out.backward(torch.randn_like(out))
    if q.is_cuda:  # (tests/test_gpu_harness.py runs this on CPU tensors: the CPU model)
        torch.cuda.synchronize()
    for t in leaves:
        check_written(t.grad)
    return f"backward ok (every gradient finite: {', '.join('d' + n for n in ('q', 'k', 'v', 'sinks')[:len(leaves)])})"


def launch_serving_once(plan, kernel) -> str:
    """A serving preset: a small ragged batch (1e4 in every cache row no sequence owns), each sequence
    against its own fp64 reference; varlen padding rows must stay NaN."""
    import torch

    from attngen.emulator.driver import serving_lengths
    from attngen.run.checks import check_written
    from attngen.reference.serving import check_serving_close, random_serving_inputs
    from attngen.run.serving import check_serving

    spec = plan.spec
    lq, lk = serving_lengths(spec.layout, 200, 333, paged=spec.paged_kv)
    x = random_serving_inputs(spec.layout, spec.paged_kv, plan.page_size or None, spec.dtype, spec.head_dim, None,
                              lq, lk, 2 * spec.gqa_group, 2, seed=0, neighbour_fill=1e4)
    dt = getattr(torch, spec.dtype)
    k_host, v_host, k_ref, v_ref, descales = kv_cache(spec, x)
    kv_dt = getattr(torch, spec.kv_dtype) if spec.kv_dtype else dt
    q = torch.from_numpy(x.q).to("cuda", dt)
    k, v = (torch.from_numpy(t).to("cuda", kv_dt) for t in (k_host, v_host))
    kw = {n: (torch.from_numpy(t).cuda() if hasattr(t, "dtype") else t) for n, t in x.keywords.items()}
    if plan.split_kv:
        kw["num_splits"] = 3
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, out=out, **kw, **{n: torch.from_numpy(d).cuda() for n, d in descales.items()})
    torch.cuda.synchronize()
    check_written(out)
    call = check_serving(plan, x.q, k_host, v_host, **x.keywords, num_splits=kw.get("num_splits"))
    res = check_serving_close(out.float().cpu().numpy(), x.q, k_ref, v_ref, call, spec.causal, spec.dtype)
    if not res.ok:
        raise AssertionError(str(res))
    return f"ok ({res})"


def kv_cache(spec, x):
    """The cache as the kernel reads it and as the reference does: an fp8 KV cache (kv_dtype) is x's
    K and V quantized to e4m3 with drawn descales, one per (page or batch, KV head), and the reference
    reads them dequantized (docs/fp8-kv-cache.md); a 16-bit cache is x's own."""
    if not spec.kv_dtype:
        return x.k, x.v, x.k, x.v, {}
    from attngen.reference.kv_cache import dequantize, quantize, random_descales

    kd, vd = random_descales(x.k.shape[0], x.k.shape[2], seed=1)
    k8, v8 = quantize(x.k, kd), quantize(x.v, vd)
    return k8, v8, dequantize(k8, kd), dequantize(v8, vd), {"k_descale": kd, "v_descale": vd}


def run_child(cmd, load_timeout: float, launch_timeout: float) -> str:
    """Run one preset's child; the launch timeout starts once it says the kernel is loaded."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def pump():  # a reader thread, so the timeouts below hold even while the child prints nothing
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen, loaded = [], False
    deadline = time.time() + load_timeout
    while proc.poll() is None or not lines.empty():
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            seen.append(line.rstrip())
            if not loaded and line.startswith(LOADED):
                loaded, deadline = True, time.time() + launch_timeout
        except queue.Empty:
            pass
        if proc.poll() is None and time.time() > deadline:
            proc.kill()
            proc.wait()
            if loaded:
                return f"HANG: the launch did not finish within {launch_timeout:.0f} s (killed)"
            return f"SLOW LOAD: the kernel was not built or loaded within {load_timeout:.0f} s (killed)"
    last = next((line for line in reversed(seen) if line and not line.startswith(LOADED)), "(no output)")
    return ("ok" if proc.returncode == 0 else "FAIL") + f": {last[-300:]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help="launch this preset in this process and exit")
    ap.add_argument("--presets", default=str(ROOT / "examples" / "*.toml"), help="glob of preset specs (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for one launch and its check (default: %(default)s)")
    ap.add_argument("--load-timeout", type=float, default=300.0,
                    help="seconds to build or load the kernel first (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="load each kernel, launch nothing (no GPU needed)")
    ap.add_argument("--json", help="also write {preset: status} here")
    args = ap.parse_args(argv)

    if args.one:
        try:
            print(launch_once(args.one, args.dry_run), flush=True)
            return 0
        except Exception as e:
            print(f"{type(e).__name__}: {str(e)[-600:]}", flush=True)
            return 1

    status = {}
    for preset in sorted(glob.glob(args.presets)):
        name = Path(preset).stem
        t0 = time.time()
        cmd = [sys.executable, "-P", __file__, "--one", preset] + (["--dry-run"] if args.dry_run else [])
        status[name] = run_child(cmd, args.load_timeout, args.timeout)
        print(f"  {name:24s} {time.time() - t0:5.1f} s  {status[name]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(status, indent=1))
    return 1 if any(not s.startswith("ok") for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
