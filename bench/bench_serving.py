"""Serving kernels on an H200: decode bandwidth against a device copy's, varlen prefill against dense.

    python3 bench/bench_serving.py              # on an H200: build, time, print the tables
    python3 bench/bench_serving.py --dry-run    # no GPU: plan every row and validate its call

Decode (examples/paged_decode_hd128_bf16_gqa8_splits.toml, issue 11): one query token per
sequence, 8 KV heads serving 64 query heads, pages of 128 keys in a shuffled cache, batch 1..64,
kv_len 4k..128k (rows whose cache passes --max-cache-gb, or 2**31 - 1 elements, are left out),
num_splits "auto". The
bytes moved are the K and V rows the sequences hold plus q and out; the table gives TB/s and
the fraction of the bandwidth of a device-to-device copy timed in the same run (read + write
bytes over time). Issue 11's goal is 80% of it.

Prefill (examples/varlen_hd128_bf16_causal.toml): 16k tokens as equal sequences of 1k..8k,
packed, against the same spec with layout "bshd" on [B, S] tensors of the same tokens; the
ratio of the two times, measured in one run (goal: varlen within 5% of dense).

Method as bench/bench_gpu.py (attngen.run.gputime): CUDA events, warm-up, median; input sets
rotate so that together they exceed the L2 three times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

START = time.time()
ROOT = Path(__file__).resolve().parents[1]
try:
    import attngen  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from attngen import hw  # noqa: E402
from attngen.run.gputime import n_sets, time_launches  # noqa: E402
from attngen.kernels.fwd.plan import make_plan  # noqa: E402
from attngen.spec import load  # noqa: E402

DECODE_PRESET = ROOT / "examples" / "paged_decode_hd128_bf16_gqa8_splits.toml"
PREFILL_PRESET = ROOT / "examples" / "varlen_hd128_bf16_causal.toml"
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_KV_LENS = (4096, 32768, 131072)
KV_HEADS = 8
PREFILL_TOKENS = 16384
PREFILL_SEQLENS = (1024, 2048, 4096, 8192)
PREFILL_HEADS = 16  # 2048 / head_dim, as bench_gpu.py
COPY_BYTES = 2 * 1024**3
H200_L2 = 60 * 1024**2


def decode_rows(max_cache_gb: float) -> list[dict]:
    """(batch, kv_len) rows whose K and V caches fit the limit, with the bytes each call moves."""
    plan = make_plan(load(DECODE_PRESET))
    spec = plan.spec
    elem = 2  # bf16
    rows = []
    for b in DECODE_BATCHES:
        for kv in DECODE_KV_LENS:
            kv_bytes = 2 * b * kv * KV_HEADS * spec.head_dim * elem  # K and V rows the sequences hold
            if kv_bytes > max_cache_gb * 1e9 or b * kv * KV_HEADS * spec.head_dim > hw.INT32_MAX:
                continue  # too big for the card, or for the kernel's int32 indexing of one cache
            heads = KV_HEADS * spec.gqa_group
            qo_bytes = 2 * b * heads * spec.head_dim * elem
            rows.append({"batch": b, "kv_len": kv, "heads": heads, "bytes": kv_bytes + qo_bytes,
                         "pages": -(-kv // plan.page_size)})
    return rows


def decode_inputs(row: dict, plan, device, seed: int = 0):
    """q, the caches, a shuffled block table and seqused_k for one decode row."""
    import torch

    spec = plan.spec
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, pages = row["batch"], row["pages"]
    num_pages = b * pages
    dt = getattr(torch, spec.dtype)
    q = torch.randn(b, 1, row["heads"], spec.head_dim, generator=g).to(device=device, dtype=dt)
    shape = (num_pages, plan.page_size, KV_HEADS, spec.head_dim)
    if device == "meta":
        kc = vc = torch.empty(shape, dtype=dt, device="meta")
    else:
        kc = torch.randn(shape, device=device, dtype=dt)
        vc = torch.randn(shape, device=device, dtype=dt)
    table = torch.randperm(num_pages, generator=g).to(torch.int32).reshape(b, pages)
    used = torch.full((b,), row["kv_len"], dtype=torch.int32)
    dev = "cpu" if device == "meta" else device
    return q, kc, vc, table.to(dev), used.to(dev)


def prefill_rows() -> list[dict]:
    return [{"seqlen": s, "batch": PREFILL_TOKENS // s, "heads": PREFILL_HEADS} for s in PREFILL_SEQLENS]


def copy_bandwidth(warmup: int, reps: int) -> float:
    """Bytes read plus written per second by a device-to-device copy of COPY_BYTES."""
    import torch

    x = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds, _ = time_launches(lambda i: y.copy_(x), 1, warmup, reps)
    return 2 * COPY_BYTES / seconds


def each_row(rows, args, measure) -> list[dict]:
    """Each row with measure(row)'s figures, until the time budget is spent; a row that fails
    records its error and costs the others nothing. Prints each row as it lands."""
    import torch

    out = []
    for row in rows:
        if time.time() - START > args.budget_s:
            out.append({**row, "error": "time budget spent"})
            continue
        try:
            out.append({**row, **measure(row)})
        except Exception as e:
            out.append({**row, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
        finally:
            torch.cuda.empty_cache()
        print(json.dumps(out[-1]), flush=True)
    return out


def run_decode(rows, args, l2) -> list[dict]:
    import torch

    from attngen.run.forward import compile_kernel

    plan = make_plan(load(DECODE_PRESET))
    kernel = compile_kernel(plan)

    def measure(row):
        sets = [decode_inputs(row, plan, "cuda", seed=i) for i in range(n_sets(row["bytes"], l2))]
        o = torch.full_like(sets[0][0], float("nan"))
        q, kc, vc, bt, su = sets[0]
        kernel(q, kc, vc, out=o, block_table=bt, seqused_k=su, num_splits="auto")  # checked once
        torch.cuda.synchronize()
        if not torch.isfinite(o).all():
            raise RuntimeError("non-finite output (an unwritten row stays NaN)")
        call, _ = kernel.check_call(q, kc, vc, o, block_table=bt, seqused_k=su, num_splits="auto")

        def launch(i):
            q, kc, vc, bt, su = sets[i]
            kernel(q, kc, vc, out=o, check=False, block_table=bt, seqused_k=su, num_splits="auto")

        seconds, spread = time_launches(launch, len(sets), args.warmup, args.reps)
        return {"splits": call.num_splits, "us": seconds * 1e6, "spread_us": spread * 1e6,
                "tb_s": row["bytes"] / seconds / 1e12}

    return each_row(rows, args, measure)


def run_prefill(rows, args, l2) -> list[dict]:
    import dataclasses

    import torch

    from attngen.run.forward import compile_kernel

    varlen = make_plan(load(PREFILL_PRESET))
    dense = make_plan(dataclasses.replace(load(PREFILL_PRESET), layout="bshd"))
    kv, kd = compile_kernel(varlen), compile_kernel(dense)
    d = varlen.spec.head_dim

    def measure(row):
        b, s, h = row["batch"], row["seqlen"], row["heads"]
        dt = getattr(torch, varlen.spec.dtype)
        x = [torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3)]
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
        packed = [t.reshape(b * s, h, d) for t in x]
        o_v, o_d = torch.empty_like(packed[0]), torch.empty_like(x[0])
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s)
        kv(*packed, out=o_v, **kw)
        kd(*x, out=o_d)
        torch.cuda.synchronize()
        diff = (o_v.reshape(b, s, h, d).float() - o_d.float()).abs().max().item()
        t_v, _ = time_launches(lambda i: kv(*packed, out=o_v, check=False, **kw), 1, args.warmup, args.reps)
        t_d, _ = time_launches(lambda i: kd(*x, out=o_d, check=False), 1, args.warmup, args.reps)
        return {"varlen_us": t_v * 1e6, "dense_us": t_d * 1e6, "ratio": t_v / t_d, "max_diff": diff}

    return each_row(rows, args, measure)


def dry_run(decode, prefill) -> None:
    """Every decode row's call passes the serving checks (meta caches: no memory); every kernel builds."""
    from attngen.build.nvcc import build
    from attngen.run.serving import check_serving

    plan = make_plan(load(DECODE_PRESET))
    for row in decode:
        q, kc, vc, bt, su = decode_inputs(row, plan, "meta")
        call = check_serving(plan, q, kc, vc, block_table=bt, seqused_k=su, num_splits="auto")
        row.update(splits=call.num_splits, plan="planned")
    for path in (DECODE_PRESET, PREFILL_PRESET):
        build(load(path))
    for row in prefill:
        row.update(plan="planned")


