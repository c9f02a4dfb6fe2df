"""Serving calls (issue 11, docs/serving.md): packed variable-length batches, a paged KV cache,
split-KV decode. The host side of the kernels' ABI (notes: serving-abi), with no GPU and no torch
import:

- `check_serving` validates a call's tensors and keywords against the spec's serving fields and
  returns a `ServingCall`: the extents of the kernel's T.dynamic names, each sequence's lengths,
  the resolved number of splits and the kernel's extra arguments in the ABI's order;
- `choose_splits` is the split-KV heuristic `num_splits="auto"` uses (FlashAttention-3's rule).

The fp64 reference of a call (`serving_reference`, `check_serving_close`, `random_serving_inputs`)
is attngen/reference/serving.py's; the KV-cache append's call (`check_append`) is run/append.py's.

The spec is read by attribute (`plan.spec.layout`, `.paged_kv`, `.page_size`, `.splits`, with
the ABI's defaults when a field is absent), so this module works with a Plan, a Spec, or any
object that carries those names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from attngen import hw
from attngen.kernels.common.plan import DEFAULT_PAGE_SIZE
from attngen.reference.forward import InputError
from attngen.spec import LAYOUTS

KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "block_table", "seqused_k", "num_splits")

# The split heuristic (choose_splits): FlashAttention-3's hopper/heuristics.h num_splits_heuristic.
FILL_FRACTION = 0.8  # a grid of at least this fraction of the SMs is not split
MIN_TILES_TO_SPLIT = 5  # 4 or fewer KV tiles are never split (a combine costs more than it saves)
MAX_SPLITS = 128  # FA3's cap (flash_api.cpp passes 128)
EFFICIENCY_FRACTION = 0.85  # the fewest splits whose wave efficiency is within 85% of the best


# -- the spec's serving fields -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Serving:
    """A spec's fields as the serving ABI reads them (resolved: page size and tile sizes known)."""

    layout: str  # "bshd" | "varlen"
    paged: bool
    page_size: int | None  # keys per page (paged only)
    splits: Any  # "auto" | int >= 1
    head_dim: int
    head_dim_v: int
    gqa_group: int
    block_m: int | None
    block_n: int | None
    lse: bool = False
    aligned: bool = False

    @property
    def varlen(self) -> bool:
        return self.layout == "varlen"

    @property
    def split(self) -> bool:
        return self.splits != 1

    @property
    def pack_gqa(self) -> bool:
        """Pack GQA (derived, serving-abi): on for a split kernel whose KV heads serve several query heads."""
        return self.split and self.gqa_group > 1

    @property
    def uses_serving(self) -> bool:
        """Whether any serving feature is on (else the kernel is today's dense BSHD one)."""
        return self.varlen or self.paged or self.split


def serving_fields(plan_like) -> Serving:
    """The serving fields of a Plan, a Spec, or an object with a `.spec` or the fields themselves.

    Absent fields take the ABI's defaults (layout "bshd", paged_kv false, splits 1), so a small
    stand-in object works in tests. An open page size becomes the plan's DEFAULT_PAGE_SIZE; open
    tile sizes are resolved by plan.resolve when the object is a real Spec.
    """
    spec = getattr(plan_like, "spec", plan_like)
    if getattr(spec, "block_n", None) is None or getattr(spec, "block_m", None) is None:
        from attngen.kernels.fwd.plan import resolve
        from attngen.spec import Spec

        if isinstance(spec, Spec):
            spec = resolve(spec)
    layout = getattr(spec, "layout", "bshd")
    paged = bool(getattr(spec, "paged_kv", False))
    page_size = getattr(spec, "page_size", None)
    if paged and page_size is None:
        page_size = DEFAULT_PAGE_SIZE
    head_dim = spec.head_dim
    return Serving(
        layout=layout, paged=paged, page_size=page_size if paged else None, splits=getattr(spec, "splits", 1),
        head_dim=head_dim, head_dim_v=getattr(spec, "head_dim_v", None) or head_dim, gqa_group=spec.gqa_group,
        block_m=getattr(spec, "block_m", None), block_n=getattr(spec, "block_n", None),
        lse=bool(getattr(spec, "lse", False)), aligned=bool(getattr(spec, "aligned", False)),
    )


