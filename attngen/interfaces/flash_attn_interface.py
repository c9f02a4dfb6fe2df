"""FlashAttention-3's front door (hopper/flash_attn_interface.py's names, arguments, defaults,
layouts and return conventions) on attngen's kernels:

    from attngen.interfaces.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Tensors are [B, S, H, D] (varlen: [total, H, D]) as in FA3. Each function maps its arguments to
attngen.attention's keywords (docs/interfaces.md has the table); the op resolves and memoizes
the spec per call signature (attngen.interfaces.op_arguments.resolve) and the runtime memoizes the compiled kernel
per spec, so a repeated call plans nothing new. An FA3 argument attngen cannot serve raises an
InputError naming it and why, unless it has FA3's default; none is silently ignored.
flash_attn_with_kvcache's k=, v= are written into the cache in place by a generated append
kernel (torch.ops.attngen.append_kv) before the attention reads the grown cache.

Returns as FA3 does: `out`, or `(out, softmax_lse)` with return_attn_probs (flash_attn_func,
flash_attn_varlen_func) or return_softmax_lse (flash_attn_with_kvcache); softmax_lse is float32
[B, H, Sq] (varlen: [H, total_q]), the natural-log log-sum-exp of the scaled scores.
"""

from __future__ import annotations

import contextlib
import numbers
import re

import numpy as np
import torch

from attngen.hw import E4M3
from attngen.run.inputs import check_tma_layout
from attngen.interfaces.op_arguments import compiling, plain_argument
from attngen.interfaces.ops import append_kv, attention, check_attention
from attngen.kernels.fwd.plan import BLOCK_N_CANDIDATES
from attngen.reference.forward import InputError
from attngen.spec import SpecError

BSHD = "[batch, seqlen, nheads, headdim] (FlashAttention's layout)"
# attngen.attention's names that FA3's functions spell otherwise (_door_names)
RENAMES = {"window": "window_size", "splits": "num_splits"}
# flash_attn_with_kvcache's: the attention reads the cache as k, v with a block_table (FA3's page_table;
# a dense cache's is a view the door makes) and seqused_k; the append op's k, v are the new keys themselves
KVCACHE_RENAMES = RENAMES | {"seqused_k": "cache_seqlens", "block_table": "page_table", "k": "k_cache", "v": "v_cache"}
APPEND_RENAMES = {"block_table": "page_table"}


def _unsupported(name: str, value, default, why: str) -> None:
    if value is None and default is None:
        return
    if default is not None and not isinstance(value, torch.Tensor) and value == default:
        return
    shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else value
    raise InputError(name, shown, f"{default!r} (FA3's default): {why}")


@contextlib.contextmanager
def _door_names(renames: dict, values: dict | None = None):
    """attngen.attention's errors in the door's argument names, in one place: `renames` maps the
    op's name (an argument or a spec field: seqused_k, block_table, splits, window) to the door's,
    everywhere in the message; `values` holds the door's value for a name whose value the door
    changed on the way (num_splits 0 became splits "auto"), shown instead of the op's."""
    try:
        yield
    except (InputError, SpecError) as e:
        # a name with an underscore is renamed wherever it stands; a plain word (k, window, splits)
        # only where it is code (k.shape, v[0], splits = 1), not in the prose around it
        words = re.compile("|".join(rf"(?<![\w.])({re.escape(n)})" + (r"(?!\w)" if "_" in n else r"(?=[.\[]|\s=|$)")
                                    for n in sorted(renames, key=len, reverse=True)))

        def rename(text: str) -> str:
            return words.sub(lambda m: renames[m.group(0)], text)

        values = values or {}
        if isinstance(e, SpecError):
            field = renames.get(e.field, e.field)
            raise SpecError(field, values.get(field, e.value), rename(e.valid)) from None
        argument = rename(e.argument)
        raise InputError(argument, values.get(argument, e.value), rename(e.expected)) from None


