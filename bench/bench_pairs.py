"""The benchmark's paired rows (bench/bench_gpu.py runs them): two of our kernels at one shape in one
row, with the same method (attngen/run/gputime.py) and the same input sets rotated.

- fp8 (issue 29): e4m3 Q, K and V with FA3's descales (float32 [batch, kv_heads], drawn in [0.5, 1.5))
  beside our float16 kernel and SDPA on the dequantized inputs (q * q_descale, ... in float16), hd64,
  hd128 and hd256, causal or not, 16k down to 1k. Before timing, the fp8 output must be finite and
  within FP8_CLOSE x max|fp16 output| of our fp16 kernel's (a loose rule: e4m3 carries 3 mantissa
  bits; a descale ignored or V untransposed is off by far more).
- persistent (issue 30): scheduler "persistent" beside "single" (the same spec, the persistent plan's
  block_n), hd128 float16, causal and not, 1k, 4k and 16k, and a varlen causal batch of mixed lengths
  (VARLEN_LENGTHS, 16k tokens). Before timing, both outputs must be written and bit-identical.

The goal rows come first (goal_first): hd128 non-causal fp8 at 16k (>= 1.6x our fp16 and >= 1000
TFLOP/s), then hd128 causal persistent at 1k, 4k and 16k (>= single, >= 1.1x at 1k).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attngen.emulator.driver import DESCALE_NAMES
from attngen.hw import E4M3
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import fa3_descale
from attngen.run.gputime import n_sets, time_launches
from attngen.spec import Spec

FP8 = E4M3  # hw.E4M3: torch's name for e4m3
FP8_HEAD_DIMS = (128, 64, 256)
FP8_CLOSE = 0.1  # max|fp8 out - fp16 out| <= FP8_CLOSE * max|fp16 out|, on the same dequantized inputs
DESCALES = DESCALE_NAMES  # FA3's call-time names (kernels/fwd/plan.py)
PERSISTENT_SEQLENS = (1024, 4096, 16384)
VARLEN_LENGTHS = (7000, 3001, 2500, 1500, 1000, 700, 300, 200, 100, 80, 3)  # 16384 tokens, mixed lengths
GOALS = (("fp8", 128, False, 16384),) + tuple(("persistent", 128, True, s) for s in PERSISTENT_SEQLENS)
DEVICE = "cuda"


@dataclasses.dataclass
class Pair:
    """One paired row: `spec` (fp8, or persistent) timed beside `baseline` (our fp16 kernel, or the
    single-tile one) at `shape`; `lengths`: a varlen batch's sequence lengths (shape: their count and max)."""

    kind: str  # "fp8" or "persistent"
    spec: Spec
    baseline: Spec
    shape: Shape
    lengths: tuple | None = None
    seed = None  # bench_gpu's prebuild and dry run read these of every row
    backward = False
    static = False

    @property
    def label(self) -> str:
        what = "varlen mixed" if self.lengths else f"hd{self.spec.head_dim}{' causal' if self.spec.causal else ''}"
        return f"{self.kind} {what}"

    @property
    def goal(self) -> bool:
        return (self.kind, self.spec.head_dim, self.spec.causal, self.shape.q_len) in GOALS and not self.lengths

    @property
    def kernel_keys(self) -> list:
        return [(self.spec, None, None), (self.baseline, None, None)]

    @property
    def kernel_name(self) -> str:
        return make_plan(self.spec).name

    def gflop(self) -> float:
        s, d = self.shape, self.spec.head_dim
        pairs = sum(n * n for n in self.lengths) if self.lengths else s.batch * s.q_len * s.kv_len
        return 4 * s.heads * pairs * d / (2 if self.spec.causal else 1) / 1e9

    def tflops(self, secs: float) -> float:
        return self.gflop() / secs / 1e3

    @property
    def set_bytes(self) -> int:
        s, d = self.shape, self.spec.head_dim
        tokens = sum(self.lengths) if self.lengths else s.batch * s.q_len
        elements = d * tokens * (s.heads + 2 * s.kv_heads)  # q, k, v (Sq == Skv)
        if self.kind == "fp8":  # e4m3 q, k, v and their float16 copies; two 16-bit outputs
            return 3 * elements + 4 * d * tokens * s.heads
        return 2 * elements + 4 * d * tokens * s.heads  # float16 q, k, v; two outputs

    def n_sets(self, l2: int) -> int:
        return n_sets(self.set_bytes, l2)


