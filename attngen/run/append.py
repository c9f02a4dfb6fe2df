"""The KV-cache append (flash_attn_with_kvcache's k=, v=; docs/interfaces.md): the compiled append
kernel of one cache kind, its checks and `append_kv`, which writes new keys into a paged cache in place.
"""

from __future__ import annotations

import dataclasses
import time

from attngen.kernels.append.plan import AppendPlan, append_plan
from attngen.kernels.append.render import render_append_source
from attngen.run import serving
from attngen.run.checks import _detach, _torch, check_device
from attngen.run.entries import KernelBuildError, _built_entry, _failure_message, _load_entry, _once, runtime_entry
from attngen.run.inputs import check_append_tensors


@dataclasses.dataclass(eq=False)
class AppendKernel:
    """The compiled append kernel of one cache kind (dtype, head dims, page size): it writes
    k, v into a paged cache in place (render.render_append_source, its own module)."""

    plan: AppendPlan
    jit: object  # tilelang JITKernel of build_append_kernel
    cache_path: str | None
    origin: str  # "compiled" or "disk", as Kernel.origin
    compile_seconds: float

    def launch(self, call: serving.AppendCall, k_cache, v_cache, k, v, block_table, cache_seqlens) -> None:
        """Launch on a checked call (append_kv's checks); nothing for an append of no key."""
        torch = _torch()
        if call.empty:  # seqlen_new = 0: an empty grid would be a launch error
            return
        with torch.cuda.device(k_cache.device):
            self.jit(*(_detach(a) for a in (k_cache, v_cache, k, v, block_table, cache_seqlens)))


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


def check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens) -> tuple[serving.AppendCall, AppendPlan]:
    """Every check of a GPU append, no launch: shapes and values (serving.check_append, one host copy
    of each int32 tensor), dtypes and layouts (inputs.check_append_tensors), one sm_90 device."""
    call = serving.check_append(k_cache, v_cache, k, v, block_table, cache_seqlens)
    dtype = check_append_tensors(k_cache, v_cache, k, v, block_table, cache_seqlens)
    check_device({"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
                  "cache_seqlens": cache_seqlens})
    return call, append_plan(dtype, call.head_dim, call.head_dim_v, call.page_size)


def append_kv(k_cache, v_cache, k, v, block_table, cache_seqlens) -> serving.AppendCall:
    """Write k, v [batch, seqlen_new, kv_heads, D(v)] into the paged CUDA caches k_cache/v_cache
    [num_pages, page_size, kv_heads, D(v)] in place, at positions cache_seqlens[b] .. + seqlen_new - 1
    through block_table (int32 [batch, max_pages]); returns the checked call (its seqused_k is
    cache_seqlens + seqlen_new, what the attention then reads)."""
    call, plan = check_append_call(k_cache, v_cache, k, v, block_table, cache_seqlens)
    compile_append(plan).launch(call, k_cache, v_cache, k, v, block_table, cache_seqlens)
    return call


__all__ = ["AppendKernel", "append_kv", "check_append_call", "compile_append"]