def _packed(name: str, t):
    """A strided q, k or v that FA3 takes (the last dimension contiguous, the other strides
    multiples of 16 bytes: `q, k, v = qkv.unbind(2)`) as one packed copy, which attngen's kernels
    take (their buffers declare no strides); autograd carries gradients back through the copy.
    What FA3 refuses too is refused by name (docs/interfaces.md, "Strided inputs")."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return t
    check_tma_layout(name, t, base=False)  # (the copy's base is aligned)
    return t.contiguous()


def _common(softmax_scale, causal, window_size, softcap, qv, q_descale, k_descale, v_descale, pack_gqa,
            sm_margin, deterministic) -> dict:
    """The keywords every door shares, with their refusals."""
    _unsupported("qv", qv, None, "attngen has no QV term (FA3's extra q @ v score for MLA decode)")
    descales = {n: x for n, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
                if x is not None}  # fp8 q, k, v (docs/fp8.md): float32 [batch, kv_heads], passed on by name
    _unsupported("pack_gqa", pack_gqa, None, "attngen derives pack GQA from the spec (docs/serving.md); "
                                             "it takes no per-call override")
    _unsupported("sm_margin", sm_margin, 0, "attngen's grid does not reserve SMs")
    # NumPy scalars and 0-d CPU tensors as the Python values they hold (a SymFloat stays symbolic)
    deterministic, softcap, causal = (plain_argument(n, x) for n, x in (("deterministic", deterministic),
                                                                     ("softcap", softcap), ("causal", causal)))
    if not isinstance(deterministic, bool):  # the forward is always deterministic; it steers the backward only
        raise InputError("deterministic", deterministic, f"a bool, got {type(deterministic).__name__}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise InputError("window_size", window_size, "(left, right), -1 meaning unbounded on that side")
    window_size = tuple(plain_argument("window_size", x) for x in window_size)
    kw = {"causal": causal}  # the Spec checks it (a bool)
    if deterministic:  # the spec field: the backward's dQ in a fixed order (docs/backward.md); the forward's kernel is the same
        kw["deterministic"] = True
    if tuple(window_size) != (-1, -1):
        kw["window"] = tuple(window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise InputError("softcap", softcap, f"a number >= 0 (0.0: off), got {type(softcap).__name__}")
    if softcap != 0:
        kw["softcap"] = float(softcap)
    if softmax_scale is not None:  # a run-time scale (issue 18); passed only when asked for
        kw["softmax_scale"] = softmax_scale  # not float(): a SymFloat under torch.compile stays symbolic
    kw.update(descales)
    return kw


def _splits(num_splits, auto):
    """FA3's num_splits: 1 no split, 0 its heuristic, n > 1 that many. `auto`: what 0 becomes."""
    num_splits = plain_argument("num_splits", num_splits)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise InputError("num_splits", num_splits, "an int: 0 (automatic), 1 (no split) or a count > 1")
    return auto if num_splits == 0 else (None if num_splits == 1 else num_splits)


