"""Document masking with a block mask against full causal attention, side by side on the CPU
model's timeline (docs/timeline.md): the same emitted kernels the GPU would run, replayed in
cycles under attngen/timeline/latency.toml.

    PYTHONPATH=. python bench/block_mask_timeline.py            # 16 documents in one 16k sequence
    PYTHONPATH=. python bench/block_mask_timeline.py --seq 4096 --docs 4

The documents are causal inside (mask_mod doc[q] == doc[kv] and q >= kv), so their ideal cost is
1/docs of full causal attention's. Every query block of head 0 is emulated (numerics included)
and replayed; printed per kernel: the KV tiles its blocks loaded, the sum of its blocks' cycles
(the work), and the whole-kernel estimate for --heads heads on 132 SMs (attngen.timeline.html.
estimate_kernel). A figure of the model, not a measurement; no test asserts it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from attngen.interfaces import flex_blocks, flex_mods
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec
from attngen.timeline.html import estimate_kernel
from attngen.timeline.latency import Latency, SourceInfo
from attngen.timeline.record import record
from attngen.timeline.replay import replay


def measure(plan, seq: int, heads: int, lat, tensors=None) -> dict:
    t0 = time.perf_counter()
    rec = record(plan, q_len=seq, kv_len=seq, blocks="auto", limit=1 << 30, tensors=tensors)
    src = SourceInfo(rec.source)
    blocks = [(cta.index, replay(cta, lat, src).total) for cta in rec.ctas]
    total_blocks = len(blocks) * heads
    return {"name": plan.name, "tiles": rec.stats.k_tiles, "blocks": len(blocks),
            "work": sum(c for _, c in blocks), "slowest": max(c for _, c in blocks),
            "kernel": estimate_kernel(blocks, total_blocks, int(lat["gpu.sms"])), "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16, help="heads of the whole-kernel estimate (head 0 is emulated)")
    ap.add_argument("--latency", default=None)
    args = ap.parse_args(argv)
    lat = Latency.load(args.latency)
    doc = torch.from_numpy(np.repeat(np.arange(args.docs), -(-args.seq // args.docs))[:args.seq]).float()

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    causal = make_plan(Spec(head_dim=args.head_dim, causal=True))
    masked = make_plan(Spec(head_dim=args.head_dim, mask_mod=flex_mods.translate(documents, "mask_mod").text, block_mask=True))
    bm = flex_blocks.create_block_mask(documents, None, None, args.seq, args.seq,
                                BLOCK_SIZE=(masked.spec.block_m, masked.spec.block_n))
    tensors = {**bm.mask_tensors, **{n: getattr(bm, n) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                                   "full_kv_indices")}}
    rows = [measure(causal, args.seq, args.heads, lat), measure(masked, args.seq, args.heads, lat, tensors)]
    print(f"{args.docs} causal documents in one {args.seq}-token sequence vs full causal attention, hd{args.head_dim}, "
          f"head 0 emulated, latency model {lat.path.name if hasattr(lat.path, 'name') else lat.path}")
    print(f"{'kernel':62} {'KV tiles':>9} {'work (Mcycles)':>15} {'slowest block':>14} {f'kernel, {args.heads} heads':>18} {'emulated':>9}")
    for r in rows:
        print(f"{r['name']:62} {r['tiles']:9d} {r['work'] / 1e6:15.2f} {r['slowest']:14.0f} {r['kernel']:18.0f} {r['seconds']:8.1f}s")
    c, m = rows
    print(f"document masking / causal: work {m['work'] / c['work']:.4f} (1/{c['work'] / m['work']:.1f}), "
          f"kernel estimate {m['kernel'] / c['kernel']:.4f} (1/{c['kernel'] / m['kernel']:.1f}); goal <= 1/8, ideal 1/{args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
