"""Single-tile against persistent scheduling on a model of 132 SMs (attngen.timeline.multi_sm,
docs/perf.md "A multi-SM model"): a MODEL, not a GPU figure, and no test asserts its output.

    PYTHONPATH=. python bench/multi_sm.py
    PYTHONPATH=. python bench/multi_sm.py --handover 700 --latency my.toml

A tile's cycles: the timeline's fit (one block per KV length, emulated and replayed; printed with
its worst residual). Shapes as FlashAttention's benchmark: batch = 16384 / seqlen, 16 heads,
hd128 fp16. The varlen batch: --varlen sequences (default 248, the batch FA3's sort was timed on)
of lengths drawn log-uniformly in [128, 8192] from a fixed seed, causal.

--handover: cycles a persistent tile pays to get its index (default 48: an mbarrier arrive + wait
and a named barrier from latency.toml, FA3's producer fetching the next index ahead so the
atomic's round trip is hidden; 700 charges a full global round trip, unhidden, every tile).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from attngen.hw import DTYPES, SM_COUNT
from attngen.kernels.common.schedulers import section_heads
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import Spec
from attngen.timeline.latency import Latency
from attngen.timeline.multi_sm import (fit_tile_cost, list_schedule, persistent_order, row_tile_visits,
                                       single_tile_order, static_schedule, varlen_pair_order)

TOKENS, HEADS = 16384, 16
PUBLISHED = {  # H200, causal hd128, TFLOP/s (flash-attention PR #2754)
    1024: {"FA3 persistent": 511, "FA4 single-tile": 414, "FA4 static LPT": 480},
    4096: {"FA3 persistent": 690, "FA4 single-tile": 610, "FA4 static LPT": 590},
    16384: {"FA3 persistent": 695, "FA4 single-tile": 623, "FA4 static LPT": 575},
}


class Problem:
    """One kernel launch's row tiles: per sequence, per head, the row tile's cycles."""

    def __init__(self, plan, cost, seqlens, heads):
        s = plan.spec
        self.plan, self.seqlens, self.heads = plan, seqlens, heads
        self.visits = [row_tile_visits(n, n, s.block_m, s.block_n, s.causal) for n in seqlens]
        self.m_blocks = [len(v) for v in self.visits]
        per_key = (s.head_dim + (s.head_dim_v or s.head_dim)) * DTYPES[s.dtype].bytes
        self.sections = [section_heads(n, per_key, 1) for n in seqlens]
        self.cost = cost

    def costs(self, order) -> list[float]:
        return [0.0 if m is None else self.cost(self.visits[b][m]) for b, _, m in order]

    def flops(self) -> float:
        s = self.plan.spec
        return sum(4 * n * n * s.head_dim * self.heads / (2 if s.causal else 1) for n in self.seqlens)


def makespans(p: Problem, handover: float, sequence_order=None, block_cycles: float = 0.0) -> dict:
    """Each policy's makespan; `block_cycles`: a cost each single-tile block pays on top of its tile."""
    single = list_schedule(p.costs(single_tile_order(p.m_blocks, p.heads)), SM_COUNT, block_cycles).makespan
    longest_first = p.plan.spec.causal  # FA3's rule: longest first for causal (and local, not run here)
    lpt = p.costs(persistent_order(p.m_blocks, p.heads, p.sections, longest_first, sequence_order))
    plain = p.costs(persistent_order(p.m_blocks, p.heads, p.sections, False, sequence_order))
    return {"single": single, "persistent": list_schedule(lpt, SM_COUNT, handover).makespan,
            "persistent, plain order": list_schedule(plain, SM_COUNT, handover).makespan,
            "static round-robin": static_schedule(lpt, SM_COUNT, handover).makespan}


def implied_block_cycles(p: Problem, handover: float, published: float) -> float:
    """The per-block cost single-tile blocks would need (launch, a prologue no earlier tile hides)
    for the model's static-LPT / single ratio to reach FA4's published one (bisection; 0 if it does)."""
    def ratio(extra):
        ms = makespans(p, handover, block_cycles=extra)
        return ms["single"] / ms["static round-robin"]
    lo, hi = 0.0, 1e5
    if ratio(lo) >= published:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < published else (lo, mid)
    return hi


