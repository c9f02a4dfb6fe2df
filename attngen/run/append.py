"""The KV-cache append (flash_attn_with_kvcache's k=, v=; docs/interfaces.md): the host side of its
ABI (`check_append` -> `AppendCall`, `cache_slots`; no GPU, no torch import, as run/serving.py's
calls), the compiled append kernel of one cache kind, its GPU checks and `append_kv`, which writes
new keys into a paged cache in place.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from attngen import hw
from attngen.kernels.append.plan import APPEND_ROWS, AppendPlan, append_plan
from attngen.kernels.append.render import render_append_source
from attngen.reference.forward import InputError
from attngen.run.checks import _detach, _torch, check_device
from attngen.run.entries import KernelBuildError, _built_entry, _failure_message, _load_entry, _once, runtime_entry
from attngen.run.inputs import check_append_tensors, check_contiguous, check_kind, dtype_name
from attngen.run.serving import _host, _int_tensor, _shape


# -- the call (the host side of the ABI) ------------------------------------------------------------
def cache_slots(block_table_row: np.ndarray, positions: np.ndarray, page_size: int) -> tuple:
    """(pages, rows) of key positions of one sequence in a paged cache, the ABI's rule (key t of
    sequence b is row t % page_size of page block_table[b, t // page_size]); the host side of
    render.cache_slot, for checks (disjoint appends, ownership)."""
    positions = np.asarray(positions, np.int64)
    return np.asarray(block_table_row)[positions // page_size].astype(np.int64), positions % page_size


@dataclasses.dataclass(frozen=True)
class AppendCall:
    """One validated append: k, v [batch, seqlen_new, kv_heads, D(v)] into a paged cache."""

    batch: int
    seqlen_new: int
    kv_heads: int
    page_size: int
    head_dim: int
    head_dim_v: int
    dims: dict  # the append kernel's T.dynamic extents
    cache_seqlens: np.ndarray  # int64 (batch,): keys before the append
    block_table: np.ndarray  # int32 host copy

    @property
    def seqused_k(self) -> np.ndarray:
        """Each sequence's keys after the append: what the attention then reads."""
        return self.cache_seqlens + self.seqlen_new

    @property
    def empty(self) -> bool:
        return self.seqlen_new == 0

    @property
    def grid(self) -> tuple:
        return (-(-self.seqlen_new // APPEND_ROWS), self.kv_heads, self.batch)

    def slots(self) -> tuple:
        """(pages, rows) of every appended key, sequence by sequence: the cache rows the append writes."""
        positions = self.cache_seqlens[:, None] + np.arange(self.seqlen_new)[None, :]
        got = [cache_slots(self.block_table[b], positions[b], self.page_size) for b in range(self.batch)]
        return (np.concatenate([p for p, _ in got]), np.concatenate([r for _, r in got]))


def check_append(k_cache, v_cache, k, v, block_table, cache_seqlens) -> AppendCall:
    """Validate an append into a paged cache k_cache/v_cache [num_pages, page_size, kv_heads, D(v)]
    of k, v [batch, seqlen_new, kv_heads, D(v)] at cache_seqlens[b] (int32 [batch]) through
    block_table (int32 [batch, max_pages]): shapes, int dtypes, every sequence fits its listed
    pages, the written pages exist, and no two sequences write one cache row (their stores would
    race). Each failure is one InputError; dtypes and layouts of the float tensors are inputs.py's."""
    cs, vcs, ks, vs = (_shape(x, n) for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")))
    cache_text = "[num_pages, page_size, kv_heads, head_dim]"
    new_text = "[batch, seqlen_new, kv_heads, head_dim]"
    for name, s, text in (("k_cache", cs, cache_text), ("v_cache", vcs, cache_text), ("k", ks, new_text), ("v", vs, new_text)):
        if len(s) != 4:
            raise InputError(f"{name}.shape", list(s), f"4 dimensions {text}")
    if vcs[:-1] != cs[:-1]:
        raise InputError("v_cache.shape", list(vcs), f"{[*cs[:-1], vcs[-1]]}: k_cache's shape but the head dim")
    num_pages, page_size, kv_heads, head_dim = cs
    head_dim_v = vcs[-1]
    if num_pages < 1:
        raise InputError("k_cache.shape[0] (num_pages)", num_pages, "at least 1")
    if ks[2:] != (kv_heads, head_dim):
        raise InputError("k.shape", list(ks), f"[batch, seqlen_new, {kv_heads}, {head_dim}]: the cache's kv_heads and head_dim")
    if vs[:3] != ks[:3] or vs[3] != head_dim_v:
        raise InputError("v.shape", list(vs), f"{[*ks[:3], head_dim_v]}: k's shape with v_cache's head dim")
    batch, seqlen_new = ks[0], ks[1]
    if batch < 1:
        raise InputError("k.shape[0] (batch)", batch, "at least 1")
    bt_shape = _int_tensor("block_table", block_table, "[batch, max_pages]", 2)
    if bt_shape[0] != batch:
        raise InputError("block_table.shape[0] (batch)", bt_shape[0], f"{batch}, k's batch")
    su_shape = _int_tensor("cache_seqlens", cache_seqlens, "[batch]", 1)
    if su_shape[0] != batch:
        raise InputError("cache_seqlens.shape[0] (batch)", su_shape[0], f"{batch}, k's batch")
    table = _host("block_table", block_table)
    lens = _host("cache_seqlens", cache_seqlens).astype(np.int64)
    capacity = bt_shape[1] * page_size
    bad = np.flatnonzero((lens < 0) | (lens + seqlen_new > capacity))
    if bad.size:
        b = int(bad[0])
        raise InputError(f"cache_seqlens[{b}]", int(lens[b]),
                         f"0 to {capacity - seqlen_new}: {seqlen_new} new keys must fit the sequence's "
                         f"max_pages x page_size = {bt_shape[1]} x {page_size} = {capacity} rows")
    positions = lens[:, None] + np.arange(seqlen_new)[None, :]  # [batch, seqlen_new]: where each new key goes
    cols = positions // page_size
    pages = np.take_along_axis(table.astype(np.int64), cols, axis=1)
    bad = np.argwhere((pages < 0) | (pages >= num_pages))
    if bad.size:
        b, t = (int(x) for x in bad[0])
        raise InputError(f"block_table[{b}, {int(cols[b, t])}]", int(pages[b, t]),
                         f"a page in [0, {num_pages}): sequence {b} appends keys into it")
    slots = (pages * page_size + positions % page_size).reshape(-1)
    order = np.argsort(slots, kind="stable")
    dup = np.flatnonzero(slots[order][1:] == slots[order][:-1])
    if dup.size:
        first, second = (int(order[i]) // max(seqlen_new, 1) for i in (dup[0], dup[0] + 1))
        slot = int(slots[order[dup[0]]])
        raise InputError("block_table", f"page {slot // page_size} row {slot % page_size} for sequences {first} and {second}",
                         "pages that no two sequences append into (their writes would race)")
    dims = {"batch": batch, "seqlen_new": seqlen_new, "kv_heads": kv_heads, "num_pages": num_pages,
            "max_pages": bt_shape[1]}
    for name, n in (("k_cache", math.prod(cs)), ("v_cache", math.prod(vcs)), ("k", math.prod(ks))):
        if n > hw.INT32_MAX:
            raise InputError(f"{name}.numel()", n, f"at most {hw.INT32_MAX}: the kernel indexes with int32")
    if kv_heads > hw.GRID_YZ_MAX or batch > hw.GRID_YZ_MAX:
        raise InputError("kv_heads, batch", f"{kv_heads}, {batch}", f"each at most {hw.GRID_YZ_MAX} (grid y and z)")
    return AppendCall(batch=batch, seqlen_new=seqlen_new, kv_heads=kv_heads, page_size=page_size, head_dim=head_dim,
                      head_dim_v=head_dim_v, dims=dims, cache_seqlens=lens, block_table=table)


def check_append_descales(plan: AppendPlan, call: AppendCall, k_descale, v_descale, *, cpu: bool = False) -> list:
    """An fp8 cache's descales, float32 [num_pages, kv_heads] (the value stored is new / descale of
    the page it goes to; docs/fp8-kv-cache.md), in the kernel's order; [] for a 16-bit cache, which
    takes none."""
    given = {"k_descale": k_descale, "v_descale": v_descale}
    if not plan.kv_dtype:
        for name, t in given.items():
            if t is not None:
                raise InputError(name, "a tensor", f"None: the cache holds {plan.dtype}, which has no descale")
        return []
    want = [call.dims["num_pages"], call.kv_heads]
    for name, t in given.items():
        if t is None:
            raise InputError(name, None, f"a float32 tensor [num_pages, kv_heads] = {want}: the cache holds {plan.kv_dtype}")
        check_kind(name, t, "float32", cpu=cpu)
        if list(t.shape) != want:
            raise InputError(f"{name}.shape", list(t.shape), f"[num_pages, kv_heads] = {want}, one descale per page and KV head")
        check_contiguous(name, t)
    return [k_descale, v_descale]


# -- the compiled kernel ------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class AppendKernel:
    """The compiled append kernel of one cache kind (dtype, head dims, page size): it writes
    k, v into a paged cache in place (render.render_append_source, its own module)."""

    plan: AppendPlan
    jit: object  # tilelang JITKernel of build_append_kernel
    cache_path: str | None
    origin: str  # "compiled" or "disk", as Kernel.origin
    compile_seconds: float

    def launch(self, call: AppendCall, k_cache, v_cache, k, v, block_table, cache_seqlens, descales=()) -> None:
        """Launch on a checked call (append_kv's checks; `descales` an fp8 cache's, checked); nothing
        for an append of no key."""
        torch = _torch()
        if call.empty:  # seqlen_new = 0: an empty grid would be a launch error
            return
        with torch.cuda.device(k_cache.device):
            self.jit(*(_detach(a) for a in (k_cache, v_cache, k, v, block_table, cache_seqlens, *descales)))


_append_memo: dict[AppendPlan, AppendKernel] = {}


def compile_append(plan: AppendPlan) -> AppendKernel:
    """The append kernel for sm_90a, from the attngen cache's runtime entry or built (and stored)
    as the forward's are; memoized per process."""

    def build() -> AppendKernel:
        text = render_append_source(plan)
        entry = runtime_entry(plan, text)
        start = time.time()
        try:
            if (entry / "meta.json").exists():
                jit, _ = _load_entry(entry, plan)
                origin = "disk"
            else:
                jit, _, origin = _built_entry(plan, text, entry, kernels={"main": "build_append_kernel"})
        except Exception as e:
            raise KernelBuildError(_failure_message(plan, e)) from None
        return AppendKernel(plan=plan, jit=jit, cache_path=str(entry), origin=origin, compile_seconds=time.time() - start)

    return _once(_append_memo, plan, build)


def check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens, k_descale=None,
                      v_descale=None) -> tuple[AppendCall, AppendPlan, list]:
    """Every check of a GPU append, no launch: shapes and values (check_append, one host copy
    of each int32 tensor), dtypes and layouts (inputs.check_append_tensors), an fp8 cache's
    descales (check_append_descales), one sm_90 device. Returns the call, the plan, the descales."""
    call = check_append(k_cache, v_cache, k, v, block_table, cache_seqlens)
    dtype = check_append_tensors(k_cache, v_cache, k, v, block_table, cache_seqlens)
    plan = append_plan(dtype, call.head_dim, call.head_dim_v, call.page_size, dtype_name(k_cache))
    descales = check_append_descales(plan, call, k_descale, v_descale)
    check_device({"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
                  "cache_seqlens": cache_seqlens} | {n: t for n, t in zip(("k_descale", "v_descale"), descales)})
    return call, plan, descales


def append_kv(k_cache, v_cache, k, v, block_table, cache_seqlens, k_descale=None, v_descale=None) -> AppendCall:
    """Write k, v [batch, seqlen_new, kv_heads, D(v)] into the paged CUDA caches k_cache/v_cache
    [num_pages, page_size, kv_heads, D(v)] in place, at positions cache_seqlens[b] .. + seqlen_new - 1
    through block_table (int32 [batch, max_pages]); an e4m3 cache stores each value / its page's
    k_descale or v_descale (float32 [num_pages, kv_heads]). Returns the checked call (its seqused_k
    is cache_seqlens + seqlen_new, what the attention then reads)."""
    call, plan, descales = check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens, k_descale, v_descale)
    compile_append(plan).launch(call, k_cache, v_cache, k, v, block_table, cache_seqlens, descales)
    return call


__all__ = ["AppendCall", "AppendKernel", "append_kv", "cache_slots", "check_append", "check_append_call", "check_append_descales",
           "compile_append"]
