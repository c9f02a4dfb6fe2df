"""How attngen times a kernel on a GPU: one method for the benchmark and for `attngen tune`.

CUDA events around each launch, warm-up first, the median of the timed runs; a sleep kernel
queued before each start event keeps the host's launch overhead out of the interval; the
caller rotates over input sets that together exceed the L2 several times, so no run finds
its inputs in the cache (docs/gpu.md).
"""

from __future__ import annotations

import math
import statistics

SLEEP_CYCLES = 400_000  # about 0.2 ms at 1.98 GHz: longer than the host needs to queue one launch
ROTATE_L2 = 3  # input sets together exceed the L2 this many times
MAX_SETS = 64


def n_sets(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate over so that together they exceed the L2 ROTATE_L2 times."""
    return max(2, min(MAX_SETS, math.ceil(ROTATE_L2 * l2_bytes / set_bytes)))


def time_launches(fn, n_sets: int, warmup: int, reps: int) -> tuple[float, float]:
    """Median and spread (max - min over the middle half) of one launch fn(set index), in seconds."""
    import torch

    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for r, (start, end) in enumerate(events):
        if sleep is not None:
            sleep(SLEEP_CYCLES)  # the GPU is busy while the host queues start, launch, end
        start.record()
        fn((warmup + r) % n_sets)
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    mid = ms[len(ms) // 4: len(ms) - len(ms) // 4] or ms
    return statistics.median(ms) / 1e3, (mid[-1] - mid[0]) / 1e3
