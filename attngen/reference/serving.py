"""The fp64 reference of a serving call (docs/serving.md): every sequence sliced out of packed
inputs (its keys gathered through the block table for a paged cache) and held to reference.py's
oracle and tolerance, one sequence at a time; and random packed inputs for tests and fuzzing.

The call is read by attribute, with no import of the ABI above this layer: `call` is a checked
serving call (attngen.run.serving.check_serving's ServingCall, with its values read): its
`fields` (varlen, paged, page_size), `batch`, each sequence's `q_lens`, `kv_lens`, `q_starts`,
`k_starts`, the host `block_table`, and the `out_shape` and `lse_shape` of the kernel's outputs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attngen.reference.forward import EPS, TINY, Check, attention, check_close, check_lse, round_to, to_numpy
from attngen.spec import LAYOUTS


# -- the reference, one sequence at a time -------------------------------------------------------
def sequence(q, k, v, call, b: int):
    """Sequence b as dense BSHD arrays q [1, q_len, H, D], k and v [1, kv_len, HKV, D(V)] (numpy),
    its keys gathered through the block table for a paged cache; also the packed rows of q it owns."""
    f = call.fields
    ql, kl = int(call.q_lens[b]), int(call.kv_lens[b])
    if f.varlen:
        q0 = int(call.q_starts[b])
        qb = q[q0:q0 + ql]
        rows = slice(q0, q0 + ql)
    else:
        qb = q[b]
        rows = b
    if f.paged:
        pages = call.block_table[b, :-(-kl // f.page_size)]
        kb = k[pages].reshape(-1, *k.shape[2:])[:kl]
        vb = v[pages].reshape(-1, *v.shape[2:])[:kl]
    elif f.varlen:
        k0 = int(call.k_starts[b])
        kb, vb = k[k0:k0 + kl], v[k0:k0 + kl]
    else:
        kb, vb = k[b], v[b]
    return qb[None], kb[None], vb[None], rows


def serving_reference(q, k, v, call, causal: bool = False, scale: float | None = None, **variant):
    """fp64 attention of every sequence: (out packed like q with head_dim_v, lse in the kernel's
    layout: (heads, total_q) varlen, (batch, heads, q_len) bshd). Causal and windows align
    bottom-right per sequence (reference.attention's rule on the sequence's own lengths); a row
    of a sequence with no key outputs 0 with lse -inf. `call` must have its values read."""
    q, k, v = (to_numpy(t).astype(np.float64) for t in (q, k, v))
    out = np.zeros(call.out_shape)
    lse = np.full(call.lse_shape, -np.inf)
    for b in range(call.batch):
        qb, kb, vb, rows = sequence(q, k, v, call, b)
        if qb.shape[1] == 0 or kb.shape[1] == 0:
            continue  # no row, or no key: out 0, lse -inf
        o, lse_b = attention(qb, kb, vb, causal, scale, batch_offset=b, **variant)
        out[rows] = o[0]
        _put_lse(lse, call, b, rows, lse_b[0])
    return out, lse


def _put_lse(lse, call, b, rows, value):
    if call.fields.varlen:
        lse[:, rows] = value
    else:
        lse[b] = value


def _get_lse(lse, call, b, rows):
    return lse[:, rows][None] if call.fields.varlen else lse[b][None]


@dataclasses.dataclass(frozen=True)
class ServingCheck:
    """check_close (and check_lse) per sequence; `worst` names the sequence furthest past (or
    closest to) its bound: (batch index, q_len, kv_len)."""

    ok: bool
    worst: tuple  # (b, q_len, kv_len) of the sequence with the largest err / bound; () when no row
    out: Check | None  # that sequence's output check
    lse: Check | None  # that sequence's LSE check (None without lse)
    failed: tuple = ()  # batch indices that failed

    def __str__(self):
        if not self.worst:
            return "no query rows: PASS"
        b, ql, kl = self.worst
        text = f"worst sequence {b} (q_len {ql}, kv_len {kl}): {self.out}"
        if self.lse is not None:
            text += f"; lse: max excess {self.lse.err:.2e} <= {self.lse.bound:.1e}: {self.lse.verdict}"
        if self.failed:
            text += f"; {len(self.failed)} sequence(s) fail: {list(self.failed)[:8]}"
        return text


def _ratio(c: Check | None) -> float:
    """How far a check is from its bound (> 1: past it); a failure within its bound (Check.note) counts as inf."""
    if c is None:
        return 0.0
    ratio = c.err / c.bound if c.bound > 0 else 0.0
    return ratio if c.ok or ratio > 1 else math.inf


def _empty_keys_check(out_b: np.ndarray, lse_b, dtype: str) -> tuple:
    """A sequence with no key: every output row 0 (within the dtype's smallest value), lse -inf."""
    err = float(np.abs(out_b).max(initial=0.0)) if np.all(np.isfinite(out_b)) else float("inf")
    bound = TINY[dtype]
    oc = Check(err <= bound, err, bound)
    lc = None
    if lse_b is not None:
        good = bool(np.all(np.isneginf(lse_b)))
        lc = Check(good, 0.0 if good else float("inf"), 0.0)
    return oc, lc


def check_serving_close(out, q, k, v, call, causal: bool, dtype: str, *, lse=None, eps: float | None = None,
                        scale: float | None = None, descales=None, out_dtype: str | None = None, block_n: int | None = None,
                        **variant) -> ServingCheck:
    """Hold every sequence's rows of `out` (packed like q) to reference.check_close, and of `lse`
    (when given) to reference.check_lse, each against that sequence alone (bottom-right causal on
    its own lengths; keys gathered through the block table when paged). Passes when every
    sequence passes; reports the worst one. `call` must have its values read. fp8: `descales`
    (q, k, v; [batch, kv_heads] each or None), `out_dtype` and `block_n` go to the fp8 rule, sequence b taking row b."""
    if dtype not in EPS:
        raise ValueError(f"check_serving_close: dtype {dtype!r}: expected float16 or bfloat16")
    q, k, v = (round_to(to_numpy(t), dtype) for t in (q, k, v))
    out = to_numpy(out).astype(np.float64)
    if tuple(out.shape) != tuple(call.out_shape):
        raise ValueError(f"check_serving_close: out has shape {list(out.shape)}, expected {list(call.out_shape)}")
    if lse is not None:
        lse = to_numpy(lse).astype(np.float64)
        if tuple(lse.shape) != tuple(call.lse_shape):
            raise ValueError(f"check_serving_close: lse has shape {list(lse.shape)}, expected {list(call.lse_shape)}")
    worst, worst_ratio, failed = (), -1.0, []
    worst_checks = (None, None)
    for b in range(call.batch):
        qb, kb, vb, rows = sequence(q, k, v, call, b)
        ql, kl = qb.shape[1], kb.shape[1]
        if ql == 0:
            continue
        ob = out[rows][None]
        lb = None if lse is None else _get_lse(lse, call, b, rows)
        if kl == 0:
            oc, lc = _empty_keys_check(ob, lb, dtype)
        else:
            db = None if descales is None else tuple(None if d is None else to_numpy(d)[b:b + 1] for d in descales)
            oc = check_close(ob, qb, kb, vb, causal, dtype=dtype, eps=eps, scale=scale, batch_offset=b, descales=db,
                             out_dtype=out_dtype, block_n=block_n, **variant)
            lc = None if lb is None else check_lse(lb, qb, kb, vb, causal, dtype=dtype, scale=scale, batch_offset=b,
                                                   descales=db, **variant)
        ok = oc.ok and (lc is None or lc.ok)
        if not ok:
            failed.append(b)
        ratio = max(_ratio(oc), _ratio(lc))
        if ratio > worst_ratio:
            worst, worst_ratio, worst_checks = (b, ql, kl), ratio, (oc, lc)
    return ServingCheck(ok=not failed, worst=worst, out=worst_checks[0], lse=worst_checks[1], failed=tuple(failed))


# -- random inputs for tests and fuzzing ---------------------------------------------------------
@dataclasses.dataclass
class ServingInputs:
    """Packed inputs of one serving call (float32 arrays holding dtype values; int32 arrays)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None
    max_seqlen_q: int | None
    block_table: np.ndarray | None
    seqused_k: np.ndarray | None
    sequences: list  # per sequence (q [q_len, H, D], k [kv_len, HKV, D], v [kv_len, HKV, DV]): the ground truth

    @property
    def keywords(self) -> dict:
        """The call-time keywords this layout takes (None ones left out)."""
        names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "block_table", "seqused_k")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def random_serving_inputs(layout: str, paged: bool, page_size: int | None, dtype: str, head_dim: int,
                          head_dim_v: int | None, seq_lens_q, seq_lens_k, heads: int, kv_heads: int, seed: int = 0,
                          shuffle_pages: bool = True, neighbour_fill: float | None = None,
                          extra_pages: int = 2) -> ServingInputs:
    """Standard-normal sequences packed for `layout` ("bshd" or "varlen") and a dense or paged KV.

    bshd needs equal query lengths (and, dense, equal key lengths). A paged cache gives sequence b
    ceil(seq_lens_k[b] / page_size) pages, plus `extra_pages` pages no sequence uses; with
    `shuffle_pages` the pages are a random permutation, so neighbours in the cache are not
    neighbours in the batch. The block table has one column more than the longest sequence needs;
    its unused entries point at unused pages. `neighbour_fill` (e.g. 1e4) poisons every cache row
    no sequence owns (the tail of a last page, the unused pages): its values are `neighbour_fill`
    and its keys 0, so a leaked key scores 0, as likely as a real one whatever the query's sign,
    and drags the output towards `neighbour_fill`, far outside the tolerance. A dense layout has
    no such rows: there a leak reads the neighbouring sequence, which the per-sequence check sees.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    lq, lk = [int(x) for x in seq_lens_q], [int(x) for x in seq_lens_k]
    if len(lq) != len(lk) or not lq:
        raise ValueError(f"seq_lens_q {lq} and seq_lens_k {lk}: one length each per sequence, at least one sequence")
    if layout == "bshd" and len(set(lq)) != 1:
        raise ValueError(f"bshd needs equal query lengths, got {lq}")
    if layout == "bshd" and not paged and len(set(lk)) != 1:
        raise ValueError(f"a dense bshd KV needs equal key lengths, got {lk}")
    if paged and not page_size:
        raise ValueError("a paged cache needs a page_size")
    dv = head_dim_v or head_dim
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return round_to(rng.standard_normal(shape), dtype)

    seqs = [(normal(a, heads, head_dim), normal(c, kv_heads, head_dim), normal(c, kv_heads, dv)) for a, c in zip(lq, lk)]
    batch = len(lq)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    if layout == "varlen":
        q = np.concatenate([s[0] for s in seqs]) if seqs else np.zeros((0, heads, head_dim), np.float32)
        max_q = max(lq)
    else:
        q = np.stack([s[0] for s in seqs])
        max_q = None
    cu_k = table = used = None
    if paged:
        need = [-(-c // page_size) for c in lk]
        num_pages = max(1, sum(need) + extra_pages)  # TMA needs at least one page
        order = rng.permutation(num_pages) if shuffle_pages else np.arange(num_pages)
        fill = neighbour_fill
        shape_k, shape_v = (num_pages, page_size, kv_heads, head_dim), (num_pages, page_size, kv_heads, dv)
        if fill is None:
            k, v = normal(*shape_k), normal(*shape_v)
        else:
            k, v = np.zeros(shape_k, np.float32), round_to(np.full(shape_v, fill, np.float32), dtype)
        spare = order[sum(need):]
        table = np.empty((batch, max(need) + 1), np.int32)
        nxt = 0
        for b, (_, kb, vb) in enumerate(seqs):
            pages = order[nxt:nxt + need[b]]
            nxt += need[b]
            table[b, :need[b]] = pages
            table[b, need[b]:] = spare[rng.integers(0, len(spare), table.shape[1] - need[b])] if len(spare) else 0
            for j, p in enumerate(pages):
                rows = kb[j * page_size:(j + 1) * page_size]
                k[p, :len(rows)] = rows
                v[p, :len(rows)] = vb[j * page_size:(j + 1) * page_size]
        used = np.asarray(lk, np.int32)
    elif layout == "varlen":
        k = np.concatenate([s[1] for s in seqs])
        v = np.concatenate([s[2] for s in seqs])
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    else:
        k = np.stack([s[1] for s in seqs])
        v = np.stack([s[2] for s in seqs])
    return ServingInputs(q=q, k=k, v=v, cu_seqlens_q=cu_q if layout == "varlen" else None, cu_seqlens_k=cu_k,
                         max_seqlen_q=max_q, block_table=table, seqused_k=used, sequences=seqs)


__all__ = ["ServingCheck", "ServingInputs", "check_serving_close", "random_serving_inputs", "sequence", "serving_reference"]
