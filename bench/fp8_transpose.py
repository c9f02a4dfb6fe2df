"""Who transposes V in an fp8 kernel, on the CPU model's timeline (docs/fp8.md, docs/timeline.md).

    PYTHONPATH=. python bench/fp8_transpose.py                    # hd128, 2 consumers, Sq 256, Skv 1024
    PYTHONPATH=. python bench/fp8_transpose.py --head-dim 64 --kv-len 2048

Four rows, one query block of head 0 each, replayed in cycles under attngen/timeline/latency.toml:
- "producer": the built kernel: the producer warpgroup transposes V tile k - 1 after issuing tile k's
  loads (its T.Parallel copy priced as shared-memory traffic, 2 bytes an element moved);
- "consumers": a model, not a kernel: the same recorded trace with the producer's transpose removed
  and, in each consumer after its wait on vt_full (the tile landed), its share of the tile's
  transpose (tile / consumers elements, the same statement's price) and a named barrier joining the
  consumers, since both PVs read the whole V^T;
- "v_layout = transposed": the kernel that takes V already [dim, keys] (no transpose at all), with
  2 V stages and with 3 (its K loads queue behind its V^T stage's release: one loop issues both);
- the 16-bit kernel of the same head dim, for scale.
A figure of the model, not a measurement; no test asserts it.
"""

from __future__ import annotations

import argparse
import dataclasses

from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec
from attngen.timeline import CTATrace, Event, Latency, SourceInfo, record, replay, summarize

FP8 = "float8_e4m3fn"
CONSUMER_BAR = 15  # a named-barrier id no emitted kernel uses (the model's consumer join)
WARPGROUP = 128


def consumers_transpose(cta: CTATrace, src: SourceInfo, tile_elems: int) -> CTATrace:
    """The recorded trace with the V transpose moved from the producer to the consumers (see the module text)."""
    lines = {line for line, st in src.loops.items() if st.smem_bytes}
    if not lines:
        raise SystemExit("no shared-to-shared transpose in this kernel: is it fp8 with v_layout = \"keys\"?")
    line = min(lines)
    n = sum(not p for p in cta.producers)
    events = []
    for agent, producer in enumerate(cta.producers):
        mine = cta.of(agent)
        if producer:
            events += [e for e in mine if not (e.kind == "parallel" and e.line in lines)]
            continue
        out, since_pv, gen = [], 0, 0
        for e in mine:
            if e.kind == "mbar_wait" and str(e.info["bar"]).startswith("vt_full"):
                share = tile_elems // n
                block = [e, Event(agent, "parallel", line, {"extents": (share,), "elems": share})]
                if n > 1:
                    block += [Event(agent, "bar_arrive", None, {"bar": CONSUMER_BAR, "gen": gen, "n": WARPGROUP,
                                                                "count": WARPGROUP * n, "sync": True}),
                              Event(agent, "bar_wait", None, {"bar": CONSUMER_BAR, "gen": gen})]
                gen += 1
                # before this tile's ping-pong turn: a join inside the turn would wait on the other
                # consumer, itself waiting for the turn
                turns = [i for i in range(since_pv, len(out)) if out[i].kind == "bar_arrive" and out[i].info["sync"]]
                at = turns[-1] if turns else len(out)
                out[at:at] = block
                since_pv = len(out)
                continue
            out.append(e)
        events += out
    return dataclasses.replace(cta, events=events)


def row(label: str, summary: dict, block_n: int) -> str:
    producer = next(a for a in summary["agents"] if a["producer"])
    transpose = producer["busy"].get("other", 0.0) / summary["tiles"]
    return (f"{label:<27} {block_n:>4} {summary['cycles']:>9.0f} {summary['cycles_per_tile']:>8.0f} "
            f"{summary['cycles_per_tile'] / block_n:>7.2f} {100 * summary['tensor_core_busy']:>6.1f}% {transpose:>9.0f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--q-len", type=int, default=256)
    ap.add_argument("--kv-len", type=int, default=1024)
    args = ap.parse_args(argv)
    lat = Latency.load()
    base = dict(head_dim=args.head_dim, consumers=args.consumers)
    print(f"hd{args.head_dim}, {args.consumers} consumers, Sq {args.q_len}, Skv {args.kv_len}: block (0, 0, 0), model cycles")
    print(f"{'who transposes':<27} {'keys':>4} {'cycles':>9} {'per tile':>8} {'per key':>7} {'TC busy':>7} "
          f"{'producer SIMT/tile':>9}")
    fp8 = make_plan(Spec(dtype=FP8, **base))
    block_n = fp8.spec.block_n
    rec = record(fp8, q_len=args.q_len, kv_len=args.kv_len, blocks={(0, 0, 0)})
    src = SourceInfo(rec.source)
    print(row("producer (built)", summarize(replay(rec.ctas[0], lat, src)), block_n))
    moved = consumers_transpose(rec.ctas[0], src, block_n * fp8.head_dim_v)
    print(row("consumers (model)", summarize(replay(moved, lat, src)), block_n))
    vt = make_plan(Spec(dtype=FP8, v_layout="transposed", block_n=block_n, **base))
    rec = record(vt, q_len=args.q_len, kv_len=args.kv_len, blocks={(0, 0, 0)})
    print(row("v_layout = transposed", summarize(replay(rec.ctas[0], lat, SourceInfo(rec.source))), block_n))
    vt3 = make_plan(Spec(dtype=FP8, v_layout="transposed", block_n=block_n, **{**base, "v_stages": 3}))
    rec = record(vt3, q_len=args.q_len, kv_len=args.kv_len, blocks={(0, 0, 0)})
    print(row("v_layout = transposed, v3", summarize(replay(rec.ctas[0], lat, SourceInfo(rec.source))), block_n))
    half = make_plan(Spec(dtype="bfloat16", **base))
    rec = record(half, q_len=args.q_len, kv_len=args.kv_len, blocks={(0, 0, 0)})
    print(row("bfloat16 (no transpose)", summarize(replay(rec.ctas[0], lat, SourceInfo(rec.source))), half.spec.block_n))


if __name__ == "__main__":
    main()
