"""The checks of a call's tensors: one home for the GPU runtime and the CPU model.

`attngen.attention`/`Kernel.__call__` (runtime.py) and `attngen.emulate` (emulator/driver.py)
both call these, so a tensor the GPU path refuses the CPU path refuses too, with the same
InputError (one line: the argument, the value, what is expected). What differs is passed as
`cpu=True` and is only what the CPU model can take besides:

- numpy arrays as well as torch tensors, on any device with values (a meta tensor has none);
- float32 or float64 tensors holding values to round (q, k, v to the spec's dtype, the
  call-time tensors to float32); a 16-bit dtype other than the kernel's is refused;
- no `out` buffer and no device rule (checks.check_device is the GPU's).

Shapes, lengths, heads, limits, layouts (TMA's strides and base, the packed ABI), the call-time
tensors (presence, dtype, shape, contiguity, finite sinks) are the same rules on both paths.
Serving calls' shapes and int32 values are checked by serving.check_serving, before these.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from attngen.run import serving
from attngen.hw import E4M3, GRID_YZ_MAX, INT32_MAX, TMA_ALIGN
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan, as_plan
from attngen.reference.forward import InputError, to_numpy
from attngen.spec import FIELDS, did_you_mean, out_dtype_of

HOLDERS = ("float32", "float64")  # what the CPU model also takes, holding values to round to the kernel's dtype


def is_torch(x) -> bool:
    """A torch.Tensor, without importing torch."""
    return hasattr(x, "detach") and hasattr(x, "data_ptr")


def dtype_name(x) -> str:
    """"float16", "bfloat16", "float32", ... of a torch tensor or numpy array."""
    return str(x.dtype).removeprefix("torch.")


def packed_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _layout(t) -> tuple:
    """(shape, strides in elements, element bytes, base address, packed) of a tensor or array."""
    if is_torch(t):
        return tuple(t.shape), tuple(t.stride()), t.element_size(), t.data_ptr(), t.is_contiguous()
    elem = t.itemsize
    return (tuple(t.shape), tuple(s // elem for s in t.strides), elem, t.__array_interface__["data"][0],
            bool(t.flags.c_contiguous))


def check_kind(name: str, t, dtype: str, *, cpu: bool = False, spec_dtype: bool = False) -> None:
    """A tensor of the kernel's `dtype` (torch; `cpu`: numpy too, values on the host or a device,
    float32/float64 holding values to round). `spec_dtype`: the dtype is the spec's (q, k, v, out)."""
    torch_ok = is_torch(t)
    if not (torch_ok or (cpu and isinstance(t, np.ndarray))):
        raise InputError(name, type(t).__name__, "a torch.Tensor or a numpy array" if cpu else "a torch.Tensor")
    if cpu and torch_ok and t.device.type == "meta":
        raise InputError(f"{name}.device", "meta", "a tensor with values (the CPU model reads them; a meta tensor has only a shape)")
    kind = dtype_name(t)
    if kind == dtype or (cpu and kind in HOLDERS and dtype != "int32"):  # indices are not rounded
        return
    if cpu and dtype != "int32":
        origin = ", the spec's dtype" if spec_dtype else ""
        want = f"{dtype}{origin} (or float32/float64 holding values to round)"
    else:
        want = f"torch.{dtype}" + (f" (spec dtype {dtype!r})" if spec_dtype else "")
    raise InputError(f"{name}.dtype", t.dtype if torch_ok else kind, want)


def element_dtype(spec, name: str) -> str:
    """The element type the kernel takes for tensor `name` (q, k, v, out): an fp8 cache's k and v
    hold the spec's kv_dtype, out its out_dtype (fp8's bfloat16 by default), the rest its dtype."""
    if name == "out":
        return out_dtype_of(spec)
    kv_dtype = getattr(spec, "kv_dtype", None)  # (a stand-in spec of a test may lack the field)
    return kv_dtype if name in ("k", "v") and kv_dtype is not None else spec.dtype


def check_contiguous(name: str, t) -> None:
    """A call-time tensor the kernel indexes element by element (no TMA): packed."""
    shape, strides, _, _, packed = _layout(t)
    if not packed:
        raise InputError(f"{name}.stride()", strides, f"a contiguous tensor, strides {packed_strides(shape)} (call .contiguous())")