# -- the split heuristic -----------------------------------------------------------------------
def choose_splits(batch: int, heads_blocks: int, q_blocks: int, max_kv_tiles: int, sms: int = hw.SM_COUNT,
                  max_splits: int = MAX_SPLITS) -> int:
    """The number of KV splits `num_splits="auto"` launches (FlashAttention-3's num_splits_heuristic).

    `batch * heads_blocks * q_blocks` is the grid without splitting (heads_blocks: query heads,
    or KV heads when GQA is packed; q_blocks: row tiles of the longest sequence); `max_kv_tiles`
    the KV tiles of the longest key sequence (ceil(kv_len / block_n)). The rule:

    1. a grid of at least FILL_FRACTION (80%) of the SMs already keeps them busy: 1;
    2. MIN_TILES_TO_SPLIT - 1 (4) or fewer KV tiles are not worth a combine: 1;
    3. otherwise, for s = 1 .. min(max_splits, sms, max_kv_tiles), the wave efficiency of
       blocks * s CTAs on `sms` SMs, e(s) = w / ceil(w) with w = blocks * s / sms (the share of
       the last wave's SMs that have work); the answer is the smallest s whose e(s) is at least
       EFFICIENCY_FRACTION (85%) of the best: more splits read and write more partials.

    FA3 also splits a filled grid when one KV head does not fit in L2; this rule does not (the
    kernels here have no persistent scheduler for it to pay off).
    """
    blocks = batch * heads_blocks * q_blocks
    if blocks <= 0 or blocks >= FILL_FRACTION * sms or max_kv_tiles < MIN_TILES_TO_SPLIT:
        return 1
    top = max(1, min(max_splits, sms, max_kv_tiles))
    eff = []
    for s in range(1, top + 1):
        waves = blocks * s / sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= EFFICIENCY_FRACTION * best)


