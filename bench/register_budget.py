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
from attngen.build import build

from plan_sweep import sass_max_register, spills_of

# Pairs across the edge: the last tile that fits and the first that spills, per split and mask.
PROBES = [
    dict(head_dim=64, consumers=3, block_n=128, causal=False),  # 160 of 160, no mask: fits
    dict(head_dim=64, consumers=3, block_n=128, causal=True),  # the diagonal mask tips it: 24 B spill (issue 21)
    dict(head_dim=64, consumers=3, block_n=112, causal=True),
    dict(head_dim=128, consumers=3, block_n=80, causal=True),
    dict(head_dim=128, consumers=3, block_n=96, causal=True),
    dict(head_dim=192, consumers=2, block_n=128, causal=True),
    dict(head_dim=256, consumers=2, block_n=80, causal=True),
    dict(head_dim=256, consumers=2, block_n=96, causal=True),
    dict(head_dim=96, consumers=2, block_n=176, causal=True),
    dict(head_dim=128, consumers=1, block_n=176, causal=True),
    dict(head_dim=128, consumers=2, block_n=128, causal=True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    print(f"{'probe':<48} {'cap':>4} {'estimate':>8} {'used':>4} {'spill B':>7}  verdict")
    disagreements = 0
    for fields in PROBES:
        spec = attngen.Spec(**fields, k_stages=1, v_stages=1)
        plan = attngen.make_plan(spec, check_registers=False)  # let every probe build; ptxas decides
        result = build(plan, cache_dir=args.cache_dir)
        spills = spills_of(result.report)
        need, cap = plan.consumer_regs_needed, plan.consumer_regs
        agree = (need <= cap) == (spills == 0)
        disagreements += not agree
        verdict = ("fits" if spills == 0 else "spills") + ("" if agree else "  <-- estimate disagrees")
        print(f"{plan.name:<48} {cap:>4} {need:>8} {sass_max_register(result.cubin_path):>4} {spills:>7}  {verdict}", flush=True)
    print(f"{disagreements} disagreement(s) between the estimate and ptxas")


if __name__ == "__main__":
    main()