def check_layout(name: str, t) -> None:
    """Layout the generated kernel can take: TMA's rules, then the packed ABI of the host stub."""
    check_tma_layout(name, t)
    shape, strides, _, _, packed = _layout(t)
    if 0 in shape:
        return
    # The emitted buffers declare no strides, so TileLang's host stub takes packed tensors
    # only (size-1 dimensions excepted, as torch's is_contiguous does).
    if not packed:
        raise InputError(
            f"{name}.stride()", strides,
            f"a contiguous tensor, strides {packed_strides(shape)} for shape {list(shape)} (call .contiguous())",
        )


def check_tma_layout(name: str, t, *, base: bool = True) -> None:
    """TMA's rules, which FlashAttention-3's strided descriptors share: the last dimension
    contiguous, every other stride a multiple of 16 bytes, a 16-byte aligned base (`base=False`:
    not looked at, for a tensor about to be copied; a traced tensor has no address)."""
    shape, strides, elem, ptr, _ = _layout(t) if base else (tuple(t.shape), tuple(t.stride()), t.element_size(), 0, None)
    if 0 in shape:  # no element to load (a varlen call without query rows launches nothing)
        return
    if shape[-1] > 1 and strides[-1] != 1:
        raise InputError(f"{name}.stride()", strides, "the last dimension (head_dim) contiguous, stride 1")
    # TMA: every non-last stride a multiple of 16 bytes, the base address 16-byte aligned.
    for dim, (size, stride) in enumerate(zip(shape[:-1], strides[:-1])):
        if size > 1 and (stride * elem) % TMA_ALIGN:
            raise InputError(
                f"{name}.stride({dim})", stride,
                f"a multiple of {TMA_ALIGN // elem} elements ({TMA_ALIGN} bytes), which TMA requires",
            )
    if ptr % TMA_ALIGN:
        raise InputError(f"{name}.data_ptr()", hex(ptr), f"a {TMA_ALIGN}-byte aligned address, which TMA requires")