# -- validation --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServingCall:
    """One validated call: what the kernel is launched with and what the reference slices by."""

    fields: Serving
    batch: int
    heads: int
    kv_heads: int
    dims: dict  # T.dynamic name -> extent (batch, heads, kv_heads, q_len/kv_len or total_q/total_k, num_pages, ...)
    max_seqlen_q: int  # rows of the longest sequence the grid covers (q_len for bshd)
    max_kv_len: int  # the key-length bound the split heuristic used
    num_splits: int  # 1 for a kernel without splits
    arg_names: tuple  # the kernel's parameters after the variant tensors, in the ABI's order
    args: tuple  # the caller's objects for them (max_seqlen_q as a Python int)
    arrays: dict  # name -> int32 numpy copy (values read) or None; what the CPU emulator passes
    q_lens: np.ndarray | None = None  # int64 (batch,): each sequence's query rows (None: values not read)
    kv_lens: np.ndarray | None = None  # int64 (batch,): each sequence's keys
    q_starts: np.ndarray | None = None  # int64 (batch,): first packed row of each sequence (varlen)
    k_starts: np.ndarray | None = None  # int64 (batch,): first packed key row (dense varlen)
    block_table: np.ndarray | None = None  # int32 host copy (paged)

    @property
    def total_q(self) -> int:
        return self.dims.get("total_q", self.batch * self.dims.get("q_len", 0))

    @property
    def empty(self) -> bool:
        """No query row at all: there is nothing to launch (an empty grid or an empty TMA tensor)."""
        return self.total_q == 0

    @property
    def out_shape(self) -> tuple:
        """O (and each split's partial): packed like q, with head_dim_v."""
        dv = self.fields.head_dim_v
        if self.fields.varlen:
            return (self.dims["total_q"], self.heads, dv)
        return (self.batch, self.dims["q_len"], self.heads, dv)

    @property
    def lse_shape(self) -> tuple:
        """LSE: (heads, total_q) for varlen (FA3's layout), (batch, heads, q_len) for bshd."""
        if self.fields.varlen:
            return (self.heads, self.dims["total_q"])
        return (self.batch, self.heads, self.dims["q_len"])

    @property
    def o_partial_shape(self) -> tuple:
        return (self.num_splits, *self.out_shape)

    @property
    def lse_partial_shape(self) -> tuple:
        return (self.num_splits, *self.lse_shape)

    @property
    def grid(self) -> tuple:
        """The main kernel's (x, y, z): serving-abi's grid rule."""
        f = self.fields
        rows = self.max_seqlen_q * (f.gqa_group if f.pack_gqa else 1)
        x = -(-rows // f.block_m) if f.block_m else 0
        y = self.kv_heads if f.pack_gqa else self.heads
        z = self.batch * (self.num_splits if f.split else 1)
        return (x, y, z)

    def host_args(self) -> list:
        """The extra arguments as the CPU emulator takes them: int32 numpy arrays, then max_seqlen_q
        as an int (needs the values read: check_serving's default)."""
        out = []
        for name, value in zip(self.arg_names, self.args):
            if name == "max_seqlen_q":
                out.append(int(value))
            elif self.arrays.get(name) is None:
                raise ValueError(f"{name}: the values were not read (check_serving(..., read_values=False))")
            else:
                out.append(self.arrays[name])
        return out


def _describe(x) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape"):
        return f"a tensor of shape {list(x.shape)}"
    return repr(x) if isinstance(x, (int, float, str)) else type(x).__name__


def _shape(x, name: str) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise InputError(name, type(x).__name__, "a torch.Tensor or a numpy array")
    return tuple(int(s) for s in shape)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_tensor(name: str, x, shape_text: str, rank: int) -> tuple:
    """An int32 tensor argument: torch tensor or numpy array, int32, `rank` dimensions."""
    if not (hasattr(x, "detach") or isinstance(x, np.ndarray)):
        raise InputError(name, _describe(x), f"an int32 torch.Tensor or numpy array {shape_text}")
    kind = str(x.dtype)
    if kind not in ("torch.int32", "int32"):
        want = "torch.int32" if hasattr(x, "detach") else "int32"
        raise InputError(f"{name}.dtype", kind, f"{want} ({name} is int32, as FlashAttention-3 takes it)")
    shape = _shape(x, name)
    if len(shape) != rank:
        raise InputError(f"{name}.shape", list(shape), shape_text)
    return shape


def _host(name: str, x) -> np.ndarray:
    """The values of a small int tensor on the host: one copy for a device tensor."""
    if hasattr(x, "detach"):
        if str(getattr(x, "device", "")) == "meta":
            raise InputError(f"{name}.device", "meta", "a tensor with values (its lengths are read on the host)")
        x = x.detach().cpu().numpy()
    return np.asarray(x, np.int32)


# What each keyword needs: (needed(f), why it is needed, how to enable it when it is not)
_USES = {
    "cu_seqlens_q": (lambda f: f.varlen, 'the spec has layout = "varlen"',
                     'the spec has layout = "bshd"; set layout = "varlen" for packed variable-length sequences'),
    "max_seqlen_q": (lambda f: f.varlen, 'the spec has layout = "varlen"',
                     'the spec has layout = "bshd"; set layout = "varlen" for packed variable-length sequences'),
    "cu_seqlens_k": (lambda f: f.varlen and not f.paged, 'the spec has layout = "varlen" and a dense KV',
                     None),
    "block_table": (lambda f: f.paged, "the spec has paged_kv = true",
                    "the spec has paged_kv = false; set paged_kv = true (and page_size) for a paged KV cache"),
    "seqused_k": (lambda f: f.paged, "the spec has paged_kv = true",
                  "the spec has paged_kv = false; set paged_kv = true (and page_size) for a paged KV cache"),
    "num_splits": (lambda f: False, "",
                   'the spec has splits = 1; set splits = "auto" or an integer for a split-KV kernel'),
}
_EXPECT = {
    "cu_seqlens_q": "an int32 tensor [batch + 1] of packed query row offsets",
    "cu_seqlens_k": "an int32 tensor [batch + 1] of packed key row offsets",
    "max_seqlen_q": "an int, the longest query sequence",
    "block_table": "an int32 tensor [batch, max_pages] of page indices",
    "seqused_k": "an int32 tensor [batch] of key lengths in the cache",
}


def _check_keywords(f: Serving, given: dict) -> None:
    """A keyword the spec does not use, then one it needs and did not get."""
    for name in KEYWORDS:
        value = given.get(name)
        needed, why, enable = _USES[name]
        if value is None or needed(f) or (name == "num_splits" and f.split):
            continue
        if name == "cu_seqlens_k":
            enable = ("a paged spec (paged_kv = true) reads each sequence's key length from seqused_k"
                      if f.paged else 'the spec has layout = "bshd"; set layout = "varlen" for packed sequences')
        raise InputError(name, _describe(value), f"None: {enable}")
    for name in KEYWORDS:
        needed, why, _ = _USES[name]
        if needed(f) and given.get(name) is None:
            raise InputError(name, None, f"{_EXPECT[name]}: {why}")


def _check_num_splits(value) -> None:
    if value is None or (isinstance(value, str) and value == "auto"):
        return
    if not _is_int(value) or value < 1:
        raise InputError("num_splits", _describe(value), 'None, "auto" or an int >= 1')


def _check_offsets(name: str, cu: np.ndarray, total: int, total_text: str) -> np.ndarray:
    """cu_seqlens: starts at 0, never decreases, ends within the packed rows (rows past the last
    offset are padding, as in a server's fixed token buffer: no kernel writes them or uses their values)."""
    if cu[0] != 0:
        raise InputError(f"{name}[0]", int(cu[0]), "0: the first sequence starts at packed row 0")
    lens = np.diff(cu.astype(np.int64))
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise InputError(f"{name}[{i}]", int(cu[i]),
                         f"at least {name}[{i - 1}] = {int(cu[i - 1])}: offsets never decrease "
                         f"(sequence {i - 1} would have length {int(lens[i - 1])})")
    if int(cu[-1]) > total:
        raise InputError(f"{name}[{len(cu) - 1}]", int(cu[-1]),
                         f"at most {total} = {total_text}: the last offset ends the packed rows")
    return lens


def check_serving(plan_like, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, block_table=None,
                  seqused_k=None, num_splits=None, read_values: bool = True) -> ServingCall:
    """Validate a call against the spec's serving fields; every bad input is an InputError.

    q, k, v: torch tensors or numpy arrays (only their shapes are read here; dtypes, layouts and
    devices are the caller's checks). The int32 tensors may live on a GPU: their values are read
    after one host copy each. `read_values=False` reads no value (no copy, no sync: for timing
    loops); then lengths, max_seqlen_q against the data, block_table and seqused_k entries go
    unchecked, and the split heuristic of a dense varlen call still copies cu_seqlens_k.
    """
    f = serving_fields(plan_like)
    if f.layout not in LAYOUTS:
        raise InputError("spec.layout", repr(f.layout), f"one of {', '.join(map(repr, LAYOUTS))}")
    given = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
             "block_table": block_table, "seqused_k": seqused_k, "num_splits": num_splits}
    _check_keywords(f, given)
    _check_num_splits(num_splits)

    # q, k, v: rank, head dims, heads
    qs, ks, vs = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    q_text = "[total_q, heads, head_dim]" if f.varlen else "[batch, q_len, heads, head_dim]"
    if f.paged:
        k_text = "[num_pages, page_size, kv_heads, head_dim]"
    else:
        k_text = "[total_k, kv_heads, head_dim]" if f.varlen else "[batch, kv_len, kv_heads, head_dim]"
    if len(qs) != (3 if f.varlen else 4):
        raise InputError("q.shape", list(qs), f"{len(q_text.split(','))} dimensions {q_text}")
    k_rank = 4 if (f.paged or not f.varlen) else 3
    for name, s in (("k", ks), ("v", vs)):
        if len(s) != k_rank:
            text = k_text.replace("head_dim", "head_dim_v") if name == "v" else k_text
            raise InputError(f"{name}.shape", list(s), f"{k_rank} dimensions {text}")
    if qs[-1] != f.head_dim:
        raise InputError(f"q.shape[{len(qs) - 1}] (head_dim)", qs[-1], f"{f.head_dim}, the spec's head_dim")
    if ks[-1] != f.head_dim:
        raise InputError(f"k.shape[{k_rank - 1}] (head_dim)", ks[-1], f"{f.head_dim}, the spec's head_dim")
    if vs[-1] != f.head_dim_v:
        raise InputError(f"v.shape[{k_rank - 1}] (head_dim_v)", vs[-1], f"{f.head_dim_v}, the spec's head_dim_v")
    if vs[:-1] != ks[:-1]:
        raise InputError("v.shape", list(vs), f"{[*ks[:-1], f.head_dim_v]}, the shape of k with head_dim_v")
    heads, kv_heads = qs[-2], ks[-2]
    if kv_heads < 1:
        raise InputError(f"k.shape[{k_rank - 2}] (kv_heads)", kv_heads, "at least 1")
    if heads < 1 or heads % kv_heads:
        raise InputError(f"q.shape[{len(qs) - 2}] (heads)", heads, f"a positive multiple of kv_heads = {kv_heads}")
    if heads // kv_heads != f.gqa_group:
        raise InputError("heads / kv_heads (gqa group)", f"{heads}/{kv_heads} = {heads // kv_heads}",
                         f"{f.gqa_group}, the spec's gqa_group (query heads per KV head)")
    if f.paged:
        if ks[1] != f.page_size:
            raise InputError("k.shape[1] (page_size)", ks[1], f"{f.page_size}, the spec's page_size")
        if ks[0] < 1:
            raise InputError("k.shape[0] (num_pages)", ks[0], "at least 1: TMA cannot describe an empty cache")
    elif f.varlen and ks[0] < 1:
        raise InputError("k.shape[0] (total_k)", ks[0],
                         "at least 1: TMA cannot describe an empty tensor (pad k and v with one unused row)")

    # the batch and the int tensors' shapes
    if f.varlen:
        cq_shape = _int_tensor("cu_seqlens_q", cu_seqlens_q, "[batch + 1]", 1)
        if cq_shape[0] < 1:
            raise InputError("cu_seqlens_q.shape", list(cq_shape), "[batch + 1]: at least one entry, 0")
        batch, batch_from = cq_shape[0] - 1, "cu_seqlens_q (batch = len(cu_seqlens_q) - 1)"
    else:
        batch, batch_from = qs[0], "q.shape[0]"
        if batch < 1:
            raise InputError("q.shape[0] (batch)", batch, "at least 1")
        if qs[1] < 1:
            raise InputError("q.shape[1] (q_len)", qs[1], "at least 1")
        if not f.paged:
            if ks[0] != batch:
                raise InputError("k.shape[0] (batch)", ks[0], f"{batch}, the batch of q")
            if ks[1] < 1:
                raise InputError("k.shape[1] (kv_len)", ks[1], "at least 1")
    if f.varlen and not f.paged:
        ck_shape = _int_tensor("cu_seqlens_k", cu_seqlens_k, "[batch + 1]", 1)
        if ck_shape[0] != batch + 1:
            raise InputError("cu_seqlens_k.shape", list(ck_shape),
                             f"[{batch + 1}]: batch + 1 with batch = {batch} from {batch_from}")
    if f.paged:
        bt_shape = _int_tensor("block_table", block_table, "[batch, max_pages]", 2)
        if bt_shape[0] != batch:
            raise InputError("block_table.shape[0] (batch)", bt_shape[0], f"{batch}, the batch of {batch_from}")
        if bt_shape[1] < 1:
            raise InputError("block_table.shape[1] (max_pages)", bt_shape[1], "at least 1")
        su_shape = _int_tensor("seqused_k", seqused_k, "[batch]", 1)
        if su_shape[0] != batch:
            raise InputError("seqused_k.shape[0] (batch)", su_shape[0], f"{batch}, the batch of {batch_from}")
    if f.varlen and not _is_int(max_seqlen_q):
        raise InputError("max_seqlen_q", _describe(max_seqlen_q), "an int, the longest query sequence")
    if f.varlen and max_seqlen_q < 0:
        raise InputError("max_seqlen_q", int(max_seqlen_q), "0 or more")

    # values
    arrays = {n: None for n in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")}
    q_lens = kv_lens = q_starts = k_starts = table = None
    if read_values:
        if f.varlen:
            cu = arrays["cu_seqlens_q"] = _host("cu_seqlens_q", cu_seqlens_q)
            q_lens, q_starts = _check_offsets("cu_seqlens_q", cu, qs[0], "q.shape[0] (total_q)"), cu[:-1].astype(np.int64)
            longest = int(q_lens.max(initial=0))
            if max_seqlen_q < longest:
                b = int(np.argmax(q_lens))
                raise InputError("max_seqlen_q", int(max_seqlen_q),
                                 f"at least {longest}, the longest query sequence (sequence {b} of cu_seqlens_q)")
        else:
            q_lens = np.full(batch, qs[1], np.int64)
            q_starts = np.arange(batch, dtype=np.int64) * qs[1]
        if f.paged:
            used = arrays["seqused_k"] = _host("seqused_k", seqused_k)
            table = arrays["block_table"] = _host("block_table", block_table)
            cap = bt_shape[1] * f.page_size
            bad = np.flatnonzero((used < 0) | (used > cap))
            if bad.size:
                b = int(bad[0])
                if used[b] < 0:
                    raise InputError(f"seqused_k[{b}]", int(used[b]), "0 or more (a key count)")
                raise InputError(f"seqused_k[{b}]", int(used[b]),
                                 f"at most max_pages * page_size = {bt_shape[1]} * {f.page_size} = {cap} "
                                 f"(block_table.shape[1] pages of page_size keys)")
            pages = -(-used.astype(np.int64) // f.page_size)  # the leading entries each sequence uses
            owned = np.arange(bt_shape[1])[None, :] < pages[:, None]
            bad = np.argwhere(owned & ((table < 0) | (table >= ks[0])))
            if bad.size:
                b, j = (int(x) for x in bad[0])
                raise InputError(f"block_table[{b}, {j}]", int(table[b, j]),
                                 f"a page index in [0, {ks[0]}) (num_pages = k.shape[0]): sequence {b} uses its "
                                 f"first {int(pages[b])} entries (seqused_k[{b}] = {int(used[b])}, page_size {f.page_size})")
            kv_lens = used.astype(np.int64)
        elif f.varlen:
            ck = arrays["cu_seqlens_k"] = _host("cu_seqlens_k", cu_seqlens_k)
            kv_lens, k_starts = _check_offsets("cu_seqlens_k", ck, ks[0], "k.shape[0] (total_k)"), ck[:-1].astype(np.int64)
        else:
            kv_lens = np.full(batch, ks[1], np.int64)
        if f.aligned:
            for what, lens, step, field in (("query", q_lens, f.block_m, "block_m"), ("key", kv_lens, f.block_n, "block_n")):
                bad = np.flatnonzero(lens % step) if step else np.array([])
                if bad.size:
                    b = int(bad[0])
                    raise InputError(f"sequence {b} {what} length", int(lens[b]),
                                     f"a multiple of {field} = {step} (the spec is aligned: no bounds masks)")

    # the bound the grid and the heuristic use
    rows = int(max_seqlen_q) if f.varlen else qs[1]
    if f.paged:
        max_kv = bt_shape[1] * f.page_size  # FA3 uses the page table's width for a paged cache too
    elif f.varlen:
        if kv_lens is None and f.split and (num_splits == "auto" or (num_splits is None and f.splits == "auto")):
            kv_lens = np.diff(_host("cu_seqlens_k", cu_seqlens_k).astype(np.int64))
        max_kv = int(kv_lens.max(initial=0)) if kv_lens is not None else ks[0]
    else:
        max_kv = ks[1]

    # splits
    n_splits = 1
    if f.split:
        choice = num_splits if num_splits is not None else f.splits
        if choice == "auto":
            heads_blocks = kv_heads if f.pack_gqa else heads
            q_rows = rows * (f.gqa_group if f.pack_gqa else 1)
            n_splits = choose_splits(batch, heads_blocks, -(-q_rows // f.block_m), -(-max_kv // f.block_n))
        else:
            n_splits = int(choice)

    dims = {"batch": batch, "heads": heads, "kv_heads": kv_heads}
    if f.varlen:
        dims["total_q"] = qs[0]
        if not f.paged:
            dims["total_k"] = ks[0]
    else:
        dims["q_len"] = qs[1]
        if not f.paged:
            dims["kv_len"] = ks[1]
    if f.paged:
        dims["num_pages"], dims["max_pages"] = ks[0], bt_shape[1]
    if f.split:
        dims["num_splits"] = n_splits

    names, args = [], []
    for name, needed in (("cu_seqlens_q", f.varlen), ("cu_seqlens_k", f.varlen and not f.paged),
                         ("block_table", f.paged), ("seqused_k", f.paged), ("max_seqlen_q", f.varlen)):
        if needed:
            names.append(name)
            args.append(int(max_seqlen_q) if name == "max_seqlen_q" else given[name])
    call = ServingCall(fields=f, batch=batch, heads=heads, kv_heads=kv_heads, dims=dims, max_seqlen_q=rows,
                       max_kv_len=max_kv, num_splits=n_splits, arg_names=tuple(names), args=tuple(args), arrays=arrays,
                       q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, k_starts=k_starts, block_table=table)
    _check_limits(call, qs, ks, vs)
    return call


def _check_limits(call: ServingCall, qs, ks, vs) -> None:
    """The launch's limits: CUDA grid extents, int32 indexing."""
    f = call.fields
    x, y, z = call.grid
    if y > hw.GRID_YZ_MAX:
        what = "kv_heads (GQA is packed)" if f.pack_gqa else "heads"
        raise InputError(what, y, f"at most {hw.GRID_YZ_MAX} (grid y)")
    if z > hw.GRID_YZ_MAX:
        if f.split:
            raise InputError("num_splits", call.num_splits,
                             f"at most {hw.GRID_YZ_MAX // call.batch}: batch * num_splits = {z} is grid z, at most {hw.GRID_YZ_MAX}")
        raise InputError("batch", call.batch, f"at most {hw.GRID_YZ_MAX} (grid z)")
    if x > hw.GRID_X_MAX:
        raise InputError("max_seqlen_q", call.max_seqlen_q, f"a grid x of at most {hw.GRID_X_MAX} blocks")
    sizes = {"q": math.prod(qs), "k": math.prod(ks), "v": math.prod(vs), "out": math.prod(call.out_shape)}
    if f.split:
        sizes["O_partial"] = math.prod(call.o_partial_shape)
    for name, n in sizes.items():
        if n > hw.INT32_MAX:
            hint = " (use fewer splits)" if name == "O_partial" else ""
            raise InputError(f"{name}.numel()", n, f"at most {hw.INT32_MAX}: the kernel indexes with int32{hint}")


__all__ = [
    "DEFAULT_PAGE_SIZE", "KEYWORDS", "LAYOUTS", "MAX_SPLITS", "Serving", "ServingCall", "check_serving", "choose_splits",
    "serving_fields",
]
