"""Forward TFLOP/s of the generated kernels beside PyTorch SDPA (flash and cuDNN backends).

    python3 bench/bench_gpu.py                      # on an H200: build, check, time, print the table
    python3 bench/bench_gpu.py --dry-run            # no GPU: build every kernel, check every planned input
    python3 bench/bench_gpu.py --prebuild-only -j 16    # fill TileLang's disk cache in parallel (every preset), then stop

Rows: every preset in examples/*.toml at sequence lengths 1k..16k (Sq == Skv, because
SDPA's is_causal aligns top-left and ours bottom-right; they agree only then), with
B = tokens / S (16k tokens) and H = 2048 / head_dim query heads (a multiple of the
preset's gqa_group), plus the seed-parity kernel at its static shape B=1, H=8, HKV=8,
Sq=Skv=1024 with the seed's two copies of the steady loop (steady_loop = "split", as
examples/seed_parity.toml), beside the hand-written seed kernel and beside the same spec with
the default one loop (steady_loop = "one": which form is faster at run time, docs/build.md). FLOPs are
4*B*H*Sq*Skv*D, halved for causal (attngen.kernels.common.plan.tflops).

Backward rows (after the forward's, in the same run): fp16 hd64/128/256, causal or not, at the
same shapes, beside SDPA's flash and cuDNN backward; 16k first, then 8k .. 1k, so the goal rows
(docs/perf.md) land first when the budget runs out. FLOPs are 2.5 x the forward's. Ours: the
backward kernels alone (BackwardKernel.run on the forward's out and LSE, what the torch op's
backward launches). SDPA's: torch.autograd.grad of a forward graph built once per input set and
retained (retain_graph), so only its backward kernels run in the interval. The forward rows stop
starting at (1 - --backward-share) of the budget; the backward rows get the rest.

Method (docs/gpu.md): CUDA events around each launch, warm-up first, the median of
the timed runs; a sleep kernel queued before each start event keeps the host's launch
overhead out of the interval; inputs rotate over several sets that together exceed
the L2 several times, so no run finds its inputs in the cache. Before timing, each
configuration runs once into a NaN-poisoned output and is compared with SDPA (a backward row:
its gradients finite, and compared with SDPA's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

START = time.time()  # the benchmark's time budget counts from here, prebuild included
ROOT = Path(__file__).resolve().parents[1]
try:  # an installed attngen (pip install -e ., or gpu_check.sh's --target install) comes first
    import attngen  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from attngen.run.gputime import n_sets, time_launches  # noqa: E402
from attngen.kernels.bwd.plan import autograd_spec, plan_backward, single_tile_twin  # noqa: E402
from attngen.kernels.common.plan import SEED_SHAPE, Shape, tflops  # noqa: E402
from attngen.kernels.fwd.plan import make_plan  # noqa: E402
from attngen.spec import Spec, load  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))  # python3 -P puts no script folder on the path
import bench_pairs  # noqa: E402  (the fp8 and persistent rows)

SEQLENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384  # B * S per row, as FlashAttention-3's benchmarks
HIDDEN = 2048  # H * D per row
H200_L2 = 60 * 1024**2  # used for the plan without a GPU; the device's own figure otherwise
SEED_SPEC = Spec(head_dim=128, dtype="float16", causal=True, gqa_group=1, consumers=2, k_stages=2, v_stages=2,
                 block_m=128, block_n=128, aligned=True, steady_loop="split")  # examples/seed_parity.toml
DEVICE = "cuda"
BACKWARD = "backward"  # the variant slot of a kernel_key that names a spec's backward module
TWIN = "backward twin"  # ... its single-tile backward with the persistent one's tiles (bwd/plan.single_tile_twin)
BWD_HEAD_DIMS = (64, 128, 256)
BWD_FLOP_FACTOR = 2.5  # backward FLOPs = 2.5 x the forward's (FlashAttention's count)


@dataclasses.dataclass
class Config:
    label: str
    spec: Spec
    shape: Shape
    static: bool = False  # the kernel was rendered for exactly this shape
    seed: Path | None = None  # the hand-written seed kernel (bench/seed_kernel.py) instead of ours
    variant: str | None = None  # a bench/build_time.py variant of our emitted text, timed beside it
    backward: bool = False  # a backward row: the spec's backward module (its forward with lse feeds it)

    @property
    def kernel_key(self):
        if self.backward:
            return (self.spec, None, BACKWARD)
        return (self.spec, self.shape if self.static else None, self.variant)

    @property
    def kernel_keys(self) -> list:
        """Every kernel the row launches: a backward row's forward (with lse) too."""
        if self.backward:
            return [(autograd_forward(self.spec), None, None), self.kernel_key]
        return [self.kernel_key]

    @property
    def kernel_name(self) -> str:
        if self.backward:
            return plan_backward(self.spec).name
        return "seed_fa3" if self.seed else make_plan(self.spec).name + (f" [{self.variant}]" if self.variant else "")

    @property
    def set_bytes(self) -> int:
        s, d = self.shape, self.spec.head_dim
        if self.backward:  # q, out, dout, dq and k, v, dk, dv in fp16, the fp32 dQ accumulator
            return 2 * d * (4 * s.batch * s.q_len * s.heads + 4 * s.batch * s.kv_len * s.kv_heads) + 4 * d * s.batch * s.q_len * s.heads
        return 2 * d * (2 * s.batch * s.q_len * s.heads + 2 * s.batch * s.kv_len * s.kv_heads)  # q, out, k, v

    def n_sets(self, l2: int) -> int:
        return n_sets(self.set_bytes, l2)

    def gflop(self) -> float:
        s = self.shape
        fwd = 4 * s.batch * s.heads * s.q_len * s.kv_len * self.spec.head_dim / (2 if self.spec.causal else 1) / 1e9
        return fwd * (BWD_FLOP_FACTOR if self.backward else 1)

    def tflops(self, secs: float) -> float:
        return tflops(self.shape, self.spec.head_dim, self.spec.causal, secs) * (BWD_FLOP_FACTOR if self.backward else 1)