def check_tensors(spec_or_plan, q, k, v, out=None, *, shape: Shape | None = None, cpu: bool = False) -> tuple:
    """Check dtypes, shapes and layouts against the planned spec (and a static `shape`); device not checked.

    Returns (batch, heads, kv_heads, q_len, kv_len).
    """
    spec = as_plan(spec_or_plan).spec  # resolved: block_m and block_n are known
    given = {"q": q, "k": k, "v": v} | ({"out": out} if out is not None else {})
    for name, t in given.items():
        if not (is_torch(t) or (cpu and isinstance(t, np.ndarray))):
            raise InputError(name, type(t).__name__, "a torch.Tensor or a numpy array" if cpu else "a torch.Tensor")
        if len(t.shape) != 4:
            raise InputError(f"{name}.shape", list(t.shape), "4 dimensions: [batch, seq_len, heads, head_dim]")
    dv = spec.head_dim if spec.head_dim_v is None else spec.head_dim_v
    stored_v = v
    if getattr(spec, "v_layout", "keys") == "transposed":  # [batch, kv_heads, dv, kv_len]: checked as its keys-major view
        want = [int(k.shape[0]), int(k.shape[2]), dv, int(k.shape[1])]
        if list(v.shape) != want:
            raise InputError("v.shape", list(v.shape), f"{want}: [batch, kv_heads, head_dim_v, kv_len] (v_layout = \"transposed\")")
        v = given["v"] = v.permute(0, 3, 1, 2) if is_torch(v) else v.transpose(0, 3, 1, 2)
    for name, t in given.items():
        check_kind(name, t, element_dtype(spec, name), cpu=cpu, spec_dtype=True)
        if name in ("v", "out") and dv != spec.head_dim:
            if t.shape[3] != dv:
                raise InputError(f"{name}.shape[3] (head_dim_v)", t.shape[3], f"{dv}, the spec's head_dim_v")
        elif t.shape[3] != spec.head_dim:
            raise InputError(f"{name}.shape[3] (head_dim)", t.shape[3], f"{spec.head_dim}, the spec's head_dim")

    batch, q_len, heads, _ = (int(s) for s in q.shape)
    _, kv_len, kv_heads, _ = (int(s) for s in k.shape)
    if k.shape[0] != batch:
        raise InputError("k.shape[0] (batch)", k.shape[0], f"{batch}, the batch of q")
    if tuple(v.shape) != (*k.shape[:3], dv):
        what = "the shape of k" if dv == spec.head_dim else "the shape of k with head_dim_v"
        raise InputError("v.shape", list(v.shape), f"{[*k.shape[:3], dv]}, {what}")
    if out is not None and tuple(out.shape) != (*q.shape[:3], dv):
        what = "the shape of q" if dv == spec.head_dim else "the shape of q with head_dim_v"
        raise InputError("out.shape", list(out.shape), f"{[*q.shape[:3], dv]}, {what}")
    for label, size in (("q.shape[0] (batch)", batch), ("q.shape[1] (q_len)", q_len), ("q.shape[2] (heads)", heads),
                        ("k.shape[1] (kv_len)", kv_len), ("k.shape[2] (kv_heads)", kv_heads)):
        if size < 1:  # an empty grid is a launch error; kv_len 0 would leave consumers waiting forever
            raise InputError(label, size, "at least 1")
    if heads % kv_heads:
        raise InputError("q.shape[2] (heads)", heads, f"a multiple of k.shape[2] (kv_heads) = {kv_heads}")
    if heads // kv_heads != spec.gqa_group:
        raise InputError(
            "q.shape[2] / k.shape[2] (gqa group)", f"{heads}/{kv_heads} = {heads // kv_heads}",
            f"{spec.gqa_group}, the spec's gqa_group (query heads per KV head)",
        )
    if heads > GRID_YZ_MAX or batch > GRID_YZ_MAX:
        bad = ("q.shape[2] (heads)", heads) if heads > GRID_YZ_MAX else ("q.shape[0] (batch)", batch)
        raise InputError(bad[0], bad[1], f"at most {GRID_YZ_MAX} (a CUDA grid dimension)")
    for name, t in given.items():
        if math.prod(t.shape) > INT32_MAX:
            raise InputError(f"{name}.numel()", math.prod(t.shape), f"at most {INT32_MAX}: the kernel indexes with int32")
    if spec.aligned:  # aligned kernels skip the bounds masks: lengths must be whole tiles
        if q_len % spec.block_m:
            raise InputError("q.shape[1] (q_len)", q_len, f"a multiple of block_m = {spec.block_m} (the spec is aligned)")
        if kv_len % spec.block_n:
            raise InputError("k.shape[1] (kv_len)", kv_len, f"a multiple of block_n = {spec.block_n} (the spec is aligned)")
    if shape is not None:
        got = Shape(batch, heads, kv_heads, q_len, kv_len)
        if got != shape:
            raise InputError("shape (B,H,HKV,SQ,SKV)", str(got), f"{shape}, the static shape this kernel was built for")
    given["v"] = stored_v  # its layout as stored
    for name, t in given.items():
        check_layout(name, t)
    if out is not None:
        for name in ("q", "k", "v"):
            if _overlap(out, given[name]):  # other blocks still read what out would overwrite
                raise InputError("out", f"memory overlapping {name}", "a buffer that shares no memory with q, k or v")
    return batch, heads, kv_heads, q_len, kv_len


# Call-time tensors a call may leave out, and what stands in for them: FA3's fp8 descales (absent: 1).
ONES_WHEN_ABSENT = ("q_descale", "k_descale", "v_descale")


def _ones(shape: tuple, like):
    """float32 ones of `shape`, a torch tensor on `like`'s device when `like` is one, else a numpy array."""
    if is_torch(like):
        import torch
        return torch.ones(shape, dtype=torch.float32, device=like.device)
    return np.ones(shape, np.float32)


