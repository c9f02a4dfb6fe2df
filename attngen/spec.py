"""The user's declarative description of one FA3 forward kernel: their choices, nothing more.

A `Spec` holds what the user wrote (fields left out keep their defaults; `block_m`,
`block_n` and `pingpong` may stay None, meaning "choose for me"). Each field is checked
on its own here: type, range, unknown keys. Everything derived (tile sizes, threads,
register split, shared memory, barrier numbering, the kernel's name and hash) and every
budget lives in `plan.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from attngen import expr
from attngen.hw import DTYPES, E4M3, FP8_K_STEP, HALF_DTYPES, OUT_DTYPES, WGMMA_M

HEAD_DIMS = (64, 96, 128, 192, 256)
MAX_CONSUMERS = 3
MAX_STAGES = 4
MAX_GQA_GROUP = 1024
BLOCK_N_STEP = 16  # wgmma N granularity and the PV reduction step
MAX_BLOCK_N = 256  # wgmma N
LAYOUTS = ("bshd", "varlen")
PAGE_SIZE_STEP = 16  # a page holds whole K tiles, and a tile is a multiple of 16 keys
MAX_PAGE_SIZE = 4096
MAX_SPLITS = 128
SHOWN_CHARS = 80  # of an expression in an error message


class SpecError(ValueError):
    """A spec that cannot become a kernel: names the field, the value and what would be valid."""

    def __init__(self, field: str, value: Any, valid: str):
        self.field, self.value, self.valid = field, value, valid
        super().__init__(f"spec field `{field}` = {toml_value(value)}: {valid}")


def ruled_out(field: str, value: Any, valid: str, given: str, why: str) -> SpecError:
    """A value that another field's value rules out: what would be valid beside it, and why."""
    return SpecError(field, value, f"expected {valid} with {given}: {why}")


def toml_value(value: Any) -> str:
    """A value as the user would write it in a spec file (true, "yes", 128)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return "(none)"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


class _Shown:
    """A value's description, printed as is in an error message (not quoted as a string)."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def plain_value(field: str, value: Any) -> Any:
    """A NumPy scalar, or a 0-d CPU tensor or array, as the Python bool, int or float it holds;
    anything else unchanged (the field's own check then judges it). A 0-d tensor on a GPU is
    refused: reading its value would wait for the device (a sync hidden in a spec)."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, (list, tuple, dict)):
        return value  # a Python value needs nothing (np.float64 is a float subclass: not this)
    if getattr(value, "ndim", None) != 0 or not hasattr(value, "item"):
        return value
    device = getattr(value, "device", "cpu")
    kind = getattr(device, "type", device)  # torch.device("cuda:0").type; numpy's .device is "cpu"
    if kind != "cpu":
        raise SpecError(field, _Shown(f"a 0-d {device} tensor"), "a Python number, a NumPy scalar or a 0-d CPU tensor: "
                        "reading a device tensor's value waits for the device (pass x.item() if you mean to)")
    return value.item()


def type_name(value: Any) -> str:
    """The TOML-ish name of a value's type, for 'expected an integer, got a string'."""
    if isinstance(value, bool):
        return "a boolean"
    kind = type(value)
    return {int: "an integer", float: "a float", str: "a string", list: "an array", tuple: "an array",
            dict: "a table", type(None): "nothing"}.get(kind, f"{kind.__module__.split('.')[0]}.{kind.__qualname__}")