def autograd_forward(spec: Spec) -> Spec:
    """The forward that attngen.attention runs when a gradient is wanted: the spec with lse (for a
    deterministic spec its text differs from the backward plan's forward in the header's spec lines)."""
    return make_plan(autograd_spec(spec)).spec


def heads_for(head_dim: int, group: int) -> int:
    return max(group, HIDDEN // head_dim // group * group)


def plan(preset_paths, seqlens, tokens, seed_kernel: Path | None = None) -> list[Config]:
    configs = [Config("seed_parity (static)", SEED_SPEC, SEED_SHAPE, static=True),
               Config("seed_parity (static), one loop", dataclasses.replace(SEED_SPEC, steady_loop="one"), SEED_SHAPE, static=True)]
    if seed_kernel is not None:  # the hand-written kernel beside ours, same shape, same run
        configs.append(Config("seed kernel (hand-written)", SEED_SPEC, SEED_SHAPE, static=True, seed=seed_kernel))
    for path in preset_paths:
        planned = make_plan(load(path))
        spec = planned.spec  # resolved: block_m and block_n known
        if planned.varlen or planned.page_size or planned.split_kv:
            print(f"skipping {Path(path).stem}: a serving preset (bench/bench_serving.py times it)")
            continue
        if spec.dtype == bench_pairs.FP8:
            print(f"skipping {Path(path).stem}: an fp8 preset (the fp8 rows time fp8 beside our fp16 kernel)")
            continue
        if planned.extra or planned.head_dim_v != spec.head_dim:
            # variant presets (docs/variants.md) take call-time tensors or a different V: not timed here yet
            print(f"skipping {Path(path).stem}: a variant preset (the timing loop passes q, k, v only)")
            continue
        h = heads_for(spec.head_dim, spec.gqa_group)
        for s in seqlens:
            if spec.aligned and (s % spec.block_m or s % spec.block_n):
                continue
            configs.append(Config(Path(path).stem, spec, Shape(max(1, tokens // s), h, h // spec.gqa_group, s, s)))
    return configs


def plan_backward_rows(seqlens, tokens) -> list[Config]:
    """The backward table: fp16 MHA at each head dim, causal or not, the longest length first (the
    goals are at 16k: docs/perf.md), at the forward table's shapes."""
    rows = []
    for s in sorted(seqlens, reverse=True):
        for d in BWD_HEAD_DIMS:
            for causal in (False, True):
                spec = plan_backward(Spec(head_dim=d, dtype="float16", causal=causal)).spec
                h = heads_for(d, 1)
                rows.append(Config(f"bwd hd{d}{' causal' if causal else ''}", spec, Shape(max(1, tokens // s), h, h, s, s),
                                   backward=True))
    return rows


# -- building -----------------------------------------------------------------------------------


def kernel_for(spec: Spec, shape: Shape | None, variant: str | None):
    """The compiled kernel of a kernel_key: the emitted text, or a variant of it."""
    from attngen.run.backward import compile_backward
    from attngen.run.forward import compile_kernel

    if variant == BACKWARD:
        return compile_backward(spec)
    if variant == TWIN:
        return compile_backward(single_tile_twin(spec))
    if variant is None:
        return compile_kernel(spec, shape)
    if str(ROOT / "bench") not in sys.path:  # build_time.py lives beside this script
        sys.path.insert(0, str(ROOT / "bench"))
    from build_time import render_variant, variant_spec

    source, applied = render_variant(spec, shape, variant)
    if not applied:
        raise ValueError(f"variant {variant} does not apply to {make_plan(spec).name}")
    return compile_kernel(variant_spec(spec, variant), shape, source=source)


def _build_one(spec: Spec, shape: Shape | None, variant: str | None):
    k = kernel_for(spec, shape, variant)
    return k.name, k.origin, k.compile_seconds


def preset_keys(preset_paths) -> list[tuple]:
    """The kernel_key of every preset's dynamic kernel, timed here or not: gpu_smoke.py and the GPU
    tests launch the variant and serving presets too, so the parallel prebuild builds them all."""
    return [(make_plan(load(path)).spec, None, None) for path in preset_paths]


def backward_preset_keys(preset_paths) -> list[tuple]:
    """The backward presets (cli.BACKWARD_PRESETS) among preset_paths: each one's backward module
    (every part: preprocess, main, postprocess or dq and dsinks, the GQA postprocess) and the
    forward with lse that autograd runs before it. tests/test_gpu_backward.py launches them all."""
    from attngen.cli.generate import BACKWARD_PRESETS

    keys = []
    for path in preset_paths:
        if Path(path).stem in BACKWARD_PRESETS:
            spec = load(path)  # the backward plan's resolved spec: one key per module, as the benchmark rows'
            keys += [(autograd_forward(spec), None, None), (plan_backward(spec).spec, None, BACKWARD)]
    return keys


def gpu_test_keys() -> list[tuple]:
    """The kernels of the GPU tests that name their specs beyond the presets (tests/test_gpu_persistent.py,
    tests/test_gpu_kv_cache_fp8.py: each one's KERNELS), so that pytest only loads them."""
    import importlib

    sys.path.insert(0, str(ROOT / "tests"))
    keys = []
    for name in ("test_gpu_persistent", "test_gpu_kv_cache_fp8"):
        for spec, backward in importlib.import_module(name).KERNELS:  # backward: False, True or "twin"
            kind = TWIN if backward == "twin" else BACKWARD if backward else None
            keys.append((plan_backward(spec).spec, None, kind) if kind else (make_plan(spec).spec, None, None))
    return keys


def build_order(keys, configs) -> list:
    """The goal rows' kernels first (a build stage cut short still leaves the goal rows theirs), then the
    backward modules (each builds its 3-5 kernels in one worker: the longest jobs), then the rest."""
    goals = {key for c in configs if getattr(c, "goal", False) for key in c.kernel_keys}
    return sorted(keys, key=lambda k: (k not in goals, k[2] not in (BACKWARD, TWIN)))


def prebuild(configs, jobs: int, extra_keys=(), load: bool = True) -> list[dict]:
    """Build every kernel in worker processes (nvcc is single-threaded), then load each here from disk
    (load=False, the GPU check's build stage: only those no worker built, so that a failure is
    reported here; the later stages load them)."""
    keys = list(dict.fromkeys([key for c in configs if c.seed is None for key in c.kernel_keys] + list(extra_keys)))
    built = {}
    t0 = time.time()
    if jobs > 1 and len(keys) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        try:
            with cf.ProcessPoolExecutor(max_workers=min(jobs, len(keys)), mp_context=mp.get_context("spawn")) as pool:
                futures = {pool.submit(_build_one, *key): key for key in build_order(keys, configs)}
                for f in cf.as_completed(futures):
                    try:
                        name, source, seconds = f.result()
                    except Exception as e:  # this kernel only: built again below, where its error is reported
                        print(f"  a worker failed to build one kernel ({type(e).__name__}); retried here", flush=True)
                        continue
                    built[futures[f]] = (source, seconds, name)
                    print(f"  built {name}: {source} in {seconds:.1f} s", flush=True)
        except Exception as e:  # a broken pool (or a build error) is retried serially below, where it is reported
            print(f"  parallel build failed ({type(e).__name__}: {e}); building serially", flush=True)
    rows = []
    for key in keys:
        if not load and key in built:
            source, seconds, name = built[key]
            rows.append({"kernel": name, "worker": source, "worker_s": seconds, "here": "-", "here_s": None, "cache": None})
            continue
        try:
            k = kernel_for(*key)
        except Exception as e:  # one kernel that does not build must not cost the others their rows
            name = {BACKWARD: plan_backward, TWIN: single_tile_twin}.get(key[2], make_plan)(key[0]).name
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[-400:]}"})
            print(f"  FAILED to build {rows[-1]['kernel']}: {rows[-1]['error']}", flush=True)
            continue
        worker = built.get(key)
        rows.append({"kernel": k.name + (f" [{key[2]}]" if key[2] and key[2] not in (BACKWARD, TWIN) else ""),
                     "worker": worker[0] if worker else "-", "worker_s": worker[1] if worker else None,
                     "here": k.origin, "here_s": k.compile_seconds, "cache": k.cache_path})
    from attngen.build.cache import cache_root

    print(f"  {len(keys)} kernels ready in {time.time() - t0:.1f} s (kernel cache: {cache_root(None)})", flush=True)
    return rows


# -- timing -------------------------------------------------------------------------------------


def make_sets(cfg: Config, n: int, seed: int = 0):
    import torch

    from attngen.run.checks import torch_dtype

    s, d = cfg.shape, cfg.spec.head_dim
    dtype = torch_dtype(cfg.spec.dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    sets = []
    for _ in range(n):  # random data: zeros run faster than real inputs and hide indexing bugs
        q = torch.randn(s.batch, s.q_len, s.heads, d, device=DEVICE, dtype=dtype, generator=gen)
        k = torch.randn(s.batch, s.kv_len, s.kv_heads, d, device=DEVICE, dtype=dtype, generator=gen)
        v = torch.randn(s.batch, s.kv_len, s.kv_heads, d, device=DEVICE, dtype=dtype, generator=gen)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


def sdpa_runner(cfg: Config, sets, backend):
    """A launch function for SDPA on `backend` ([B, H, S, D] views of our BSHD tensors), and a note."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    g = cfg.spec.gqa_group

    def views(q, k, v):
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attempt(tensors, gqa):
        def fn(i):
            q, k, v = tensors[i]
            return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.spec.causal, enable_gqa=gqa)

        with sdpa_kernel([backend]):
            out = fn(0)
        torch.cuda.synchronize()
        return fn, out

    plain = [views(q, k, v) for q, k, v, _ in sets]
    try:
        fn, out = attempt(plain, g > 1)
        note = ""
    except RuntimeError:
        if g == 1:
            raise
        # the backend refuses grouped KV heads: repeat them (outside the timed region)
        expanded = [views(q, k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)) for q, k, v, _ in sets]
        fn, out = attempt(expanded, False)
        note = "kv repeated"

    def timed(i):
        with sdpa_kernel([backend]):
            return fn(i)

    return timed, out.transpose(1, 2), note


def seed_launcher(cfg: Config):
    """The hand-written seed kernel at cfg's shape: a function (q, k, v) -> out."""
    import importlib.util

    from tvm.target import Target

    from attngen.build.lower import TARGET

    spec = importlib.util.spec_from_file_location("attngen_seed_kernel", cfg.seed)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    s = cfg.shape
    with Target(TARGET):
        return module.fa3_prefill(s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, cfg.spec.head_dim, cfg.spec.dtype)


def run_seed(cfg: Config, row: dict, sets, n: int, args) -> dict:
    """Time the seed kernel; its output is not checked (it has the known tile-0 mask bug: docs/seed-parity.md)."""
    jit = seed_launcher(cfg)
    secs, spread = time_launches(lambda i: jit(*sets[i][:3]), n, args.warmup, args.reps)
    row["attngen"] = {"s": secs, "spread_s": spread, "tflops": tflops(cfg.shape, cfg.spec.head_dim, cfg.spec.causal, secs)}
    return row


def run_config(cfg: Config, args, l2: int) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    from attngen.run.checks import check_written

    row = {"label": cfg.label, "shape": str(cfg.shape), "dtype": cfg.spec.dtype, "causal": cfg.spec.causal,
           "head_dim": cfg.spec.head_dim, "gflop": cfg.gflop(), "kernel": cfg.kernel_name}
    n = cfg.n_sets(l2)
    row["sets"] = n
    sets = make_sets(cfg, n)
    if cfg.seed is not None:
        try:
            return run_seed(cfg, row, sets, n, args)
        finally:
            sets.clear()
            torch.cuda.empty_cache()
    kernel = kernel_for(*cfg.kernel_key)
    try:
        q, k, v, out = sets[0]
        out.fill_(float("nan"))
        kernel(q, k, v, out=out)  # checked launch: the inputs pass every runtime check
        torch.cuda.synchronize()
        try:
            check_written(out)
            row["written"] = True
        except AssertionError as e:
            row["written"] = False
            row["error"] = str(e)
        secs, spread = time_launches(lambda i: kernel(*sets[i][:3], out=sets[i][3], check=False), n, args.warmup, args.reps)
        row["attngen"] = {"s": secs, "spread_s": spread, "tflops": tflops(cfg.shape, cfg.spec.head_dim, cfg.spec.causal, secs)}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                fn, ref, note = sdpa_runner(cfg, sets, backend)
                diff = (out.float() - ref.float()).abs().max().item()
                secs, spread = time_launches(fn, n, args.warmup, args.reps)
                row[name] = {"s": secs, "spread_s": spread, "tflops": tflops(cfg.shape, cfg.spec.head_dim, cfg.spec.causal, secs),
                             "max_abs_diff": diff, "note": note}
            except Exception as e:  # a backend that cannot take this configuration: n/a, with the reason
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    finally:
        sets.clear()  # free the inputs before the next configuration allocates its own
        torch.cuda.empty_cache()
    return row


def run_backward(cfg: Config, args, l2: int) -> dict:
    """A backward row: our backward kernels on the forward's out and LSE, then SDPA's backward on
    each backend (autograd.grad over a retained forward graph), the same input sets rotated."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attngen.reference.forward import default_scale
    from attngen.run.checks import check_written

    row = {"label": cfg.label, "pass": BACKWARD, "shape": str(cfg.shape), "dtype": cfg.spec.dtype, "causal": cfg.spec.causal,
           "head_dim": cfg.spec.head_dim, "gflop": cfg.gflop(), "kernel": cfg.kernel_name}
    n = cfg.n_sets(l2)
    row["sets"] = n
    sets = make_sets(cfg, n)
    fwd, bwd = (kernel_for(*key) for key in cfg.kernel_keys)
    scale = default_scale(cfg.spec.head_dim)  # what the op passes: SDPA's default too
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    saved = []
    try:
        for q, k, v, _ in sets:  # the forward's out and LSE, and a random dout, per set (outside the timing)
            out, lse = fwd(q, k, v)
            saved.append((out, lse, torch.randn(out.shape, device=DEVICE, dtype=out.dtype, generator=gen)))
        torch.cuda.synchronize()

        def ours(i):
            q, k, v, _ = sets[i]
            out, lse, dout = saved[i]
            return bwd.run(q, k, v, out, lse, dout, softmax_scale=scale)

        grads = ours(0)
        torch.cuda.synchronize()
        try:
            for g in grads:
                check_written(g)  # finite: random inputs have finite gradients
            row["written"] = True
        except AssertionError as e:
            row["written"] = False
            row["error"] = str(e)
        secs, spread = time_launches(ours, n, args.warmup, args.reps)
        row["attngen"] = {"s": secs, "spread_s": spread, "tflops": cfg.tflops(secs)}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            graphs = []
            try:
                for (q, k, v, _), (_, _, dout) in zip(sets, saved):
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    with sdpa_kernel([backend]):
                        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=cfg.spec.causal)
                    graphs.append((o, leaves, dout.transpose(1, 2)))

                def sdpa(i):
                    o, leaves, dout = graphs[i]
                    return torch.autograd.grad(o, leaves, dout, retain_graph=True)

                ref = sdpa(0)
                torch.cuda.synchronize()
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref))
                secs, spread = time_launches(sdpa, n, args.warmup, args.reps)
                row[name] = {"s": secs, "spread_s": spread, "tflops": cfg.tflops(secs), "max_abs_diff": diff, "note": ""}
            except Exception as e:  # a backend that cannot take this configuration: n/a, with the reason
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
            finally:
                graphs.clear()
    finally:
        sets.clear()
        saved.clear()
        torch.cuda.empty_cache()
    return row


# -- table --------------------------------------------------------------------------------------


def cell(entry) -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return "n/a"
    if "tflops" in entry:
        t = entry["tflops"]
        return (f"{t:.0f}" if t >= 100 else f"{t:.1f}") + ("*" if entry.get("note") else "")
    return entry.get("plan", "-")


def table(rows, dry_run: bool) -> str:
    """One table (forward rows, or backward rows: the columns are the same, the FLOPs 2.5 x)."""
    head = ["kernel", "dtype", "D", "causal", "B,H,HKV,Sq,Skv", "GFLOP", "sets",
            "attngen TFLOP/s", "SDPA flash", "SDPA cuDNN", "attngen/best", "max abs diff vs SDPA", "written"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a, f, c = r.get("attngen"), r.get("flash"), r.get("cudnn")
        best = max((e["tflops"] for e in (f, c) if e and "tflops" in e), default=None)
        ratio = f"{a['tflops'] / best:.2f}" if a and "tflops" in a and best else "-"
        diffs = [e["max_abs_diff"] for e in (f, c) if e and "max_abs_diff" in e]
        written = "planned" if dry_run else {True: "yes", False: "NO"}.get(r.get("written"), "-")
        lines.append("| " + " | ".join([
            r["label"], r["dtype"], str(r["head_dim"]), "yes" if r["causal"] else "no", r["shape"], f"{r['gflop']:.0f}",
            str(r.get("sets", "-")), cell(a), cell(f), cell(c), ratio, f"{min(diffs):.1e}" if diffs else "-", written,
        ]) + " |")
    notes = sorted({f"{r['label']} {n}: {e['error']}" for r in rows for n, e in (("flash", r.get("flash")), ("cudnn", r.get("cudnn")))
                    if e and "error" in e})
    if any((e or {}).get("note") for r in rows for e in (r.get("flash"), r.get("cudnn"))):
        lines.append("\n\\* SDPA refused grouped KV heads; K and V were repeated to H heads before timing.")
    if notes:
        lines.append("\nn/a: " + "; ".join(notes[:12]))
    failures = [r["label"] + " " + r["shape"] + ": " + r["error"] for r in rows if r.get("error")]
    if failures:
        lines.append("\nFAILED: " + "; ".join(failures))
    return "\n".join(lines)


def environment_lines(dry_run: bool) -> list[str]:
    import torch

    lines = [f"torch {torch.__version__}"]
    try:
        import tilelang

        lines.append(f"tilelang {tilelang.__version__}")
    except Exception as e:
        lines.append(f"tilelang not importable: {e}")
    if not dry_run:
        p = torch.cuda.get_device_properties(0)
        lines.append(f"device {p.name}, {p.multi_processor_count} SMs, L2 {p.L2_cache_size / 2**20:.0f} MiB, "
                     f"capability {p.major}.{p.minor}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    else:
        lines.append("dry run: no launches; the L2 is taken as the H200's 60 MiB")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="build and check everything, launch nothing (no GPU needed)")
    ap.add_argument("--prebuild-only", action="store_true", help="build the kernels into TileLang's disk cache and stop")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel kernel builds (default: all cores)")
    ap.add_argument("--presets", default=str(ROOT / "examples" / "*.toml"), help="glob(s) of preset specs, comma-separated")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--tokens", type=int, default=TOKENS, help="B * S per row (default 16384)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--backward-share", type=float, default=0.4,
                    help="the share of --budget-s kept for the backward rows: the forward rows stop starting at "
                         "(1 - share) of it (default %(default)s; 0: no backward rows)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="start no new row once this many seconds have passed since the process started (prebuild included)")
    ap.add_argument("--seed-kernel", type=Path, default=ROOT / ".seed" / "seed_fa3.py",
                    help="the hand-written seed kernel (bench/seed_kernel.py writes it; skipped when absent)")
    ap.add_argument("--rows", choices=("all", "goals", "rest"), default="all",
                    help="goals: only issue 29's and 30's goal rows (the GPU check runs them early); rest: all but those")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/attngen-bench", help="folder for bench.md and bench.json")
    args = ap.parse_args(argv)

    import glob

    presets = sorted({p for pattern in args.presets.split(",") if pattern for p in glob.glob(pattern)})
    seed = args.seed_kernel if args.seed_kernel and args.seed_kernel.is_file() else None
    if seed is None:
        print(f"no seed kernel at {args.seed_kernel}: run bench/seed_kernel.py to compare with it", flush=True)
    if not 0 <= args.backward_share < 1:
        ap.error(f"--backward-share {args.backward_share}: expected a fraction in [0, 1)")
    seqlens = [int(s) for s in args.seqlens.split(",")]
    pairs = bench_pairs.fp8_rows(seqlens, args.tokens, heads_for) + bench_pairs.persistent_rows(args.tokens, heads_for)
    configs = bench_pairs.forward_order(pairs, plan(presets, seqlens, args.tokens, seed))
    if args.rows != "all":
        configs = [c for c in configs if (args.rows == "goals") == bool(getattr(c, "goal", False))]
    if args.backward_share > 0 and args.rows != "goals":
        configs += plan_backward_rows(seqlens, args.tokens)
    print(f"{len(presets)} presets, {len(configs)} rows ({sum(c.backward for c in configs)} backward), "
          f"{len({k for c in configs for k in c.kernel_keys})} kernels", flush=True)
    extra = preset_keys(presets) + backward_preset_keys(presets) + gpu_test_keys() if args.prebuild_only else ()
    build_rows = prebuild(configs, args.jobs, extra, load=not args.prebuild_only)
    if args.prebuild_only:
        return 1 if any(r.get("error") for r in build_rows) else 0

    import torch

    from attngen.run.checks import torch_dtype
    from attngen.run.inputs import check_layout, check_tensors

    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():  # after every row: a run cut short still leaves its table behind
        fwd_rows = [r for r in rows if r.get("pass") not in (BACKWARD, "fp8", "persistent")]
        bwd_rows = [r for r in rows if r.get("pass") == BACKWARD]
        paired = []
        for kind, title in (("fp8", "fp8 beside our fp16 kernel (issue 29; SDPA and fp16 on the dequantized inputs)"),
                            ("persistent", "persistent beside single-tile (issue 30)")):
            kind_rows = [r for r in rows if r.get("pass") == kind]
            if kind_rows:
                paired += [f"## {title}", "", bench_pairs.pair_table(kind_rows, kind, args.dry_run, cell), ""]
        text = "\n".join(["# attngen forward benchmark" + (" (DRY RUN: nothing launched)" if args.dry_run else ""), ""]
                         + [f"- {line}" for line in environment_lines(args.dry_run)] + [""] + paired
                         + ([table(fwd_rows, args.dry_run), ""] if fwd_rows or not paired else [])
                         + (["## Backward (TFLOP/s at 2.5 x the forward's FLOPs; the backward kernels alone)", "",
                             table(bwd_rows, args.dry_run), ""] if bwd_rows else []))
        (out / "bench.md").write_text(text)
        (out / "bench.json").write_text(json.dumps({"dry_run": args.dry_run, "builds": build_rows, "rows": rows}, indent=1, default=str))
        return text

    if args.dry_run:
        l2 = H200_L2
        for cfg in configs:  # every planned input passes the runtime's checks (meta tensors: no memory)
            if isinstance(cfg, bench_pairs.Pair):
                bench_pairs.check_planned(cfg)
                for key in cfg.kernel_keys:  # loaded (the prebuild built them)
                    kernel_for(*key)
                rows.append({"label": cfg.label, "pass": cfg.kind, "shape": str(cfg.shape), "dtype": cfg.spec.dtype,
                             "causal": cfg.spec.causal, "head_dim": cfg.spec.head_dim, "gflop": cfg.gflop(),
                             "sets": cfg.n_sets(H200_L2), "kernel": cfg.kernel_name, "goal": cfg.goal,
                             "attngen": {"plan": "planned"}, "baseline": {"plan": "planned"},
                             **({"flash": {"plan": "planned"}, "cudnn": {"plan": "planned"}} if cfg.kind == "fp8" else {})})
                save()
                continue
            s, d, dt = cfg.shape, cfg.spec.head_dim, torch_dtype(cfg.spec.dtype)
            q = torch.empty(s.batch, s.q_len, s.heads, d, dtype=dt, device="meta")
            kv = torch.empty(s.batch, s.kv_len, s.kv_heads, d, dtype=dt, device="meta")
            check_tensors(cfg.spec, q, kv, kv.clone(), torch.empty_like(q), shape=s if cfg.static else None)
            if cfg.seed is not None:
                seed_launcher(cfg)  # builds it (nvcc, no launch)
            if cfg.backward:  # the forward with lse that feeds it, and dout laid out as the kernels take it
                check_tensors(autograd_forward(cfg.spec), q, kv, kv.clone(), torch.empty_like(q))
                check_layout("dout", torch.empty_like(q))
                for key in cfg.kernel_keys:  # loaded (the prebuild built them)
                    kernel_for(*key)
            rows.append({"label": cfg.label, "pass": BACKWARD if cfg.backward else "forward", "shape": str(s),
                         "dtype": cfg.spec.dtype, "causal": cfg.spec.causal,
                         "head_dim": d, "gflop": cfg.gflop(), "sets": cfg.n_sets(l2),
                         "kernel": cfg.kernel_name,
                         "attngen": {"plan": "planned"}, "flash": {"plan": "planned"}, "cudnn": {"plan": "planned"}})
            save()
    else:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        forward_until = args.budget_s * (1 - args.backward_share)  # forward rows first; the backward's share after
        skipped = {False: 0, True: 0}
        for cfg in configs:
            limit = args.budget_s if cfg.backward else forward_until
            if time.time() - START > limit:
                skipped[cfg.backward] += 1
                continue
            try:
                if isinstance(cfg, bench_pairs.Pair):
                    row = bench_pairs.run_pair(cfg, args, l2, kernel_for, sdpa_runner)
                else:
                    row = (run_backward if cfg.backward else run_config)(cfg, args, l2)
            except Exception as e:  # record the row's failure and go on, unless the context is poisoned
                kind = cfg.kind if isinstance(cfg, bench_pairs.Pair) else BACKWARD if cfg.backward else "forward"
                row = {"label": cfg.label, "pass": kind, "shape": str(cfg.shape),
                       "dtype": cfg.spec.dtype, "causal": cfg.spec.causal, "head_dim": cfg.spec.head_dim, "gflop": cfg.gflop(),
                       "error": f"{type(e).__name__}: {str(e)[-300:]}"}
            rows.append(row)
            paired = row.get("pass") in ("fp8", "persistent")
            one = bench_pairs.pair_table([row], row["pass"], False, cell) if paired else table([row], False)
            print(one.splitlines()[2] if "error" not in row else f"{cfg.label} {cfg.shape}: {row['error']}", flush=True)
            save()
            if "error" in row:
                try:
                    torch.cuda.synchronize()
                except Exception as e:  # a sticky CUDA error: every later launch would fail too
                    print(f"CUDA context is broken after {cfg.label} ({type(e).__name__}: {e}); stopping", flush=True)
                    break
        for backward, n in skipped.items():
            if n:
                print(f"time budget spent: {n} {'backward' if backward else 'forward'} rows not run "
                      f"(limit {args.budget_s if backward else forward_until:.0f} s since start)", flush=True)

    text = save()
    print("\n" + text)
    print(f"written: {out / 'bench.md'}, {out / 'bench.json'}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