def check_extra(plan: Plan, dims: tuple, tensors: dict, *, cpu: bool = False, like=None) -> list:
    """The call-time tensors the plan's kernel takes (alibi_slopes, sinks, score_mod/mask_mod
    tensors), checked for presence, type, dtype float32, shape, layout and (sinks) finite values;
    returned in the kernel's parameter order (outputs left out). `dims` is check_tensors's result
    (extra_dims for a serving call). An fp8 descale left out is ones (on `like`'s device: q's)."""
    batch, heads, kv_heads, q_len, kv_len, *cache = dims
    extent = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len, "kv_heads": kv_heads}
    if cache:  # a paged cache's pages (an fp8 cache's per-page descales)
        extent["num_pages"] = cache[0]
    if getattr(plan, "block_mask", False):  # (a stand-in plan of a test may lack the field)
        extent.update(block_mask_extents(plan, dims, tensors))
    wanted = [t for t in plan.extra if not t.output]
    unknown = sorted(set(tensors) - {t.name for t in wanted})
    for name in unknown:
        if name in ONES_WHEN_ABSENT:
            raise InputError(name, _describe(tensors[name]), f"none: descales scale fp8 inputs (dtype {E4M3}), "
                                                             f"and this kernel's are {plan.spec.dtype}")
    if unknown:  # a misspelt tensor, or a spec field given beside the spec (casual=True)
        name, takes = unknown[0], ", ".join(t.name for t in wanted) or "no extra tensors"
        hint = did_you_mean(name, [*(t.name for t in wanted), "alibi_slopes", "sinks"]) or \
            did_you_mean(name, FIELDS, ", a spec field (set on the spec)")
        raise InputError(name, _describe(tensors[name]), f"no such tensor: {hint}the spec takes {takes}")
    ordered = []
    for t in wanted:
        shape_text = "[" + ", ".join("any" if a is None else f"{a} = {extent[a]}" for a in t.shape) + "]"
        x = tensors.get(t.name)
        if x is None and t.name in ONES_WHEN_ABSENT:
            x = _ones((batch, kv_heads), like)
        if x is None:
            raise InputError(t.name, None, f"a {t.dtype} tensor of shape {shape_text}: the spec uses it")
        check_kind(t.name, x, t.dtype, cpu=cpu)
        if len(x.shape) != len(t.shape) or any(a is not None and x.shape[i] != extent[a] for i, a in enumerate(t.shape)) \
                or math.prod(x.shape) == 0:
            raise InputError(f"{t.name}.shape", list(x.shape), shape_text)
        check_contiguous(t.name, x)
        if t.name == "sinks":
            _check_finite(t.name, x)
        ordered.append(x)
    if getattr(plan, "block_mask", False):
        check_block_mask_lists({t.name: x for t, x in zip(wanted, ordered)}, extent["bm_kv_tiles"],
                               kv_len % plan.spec.block_n != 0)
    return ordered


# Block-mask lists already checked and unchanged since (a model reuses one BlockMask in every layer):
# key: the check's arguments and each tensor's id and version counter; value: weak references, so
# that a new tensor that reuses a dead one's id is never taken for it.
_CHECKED_LISTS: dict = {}
_CHECKED_LISTS_MAX = 64


def check_block_mask_lists(lists: dict, n_cols: int, last_runs_past: bool) -> None:
    """check_lists_values, skipped for torch tensors checked before and not written to since (their
    version counters unchanged): the host copy and the check then cost nothing on a reused mask."""
    if any(is_torch(x) and x.device.type == "meta" for x in lists.values()):
        return
    key = checked_lists_key(lists, n_cols, last_runs_past)
    if key is not None:
        refs = _CHECKED_LISTS.get(key)
        if refs is not None and all(r() is x for r, (_, x) in zip(refs, sorted(lists.items()))):
            return
    check_lists_values(lists, n_cols, last_runs_past)
    if key is not None:
        if len(_CHECKED_LISTS) >= _CHECKED_LISTS_MAX:
            _CHECKED_LISTS.clear()
        _CHECKED_LISTS[key] = [weakref.ref(x) for _, x in sorted(lists.items())]


def checked_lists_key(lists: dict, n_cols: int, last_runs_past: bool):
    """_CHECKED_LISTS' key for the lists: None where a list has no version counter (numpy, inference tensors)."""
    if not all(is_torch(x) and not x.is_inference() for x in lists.values()):
        return None
    return n_cols, last_runs_past, tuple((n, id(x), x._version) for n, x in sorted(lists.items()))