def _check_gqa(q, k, v, h_axis: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, f"a torch.Tensor {layout}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise InputError("k.shape", list(k.shape), f"the rank of q {list(q.shape)}: {layout}")
    hq, hk = q.shape[h_axis], k.shape[h_axis]
    if hk < 1 or hq % hk:
        raise InputError(f"q.shape[{h_axis}] (nheads)", hq,
                         f"a multiple of k.shape[{h_axis}] (nheads_k) = {hk}: q, k, v are {layout}; a "
                         f"[batch, nheads, seqlen, headdim] tensor (SDPA/Flex layout) needs .transpose(1, 2)")
    if k.shape[:-1] != v.shape[:-1]:
        raise InputError("v.shape", list(v.shape), f"k's {list(k.shape[:-1])} but the head dim: {layout}")


def _chunk_mask(attention_chunk, q_len, kv_len, where: str) -> dict:
    """FA3's attention_chunk (chunked local attention): row i sees keys in its chunk of the
    bottom-right-aligned key positions, as a mask_mod with the new integer // (the offset is a
    literal: one kernel per kv_len - q_len)."""
    attention_chunk = plain_argument("attention_chunk", attention_chunk)
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise InputError("attention_chunk", attention_chunk, "an int >= 0 (0: off)")
    if attention_chunk == 0:
        return {}
    if where != "dense":
        raise InputError("attention_chunk", attention_chunk, f"0 in {where}: the chunk's offset differs per "
                                                             f"sequence, and a mask_mod holds it as a literal")
    off = int(kv_len) - int(q_len)
    return {"mask_mod": f"(q_idx + {off}) // {attention_chunk} == kv_idx // {attention_chunk}"}


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_func: q [B, Sq, H, D], k/v [B, Skv, HKV, D] -> out [B, Sq, H, D];
    (out, softmax_lse [B, H, Sq]) with return_attn_probs (FA3 returns the LSE there, not probabilities)."""
    _check_gqa(q, k, v, 2, BSHD)
    q, k, v = (_packed(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    kw = _common(softmax_scale, causal, window_size, softcap, qv, q_descale, k_descale, v_descale, pack_gqa,
                 sm_margin, deterministic)
    if q.dim() != 4:
        raise InputError("q.shape", list(q.shape), f"4 dimensions: {BSHD}")
    kw.update(_chunk_mask(attention_chunk, q.shape[1], k.shape[1], "dense"))
    splits = _splits(num_splits, None)  # 0: attngen's choice, which for a dense call is no split
    if splits is not None:
        kw["num_splits"] = splits
    with _door_names(RENAMES, {"num_splits": num_splits}):
        return attention(q, k, v, return_lse=bool(return_attn_probs), **kw)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_varlen_func: packed q [total_q, H, D], k/v [total_k, HKV, D], int32
    cu_seqlens_q/cu_seqlens_k [B + 1] -> out [total_q, H, D]; (out, softmax_lse [H, total_q])
    with return_attn_probs. max_seqlen_k is checked against cu_seqlens_k (attngen reads each
    key length from it)."""
    layout = "[total, nheads, headdim] (packed varlen)"
    _check_gqa(q, k, v, 1, layout)
    q, k, v = (_packed(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    if q.dim() != 3:
        raise InputError("q.shape", list(q.shape), f"3 dimensions: {layout}")
    kw = _common(softmax_scale, causal, window_size, softcap, qv, q_descale, k_descale, v_descale, pack_gqa,
                 sm_margin, deterministic)
    _unsupported("seqused_q", seqused_q, None, "attngen reads each query length from cu_seqlens_q")
    _unsupported("seqused_k", seqused_k, None, "a dense varlen call reads each key length from cu_seqlens_k "
                                               "(seqused_k is a paged cache's: flash_attn_with_kvcache)")
    kw.update(_chunk_mask(attention_chunk, 0, 0, "a varlen call"))
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
        raise InputError("max_seqlen_k", type(max_seqlen_k).__name__, "an int, the longest key sequence")
    # FA3's contract, checked eagerly; attngen reads each key length from cu_seqlens_k, so a traced call
    # (its max would be data-dependent: a graph break, or a fullgraph error) skips it harmlessly
    if not compiling() and isinstance(cu_seqlens_k, torch.Tensor) and cu_seqlens_k.dim() == 1 and cu_seqlens_k.numel() > 1:
        longest = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        if max_seqlen_k < longest:
            raise InputError("max_seqlen_k", max_seqlen_k, f"at least {longest}, the longest sequence in cu_seqlens_k")
    splits = _splits(num_splits, None)
    if splits is not None:
        kw["num_splits"] = splits
    with _door_names(RENAMES, {"num_splits": num_splits}):
        return attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         return_lse=bool(return_attn_probs), **kw)


def _dense_as_pages(k_cache, v_cache, batch, cache_batch_idx):
    """A dense cache [B_cache, S_cache, HKV, D] as pages of the largest block_n candidate that
    divides S_cache: a view (no copy for a contiguous cache), with the page table that walks
    each sequence's row (row cache_batch_idx[b] if given)."""
    s_cache = int(k_cache.shape[1])
    page = next((p for p in BLOCK_N_CANDIDATES if s_cache % p == 0), None)
    if page is None:
        raise InputError("k_cache.shape[1] (seqlen_cache)", s_cache,
                         f"a multiple of 16 with cache_seqlens: attngen reads a dense cache as pages of "
                         f"{'/'.join(map(str, BLOCK_N_CANDIDATES))} keys (docs/interfaces.md)")
    per = s_cache // page
    k_pages = k_cache.reshape(k_cache.shape[0] * per, page, *k_cache.shape[2:])
    v_pages = v_cache.reshape(v_cache.shape[0] * per, page, *v_cache.shape[2:])
    rows = torch.arange(batch, dtype=torch.int32, device=k_cache.device) if cache_batch_idx is None \
        else cache_batch_idx.to(torch.int32)
    table = rows[:, None] * per + torch.arange(per, dtype=torch.int32, device=k_cache.device)[None, :]
    return k_pages, v_pages, table.contiguous()


def _check_seqlens(cache_seqlens, k_cache, page_table, batch: int, s_new: int) -> None:
    """cache_seqlens against the room each sequence has (and s_new keys appended after them)."""
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise InputError("cache_seqlens", f"a {cache_seqlens.dtype} tensor of shape {list(cache_seqlens.shape)}",
                         f"an int or an int32 tensor [{batch}]")
    if page_table is None:  # a dense cache: each sequence owns one row of S_cache keys
        capacity = int(k_cache.shape[1])
        room = f"the dense cache's seqlen_cache = k_cache.shape[1] = {capacity} rows"
    else:
        capacity = int(page_table.shape[1]) * int(k_cache.shape[1])
        room = f"its page_table row: max_pages x page_block_size = {int(page_table.shape[1])} x {int(k_cache.shape[1])} rows"
    if s_new > capacity:
        raise InputError("k.shape[1] (seqlen_new)", s_new, f"at most {capacity}: the new keys must fit {room}")
    for b, n in enumerate(cache_seqlens.cpu().tolist()):
        if n < 0 or n + s_new > capacity:
            why = f"{s_new} new keys must fit {room}" if s_new else f"{room}"
            raise InputError(f"cache_seqlens[{b}]", n, f"0 to {capacity - s_new}: {why}")


def _check_batch_idx(cache_batch_idx, batch: int, batch_cache: int) -> None:
    """cache_batch_idx: one row of a dense cache per sequence (the door's page table is made from it)."""
    if not isinstance(cache_batch_idx, torch.Tensor):
        raise InputError("cache_batch_idx", type(cache_batch_idx).__name__, f"an int32 tensor [{batch}]")
    if cache_batch_idx.dtype not in (torch.int32, torch.int64) or cache_batch_idx.shape != (batch,):
        raise InputError("cache_batch_idx", f"a {cache_batch_idx.dtype} tensor of shape {list(cache_batch_idx.shape)}",
                         f"an int32 tensor [{batch}], q's batch")
    for b, row in enumerate(cache_batch_idx.cpu().tolist()):
        if not 0 <= row < batch_cache:
            raise InputError(f"cache_batch_idx[{b}]", row, f"a row of the cache in [0, {batch_cache}) "
                                                           f"(k_cache.shape[0], batch_cache)")


def _check_append(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, batch: int) -> None:
    """The append's checks in FA3's names (k, v against the cache and q's batch, the dense cache's
    capacity); run.append.check_append then checks the page view the kernel writes (a paged cache's
    capacity and pages, rows no two sequences share)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            other = "v" if name == "k" else "k"
            raise InputError(name, type(t).__name__, f"a torch.Tensor [batch, seqlen_new, nheads_k, headdim], "
                                                     f"given with {other}: k and v are appended together")
    want = f"[{batch}, seqlen_new, {int(k_cache.shape[2])}, {int(k_cache.shape[3])}] (batch, seqlen_new, nheads_k, headdim)"
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
        raise InputError("k.shape", list(k.shape), f"{want}: q's batch, k_cache's nheads_k and headdim")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3] or v.shape[3] != v_cache.shape[3]:
        raise InputError("v.shape", list(v.shape), f"{[*k.shape[:3], int(v_cache.shape[3])]}: k's shape with v_cache's headdim")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if cache.dtype == FP8_CACHE:  # an fp8 cache: new keys of q's dtype, quantized by the append
            if t.dtype != q.dtype:
                raise InputError(f"{name}.dtype", t.dtype, f"{q.dtype}, the dtype of q (the append quantizes them into "
                                                           f"{name}_cache's {cache.dtype})")
        elif t.dtype != cache.dtype:
            raise InputError(f"{name}.dtype", t.dtype, f"{cache.dtype}, the dtype of {name}_cache")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise InputError(f"{name}.stride()", tuple(t.stride()), "a contiguous cache: the append writes it in place")
    _check_seqlens(cache_seqlens, k_cache, page_table, batch, int(k.shape[1]))
    if page_table is None:
        if cache_batch_idx is not None:
            rows = cache_batch_idx.cpu().tolist()
            if len(set(rows)) != len(rows):
                raise InputError("cache_batch_idx", rows, "distinct rows with k and v: two sequences appending "
                                                          "into one cache row would race")


FP8_CACHE = getattr(torch, E4M3)  # an fp8 KV cache's element type (docs/fp8-kv-cache.md)


def _cache_descales(k_pages, k_descale, v_descale, table, seqlens, batch: int) -> dict:
    """FA3's k_descale / v_descale of an e4m3 cache (`k_pages`: the cache as the kernel reads it),
    float32 [batch, nheads_k] (one per sequence and KV head; absent means 1), as the kernels take
    them: as given for a dense cache read whole, else
    one per page of the page view, [num_pages, nheads_k], from the sequences that list the page
    (pages no sequence uses get 1). A page two sequences list with different descales is refused.
    A 16-bit cache takes none. The per-page expansion reads the values on the host, as the serving
    call's checks read the page table."""
    given = {"k_descale": k_descale, "v_descale": v_descale}
    if k_pages.dtype != FP8_CACHE:
        for name, x in given.items():
            _unsupported(name, x, None, f"the cache holds {k_pages.dtype}: only an e4m3 (fp8) cache is descaled; "
                                        f"q_descale is FA3's fp8 forward's")
        return {}
    hk = int(k_pages.shape[2])
    out = {}
    for name, x in given.items():
        if x is None:
            x = torch.ones((batch, hk), dtype=torch.float32, device=k_pages.device)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != (batch, hk):
            shown = f"a {x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(name, shown, f"a float32 tensor [batch, nheads_k] = [{batch}, {hk}]: FA3's descale per "
                                          f"sequence and KV head (the cache holds e4m3)")
        out[name] = x if table is None else _per_page(name, x, k_pages, table, seqlens)
    return out


def _per_page(name: str, descale, pages, table, seqlens):
    """A per-sequence descale [batch, nheads_k] as one per page of `pages` [num_pages, page_size, ..]."""
    num_pages, page_size = int(pages.shape[0]), int(pages.shape[1])
    rows, used = table.cpu().numpy(), -(-seqlens.cpu().numpy().astype(np.int64) // page_size)
    values = descale.detach().cpu().numpy()
    per_page = np.ones((num_pages, values.shape[1]), np.float32)
    owner = np.full(num_pages, -1)
    for b, n in enumerate(used):
        listed = rows[b, :n]
        for p in listed[owner[listed] >= 0]:
            if not np.array_equal(per_page[p], values[b]):
                raise InputError(name, f"rows {owner[p]} and {b} differing", f"one descale for page {p}, which "
                                 f"sequences {owner[p]} and {b} both read (a page holds one scale per KV head)")
        per_page[listed], owner[listed] = values[b], b
    return torch.from_numpy(per_page).to(descale.device)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3's flash_attn_with_kvcache: q [B, Sq, H, D] (or packed with cu_seqlens_q), k_cache/v_cache
    dense [B_cache, S_cache, HKV, D] or paged [num_pages, page_size, HKV, D] with page_table int32
    [B, max_pages]; cache_seqlens an int or int32 [B] (None: the whole dense cache).
    k, v [B, S_new, HKV, D(v)], when given, are written into the caches in place at rows
    cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 (a generated append kernel: on the CPU model
    for CPU tensors), and the attention then reads cache_seqlens + S_new keys per sequence.
    An e4m3 cache (torch.float8_e4m3fn, for 16-bit q) takes k_descale and v_descale, float32
    [B, HKV] as FA3's (absent: 1): the kernel dequantizes each tile, the append quantizes k and v.
    Causal aligns each sequence bottom-right at that length, as FA3. num_splits 0 is attngen's
    "auto". Returns out, or (out, softmax_lse) with return_softmax_lse."""
    _unsupported("cu_seqlens_k_new", cu_seqlens_k_new, None, "attngen appends k and v of one length per sequence, "
                                                             "[batch, seqlen_new, nheads_k, headdim]; packed new keys "
                                                             "of different lengths are not offered")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("rotary_seqlens", rotary_seqlens)):
        _unsupported(name, x, None, "attngen applies no rotary embedding: rotate q and k before the call")
    if not isinstance(rotary_interleaved, bool):
        raise InputError("rotary_interleaved", rotary_interleaved, "a bool (it matters only with rotary_cos)")
    _unsupported("cache_leftpad", cache_leftpad, None, "attngen's caches start at key 0")
    _unsupported("scheduler_metadata", scheduler_metadata, None, "attngen plans its grid per call")
    kw = _common(softmax_scale, causal, window_size, softcap, qv, q_descale, None, None, pack_gqa,
                 sm_margin, False)  # k and v's descales: an fp8 cache's (_cache_descales)
    kw.update(_chunk_mask(attention_chunk, 0, 0, "flash_attn_with_kvcache"))
    varlen = cu_seqlens_q is not None
    layout = "[total_q, nheads, headdim] with cu_seqlens_q" if varlen else BSHD
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
    if q.dim() != (3 if varlen else 4):
        raise InputError("q.shape", list(q.shape), f"{3 if varlen else 4} dimensions: {layout}")
    if k_cache.dim() != 4 or k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise InputError("k_cache.shape", list(k_cache.shape), f"4 dimensions like v_cache {list(v_cache.shape)}: "
                                                               f"[batch_cache, seqlen_cache, nheads_k, headdim] or "
                                                               f"[num_blocks, page_block_size, nheads_k, headdim]")
    hq, hk = q.shape[-2], k_cache.shape[2]
    if hk < 1 or hq % hk:
        raise InputError(f"q.shape[{q.dim() - 2}] (nheads)", hq,
                         f"a multiple of k_cache.shape[2] (nheads_k) = {hk}: q is {layout}, the cache "
                         f"[.., .., nheads_k, headdim]")
    q, k, v = (_packed(n, t) for n, t in (("q", q), ("k", k), ("v", v)))  # the caches: contiguous (their rows are written)
    batch = int(cu_seqlens_q.shape[0]) - 1 if varlen else int(q.shape[0])
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=k_cache.device)
    elif cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        raise InputError("cache_seqlens", type(cache_seqlens).__name__, "an int or an int32 tensor [batch]")
    if (k is not None or v is not None) and cache_seqlens is None:
        raise InputError("cache_seqlens", None, "an int or an int32 tensor [batch] with k and v: the new keys go to "
                                                "rows cache_seqlens[b] onwards")
    if page_table is not None:
        _unsupported("cache_batch_idx", cache_batch_idx, None, "a paged cache's sequences are its page_table's rows")
        k_pages, v_pages, table = k_cache, v_cache, page_table
        if cache_seqlens is None:  # every listed page in use
            cache_seqlens = torch.full((batch,), int(page_table.shape[1]) * int(k_cache.shape[1]), dtype=torch.int32,
                                       device=k_cache.device)
    elif cache_seqlens is None and cache_batch_idx is None and not varlen:
        k_pages, v_pages, table = k_cache, v_cache, None  # the whole dense cache: a plain call
    else:
        if cache_batch_idx is not None:
            _check_batch_idx(cache_batch_idx, batch, int(k_cache.shape[0]))
        elif k_cache.shape[0] < batch:
            raise InputError("k_cache.shape[0] (batch_cache)", int(k_cache.shape[0]), f"at least {batch}, q's batch")
        k_pages, v_pages, table = _dense_as_pages(k_cache, v_cache, batch, cache_batch_idx)
        if cache_seqlens is None:
            cache_seqlens = torch.full((batch,), int(k_cache.shape[1]), dtype=torch.int32, device=k_cache.device)
        elif k is None and v is None:  # (an append checks them with its new keys)
            _check_seqlens(cache_seqlens, k_cache, None, batch, 0)
    appending = k is not None or v is not None
    if appending:
        _check_append(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, batch)
        old_seqlens = cache_seqlens
        cache_seqlens = cache_seqlens + int(k.shape[1])  # what the attention reads (an int32 tensor stays int32)
    kw.update(_cache_descales(k_pages, k_descale, v_descale, table, cache_seqlens, batch))
    serving = {}
    if table is not None:
        serving.update(block_table=table, seqused_k=cache_seqlens)
        # 0 is FA3's heuristic: attngen's "auto", except where attngen has no split kernel (a window)
        splits = _splits(num_splits, "auto" if "window" not in kw else None)
        if splits is not None:
            serving["num_splits"] = splits
    else:
        splits = _splits(num_splits, None)
        if splits is not None:
            raise InputError("num_splits", num_splits, "0 or 1 for a dense cache without cache_seqlens "
                                                       "(attngen splits only serving calls)")
    if varlen:
        serving.update(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
    elif max_seqlen_q is not None:
        raise InputError("max_seqlen_q", max_seqlen_q, "None without cu_seqlens_q")
    if appending:  # every check of the attention first: a refused call leaves the cache as it was
        with _door_names(KVCACHE_RENAMES, {"num_splits": num_splits}):
            check_attention(q, k_pages, v_pages, return_lse=bool(return_softmax_lse), **serving, **kw)
        with _door_names(APPEND_RENAMES):
            append_kv(k_pages, v_pages, k, v, table, old_seqlens, kw.get("k_descale"), kw.get("v_descale"))  # in place
    with _door_names(KVCACHE_RENAMES, {"num_splits": num_splits}):
        return attention(q, k_pages, v_pages, return_lse=bool(return_softmax_lse), **serving, **kw)


__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
