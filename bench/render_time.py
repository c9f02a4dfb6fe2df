"""Rendering time per spec: plan + render, for every preset and a few variant-heavy specs.

    PYTHONPATH=. python bench/render_time.py [repeats]

Prints the median milliseconds per spec (the target is under 20 ms; no test asserts timings).
"""

import statistics
import sys
import time
from pathlib import Path

import attngen
from attngen.kernels.common.emit import environment

ROOT = Path(__file__).resolve().parent.parent
EXTRA = {
    "everything": attngen.Spec(causal=True, window=[300, -1], softcap=30.0, alibi=True, sinks=True, lse=True, head_dim=64,
                               head_dim_v=128, score_mod="score + rel[h, q_idx - kv_idx + 255] * (1 + s[h])",
                               mask_mod="doc[b, q_idx] == doc[b, kv_idx] and kv_idx != 3"),
    "window both edges, 3 consumers": attngen.Spec(window=[37, 21], consumers=3, head_dim=64, lse=True),
}


def main(repeats: int = 50) -> None:
    environment().get_template("fa3_fwd.py.j2")  # template parsing is once per process: not per spec
    specs = {p.stem: attngen.load_spec(p) for p in sorted((ROOT / "examples").glob("*.toml"))} | EXTRA
    worst = 0.0
    for name, spec in specs.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            attngen.render_source(attngen.make_plan(spec))
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        worst = max(worst, ms)
        print(f"{name:40s} {ms:7.2f} ms  (median of {repeats}, plan + render)")
    print(f"{'slowest':40s} {worst:7.2f} ms  (target: under 20 ms per spec)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