def check_lists_values(lists: dict, n_cols: int, last_runs_past: bool) -> None:
    """The values of a block mask's lists (shapes and dtypes are check_extra's): per row, a count in
    [0, n_cols], its first `count` indices in [0, n_cols) (the kernels read only those; the padding
    after them may be anything, as create_block_mask's is), no tile listed twice, none both partial
    and full, and (`last_runs_past`: kv_len is no multiple of block_n) the last tile never full, as
    its keys past kv_len must be masked. The kernels would read out of bounds, visit a tile twice or
    skip a mask: a wrong answer without a word. One host copy of the lists per call (docs/variants.md
    measures it)."""

    def at(where) -> str:  # the first True of a boolean array, as "[i, j, ...]"
        return "[" + ", ".join(str(int(i)) for i in np.argwhere(where)[0]) + "]"
    marks = {}
    for counts_name, indices_name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts, indices = np.asarray(to_numpy(lists[counts_name])), np.asarray(to_numpy(lists[indices_name]))
        bad = (counts < 0) | (counts > n_cols)
        if bad.any():
            raise InputError(f"{counts_name}{at(bad)}", int(counts[bad][0]),
                             f"a count of KV tiles in [0, {n_cols}] ({n_cols} KV tiles of the kernel)")
        read = np.arange(indices.shape[-1], dtype=counts.dtype) < counts[..., None]  # the entries the kernels read
        bad = read & ((indices < 0) | (indices >= n_cols))
        if bad.any():
            raise InputError(f"{indices_name}{at(bad)}", int(indices[bad][0]),
                             f"a KV tile index in [0, {n_cols - 1}] (the first {counts_name} entries of a row are read)")
        # the tiles each row lists (column n_cols: the unread entries); fewer than its count: one twice
        mark = np.zeros(counts.size * (n_cols + 1), bool)
        row_start = np.arange(0, mark.size, n_cols + 1, dtype=np.int64).reshape(counts.shape)[..., None]
        mark[(row_start + np.where(read, indices, n_cols)).reshape(-1)] = True  # (put_along_axis: 2x slower)
        mark = mark.reshape(counts.shape + (n_cols + 1,))[..., :n_cols]
        twice = mark.sum(axis=-1, dtype=counts.dtype) < counts
        if twice.any():
            row = tuple(np.argwhere(twice)[0])
            tiles_of_row, times = np.unique(indices[row][:counts[row]], return_counts=True)
            raise InputError(f"{indices_name}{at(twice)}", f"KV tile {int(tiles_of_row[times > 1][0])} listed "
                             f"{int(times[times > 1][0])} times", "each tile at most once in a row")
        marks[indices_name] = mark
    both = marks["kv_indices"] & marks["full_kv_indices"]
    if both.any():
        row, col = at(both.any(axis=-1)), int(np.argwhere(both)[0][-1])
        raise InputError(f"kv_indices{row} and full_kv_indices{row}", f"both list KV tile {col}",
                         "a tile either partial or full (or neither: empty)")
    if last_runs_past and marks["full_kv_indices"][..., n_cols - 1].any():
        raise InputError(f"full_kv_indices{at(marks['full_kv_indices'][..., n_cols - 1])}", f"KV tile {n_cols - 1}, the last",
                         "the last KV tile partial (in kv_indices), never full: it runs past kv_len, whose keys "
                         "past the end must be masked")


