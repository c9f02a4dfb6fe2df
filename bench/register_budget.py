"""Calibrate the register estimate in attngen/hw.py against ptxas (no GPU needed).

Each probe sits on one side of the budget for its setmaxnreg count (240 for 1-2 consumers, 160
for 3). It is built with the estimate switched off, and ptxas says whether the consumer code
fits (0 spill bytes, no local memory, no LDL/STL) or not. The estimate (plan.regs_needed:
accumulators + CONSUMER_REG_OVERHEAD + DIAGONAL_MASK_REG_OVERHEAD + VARIANT_REG_OVERHEAD)
must accept every probe that fits and reject every probe that spills; the table shows both,
the registers the SASS names, and flags disagreements. Each probe is one cold build (~15-25 s
on 2 cores). bench/plan_sweep.py checks the same estimate on a seeded draw of whole specs.

    python bench/register_budget.py [--cache-dir DIR]
"""

import argparse

import attngen
from attngen.build.nvcc import build

from plan_sweep import sass_max_register, spills_of

# Pairs across the edge, as measured (docs/spec-reference.md, "Register budget"): the last tile
# that fits and the first that spills, per split, mask and layout. Two probes fit above the
# estimate (it is loose there: hd96 causal and hd256 non-causal; the table flags them).
C3 = dict(consumers=3, k_stages=2, v_stages=2, gqa_group=8, causal=True)
VARLEN = dict(head_dim=256, dtype="bfloat16", gqa_group=16, consumers=2, k_stages=1, v_stages=3,
              mask_mod="doc_id[b, q_idx] == doc_id[b, kv_idx]", layout="varlen")
PROBES = [
    {**C3, "head_dim": 64, "block_n": 128, "k_stages": 3, "causal": False},  # no mask: 152 in the SASS
    {**C3, "head_dim": 64, "block_n": 128, "k_stages": 3},  # the issue-21 reproducer: 24 B spill
    {**C3, "head_dim": 64, "block_n": 112},
    {**C3, "head_dim": 128, "block_n": 80},
    {**C3, "head_dim": 128, "block_n": 80, "window": (511, -1)},
    {**C3, "head_dim": 128, "block_n": 96, "gqa_group": 1, "causal": False},
    {**C3, "head_dim": 96, "block_n": 112, "gqa_group": 1},  # fits above the estimate
    dict(head_dim=192, consumers=2, block_n=128, causal=True, k_stages=1, v_stages=1),
    dict(head_dim=256, consumers=2, block_n=96, k_stages=1, v_stages=1),  # fits above the estimate
    {**VARLEN, "block_n": 48},  # the sequence's offsets spill: 8 B stack
    {**VARLEN, "block_n": 32},
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    # used: 1 + the highest register the SASS names; spill/stack: ptxas's spill-store and stack bytes
    print(f"{'probe':<64} {'cap':>4} {'estimate':>8} {'used':>4} {'spill/stack B':>13}  verdict")
    disagreements = 0
    for fields in PROBES:
        spec = attngen.Spec(**fields)
        plan = attngen.make_plan(spec, check_registers=False)  # let every probe build; ptxas decides
        result = build(plan, cache_dir=args.cache_dir)
        r = result.report
        spills = spills_of(r)
        need, cap = plan.consumer_regs_needed, plan.consumer_regs
        agree = (need <= cap) == (spills == 0)
        disagreements += not agree
        verdict = ("fits" if spills == 0 else "spills") + ("" if agree else "  <-- estimate disagrees")
        spill_stack = f"{r['spill_store_bytes']}/{r['stack_frame_bytes']}"
        print(f"{plan.name:<64} {cap:>4} {need:>8} {sass_max_register(result.cubin_path):>4} {spill_stack:>13}  {verdict}", flush=True)
    print(f"{disagreements} disagreement(s) between the estimate and ptxas")


if __name__ == "__main__":
    main()
