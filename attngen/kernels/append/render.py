"""AppendPlan -> the emitted KV-cache append module (templates/append/fa3_kv_append.py.j2)."""

from __future__ import annotations

from pathlib import Path



from attngen.version import __version__
from attngen.kernels.append.plan import AppendPlan
from attngen.kernels.common.emit import render_template, tensor_param

APPEND_TEMPLATE = "append/fa3_kv_append.py.j2"  # the KV-cache append: a module of its own


# -- the KV-cache append kernel (fa3_kv_append.py.j2) ------------------------------------------
def cache_slot(key: str, batch: str = "batch_idx") -> str:
    """The paged cache row (page, row in page) of key position `key` of sequence `batch`: the
    serving ABI's rule, key t of sequence b is row t % PAGE_SIZE of page block_table[b, t // PAGE_SIZE]
    (docs/serving.md). The forward's kv_tile_setup is its tile form (a K tile is BLOCK_N keys of one
    page); run.append.cache_slots is its host side."""
    return f"block_table[{batch}, ({key}) // PAGE_SIZE], ({key}) % PAGE_SIZE"


def append_context(plan: AppendPlan) -> dict:
    """Names of the append kernel: grid (ceildiv(seqlen_new, APPEND_ROWS), kv_heads, batch); block
    (x, y, z) copies new rows [x R, x R + R) of KV head y of sequence z to cache positions
    cache_seqlens[z] + those rows, through the block table."""
    new = "r0 + i"
    position = f"start + {new}"
    cache_dtype = "KV_DTYPE" if plan.kv_dtype else "DTYPE"
    params = [tensor_param("K_cache", ["num_pages", "PAGE_SIZE", "kv_heads", "HEAD_DIM"], cache_dtype,
                      "written in place: the appended rows only"),
              tensor_param("V_cache", ["num_pages", "PAGE_SIZE", "kv_heads", "HEAD_DIM_V"], cache_dtype,
                      "written in place: the appended rows only"),
              tensor_param("K_new", ["batch", "seqlen_new", "kv_heads", "HEAD_DIM"], "DTYPE"),
              tensor_param("V_new", ["batch", "seqlen_new", "kv_heads", "HEAD_DIM_V"], "DTYPE"),
              tensor_param("block_table", ["batch", "max_pages"], '"int32"',
                      "sequence b's key t lives in page block_table[b, t // PAGE_SIZE]"),
              tensor_param("cache_seqlens", ["batch"], '"int32"',
                      "keys of sequence b before the append: its new keys go to positions cache_seqlens[b] ..")]
    # an fp8 cache stores x / descale of the page the row goes to, rounded to e4m3 (saturating): the
    # forward dequantizes the same page's rows with the same descale
    quantize = {"K_cache": "", "V_cache": ""}
    if plan.kv_dtype:
        page = f"block_table[batch_idx, ({position}) // PAGE_SIZE], kv_head"
        for cache, scale in (("K_cache", "K_descale"), ("V_cache", "V_descale")):
            params.append(tensor_param(scale, ["num_pages", "kv_heads"], '"float32"',
                                       f"{cache}'s descale per (page, KV head): stored = new / descale"))
            quantize[cache] = f" / {scale}[{page}]"
    header = [
        "=" * 78,
        "attngen auto-generated kernel: do not edit; emitted by attngen.kernels.append.render.render_append_source.",
        f"kernel:    {plan.name}",
        f"generator: attngen {__version__}, template {Path(APPEND_TEMPLATE).name}",
        "role:      flash_attn_with_kvcache(k=, v=): appends the new keys and values into the paged cache",
        "shape:     dynamic: batch, seqlen_new, kv_heads, num_pages, max_pages are runtime values",
        f"fields:    dtype {plan.dtype}, head_dim {plan.head_dim}, head_dim_v {plan.head_dim_v}, "
        f"page_size {plan.page_size}" + (f", cache {plan.kv_dtype}" if plan.kv_dtype else ""),
        "=" * 78,
    ]
    return {
        "header": header,
        "plan": plan,
        "dims": ["batch", "seqlen_new", "kv_heads", "num_pages", "max_pages"],
        "params": params,
        "grid": "T.ceildiv(seqlen_new, APPEND_ROWS), kv_heads, batch",
        "block_vars": "row_block, kv_head, batch_idx",
        "setup": ["r0 = row_block * APPEND_ROWS  # this block's first new row",
                  "start = cache_seqlens[batch_idx]  # the sequence's keys before the append"],
        "stores": [{"cache": "K_cache", "new": "K_new", "dim": "HEAD_DIM", "quantize": quantize["K_cache"]},
                   {"cache": "V_cache", "new": "V_new", "dim": "HEAD_DIM_V", "quantize": quantize["V_cache"]}],
        "guard": f"{new} < seqlen_new",
        "new_index": f"batch_idx, {new}, kv_head, d",
        "cache_index": f"{cache_slot(position)}, kv_head, d",
    }


def render_append_source(plan: AppendPlan) -> str:
    """The emitted TileLang source of the append kernel (its own module: build_append_kernel())."""
    return render_template(APPEND_TEMPLATE, append_context(plan))
