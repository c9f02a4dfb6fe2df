"""What FA3's door pays for a strided q, k, v (`q, k, v = qkv.unbind(2)`): one packed copy each
(attngen.interfaces.flash_attn_interface._packed; docs/interfaces.md, "Strided inputs"). Figures only.

    python bench/bench_strided_copy.py [--repeat N] [--device cpu|cuda]

Per shape: the bytes the copies move (read and written), the copies' median time, and the
attention call's on the same device: on CUDA the compiled kernel at every shape, on the CPU
(the CPU model) at the smallest shape only, the larger ones being minutes per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attngen.interfaces.flash_attn_interface import flash_attn_func

SHAPES = [(1, 128, 2, 64), (1, 2048, 16, 128), (2, 4096, 32, 128)]  # (batch, seqlen, nheads, headdim)


def median_seconds(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"device {args.device}, float16, q, k, v = qkv.unbind(2), median of {args.repeat}")
    print(f"{'B x S x H x D':>22} {'copied MB':>10} {'copy ms':>9} {'attention ms':>13} {'copy/attention':>15}")
    for shape in SHAPES:
        b, s, h, d = shape
        qkv = torch.randn(b, s, 3, h, d, dtype=torch.float16, device=args.device)
        q, k, v = qkv.unbind(2)
        copied = 2 * 3 * q.numel() * q.element_size()  # each element read once and written once
        copy = median_seconds(lambda: [t.contiguous() for t in (q, k, v)], args.repeat, sync)
        attend = None
        if args.device == "cuda" or shape == SHAPES[0]:
            packed = [t.contiguous() for t in (q, k, v)]
            flash_attn_func(*packed)  # the build and the first call out of the timing
            attend = median_seconds(lambda: flash_attn_func(*packed), 1 if args.device == "cpu" else args.repeat, sync)
        ratio = f"{copy / attend:.2%}" if attend else "-"
        shown = f"{attend * 1e3:.2f}" if attend else "-"
        print(f"{' x '.join(map(str, shape)):>22} {copied / 1e6:>10.1f} {copy * 1e3:>9.3f} {shown:>13} {ratio:>15}")


if __name__ == "__main__":
    main()
