"""The GPU launcher's side of a persistent kernel (spec.scheduler = "persistent", issue 30).

Such a kernel takes, after softmax_scale, its tile counters (int32, COUNTER_SLOTS of them), the
call's epoch, the grid (the device's SM count) and the L2 section (schedulers.section_of). The
counters live on the device from call to call, one set per (device, stream): the kernel zeroes
the slots the next two calls take from, so no call resets anything from the host and none waits
for the device. The epoch counts calls modulo COUNTER_SLOTS (only its slot matters).
"""

from __future__ import annotations

from attngen.kernels.bwd.persistent import varlen_dq_list, varlen_main_list
from attngen.kernels.common.layouts import layout_of
from attngen.kernels.common.schedulers import COUNTER_SLOTS, section_of, varlen_tile_list
from attngen.run.checks import _torch

_counters: dict = {}  # (device index, stream handle) -> [counters tensor, next epoch]
_sm_counts: dict = {}  # device index -> its SM count


def launch_args(plan, q, k, section: int | None = None) -> list:
    """The arguments a persistent kernel takes after softmax_scale (none for a single-tile one).
    `section`: the kernel's L2 section (None: the forward's, schedulers.section_of). The backward's
    main kernel shares the stream's counters: its calls and the forward's run in stream order."""
    if plan.spec.scheduler != "persistent":
        return []
    torch = _torch()
    device = q.device
    index = _index(q)
    key = (index, torch.cuda.current_stream(device).cuda_stream)
    state = _counters.get(key)
    if state is None:  # zeroed once; from here on each call zeroes the slots of the calls after it
        state = _counters[key] = [torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device), 0]
    epoch = state[1]
    state[1] = (epoch + 1) % COUNTER_SLOTS
    if layout_of(plan).per_sequence:  # varlen or paged: the sorted tile list in the L2 section's place (varlen_launch_args)
        return [state[0], epoch, sm_count(q)]
    return [state[0], epoch] + block_args(plan, q, section_of(plan.spec, k.shape[1]) if section is None else section)


def varlen_launch_args(plan, call, q, k) -> list:
    """A per-sequence (varlen or paged) persistent forward's arguments after softmax_scale: the counters,
    the epoch, the grid and the tile list, built on the lengths' device (cu_seqlens, seqused_k) by
    schedulers.varlen_tile_list: torch ops sized by q's shape, so nothing is copied to the host and
    the launch waits for nothing."""
    if plan.spec.scheduler != "persistent":
        return []
    listed = varlen_tile_list(plan, dict(zip(call.arg_names, call.args)), q.shape)
    return launch_args(plan, q, k) + [listed.to(q.device)]


def varlen_backward_args(bp, call, q, k) -> tuple[list, list]:
    """A varlen persistent backward's arguments after softmax_scale, built on cu_seqlens' device (no host
    read): the main kernel's (the counters, the epoch, the grid and its (sequence, KV tile) list) and the
    deterministic dq kernel's (the grid and its (sequence, Q tile) list); none for a single-tile one."""
    if bp.spec.scheduler != "persistent":
        return [], []
    named = dict(zip(call.arg_names, call.args))
    cu = named["cu_seqlens_q"], named["cu_seqlens_k"]
    main = launch_args(bp.forward, q, k) + [varlen_main_list(bp, *cu, k.shape[0]).to(q.device)]
    return main, [sm_count(q), varlen_dq_list(bp, *cu, q.shape[0]).to(q.device)] if bp.deterministic else []


def block_args(plan, q, section: int) -> list:
    """A persistent kernel's grid and L2 section (the deterministic dq kernel's fixed order takes no
    counter); none for a single-tile one."""
    if plan.spec.scheduler != "persistent":
        return []
    return [sm_count(q), section]


def sm_count(q) -> int:
    """The SMs of q's device: a persistent kernel's grid."""
    index = _index(q)
    if index not in _sm_counts:
        _sm_counts[index] = _torch().cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def _index(q) -> int:
    return q.device.index if q.device.index is not None else _torch().cuda.current_device()