def fp8_rows(seqlens, tokens: int, heads_for) -> list[Pair]:
    rows = []
    for s in sorted(seqlens, reverse=True):
        for d in FP8_HEAD_DIMS:
            for causal in (False, True):
                spec = make_plan(Spec(head_dim=d, dtype=FP8, causal=causal)).spec
                base = make_plan(Spec(head_dim=d, dtype="float16", causal=causal)).spec
                h = heads_for(d, 1)
                rows.append(Pair("fp8", spec, base, Shape(max(1, tokens // s), h, h, s, s)))
    return rows


def persistent_rows(tokens: int, heads_for) -> list[Pair]:
    rows = []
    h = heads_for(128, 1)
    for causal in (True, False):
        for s in PERSISTENT_SEQLENS:
            rows.append(persistent_pair(Spec(causal=causal), Shape(max(1, tokens // s), h, h, s, s)))
    n = len(VARLEN_LENGTHS)
    rows.append(persistent_pair(Spec(causal=True, layout="varlen"), Shape(n, h, h, max(VARLEN_LENGTHS), max(VARLEN_LENGTHS)),
                                VARLEN_LENGTHS))
    return rows


def persistent_pair(spec: Spec, shape: Shape, lengths=None) -> Pair:
    """The persistent plan's spec and the single-tile one with its block_n (tests/test_gpu_persistent.py's pair)."""
    persistent = make_plan(dataclasses.replace(spec, scheduler="persistent")).spec
    single = make_plan(dataclasses.replace(spec, block_n=persistent.block_n)).spec
    return Pair("persistent", persistent, single, shape, lengths)


def goal_first(rows: list) -> list:
    """The goal rows first (in GOALS' order), then the others in their own order."""
    goals = sorted((r for r in rows if isinstance(r, Pair) and r.goal),
                   key=lambda r: GOALS.index((r.kind, r.spec.head_dim, r.spec.causal, r.shape.q_len)))
    return goals + [r for r in rows if not (isinstance(r, Pair) and r.goal)]


# -- inputs -------------------------------------------------------------------------------------------


def input_tensors(row: Pair, device: str, seed: int = 0, empty: bool = False) -> dict:
    """One input set: q, k, v (e4m3 for fp8) and the call's keywords; for fp8 also q16, k16, v16 (the
    dequantized inputs in float16: our fp16 kernel's and SDPA's) and the descales; a varlen row's
    tensors are packed [total, heads, dim] with cu_seqlens. `empty`: uninitialised (the dry run's meta
    tensors)."""
    import torch

    from attngen.run.checks import torch_dtype

    s, d = row.shape, row.spec.head_dim
    gen = None if empty else torch.Generator(device=device).manual_seed(seed)

    def draw(*shape, dtype=torch.float16):
        if empty:
            return torch.empty(*shape, device=device, dtype=dtype)
        return torch.randn(*shape, device=device, generator=gen).to(dtype)  # e4m3 has no randn

    if row.lengths:
        total = sum(row.lengths)
        cu = torch.tensor((0,) + row.lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        q, k, v = (draw(total, heads, d) for heads in (s.heads, s.kv_heads, s.kv_heads))
        cu = cu if device == "meta" else cu.to(device)  # the dry run's checks read it on the host
        kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(row.lengths)}
        return {"q": q, "k": k, "v": v, "keywords": kw}
    dt = torch_dtype(row.spec.dtype)
    q, k, v = (draw(s.batch, n, heads, d, dtype=dt) for n, heads in ((s.q_len, s.heads), (s.kv_len, s.kv_heads),
                                                                       (s.kv_len, s.kv_heads)))
    x = {"q": q, "k": k, "v": v, "keywords": {}}
    if row.kind == "fp8":
        rng = np.random.default_rng(seed)  # the CPU model's draw (reference.fa3_descale), copied over
        ds = [torch.empty(s.batch, s.kv_heads, device=device) if empty else
              torch.from_numpy(fa3_descale(rng, s.batch, s.kv_heads)).to(device) for _ in DESCALES]
        x["keywords"] = dict(zip(DESCALES, ds))
        group = s.heads // s.kv_heads
        x["q16"], x["k16"], x["v16"] = (dequantized(t, dscale, group if name == "q" else 1)
                                        for name, t, dscale in (("q", q, ds[0]), ("k", k, ds[1]), ("v", v, ds[2])))
    return x


def dequantized(t, descale, group: int):
    """float16(t * descale) with descale [batch, kv_heads] per (batch, head // group): FA3's meaning."""
    import torch

    scale = descale.repeat_interleave(group, dim=1)[:, None, :, None]
    return (t.to(torch.float32) * scale).to(torch.float16)


def out_like(row: Pair, x: dict, spec: Spec):
    import torch

    from attngen.run.checks import torch_dtype

    return torch.empty(x["q"].shape, device=x["q"].device, dtype=torch_dtype(spec.out_dtype or spec.dtype))


def check_planned(row: Pair) -> None:
    """The dry run: every input of the row (meta tensors, host cu_seqlens) passes the runtime's checks,
    for both kernels."""
    from attngen.run.inputs import check_tensors
    from attngen.run.serving import check_serving

    x = input_tensors(row, "meta", empty=True)
    if row.lengths:
        for spec in (row.spec, row.baseline):
            check_serving(make_plan(spec), x["q"], x["k"], x["v"], **x["keywords"])
        return
    check_tensors(row.spec, x["q"], x["k"], x["v"], out_like(row, x, row.spec))
    base = (x["q16"], x["k16"], x["v16"]) if row.kind == "fp8" else (x["q"], x["k"], x["v"])
    check_tensors(row.baseline, *base, out_like(row, {"q": base[0]}, row.baseline))
    for name, t in x["keywords"].items():  # FA3's descales: float32 [batch, kv_heads]
        assert t.dtype.is_floating_point and tuple(t.shape) == (row.shape.batch, row.shape.kv_heads), (name, t.shape)


# -- running --------------------------------------------------------------------------------------


def run_pair(row: Pair, args, l2: int, kernel_for, sdpa_runner) -> dict:
    """Both kernels once into NaN-poisoned outputs and checked (fp8: finite and close to our fp16;
    persistent: bit-identical to single), then each timed over the rotated sets; fp8 rows also time
    SDPA (flash, cuDNN) on the dequantized float16 inputs."""
    import torch
    from torch.nn.attention import SDPBackend

    from attngen.run.checks import check_written

    out = {"label": row.label, "pass": row.kind, "shape": str(row.shape), "dtype": row.spec.dtype, "causal": row.spec.causal,
           "head_dim": row.spec.head_dim, "gflop": row.gflop(), "kernel": row.kernel_name, "goal": row.goal}
    n = row.n_sets(l2)
    out["sets"] = n
    ours, base = kernel_for(row.spec, None, None), kernel_for(row.baseline, None, None)
    sets = [input_tensors(row, DEVICE, seed=i) for i in range(n)]
    for x in sets:
        x["out"], x["out16"] = out_like(row, x, row.spec), out_like(row, x, row.baseline)
    b16 = ("q16", "k16", "v16") if row.kind == "fp8" else ("q", "k", "v")

    def run_ours(i, check=False):
        x = sets[i]
        return ours(x["q"], x["k"], x["v"], out=x["out"], check=check, **x["keywords"])

    def run_base(i, check=False):
        x = sets[i]
        kw = {} if row.kind == "fp8" else x["keywords"]
        return base(*(x[n] for n in b16), out=x["out16"], check=check, **kw)

    try:
        x = sets[0]
        x["out"].fill_(float("nan"))
        x["out16"].fill_(float("nan"))
        run_ours(0, check=True)
        run_base(0, check=True)
        torch.cuda.synchronize()
        try:
            check_written(x["out"])
            check_written(x["out16"])
            if row.kind == "fp8":
                gap = (x["out"].float() - x["out16"].float()).abs().max().item()
                peak = x["out16"].float().abs().max().item()
                out["fp8_vs_fp16"] = gap / peak if peak else float("inf")
                assert gap <= FP8_CLOSE * peak, f"max|fp8 - fp16| = {gap:.3g} > {FP8_CLOSE} x max|fp16| = {FP8_CLOSE * peak:.3g}"
            else:
                assert torch.equal(x["out"], x["out16"]), "persistent differs from single-tile"
                out["bit_equal"] = True
            out["written"] = True
        except AssertionError as e:
            out["written"] = False
            out["error"] = str(e)
        for name, fn in (("attngen", run_ours), ("baseline", run_base)):
            secs, spread = time_launches(fn, n, args.warmup, args.reps)
            out[name] = {"s": secs, "spread_s": spread, "tflops": row.tflops(secs)}
        if row.kind == "fp8":
            plain = [(x["q16"], x["k16"], x["v16"], None) for x in sets]
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    fn, ref, note = sdpa_runner(row, plain, backend)
                    secs, spread = time_launches(fn, n, args.warmup, args.reps)
                    out[name] = {"s": secs, "spread_s": spread, "tflops": row.tflops(secs), "note": note,
                                 "max_abs_diff": (x["out"].float() - ref.float()).abs().max().item()}
                except Exception as e:  # a backend that cannot take this configuration: n/a, with the reason
                    out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    finally:
        sets.clear()
        torch.cuda.empty_cache()
    return out


# -- tables ---------------------------------------------------------------------------------------


def pair_table(rows, kind: str, dry_run: bool, cell) -> str:
    fp8 = kind == "fp8"
    head = ["row", "goal", "D", "causal", "B,H,HKV,Sq,Skv", "GFLOP", "sets",
            "fp8 TFLOP/s" if fp8 else "persistent TFLOP/s", "fp16 (ours)" if fp8 else "single",
            "fp8/fp16" if fp8 else "persistent/single"]
    head += ["SDPA flash", "SDPA cuDNN", "max|fp8-fp16| / max|fp16|", "written"] if fp8 else ["bit-equal", "written"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a, b = r.get("attngen"), r.get("baseline")
        ratio = f"{a['tflops'] / b['tflops']:.2f}" if a and b and "tflops" in a and "tflops" in b else "-"
        written = "planned" if dry_run else {True: "yes", False: "NO"}.get(r.get("written"), "-")
        cells = [r["label"], "yes" if r.get("goal") else "", str(r["head_dim"]), "yes" if r["causal"] else "no", r["shape"],
                 f"{r['gflop']:.0f}", str(r.get("sets", "-")), cell(a), cell(b), ratio]
        if fp8:
            gap = r.get("fp8_vs_fp16")
            cells += [cell(r.get("flash")), cell(r.get("cudnn")), "-" if gap is None else f"{gap:.3f}", written]
        else:
            cells += ["planned" if dry_run else {True: "yes"}.get(r.get("bit_equal"), "NO"), written]
        lines.append("| " + " | ".join(cells) + " |")
    failures = [r["label"] + " " + r["shape"] + ": " + r["error"] for r in rows if r.get("error")]
    if failures:
        lines.append("\nFAILED: " + "; ".join(failures))
    return "\n".join(lines)


def forward_order(pairs: list, others: list) -> list:
    """The forward rows in the order the budget reaches them: the goal rows, the other persistent rows
    (issue 30's "persistent >= single everywhere"), the fp8 rows at the longest length, then `others`
    (the seed and preset rows), then the shorter fp8 rows."""
    first = goal_first(pairs)
    goals = [r for r in first if r.goal]
    rest = [r for r in first if not r.goal]
    longest = max((r.shape.q_len for r in rest if r.kind == "fp8"), default=0)
    persistent = [r for r in rest if r.kind == "persistent"]
    fp8_long = [r for r in rest if r.kind == "fp8" and r.shape.q_len == longest]
    fp8_short = [r for r in rest if r.kind == "fp8" and r.shape.q_len != longest]
    return goals + persistent + fp8_long + list(others) + fp8_short