def table(decode, prefill, copy_tb_s) -> str:
    lines = ["## Decode (paged, GQA 8, hd128, q_len 1, splits auto)", "",
             f"device copy: {copy_tb_s:.2f} TB/s" if copy_tb_s else "device copy: not measured", "",
             "| batch | kv_len | splits | MB moved | time us | TB/s | of copy |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in decode:
        if "tb_s" in r:
            frac = f"{r['tb_s'] / copy_tb_s:.0%}" if copy_tb_s else "-"
            lines.append(f"| {r['batch']} | {r['kv_len']} | {r['splits']} | {r['bytes'] / 1e6:.0f} | {r['us']:.1f} | "
                         f"{r['tb_s']:.2f} | {frac} |")
        else:
            lines.append(f"| {r['batch']} | {r['kv_len']} | {r.get('splits', '-')} | {r['bytes'] / 1e6:.0f} | "
                         f"{r.get('error', r.get('plan'))} | | |")
    lines += ["", "## Prefill, 16k tokens, hd128 causal: varlen vs dense", "",
              "| seqlen | batch | varlen us | dense us | varlen / dense |", "| --- | --- | --- | --- | --- |"]
    for r in prefill:
        if "ratio" in r:
            lines.append(f"| {r['seqlen']} | {r['batch']} | {r['varlen_us']:.1f} | {r['dense_us']:.1f} | {r['ratio']:.3f} |")
        else:
            lines.append(f"| {r['seqlen']} | {r['batch']} | {r.get('error', r.get('plan'))} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="plan and validate every row, launch nothing")
    ap.add_argument("--max-cache-gb", type=float, default=24.0, help="leave out decode rows whose K+V exceed this")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=90.0, help="start no new row after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/attngen-bench", help="folder for serving.md/.json")
    args = ap.parse_args(argv)
    decode, prefill = decode_rows(args.max_cache_gb), prefill_rows()
    copy_tb_s = None
    if args.dry_run:
        dry_run(decode, prefill)
    else:
        import torch

        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        copy_tb_s = copy_bandwidth(args.warmup, args.reps) / 1e12
        decode = run_decode(decode, args, l2)
        prefill = run_prefill(prefill, args, l2)
    text = "# attngen serving benchmark" + (" (DRY RUN: nothing launched)" if args.dry_run else "") + "\n\n"
    text += table(decode, prefill, copy_tb_s) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.md").write_text(text)
    (out / "serving.json").write_text(json.dumps({"dry_run": args.dry_run, "copy_tb_s": copy_tb_s, "decode": decode,
                                                  "prefill": prefill}, indent=1))
    print(text)
    return 1 if any("error" in r for r in decode + prefill) else 0


if __name__ == "__main__":
    sys.exit(main())
