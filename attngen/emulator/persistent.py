"""The CPU model's side of a persistent kernel (spec.scheduler = "persistent", issue 30): its
launcher's state and arguments, and the check that every tile ran exactly once.

A persistent kernel takes, after softmax_scale, the tile counters, the call's epoch, the number
of blocks (one per SM) and the L2 section (kernels/common/schedulers.py). `TileCounters` is the
launcher's state as on the GPU: the int32 counters persist from call to call (the kernel zeroes
the ones the next calls use) and the epoch counts calls, crashed ones included. The driver runs
the blocks concurrently (Runtime.run(concurrent=True)), so they race for tiles at the counter.
"""

from __future__ import annotations

import collections

import numpy as np

from attngen.emulator.errors import KernelError
from attngen.hw import SM_COUNT
from attngen.kernels.common.schedulers import COUNTER_SLOTS, section_of, varlen_tile_list


class TileCounters:
    """A launcher's tile counters (zeroed once, at allocation) and its count of calls."""

    def __init__(self):
        self.slots = np.zeros(COUNTER_SLOTS, np.int32)
        self.epoch = 0

    def take_epoch(self) -> int:
        """The next call's epoch, counted before its launch: a call that dies still used its number."""
        epoch, self.epoch = self.epoch, (self.epoch + 1) % COUNTER_SLOTS  # only its slot matters (run/persistent.py: the same)
        return epoch


DEFAULT_COUNTERS = TileCounters()  # the CPU model's launcher, as the GPU runtime keeps one per device


def total_tiles(plan, dims: dict) -> int:
    if "tile_list" in dims:  # per sequence (varlen, paged): the list's real pairs (its last row), each head's
        return int(dims["tile_list"][-1, 0]) * dims["heads"]
    return -(-dims["q_len"] // plan.spec.block_m) * dims["heads"] * dims["batch"]


def varlen_tiles(plan, dims: dict, arrays: dict) -> np.ndarray:
    """A per-sequence (varlen, paged) persistent kernel's tile list: schedulers.varlen_tile_list on CPU
    torch tensors of the call's lengths (cu_seqlens, seqused_k: the GPU launcher's builder), as numpy;
    kept in `dims` ("tile_list", "tile_rows") for the launch and its check."""
    import torch

    named = {n: torch.from_numpy(np.asarray(arrays[n], np.int32)) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")
             if arrays.get(n) is not None}
    q_shape = (dims["total_q"],) if plan.varlen else (dims["batch"], dims["q_len"])
    listed = varlen_tile_list(plan, named, q_shape).numpy()
    dims["tile_list"], dims["tile_rows"] = listed, len(listed)
    return listed


def backward_varlen_lists(bp, dims: dict, cu_seqlens_q, cu_seqlens_k) -> None:
    """A varlen persistent backward's tile lists, as the GPU launcher builds them (bwd/persistent.py:
    varlen_main_list, varlen_dq_list, on CPU torch tensors), into `dims` ("tile_list", "tile_rows",
    and the deterministic dq kernel's "dq_tile_list", "dq_tile_rows") for the launches and their checks."""
    import torch

    from attngen.kernels.bwd.persistent import varlen_dq_list, varlen_main_list

    cu = [torch.from_numpy(np.asarray(c, np.int32)) for c in (cu_seqlens_q, cu_seqlens_k)]
    dims["cu_seqlens_q"], dims["cu_seqlens_k"] = cu_seqlens_q, cu_seqlens_k
    dims["tile_list"] = varlen_main_list(bp, *cu, dims["total_k"]).numpy()
    dims["tile_rows"] = len(dims["tile_list"])
    if bp.deterministic:
        dims["dq_tile_list"] = varlen_dq_list(bp, *cu, dims["total_q"]).numpy()
        dims["dq_tile_rows"] = len(dims["dq_tile_list"])


def check_num_sms(num_sms, plan, dims: dict, tiles: int | None = None) -> int:
    """The blocks of a persistent launch: `num_sms`, or (None) the SMs of an H100/H200 or fewer where
    there are fewer tiles (the blocks past them would only take an end mark). `tiles`: the kernel's
    tile count (None: the forward's)."""
    from attngen.reference.forward import InputError

    if plan.spec.scheduler != "persistent":
        if num_sms is not None:
            raise InputError("num_sms", repr(num_sms), 'None: the spec\'s kernel launches a block per tile '
                             '(num_sms is a persistent kernel\'s: scheduler = "persistent")')
        return 0
    if num_sms is None:
        return max(1, min(SM_COUNT, total_tiles(plan, dims) if tiles is None else tiles))
    if isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer)) or not 1 <= num_sms <= SM_COUNT:
        raise InputError("num_sms", repr(num_sms), f"an integer from 1 to {SM_COUNT} (the blocks: one per SM)")
    return int(num_sms)


def launch_inputs(plan, dims: dict, num_sms: int, counters: TileCounters, section: int | None = None) -> list:
    """The kernel's arguments after softmax_scale: the counters (the driver writes them back after the
    run, crashed or not, through `keep`), this call's epoch, the blocks and the L2 section (None: the
    forward's)."""
    if "tile_list" in dims:  # per sequence (varlen, paged): the sorted tile list in the L2 section's place
        return [counters.slots, counters.take_epoch(), num_sms, dims["tile_list"]]
    return [counters.slots, counters.take_epoch(), num_sms, section_of(plan.spec, dims["kv_len"]) if section is None else section]


