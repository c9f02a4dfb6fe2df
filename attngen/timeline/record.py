"""Run an emitted kernel on the CPU model and record its events (the blocks asked for)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from attngen.emulator import blas
from attngen.emulator.driver import Runtime, Stats, _prepare, stored_v
from attngen.timeline.trace import Recorder


@dataclasses.dataclass
class Recording:
    plan: object
    source: str
    grid: tuple
    ctas: list  # CTATrace per recorded block, in launch order
    seconds: float
    stats: Stats


def grid_of(plan, dims) -> tuple:
    """The launch grid of the emitted kernel (x: query blocks, y: heads, z: batch)."""
    spec = plan.spec
    return (-(-dims["q_len"] // spec.block_m), dims["heads"], dims["batch"])


def linear(index, grid) -> int:
    x, y, z = index
    return x + grid[0] * (y + grid[1] * z)


def unlinear(n, grid) -> tuple:
    return (n % grid[0], (n // grid[0]) % grid[1], n // (grid[0] * grid[1]))


def sample_blocks(grid, chosen: int | None, limit: int) -> set | None:
    """Every block when there are at most `limit`, else `limit` spread evenly plus the chosen one."""
    total = grid[0] * grid[1] * grid[2]
    if total <= limit:
        return None
    picks = {round(i * (total - 1) / (limit - 1)) for i in range(limit)}
    if chosen is not None:
        picks.add(chosen)
    return {unlinear(p, grid) for p in picks}


def record(plan, *, batch=1, kv_heads=1, q_len=128, kv_len=128, seed=0, policy="random", source=None,
           filename=None, blocks="auto", limit=64, tensors=None) -> Recording:
    """Emulate the plan's kernel (or `source`) on random inputs and record the blocks asked for (a set of
    (x, y, z), or "auto": every block up to `limit`, else `limit` spread evenly). `tensors`: the
    call-time tensors by name (a mask_mod's, a block mask's lists), checked as the emulator checks them."""
    from attngen.reference.forward import random_inputs
    from attngen.kernels.fwd.render import render_source

    spec = plan.spec
    heads = kv_heads * spec.gqa_group
    q, k, v = random_inputs(spec.dtype, spec.head_dim, batch, heads, kv_heads, q_len, kv_len, seed)
    v = stored_v(spec, v)  # fp8's v_layout = "transposed": [batch, kv_heads, head_dim_v, kv_len]
    inputs, dims, _ = _prepare(plan, q, k, v, tensors)  # a bshd, dense kernel: no serving call
    grid = grid_of(plan, dims)
    wanted = sample_blocks(grid, None, limit) if blocks == "auto" else blocks
    text = render_source(plan) if source is None else source
    rt = Runtime(text, filename or f"<emitted {plan.name}>", dims)
    rec = Recorder(blocks=wanted).attach(rt)
    stats = Stats()
    t0 = time.perf_counter()
    with blas.single_threaded(), np.errstate(all="ignore"):
        rt.run(inputs, seed=seed, policy=policy, stats=stats, proxy_fences=True)
    return Recording(plan, text, rec.grid or grid, rec.ctas, time.perf_counter() - t0, stats)
