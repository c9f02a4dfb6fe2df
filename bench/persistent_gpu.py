"""Single-tile against persistent forward kernels on an sm_90 GPU, in one run (issue 30's rows):
hd128 fp16 causal at 1k, 4k and 16k (16k tokens a row, 16 heads), and non-causal at 4k.

    python bench/persistent_gpu.py

Nothing is written anywhere: a figure goes into the docs only from a run that printed it.
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench/persistent_gpu.py needs a compute capability 9.0 GPU (H100/H200)", file=sys.stderr)
        return 2
    import attngen
    from attngen.kernels.common.plan import Shape, tflops
    from attngen.kernels.fwd.plan import make_plan
    from attngen.run import forward
    from attngen.run.gputime import time_launches

    print(f"{'case':24} {'single':>10} {'persistent':>11} {'ratio':>6}  ({torch.cuda.get_device_name()})")
    for causal, seq in [(True, 1024), (True, 4096), (True, 16384), (False, 4096)]:
        persistent = make_plan(attngen.Spec(causal=causal, scheduler="persistent"))
        single = make_plan(attngen.Spec(causal=causal))
        batch, heads = max(1, 16384 // seq), 16
        q, k, v = (torch.randn(batch, seq, heads, 128, device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        rate = {}
        for name, plan in (("single", single), ("persistent", persistent)):
            kernel = forward.compile_kernel(plan)
            seconds, _ = time_launches(lambda i: kernel(q, k, v, out=out, check=False), 1, 10, 30)
            rate[name] = tflops(Shape(batch, heads, heads, seq, seq), 128, causal, seconds)
        case = f"hd128 {'causal' if causal else 'full'} {seq}"
        print(f"{case:24} {rate['single']:10.0f} {rate['persistent']:11.0f} {rate['persistent'] / rate['single']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
