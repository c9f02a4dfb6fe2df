"""The forward's KV cache element type (spec.kv_dtype, docs/fp8-kv-cache.md): a 16-bit cache, or an
e4m3 one whose tiles the producer warpgroup dequantizes into the 16-bit tiles the wgmmas read.

Descales, FlashAttention-3's names and meaning (the stored value times its descale is the key or
value): `k_descale` and `v_descale`, float32, one per (batch, KV head) of a dense or packed cache,
[batch, kv_heads], or one per (page, KV head) of a paged cache, [num_pages, kv_heads].

Why dequantize the tile rather than fold the descales into the softmax scale and the output's
normalisation (FA3's fp8 forward): a paged cache's pages each carry their own scale, and the
output sums P V over the pages of a sequence. k's scale could still be folded per tile (a tile
lies inside one page), but v's cannot be taken out of a sum over pages with different scales.
Multiplying each element as it is converted is right for any granularity, and a per-page scale
costs one scalar load per tile, as a per-batch one does.

Who converts: the producer warpgroup. Its TMA warp lands the e4m3 tiles in a staging buffer; all
four of its warps (three otherwise idle) convert them into the 16-bit K/V stage and arrive on its
"full" barrier. The consumers' mainloop stays the 16-bit kernel's, instruction for instruction,
and tile k + 1 is dequantized while the consumers run the GEMMs of tile k (the 16-bit stages
decouple the two). The cost: one staging tile of each of K and V in shared memory, and a named
barrier per tile before the staging is reloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.kernels.common.plan import ExtraTensor
from attngen.spec import Spec


E4M3_BYTES = 1  # hw.E4M3's element
DESCALES = ("k_descale", "v_descale")  # FA3's names, the call-time tensors of an fp8 cache


def kv_fp8(spec: Spec) -> bool:
    """K and V are stored in e4m3 (the resolved spec's kv_dtype is set only then)."""
    return spec.kv_dtype is not None


def descale_tensors(spec: Spec) -> list:
    """The call-time descales of an fp8 cache: one float32 per (batch or page, KV head)."""
    if not kv_fp8(spec):
        return []
    rows = "num_pages" if spec.paged_kv else "batch"
    return [ExtraTensor(name, name[0].upper() + name[1:], (rows, "kv_heads")) for name in DESCALES]


def staging_bytes(spec: Spec, block_n: int, head_dim_v: int) -> dict:
    """Shared memory of the e4m3 staging tiles TMA lands before they are dequantized."""
    if not kv_fp8(spec):
        return {}
    return {"K8": block_n * spec.head_dim * E4M3_BYTES, "V8": block_n * head_dim_v * E4M3_BYTES}


@dataclass(frozen=True)
class KvCache:
    """fa3_fwd.py.j2's `kv_cache`: whether the cache is e4m3, and the text its dequantization needs."""

    fp8: bool
    scale_row: str = "batch_idx"  # the descale's row of this tile: the batch's, or its page's
    dequant_bar: int = 0  # the named barrier the producer warpgroup meets at before reloading the staging

    @property
    def k_dtype(self) -> str:
        """K's and V's element type, as the kernel names it."""
        return "KV_DTYPE" if self.fp8 else "DTYPE"

    @classmethod
    def of(cls, plan) -> KvCache:
        if not kv_fp8(plan.spec):
            return cls(fp8=False)
        # after the ping-pong ring (1..n) and the epilogues' barriers (epilogue_bar + g)
        return cls(fp8=True, scale_row="page" if plan.page_size else "batch_idx",
                   dequant_bar=plan.epilogue_bar + plan.spec.consumers)