def keep(counters: TileCounters, tensors: dict) -> None:
    """The counters as the launch left them (global memory outlives a call, a failed one too)."""
    if "tile_counter" in tensors:
        counters.slots[:] = tensors["tile_counter"]


def check_each_tile_once(plan, dims: dict, q_boxes: list) -> None:
    """Every (batch, row tile, head) loaded by exactly one block, once per consumer warpgroup: a
    tile handed out twice (or skipped) is a KernelError naming it, whatever the numbers say."""
    wg_rows = plan.wg_rows
    if plan.varlen:  # packed rows (first row, head, 0), each sequence's row tiles from its start
        each_once(packed_row_tiles(dims["cu_seqlens_q"], dims["heads"], plan.spec.block_m, plan.spec.consumers),
                  collections.Counter(tuple(box) for box in q_boxes),
                  lambda row, h, _: f"Q rows {row}..{row + wg_rows - 1} (packed), head {h}")
        return
    want = collections.Counter((b, m * plan.spec.block_m + g * wg_rows, h, 0)
                               for b in range(dims["batch"]) for h in range(dims["heads"])
                               for m in range(-(-dims["q_len"] // plan.spec.block_m)) for g in range(plan.spec.consumers))
    each_once(want, collections.Counter(tuple(box) for box in q_boxes),
              lambda b, row, h, _: f"Q rows {row}..{row + wg_rows - 1} of batch {b}, head {h}")


def each_once(want: collections.Counter, got: collections.Counter, what) -> None:
    """Tile loads counted against the schedule's: a KernelError naming the first that differs
    (`what(*key)` says which tile)."""
    for key in sorted(set(want) | set(got)):
        if got[key] != want[key]:
            raise KernelError(f"KERNEL ERROR: the persistent schedule loaded {what(*key)} {got[key]} time(s), expected "
                              f"{want[key]}: the schedule hands out each tile exactly once (a tile run twice, or skipped)")


def check_each_kv_tile_once(bp, dims: dict, k_boxes: list) -> None:
    """The backward's main kernel: every (batch, KV tile, KV head) loaded once per consumer warpgroup
    by each block that owns it (one per query head of the group, one for a grouped deterministic tile)."""
    owners = 1 if bp.deterministic else bp.spec.gqa_group
    if bp.forward.varlen:  # each load's first packed key (a slice past a sequence's end reads the next one's)
        cu_k = dims["cu_seqlens_k"]
        slices = [0] * bp.consumers if bp.columns else [g * bp.wg_keys for g in range(bp.consumers)]
        want = collections.Counter((int(cu_k[b]) + t * bp.block_n + s, h) for b in range(len(cu_k) - 1)
                                   for t in range(-(-int(cu_k[b + 1] - cu_k[b]) // bp.block_n))
                                   for h in range(dims["kv_heads"]) for s in slices for _ in range(owners))
        each_once(want, collections.Counter((key, h) for key, h, _ in k_boxes),
                  lambda key, h: f"K keys {key}.. (packed; a KV tile's load), KV head {h}")
        return
    want = collections.Counter({(b, t, h): bp.consumers * owners for b in range(dims["batch"])
                                for t in range(-(-dims["kv_len"] // bp.block_n)) for h in range(dims["kv_heads"])})
    got = collections.Counter((b, key // bp.block_n, h) for b, key, h, _ in k_boxes)
    each_once(want, got, lambda b, t, h: f"K tile {t} ({bp.block_n} keys) of batch {b}, KV head {h}")


def check_each_dq_tile_once(bp, dims: dict, q_boxes: list) -> None:
    """The deterministic dq kernel: every (batch, rows, head) loaded once per consumer warpgroup."""
    wg_rows = bp.dq_block_m // bp.consumers
    got = collections.Counter(tuple(box) for box in q_boxes)
    if bp.forward.varlen:  # packed rows
        each_once(packed_row_tiles(dims["cu_seqlens_q"], dims["heads"], bp.dq_block_m, bp.consumers), got,
                  lambda row, h, _: f"dq's Q rows {row}..{row + wg_rows - 1} (packed), head {h}")
        return
    want = collections.Counter((b, m * bp.dq_block_m + g * wg_rows, h, 0) for b in range(dims["batch"])
                               for h in range(dims["heads"]) for m in range(-(-dims["q_len"] // bp.dq_block_m))
                               for g in range(bp.consumers))
    each_once(want, got, lambda b, row, h, _: f"dq's Q rows {row}..{row + wg_rows - 1} of batch {b}, head {h}")


def packed_row_tiles(cu_q, heads: int, block_m: int, consumers: int) -> collections.Counter:
    """A varlen kernel's Q loads, one per consumer warpgroup of each row tile: (first packed row, head,
    0), each sequence's row tiles from its start."""
    wg_rows = block_m // consumers
    return collections.Counter((int(cu_q[b]) + m * block_m + g * wg_rows, h, 0)
                               for b in range(len(cu_q) - 1) for h in range(heads)
                               for m in range(-(-int(cu_q[b + 1] - cu_q[b]) // block_m)) for g in range(consumers))
