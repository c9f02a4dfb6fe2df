"""FlexAttention's front door: `flex_attention`, Python score_mod/mask_mod functions, `create_block_mask`.

    out = attngen.flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                                 enable_gqa=False, return_lse=False)     # [B, H, S, D], as torch's
    mask = attngen.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128)

The door checks FlexAttention's [B, H, S, D] call, translates its mods (flex_mods.translate: a
score_mod or mask_mod as attngen's expression language; flex_source.py finds their source), fits
its block mask to the kernel's tiles (flex_blocks.py: create_block_mask, BlockMask) and calls
attngen.attention; under torch.compile the translation is a constant of the graph (_traced_mods).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from attngen import tiles
from attngen.interfaces.flex_blocks import KERNEL_Q_TILES, _block_mask, _positive, kernel_block_mask
from attngen.interfaces.flex_mods import _canonical, translate
from attngen.interfaces.op_arguments import compiling
from attngen.interfaces.ops import attention
from attngen.reference.forward import InputError


# -- flex_attention --------------------------------------------------------------------------------------


def _bhsd(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(name, type(t).__name__, "a torch.Tensor [B, H, S, D]")
    if t.dim() != 4:
        raise InputError(f"{name}.shape", list(t.shape), "4 dimensions: [B, H, S, D] (FlexAttention's layout)")


def check_layout(query, key, value, enable_gqa: bool) -> None:
    """Shapes that the [B, H, S, D] layout explains; a [B, S, H, D] tensor usually is not one."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _bhsd(name, t)
    hint = ("flex_attention takes [B, H, S, D] (FlexAttention's layout); a [B, S, H, D] tensor (the "
            "flash-attn layout) needs .transpose(1, 2)")
    if key.shape[0] not in (1, query.shape[0]) or value.shape[0] != key.shape[0]:
        raise InputError("key.shape[0] (B)", key.shape[0], f"{query.shape[0]}, query's batch, or 1 (broadcast), "
                                                           f"and value's the same")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise InputError("value.shape", list(value.shape), f"heads and length {list(key.shape[1:3])} of key's: {hint}")
    if key.shape[3] != query.shape[3]:
        raise InputError("key.shape[3] (D)", key.shape[3], f"{query.shape[3]}, query's head dim: {hint}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        if hkv < 1 or hq % hkv:
            raise InputError("query.shape[1] (H)", hq, f"a multiple of key.shape[1] (kv heads) = {hkv}: {hint}")
        if not enable_gqa:
            raise InputError("enable_gqa", enable_gqa, f"True: query has {hq} heads and key {hkv} (GQA), "
                                                       f"as torch's flex_attention requires")


def _to_bshd(t):
    """[B, H, S, D] -> [B, S, H, D] as the kernels take it: a view when the permuted strides are
    packed (the tensor is a transpose of a packed [B, S, H, D]), else one packed copy (the
    kernels' host stub takes packed tensors only: attngen.run.inputs.check_layout)."""
    view = t.transpose(1, 2)
    return view if view.is_contiguous() else view.contiguous()


# kernel_options keys that are spec fields (the kernel's tiles); any other key is refused by name
KERNEL_OPTIONS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n"}


def kernel_fields(kernel_options) -> dict:
    """torch's kernel_options as spec fields: BLOCK_M (64, 128 or 192: 64 rows per consumer) and BLOCK_N."""
    fields = {}
    for name, value in dict(kernel_options or {}).items():
        if name not in KERNEL_OPTIONS:
            raise InputError(f"kernel_options[{name!r}]", value, f"one of {', '.join(KERNEL_OPTIONS)} (spec fields; "
                                                                 f"attngen picks the rest of its schedule itself)")
        fields[KERNEL_OPTIONS[name]] = _positive(f"kernel_options[{name!r}]", value)
    if "block_m" in fields:
        if fields["block_m"] not in KERNEL_Q_TILES:
            raise InputError("kernel_options['BLOCK_M']", fields["block_m"], "64, 128 or 192 (64 rows per consumer warpgroup)")
        fields["consumers"] = fields["block_m"] // 64
    return fields


def _aux_output(lse):
    """torch's AuxOutput(lse=..., max_scores=None), or a namedtuple of those fields on a torch without it."""
    import collections
    from torch.nn.attention import flex_attention as torch_flex
    aux = getattr(torch_flex, "AuxOutput", None) or collections.namedtuple("AuxOutput", ["lse", "max_scores"])
    return aux(lse=lse, max_scores=None)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention's call, on attngen's kernel: [B, H, S, D] in and out;
    returns out, or (out, lse [B, H, Q_LEN] float32, natural log) with return_lse, or
    (out, AuxOutput(lse=..., max_scores=None)) with return_aux=AuxRequest(lse=True) (torch's
    AuxRequest, or any object with the fields lse and max_scores). key and value may have a batch
    of 1 (broadcast over query's). kernel_options: BLOCK_M and BLOCK_N, the kernel's tiles."""
    check_layout(query, key, value, enable_gqa)
    if return_aux is not None:
        if getattr(return_aux, "max_scores", False):
            raise InputError("return_aux.max_scores", True, "False: attngen's kernels keep no row max for the caller")
        if not hasattr(return_aux, "lse"):
            raise InputError("return_aux", type(return_aux).__name__, "torch's AuxRequest(lse=...), or None")
        return_lse = bool(return_lse or return_aux.lse)
    if key.shape[0] != query.shape[0]:  # a key/value batch of 1, broadcast (a copy: the kernels take packed tensors)
        key, value = (t.expand(query.shape[0], *t.shape[1:]) for t in (key, value))
    fields = kernel_fields(kernel_options)
    meta = (tuple(int(n) for n in query.shape), int(key.shape[2]), int(value.shape[-1]), query.dtype,
            tuple(sorted(fields.items())))
    if compiling():  # the translation is a constant of the graph (_traced_mods)
        kw = dict(_TRACED[_traced_mods(score_mod, block_mask, meta)])
    else:
        kw = _mods(score_mod, block_mask, meta)
    if scale is not None:  # a run-time scale (issue 18); passed only when asked for
        kw["softmax_scale"] = scale  # not float(): a SymFloat under torch.compile stays symbolic
    kw = {n: (x.to(query.device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    if "block_mask" not in kw:  # (with one, its tiles are the kernel's: _mods fitted them to these fields)
        kw.update(fields)
    result = attention(_to_bshd(query), _to_bshd(key), _to_bshd(value), return_lse=return_lse, **kw)
    out, lse = result if return_lse else (result, None)
    out = out.transpose(1, 2)  # [B, H, S, D], a view
    if return_aux is not None:
        return out, _aux_output(lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


_TRACED: dict = {}  # _traced_mods' results, by key
# Bounded: a program that traces many mods (one per layer, say) must not hold every translation and its
# tensors forever. A graph whose entry was dropped fails its guard on _TRACED and is traced again.
_TRACED_MAX = 64


@torch._dynamo.assume_constant_result
def _traced_mods(score_mod, block_mask, meta) -> str:
    """_mods under torch.compile: run once while tracing (the translation reads source, closures and
    numpy, which dynamo cannot trace), its result kept in _TRACED under the returned key, a constant
    of the graph; the graph reads the captured tensors and block-mask lists from there (guarded
    graph inputs). So a compiled graph keeps the translation it was traced with, as torch's does."""
    key = f"{id(score_mod)}:{id(block_mask)}:{meta}"
    if key not in _TRACED and len(_TRACED) >= _TRACED_MAX:
        _TRACED.clear()
    _TRACED[key] = _mods(score_mod, block_mask, meta)
    return key


def _mods(score_mod, block_mask, meta) -> dict:
    """attngen.attention's keywords for a score_mod and a block mask: the translated texts, their captured
    tensors and the kernel's block mask. `meta`: query's shape, the key length, value's head dim, the dtype."""
    (batch, heads, q_len, head_dim), kv_len, head_dim_v, dtype, fields = meta
    kw = {}
    score_mask = ""  # the score_mod's -inf keys, as a mask
    if score_mod is not None:
        tr = translate(score_mod, "score_mod")
        if tr.text != "score":  # (where(c, score, -inf) is a mask alone)
            kw["score_mod"] = tr.text
        kw.update(tr.tensors)
        score_mask = tr.mask
    if block_mask is not None:
        mm = getattr(block_mask, "mask_mod", None)
        lengths = tuple(getattr(block_mask, "seq_lengths", ()))
        if mm is None or len(lengths) != 2:
            raise InputError("block_mask", type(block_mask).__name__, "a BlockMask from attngen.create_block_mask")
        if lengths != (q_len, kv_len):
            raise InputError("block_mask.seq_lengths", lengths, f"({q_len}, {kv_len}), query's and key's lengths")
        bshape = tuple(getattr(block_mask, "kv_num_blocks").shape[:2]) if hasattr(block_mask, "kv_num_blocks") else (1, 1)
        for axis, (got, want) in enumerate(zip(bshape, (batch, heads))):
            if got not in (1, want):
                raise InputError(f"block_mask {'BH'[axis]}", got, f"1 or {want}")
        tr = translate(mm, "mask_mod")  # afresh: its captures as they are now, as torch's flex_attention reads them
        clash = {n for n in set(tr.tensors) & set(kw) if not (kw[n].dtype == tr.tensors[n].dtype
                                                              and torch.equal(kw[n], tr.tensors[n]))}
        if clash:  # the two mods captured different tensors under one name
            raise InputError("block_mask.mask_mod", sorted(clash), "tensor names other than score_mod's")
        kw["mask_mod"] = tr.text
        kw.update(tr.tensors)
        bm = kernel_block_mask(block_mask, bshape, head_dim, dtype, head_dim_v, kw, dict(fields))
        if score_mask:  # the block mask's tiles, its full ones masked too: the score_mod's -inf may fall there
            st = np.where(bm.states == tiles.FULL, tiles.PARTIAL, bm.states).astype(bm.states.dtype)
            kw["mask_mod"] = _canonical(score_mod, f"({tr.text}) and ({score_mask})", "mask_mod")
            bm = _block_mask(bm.seq_lengths, bm.BLOCK_SIZE, st, bm.mask_mod, kw["mask_mod"], bm.mask_tensors,
                             bm.kv_num_blocks.device)
        elif bm.mask_text != kw["mask_mod"]:  # the same tiles; the mod's text as it translates now
            bm = dataclasses.replace(bm, mask_text=kw["mask_mod"])
        kw["block_mask"] = bm
        del kw["mask_mod"]  # the block mask brings its own (attention checks nothing twice)
    elif score_mask:
        kw["mask_mod"] = score_mask
    return kw


__all__ = ["check_layout", "flex_attention", "kernel_fields"]