def sort_microseconds(lengths: list[int], repeat: int = 200) -> float:
    """The host's sort of the sequences by length, longest first (best of `repeat`)."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def pair_sort_milliseconds(p: Problem, repeat: int = 5) -> tuple[list, float]:
    """The varlen persistent launcher's tile list (varlen_pair_order: schedulers.varlen_pairs on CPU
    torch tensors, expanded to (sequence, head, row tile); best of `repeat`) and its order."""
    best, s = math.inf, p.plan.spec
    for _ in range(repeat):
        t0 = time.perf_counter()
        order = varlen_pair_order(p.seqlens, p.seqlens, p.heads, s.block_m, s.block_n, s.causal)
        best = min(best, time.perf_counter() - t0)
    return order, best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handover", type=float, default=None, help="cycles per persistent tile (default: see above)")
    ap.add_argument("--varlen", type=int, default=248)
    ap.add_argument("--latency", default=None)
    args = ap.parse_args(argv)
    lat = Latency.load(args.latency)
    b = lat.params["barrier"]
    handover = args.handover if args.handover is not None else \
        b["mbarrier_arrive_cycles"] + b["mbarrier_wait_cycles"] + b["named_barrier_cycles"]
    print(f"{SM_COUNT} SMs, {lat.clock_ghz} GHz, persistent handover {handover:g} cycles per tile; a model, not a GPU figure")
    cols = ["single", "persistent", "persistent, plain order", "static round-robin"]
    for causal in (True, False):
        plan = make_plan(Spec(head_dim=128, causal=causal))
        cost, resid = fit_tile_cost(plan, lat)
        print(f"\n{plan.name}: tile = {cost.fixed:.0f} + {cost.per_visit:.0f} x visits cycles (fit's worst residual {resid:.2%})")
        head = "  ".join(f"{c:>24}" for c in cols[1:])
        print(f"{'seqlen':>6} {'batch':>5} {'tiles':>6}  {head}   model TFLOP/s (single / persistent)")
        for n in (1024, 4096, 16384):
            p = Problem(plan, cost, [n] * (TOKENS // n), HEADS)
            ms = makespans(p, handover)
            ratios = "  ".join(f"{ms['single'] / ms[c]:>24.3f}" for c in cols[1:])
            tf = [p.flops() / (ms[c] / (lat.clock_ghz * 1e9)) / 1e12 for c in ("single", "persistent")]
            print(f"{n:6d} {TOKENS // n:5d} {sum(p.m_blocks) * HEADS:6d}  {ratios}   {tf[0]:.0f} / {tf[1]:.0f}")
    print("(columns: single-tile makespan / that schedule's makespan; > 1: faster than single-tile)")

    print("\npublished, H200 causal hd128 (flash-attention PR #2754), ratios to FA4 single-tile:")
    for n, row in PUBLISHED.items():
        print(f"{n:6d}  " + "  ".join(f"{k} {v} ({v / row['FA4 single-tile']:.3f})" for k, v in row.items()))

    plan = make_plan(Spec(head_dim=128, causal=True))
    cost, _ = fit_tile_cost(plan, lat)
    print("\nthe per-block cost single-tile would need for the model's static LPT / single to match FA4's:")
    for n, row in PUBLISHED.items():
        extra = implied_block_cycles(Problem(plan, cost, [n] * (TOKENS // n), HEADS), handover,
                                     row["FA4 static LPT"] / row["FA4 single-tile"])
        print(f"{n:6d}  {extra:6.0f} cycles ({extra / (lat.clock_ghz * 1e3):.2f} us) per block")

    rng = random.Random(0)
    batches = {f"{args.varlen} sequences": [round(128 * 64 ** rng.random()) for _ in range(args.varlen)]}
    budget = []
    while sum(budget) < TOKENS:
        budget.append(min(round(128 * 64 ** rng.random()), TOKENS - sum(budget)))
    batches[f"a {TOKENS}-token batch"] = budget
    print(f"\nvarlen, causal hd128, {HEADS} heads, lengths drawn log-uniformly in [128, 8192] (seed 0):")
    for what, lengths in batches.items():
        p = Problem(plan, cost, lengths, HEADS)
        by_length = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
        ms, unsorted = makespans(p, handover, by_length), makespans(p, handover, list(range(len(lengths))))
        print(f"  {what} ({len(lengths)} of {min(lengths)}..{max(lengths)}, {sum(lengths)} tokens): persistent, "
              f"sorted longest first {ms['single'] / ms['persistent']:.3f}; unsorted {ms['single'] / unsorted['persistent']:.3f}; "
              f"sorted, plain order {ms['single'] / ms['persistent, plain order']:.3f}")
        print(f"    the host's sort of {len(lengths)} lengths: {sort_microseconds(lengths):.1f} us on this machine's CPU "
              f"(Python sorted, best of 200; a CPU figure, not the GPU's); the kernel: "
              f"{ms['persistent'] / (lat.clock_ghz * 1e3):.0f} us in the model")
        pairs, pair_ms = pair_sort_milliseconds(p)
        kernel = list_schedule(p.costs(pairs), SM_COUNT, handover).makespan
        print(f"    the kernel's order, (sequence, row tile) pairs longest first, heads innermost: {ms['single'] / kernel:.3f}; "
              f"its builder (schedulers.varlen_pairs, {len(pairs)} tiles, with the expansion to tuples): {pair_ms:.1f} ms "
              f"on this machine's CPU (bench/varlen_order.py times the builder alone) "
              f"(best of 5; a CPU figure, not the GPU's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
