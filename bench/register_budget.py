"""Calibrate the register estimate in attngen/hw.py against ptxas (no GPU needed).

For each (head_dim, consumers, block_n) probe, the kernel is built with the estimate
switched off, and ptxas says whether the consumer code fits its setmaxnreg count
(0 spill bytes) or not. The estimate D/2 + 3*block_n/4 + CONSUMER_REG_OVERHEAD[consumers]
must accept every probe that fits and reject every probe that spills; the table shows
both and flags disagreements. Each probe is one cold build (~15-25 s on 2 cores).

    python bench/register_budget.py [--cache-dir DIR]
"""

import argparse

import attngen
from attngen import hw
from attngen.build import build

# Probes on both sides of the budget for each setmaxnreg count (240 for 1-2 consumers, 160 for 3).
PROBES = [(64, 3, 128), (128, 3, 80), (128, 3, 96), (192, 2, 128), (256, 2, 80), (256, 2, 96),
          (96, 2, 176), (128, 1, 176), (128, 2, 128)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    print(f"{'head_dim':>8} {'consumers':>9} {'block_n':>7} {'regs':>4} {'estimate':>8} {'spill B':>7}  verdict")
    disagreements = 0
    for head_dim, consumers, block_n in PROBES:
        spec = attngen.Spec(head_dim=head_dim, consumers=consumers, block_n=block_n, k_stages=1, v_stages=1, causal=True)
        plan = attngen.make_plan(spec, check_registers=False)  # let every probe build; ptxas decides
        report = build(plan, cache_dir=args.cache_dir).report
        regs = hw.REG_SPLIT[consumers][1]
        need = plan.consumer_regs_needed
        spills = report["spill_store_bytes"] + report["stack_frame_bytes"]
        agree = (need <= regs) == (spills == 0)
        disagreements += not agree
        verdict = ("fits" if spills == 0 else "spills") + ("" if agree else "  <-- estimate disagrees")
        print(f"{head_dim:>8} {consumers:>9} {block_n:>7} {regs:>4} {need:>8} {spills:>7}  {verdict}", flush=True)
    print(f"{disagreements} disagreement(s) between the estimate and ptxas")


if __name__ == "__main__":
    main()