def block_mask_extents(plan: Plan, dims: tuple, tensors: dict) -> dict:
    """The extents a block mask's tensors must have (plan.BLOCK_MASK_TENSORS): its Q and KV tiles are
    the kernel's (block_m x block_n), and its batch and heads are 1 (broadcast) or the call's."""
    batch, heads, _, q_len, kv_len = dims[:5]
    spec = plan.spec
    first = tensors.get("kv_indices")
    shape = tuple(int(n) for n in first.shape) if first is not None and len(first.shape) == 4 else (batch, heads)
    for axis, (name, full) in enumerate((("batch", batch), ("heads", heads))):
        if shape[axis] not in (1, full):
            raise InputError(f"kv_indices.shape[{axis}] ({name})", shape[axis], f"1 (broadcast) or {full}, the call's {name}")
    return {"bm_batch": shape[0], "bm_heads": shape[1], "bm_q_tiles": -(-q_len // spec.block_m),
            "bm_kv_tiles": -(-kv_len // spec.block_n)}


def backward_block_mask(bp, tensors: dict, q_len: int, kv_len: int) -> tuple[list, dict]:
    """A block-mask backward's lists (kernels.bwd.render.block_mask_params' order: the main kernel's q_*,
    then the deterministic dq kernel's kv_*) and their extents, from the forward's four lists in
    `tensors` (tiles.backward_lists: transposed and retiled to the backward's tiles, host side)."""
    from attngen import tiles
    from attngen.kernels.common.plan import BLOCK_MASK_TENSORS, BWD_BLOCK_MASK_TENSORS, DQ_BLOCK_MASK_TENSORS

    if not bp.forward.block_mask:
        return [], {}
    names = [n for n, _, _ in BLOCK_MASK_TENSORS]
    for n in names:
        if tensors.get(n) is None:
            raise InputError(n, "None", "the forward's block-mask lists (kv_num_blocks, kv_indices, full_kv_*): "
                                        "the backward derives its own from them")
    given = {n: np.asarray(to_numpy(tensors[n])) for n in names}
    f = bp.forward.spec
    check_block_mask_lists(given, -(-kv_len // f.block_n), kv_len % f.block_n != 0)  # before they are transposed
    dq_tile = (bp.dq_block_m, bp.dq_block_n) if bp.deterministic else None
    lists = tiles.backward_lists(given, (f.block_m, f.block_n), (q_len, kv_len), (bp.block_m, bp.block_n), dq_tile)
    order = BWD_BLOCK_MASK_TENSORS + (DQ_BLOCK_MASK_TENSORS if bp.deterministic else ())
    dims = {"bm_batch": given["kv_indices"].shape[0], "bm_heads": given["kv_indices"].shape[1],
            "bm_q_tiles": -(-q_len // bp.block_m), "bm_kv_tiles": -(-kv_len // bp.block_n)}
    if bp.deterministic:
        dims.update(bm_dq_q_tiles=-(-q_len // bp.dq_block_m), bm_dq_kv_tiles=-(-kv_len // bp.dq_block_n))
    return [lists[n] for n, _, _ in order], dims


def _check_finite(name: str, x) -> None:
    """A sink is a logit in every row's softmax denominator: NaN or inf has no meaning there.
    (A device tensor is read with one small host copy; a meta tensor is left to the device check.)"""
    if is_torch(x) and x.device.type == "meta":
        return
    values = to_numpy(x)
    bad = np.flatnonzero(~np.isfinite(values.reshape(-1)))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{name}[{i}]", float(values.reshape(-1)[i]),
                         "a finite logit (a sink joins every row's softmax denominator)")


def _describe(x) -> str:
    return f"a tensor of shape {list(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def _overlap(a, b) -> bool:
    if not (is_torch(a) and is_torch(b)) or a.device != b.device or a.device.type == "meta":
        return False  # meta tensors have no memory (data_ptr 0)
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def extra_dims(call: serving.ServingCall) -> tuple:
    """check_extra's (batch, heads, kv_heads, q_len, kv_len[, num_pages]) for a serving call: q_len is
    the longest query sequence (max_seqlen_q), kv_len the key-length bound of the call; num_pages
    where the cache is paged."""
    pages = (call.dims["num_pages"],) if "num_pages" in call.dims else ()
    return (call.batch, call.heads, call.kv_heads, call.max_seqlen_q, call.max_kv_len, *pages)


def check_serving_tensors(plan: Plan, call: serving.ServingCall, q, k, v, out=None,
                          int_tensors: dict | None = None, *, cpu: bool = False) -> None:
    """The tensor side of a serving call that serving.check_serving (shapes and values) leaves:
    tensor types, the spec's dtype, out's shape, TMA layouts, contiguous int32 tensors, and an
    `out` that shares no memory with q, k or v. Device not checked (checks.check_device)."""
    spec = plan.spec
    given = {"q": q, "k": k, "v": v} | ({"out": out} if out is not None else {})
    for name, t in given.items():
        check_kind(name, t, element_dtype(spec, name), cpu=cpu, spec_dtype=True)
    if out is not None and tuple(out.shape) != tuple(call.out_shape):
        raise InputError("out.shape", list(out.shape), f"{list(call.out_shape)}, packed like q with head_dim_v")
    for name, t in (int_tensors or {}).items():
        if t is None:
            continue
        if not (is_torch(t) or (cpu and isinstance(t, np.ndarray))):
            raise InputError(name, type(t).__name__, "a torch.Tensor (int32)")
        shape, strides, _, _, packed = _layout(t)
        if not packed:
            raise InputError(f"{name}.stride()", strides,
                             f"a contiguous tensor, strides {packed_strides(shape)} (call .contiguous())")
    for name, t in given.items():
        check_layout(name, t)
    if out is not None:
        for name in ("q", "k", "v"):
            if _overlap(out, given[name]):
                raise InputError("out", f"memory overlapping {name}", "a buffer that shares no memory with q, k or v")


def check_append_tensors(k_cache, v_cache, k, v, block_table, cache_seqlens, *, cpu: bool = False) -> str:
    """The tensor side of a KV-cache append that append.check_append (shapes and values) leaves:
    a float16/bfloat16 cache with k and v of its dtype, or an e4m3 cache (an fp8 KV cache) with k
    and v of one 16-bit dtype, contiguous tensors (the kernel's buffers declare no strides, and the
    caches are written in place: a copy would lose the append), int32 tensors contiguous, and new
    keys sharing no memory with the cache. Returns the new keys' dtype name (the cache's is
    k_cache's). Device not checked (checks.check_device). `cpu`: numpy arrays too."""
    from attngen.hw import HALF_DTYPES  # new keys are 16-bit; an fp8 cache takes them quantized
    from attngen.spec import KV_DTYPES

    if not (is_torch(k_cache) or (cpu and isinstance(k_cache, np.ndarray))):
        raise InputError("k_cache", type(k_cache).__name__, "a torch.Tensor")
    cache = dtype_name(k_cache)
    if cache not in HALF_DTYPES and cache not in KV_DTYPES:
        raise InputError("k_cache.dtype", k_cache.dtype, " or ".join(f"torch.{d}" for d in (*HALF_DTYPES, *KV_DTYPES)))
    dtype = cache if cache in HALF_DTYPES else dtype_name(k)
    if dtype not in HALF_DTYPES:
        raise InputError("k.dtype", k.dtype, " or ".join(f"torch.{d}" for d in HALF_DTYPES) + f" (new keys for a {cache} cache)")
    given = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
    for name, t in given.items():
        if not (is_torch(t) or (cpu and isinstance(t, np.ndarray))):
            raise InputError(name, type(t).__name__, "a torch.Tensor")
        want, whose = (cache, "k_cache") if name.endswith("cache") else (dtype, "k")
        if dtype_name(t) != want:
            raise InputError(f"{name}.dtype", t.dtype, f"{want}, the dtype of {whose}")
        if cpu and is_torch(t) and t.device.type == "meta":
            raise InputError(f"{name}.device", "meta", "a tensor with values (the CPU model reads them)")
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        shape, strides, _, _, packed = _layout(t)
        if not packed:
            raise InputError(f"{name}.stride()", strides, f"a contiguous tensor, strides {packed_strides(shape)} (call .contiguous())")
    for name, t in given.items():
        shape, strides, _, _, packed = _layout(t)
        if not packed:
            why = "the append writes it in place, so a copy would lose the new keys" if name.endswith("cache") else \
                "the kernel's buffers declare no strides"
            raise InputError(f"{name}.stride()", strides,
                             f"a contiguous tensor, strides {packed_strides(shape)} for shape {list(shape)}: {why}")
    for new in ("k", "v"):
        for cache in ("k_cache", "v_cache"):
            if _overlap(given[new], given[cache]):
                raise InputError(new, f"memory overlapping {cache}", "new keys and values that share no memory with the cache")
    return dtype