@dataclasses.dataclass(frozen=True, init=False)
class Spec:
    """One FlashAttention-3 forward kernel for sm_90a. See docs/spec-reference.md."""

    head_dim: int = 128
    dtype: str = "float16"
    # O's element type: None is the dtype itself for 16-bit kernels and "bfloat16" for fp8 (FA3's);
    # a 16-bit kernel writes O in its own dtype, so only fp8 takes another value (docs/fp8.md).
    out_dtype: str | None = None
    causal: bool = False
    gqa_group: int = 1
    consumers: int = 2
    k_stages: int = 2
    v_stages: int = 2
    block_m: int | None = None  # None: 64 x consumers
    block_n: int | None = None  # None: the largest tile within the budgets (plan.py)
    pingpong: bool | None = None  # None: on when there are 2+ consumers
    aligned: bool = False
    # "split": the steady loop as two copies, masked tiles apart (the seed's and FlashAttention-3's
    # form); "one": one loop that masks under a per-tile test (faster to build: docs/build.md).
    steady_loop: str = "one"
    # Variants (docs/variants.md). At their defaults they leave the kernel, its name, hash and
    # header byte-identical to a kernel of a spec without these fields.
    lse: bool = False  # also return the natural-log log-sum-exp per row, float32 (batch, heads, q_len)
    window: tuple = (-1, -1)  # sliding window [left, right] around the bottom-right diagonal; -1: unbounded
    softcap: float = 0.0  # > 0: score = softcap * tanh(score / softcap), before the masks
    alibi: bool = False  # score -= slope[h] * |i + kv_len - q_len - j|; slopes float32 (heads,) at call time
    sinks: bool = False  # a per-head logit sink[h] joins each row's softmax denominator; float32 (heads,)
    head_dim_v: int | None = None  # V and O head dim; None: head_dim
    score_mod: str = ""  # expression over score, b, h, q_idx, kv_idx and call-time tensors (attngen/expr.py)
    mask_mod: str = ""  # boolean expression over b, h, q_idx, kv_idx and call-time tensors
    # true: the kernel takes a block mask at call time (FlexAttention's kv_num_blocks/kv_indices and
    # full_*, int32): it loads only the listed KV tiles and runs mask_mod on the partial ones only
    block_mask: bool = False
    # Serving (docs/serving.md); at their defaults they too leave the kernel byte-identical.
    layout: str = "bshd"  # "varlen": q, k, v packed (total, heads, D) with cu_seqlens at call time
    paged_kv: bool = False  # K and V in a paged cache (num_pages, page_size, kv_heads, D) with a block_table
    page_size: int | None = None  # keys per page (paged_kv only); None: DEFAULT_PAGE_SIZE
    splits: int | str = 1  # split-KV: partial outputs per split, merged by a combine kernel; "auto": at call time
    # an fp8 KV cache (docs/fp8-kv-cache.md): K and V stored in e4m3 with float32 k_descale/v_descale
    # per (batch, or page of a paged cache; KV head), dequantized into the 16-bit GEMMs; None: dtype
    kv_dtype: str | None = None
    # The backward pass (docs/backward.md); the forward kernel ignores it.
    deterministic: bool = False  # the backward sums dQ (and GQA's dK/dV) in one fixed order: no atomics
    # call-time tensors the backward differentiates (float tensors the score_mod reads, alibi_slopes):
    # their gradients scattered into their own shapes (docs/backward.md, "Learnable tensors")
    learnable: tuple = ()
    # "single": a block per tile; "persistent": a block per SM loops over tiles an atomic counter hands
    # out (longest first under causal or a window; docs/build.md). At "single" the kernel is unchanged.
    scheduler: str = "single"
    # fp8 only (docs/fp8.md): "keys" takes v as [batch, seqlen_k, kv_heads, head_dim_v], like k, and the
    # kernel transposes each V tile in shared memory; "transposed" takes v already stored as
    # [batch, kv_heads, head_dim_v, seqlen_k] (FA3's V_colmajor) and TMA-loads it straight into V^T.
    v_layout: str = "keys"

    def __init__(self, **fields):
        # Keyword-only, and a typo is a SpecError with the nearest field, not a TypeError.
        check_keys(fields, "attngen.Spec(...)")
        for f in dataclasses.fields(self):
            value = plain_value(f.name, fields.get(f.name, f.default))
            if f.name == "window" and isinstance(value, (list, tuple)):
                value = tuple(plain_value(f.name, x) for x in value)  # TOML arrays: a tuple keeps the spec hashable
            if f.name == "learnable" and isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
                value = tuple(sorted(set(value)))  # one kernel per set of names
            if f.name == "softcap" and type(value) is int:
                value = float(value)  # 30 and 30.0 are one spec
            object.__setattr__(self, f.name, value)
        check_fields(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def canonical_dict(self) -> dict[str, Any]:
        """The fields that identify the kernel: variant fields at their defaults are left out,
        so kernels that use no variant keep their names, hashes and headers."""
        out = {}
        for key, value in self.to_dict().items():
            if key in VARIANT_DEFAULTS and (value == VARIANT_DEFAULTS[key] or (key == "head_dim_v" and value == self.head_dim)):
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


FIELDS = tuple(f.name for f in dataclasses.fields(Spec))
STEADY_LOOPS = ("one", "split")
SCHEDULERS = ("single", "persistent")
VARIANT_DEFAULTS = {"out_dtype": None,
                    "steady_loop": "one", "lse": False, "window": (-1, -1), "softcap": 0.0, "alibi": False, "sinks": False,
                    "head_dim_v": None, "score_mod": "", "mask_mod": "", "block_mask": False,
                    "layout": "bshd", "paged_kv": False, "page_size": None, "splits": 1,
                    "deterministic": False, "learnable": (), "scheduler": "single"}


VARIANT_DEFAULTS["v_layout"] = "keys"  # left out of names and hashes at its default (docs/fp8.md)
V_LAYOUTS = ("keys", "transposed")
VARIANT_DEFAULTS["kv_dtype"] = None  # an fp8 KV cache (docs/fp8-kv-cache.md): left out of names and hashes at its default


def did_you_mean(name: str, choices, where: str = "") -> str:
    """"did you mean `x`? " for the choice nearest a misspelt name (`where` said after it), or "" when none is near."""
    near = difflib.get_close_matches(str(name), list(choices), n=1)
    return f"did you mean `{near[0]}`{where}? " if near else ""


def check_keys(data: dict, source: str) -> None:
    for key, value in data.items():
        if key not in FIELDS:
            raise SpecError(str(key), value, f"unknown key in {source}; {did_you_mean(key, FIELDS)}valid keys: {', '.join(FIELDS)}")


def _need_int(field: str, v, valid: str) -> None:
    if type(v) is not int:
        raise SpecError(field, v, f"expected an integer ({valid}), got {type_name(v)}")


def _need_range(s: Spec, field: str, lo: int, hi: int) -> None:
    v = getattr(s, field)
    _need_int(field, v, f"from {lo} to {hi}")
    if not lo <= v <= hi:
        raise SpecError(field, v, f"expected an integer from {lo} to {hi}")


def _need_bool(s: Spec, field: str, optional: bool = False) -> None:
    v = getattr(s, field)
    if not (isinstance(v, bool) or (optional and v is None)):
        raise SpecError(field, v, f"expected true or false, got {type_name(v)}")


def check_fields(s: Spec) -> None:
    """Each field on its own (and the two that only make sense against `consumers`)."""
    head_dims = ", ".join(map(str, HEAD_DIMS))
    _need_int("head_dim", s.head_dim, f"one of {head_dims}")
    if s.head_dim not in HEAD_DIMS:
        raise SpecError("head_dim", s.head_dim, f"expected one of {head_dims}")
    if not isinstance(s.dtype, str):
        raise SpecError("dtype", s.dtype, f'expected a string, "float16", "bfloat16" or "{E4M3}", '
                        f'got {type_name(s.dtype)}')
    if s.dtype not in DTYPES:
        raise SpecError("dtype", s.dtype, f'expected "float16", "bfloat16" or "{E4M3}" (fp8 Q, K and V)')
    check_out_dtype(s)
    _need_bool(s, "causal")
    _need_range(s, "gqa_group", 1, MAX_GQA_GROUP)
    _need_range(s, "consumers", 1, MAX_CONSUMERS)
    _need_range(s, "k_stages", 1, MAX_STAGES)
    _need_range(s, "v_stages", 1, MAX_STAGES)
    _need_bool(s, "pingpong", optional=True)
    _need_bool(s, "aligned")
    if s.block_m is not None:
        rows = WGMMA_M * s.consumers
        why = f"each consumer warpgroup owns {WGMMA_M} query rows (one wgmma M tile), so block_m = {WGMMA_M} * consumers"
        _need_int("block_m", s.block_m, f"{rows}")
        if s.block_m != rows:
            raise SpecError("block_m", s.block_m, f"expected {rows}: {why}")
    if s.block_n is not None:
        valid = f"a multiple of {BLOCK_N_STEP} from {BLOCK_N_STEP} to {MAX_BLOCK_N} (wgmma N and the PV reduction step)"
        _need_int("block_n", s.block_n, valid)
        if not (BLOCK_N_STEP <= s.block_n <= MAX_BLOCK_N and s.block_n % BLOCK_N_STEP == 0):
            raise SpecError("block_n", s.block_n, f"expected {valid}")
    if not isinstance(s.steady_loop, str) or s.steady_loop not in STEADY_LOOPS:
        raise SpecError("steady_loop", s.steady_loop, 'expected "one" (one loop, a per-tile mask test) or "split" '
                        '(an unmasked and a masked copy of the loop)')
    check_variant_fields(s)
    check_serving_fields(s)
    check_kv_dtype(s)
    check_scheduler_field(s)
    check_fp8_fields(s)
    if s.pingpong and s.consumers < 2:
        raise ruled_out("pingpong", s.pingpong, "false (or no pingpong)", f"consumers = {s.consumers}",
                        "ping-pong needs consumers >= 2 (there is no other warpgroup to alternate with)")


def check_out_dtype(s: Spec) -> None:
    if s.out_dtype is None:
        return
    if s.dtype != E4M3:
        if s.out_dtype != s.dtype:
            raise ruled_out("out_dtype", s.out_dtype, f"{toml_value(s.dtype)} (or no out_dtype)", f"dtype = {toml_value(s.dtype)}",
                            "a 16-bit kernel writes O in its input dtype; out_dtype chooses the output of an fp8 kernel")
        return
    if s.out_dtype not in OUT_DTYPES:
        raise SpecError("out_dtype", s.out_dtype, 'expected "bfloat16" (the default, as FlashAttention-3) or "float16": '
                        "an fp8 kernel's output is 16-bit")


def out_dtype_of(s: Spec) -> str:
    """O's element type: the spec's out_dtype, else bfloat16 for fp8 (FlashAttention-3's) and the dtype itself for 16 bits."""
    chosen = getattr(s, "out_dtype", None)  # (a test's stand-in spec may lack the field)
    if chosen is not None:
        return chosen
    return OUT_DTYPES[0] if s.dtype == E4M3 else s.dtype


# Fields an fp8 (e4m3 Q, K, V) kernel does not take yet, with the reason (docs/fp8.md).
FP8_REFUSED = {
    "paged_kv": "fp8 Q/K/V from a paged cache is not built (each page's V tile would need its own transpose stage)",
    "splits": "split-KV's combine kernel writes 16-bit O from the dtype's partials; fp8 runs unsplit (splits = 1)",
}


def check_fp8_fields(s: Spec) -> None:
    """What an fp8 kernel takes beside its dtype: unsplit, unpaged; block_n a multiple of the fp8 wgmma's K step."""
    if s.v_layout not in V_LAYOUTS:
        raise SpecError("v_layout", s.v_layout, 'expected "keys" (v as [batch, seqlen_k, kv_heads, head_dim_v], the default) '
                        'or "transposed" (v as [batch, kv_heads, head_dim_v, seqlen_k], fp8 only)')
    if s.v_layout != "keys" and s.dtype != E4M3:
        raise ruled_out("v_layout", s.v_layout, '"keys" (or no v_layout)', f"dtype = {toml_value(s.dtype)}",
                        "only an fp8 kernel reads V transposed (its PV wgmma takes V K-major)")
    if s.dtype != E4M3:
        return
    if s.v_layout != "keys" and s.layout != "bshd":
        raise ruled_out("v_layout", s.v_layout, '"keys"', f"layout = {toml_value(s.layout)}",
                        "a transposed V is built for the bshd layout only (packed sequences would need [kv_heads, head_dim_v, total_k])")
    for field, why in FP8_REFUSED.items():
        if getattr(s, field) != VARIANT_DEFAULTS[field]:
            raise ruled_out(field, getattr(s, field), toml_value(VARIANT_DEFAULTS[field]), f'dtype = "{E4M3}"', why)
    if s.v_stages < 2:
        raise ruled_out("v_stages", s.v_stages, "2 or more", f'dtype = "{E4M3}"', "the producer transposes V tile k - 1 "
                        "after issuing tile k's loads, so two V tiles are in shared memory at once")
    if s.block_n is not None and s.block_n % FP8_K_STEP:
        raise ruled_out("block_n", s.block_n, f"a multiple of {FP8_K_STEP}", f'dtype = "{E4M3}"',
                        f"the PV GEMM contracts over the tile's keys, {FP8_K_STEP} per fp8 wgmma")


def check_variant_fields(s: Spec) -> None:
    for field in ("lse", "alibi", "sinks", "block_mask", "deterministic"):
        _need_bool(s, field)
    check_window(s.window)
    check_softcap(s.softcap)
    if s.head_dim_v is not None:
        head_dims = ", ".join(map(str, HEAD_DIMS))
        _need_int("head_dim_v", s.head_dim_v, f"one of {head_dims}")
        if s.head_dim_v not in HEAD_DIMS:
            raise SpecError("head_dim_v", s.head_dim_v, f"expected one of {head_dims} (the PV wgmma's N)")
    for field in ("score_mod", "mask_mod"):
        text = getattr(s, field)
        if not isinstance(text, str):
            raise SpecError(field, text, f"expected a string expression, got {type_name(text)}")
        if text.strip():
            try:
                expr.parse(text, field)
            except expr.ExprError as e:  # a text too long to repeat is shown by its start
                shown = text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
                raise SpecError(field, shown, str(e)) from None
    if s.learnable != ():
        check_learnable(s)


def check_learnable(s: Spec) -> None:
    """Each learnable name is a float tensor the score_mod reads, or alibi_slopes with alibi = true:
    what has a derivative in the score (a mask_mod's tensors and int32 ones have none; sinks always
    get theirs)."""
    if not isinstance(s.learnable, tuple) or not all(isinstance(x, str) for x in s.learnable):
        raise SpecError("learnable", s.learnable, f"expected an array of tensor names, got {type_name(s.learnable)}")
    reads = expr.parse(s.score_mod, "score_mod") if s.score_mod.strip() else None
    floats = {n for n, _ in reads.tensors if n not in reads.int_tensors} if reads else set()
    valid = sorted(floats) + (["alibi_slopes"] if s.alibi else [])
    for name in s.learnable:
        if name not in valid:
            raise SpecError("learnable", list(s.learnable), f"`{name}` is not a float tensor the score_mod reads nor "
                            f"alibi_slopes with alibi = true; valid: {valid or 'none in this spec'}")


def check_window(w) -> None:
    valid = "expected [left, right], two integers >= -1 (-1: unbounded on that side)"
    if not isinstance(w, tuple) or len(w) != 2:
        raise SpecError("window", w, f"{valid}, got " + (f"{len(w)} values" if isinstance(w, tuple) else type_name(w)))
    odd = [x for x in w if type(x) is not int]
    if odd:
        raise SpecError("window", w, f"{valid}, got {type_name(odd[0])} in it")
    if any(x < -1 for x in w):
        raise SpecError("window", w, valid)


def check_softcap(c) -> None:
    valid = "expected a finite number >= 0 (0 turns softcapping off)"
    if type(c) is not float:
        raise SpecError("softcap", c, f"{valid}, got {type_name(c)}")
    if not math.isfinite(c) or c < 0:
        raise SpecError("softcap", c, valid)


def check_serving_fields(s: Spec) -> None:
    if not isinstance(s.layout, str) or s.layout not in LAYOUTS:
        raise SpecError("layout", s.layout, 'expected "bshd" (batch, seq, heads, dim) or "varlen" (packed sequences with cu_seqlens)')
    _need_bool(s, "paged_kv")
    if s.page_size is not None:
        valid = f"a multiple of {PAGE_SIZE_STEP} from {PAGE_SIZE_STEP} to {MAX_PAGE_SIZE}"
        _need_int("page_size", s.page_size, valid)
        if not s.paged_kv:
            raise ruled_out("page_size", s.page_size, "no page_size", "paged_kv = false",
                            "a dense K/V has no pages (page_size goes with paged_kv = true)")
        if not (PAGE_SIZE_STEP <= s.page_size <= MAX_PAGE_SIZE and s.page_size % PAGE_SIZE_STEP == 0):
            raise SpecError("page_size", s.page_size, f"expected {valid}")
    if s.splits != "auto":
        _need_int("splits", s.splits, f'1 to {MAX_SPLITS}, or "auto"')
        if not 1 <= s.splits <= MAX_SPLITS:
            raise SpecError("splits", s.splits, f'expected an integer from 1 to {MAX_SPLITS}, or "auto" (chosen per call)')
    serving = s.layout != "bshd" or s.paged_kv
    check_block_mask_field(s)
    if serving and s.aligned:
        raise ruled_out("aligned", s.aligned, "false", serving_given(s), "varlen and paged kernels read each "
                        "sequence's length at call time; aligned = true needs tile-multiple lengths known ahead")
    if s.splits != 1 and s.sinks:
        raise ruled_out("splits", s.splits, "1", "sinks = true", "a sink joins each row's softmax once, but every "
                        "split would count it")
    if s.splits != 1 and s.window != (-1, -1):
        raise ruled_out("splits", s.splits, "1", f"window = {toml_value(s.window)}", "split-KV with a sliding window "
                        "is not supported (a window already bounds each row's keys)")


KV_DTYPES = (E4M3,)  # what a KV cache may hold besides the spec's dtype


def check_kv_dtype(s: Spec) -> None:
    """An fp8 KV cache: e4m3 keys and values for 16-bit queries (the GEMMs stay 16-bit)."""
    if s.kv_dtype is None or s.kv_dtype == s.dtype:
        return
    if not isinstance(s.kv_dtype, str) or s.kv_dtype not in KV_DTYPES:
        raise SpecError("kv_dtype", s.kv_dtype, f'expected "{E4M3}" (an fp8 KV cache) or nothing (K and V hold dtype)')
    if s.dtype not in HALF_DTYPES:
        raise ruled_out("kv_dtype", s.kv_dtype, "nothing", f"dtype = {toml_value(s.dtype)}", "an fp8 KV cache "
                        "serves 16-bit queries (its tiles are dequantized into the 16-bit GEMMs)")


def check_block_mask_field(s: Spec) -> None:
    """A block mask lists the tiles of its mask_mod; causal, a window and the serving layouts have
    tile ranges of their own, which the block mask's lists would have to be merged with (not done)."""
    if not s.block_mask:
        return
    if not s.mask_mod.strip():
        raise ruled_out("block_mask", s.block_mask, "false", "no mask_mod", "a block mask needs a mask_mod, which "
                        "its partial tiles run")
    if s.causal:
        raise ruled_out("causal", s.causal, "false", "block_mask = true", "write causality into the mask_mod "
                        "(q_idx >= kv_idx), whose tiles the block mask lists")
    if s.window != (-1, -1):
        raise ruled_out("window", s.window, "[-1, -1]", "block_mask = true", "write the window into the mask_mod")
    for field in ("layout", "paged_kv", "splits"):
        if getattr(s, field) != VARIANT_DEFAULTS[field]:
            raise ruled_out(field, getattr(s, field), toml_value(VARIANT_DEFAULTS[field]), "block_mask = true",
                            "a block mask serves bshd, dense, unsplit kernels")


def check_scheduler_field(s: Spec) -> None:
    """The persistent scheduler serves unsplit kernels without a block mask (bshd or varlen queries, dense or
    paged K/V) so far: the others choose their tile's split or visits from grid axes it replaces (not done yet)."""
    if not isinstance(s.scheduler, str) or s.scheduler not in SCHEDULERS:
        raise SpecError("scheduler", s.scheduler, 'expected "single" (a block per tile) or "persistent" (a block '
                        'per SM looping over tiles from an atomic counter)')
    if s.scheduler == "single":
        return
    for field in ("splits", "block_mask"):
        if getattr(s, field) != VARIANT_DEFAULTS[field]:
            raise ruled_out(field, getattr(s, field), toml_value(VARIANT_DEFAULTS[field]), 'scheduler = "persistent"',
                            "the persistent scheduler serves unsplit kernels without a block mask "
                            "(a tile's split or block-mask visits are not handed out yet)")
    if s.kv_dtype not in (None, s.dtype):
        raise ruled_out("kv_dtype", s.kv_dtype, "none", 'scheduler = "persistent"', "the persistent producer's tile loop "
                        "loads 16-bit K/V: an fp8 cache's dequantizing producer is not wrapped in it yet")


def serving_given(s: Spec) -> str:
    """The serving fields that make a kernel read its lengths at call time, as the spec sets them."""
    given = [f"layout = {toml_value(s.layout)}"] if s.layout != "bshd" else []
    return " and ".join(given + (["paged_kv = true"] if s.paged_kv else []))


def serving_field(s: Spec) -> tuple:
    """(field, value) of the first serving field a spec sets, for errors of tools that do not take them."""
    for field in ("layout", "paged_kv", "splits"):
        if getattr(s, field) != VARIANT_DEFAULTS[field]:
            return field, getattr(s, field)
    return "layout", s.layout


def from_dict(data: dict[str, Any], *, source: str = "spec") -> Spec:
    """Build a Spec from flat keys, rejecting unknown ones with the nearest valid key."""
    if not isinstance(data, dict):
        raise SpecError("<spec>", data, "expected a table of flat keys")
    check_keys(data, source)
    return Spec(**data)


def load(path: str | Path) -> Spec:
    """Read a spec from a TOML file of flat keys."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise SpecError("<file>", str(path), "no such spec file") from None
    except IsADirectoryError:
        raise SpecError("<file>", str(path), "is a directory; expected a spec TOML file") from None
    except UnicodeDecodeError as e:
        raise SpecError("<file>", str(path), f"not UTF-8 text (byte {e.start}); a spec is a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError("<file>", str(path), f"not valid TOML: {e}") from None
    except OSError as e:
        raise SpecError("<file>", str(path), f"cannot be read: {e.strerror or e}") from None
    return from_dict(data, source=str(path))


def to_toml(spec: Spec) -> str:
    """The spec as TOML (what the emitted header and presets carry); None fields are left out."""
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in spec.canonical_dict().items() if value is not None)
