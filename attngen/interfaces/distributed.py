"""Context parallelism on torch.distributed: attention over a sequence sharded across ranks (docs/distributed.md).

    q_local = shard_sequence(q, group=g)                                   # this rank's part of [B, S, H, D]
    out_local = context_parallel_attention(q_local, k_local, v_local, group=g, causal=True)
    out = unshard_sequence(out_local, group=g)                              # the full [B, S, H, D] again

Every step runs attngen's own ops (torch.ops.attngen.fwd and .bwd): on CUDA tensors the compiled
kernels, on CPU tensors the same emitted kernels on the CPU model. Nothing here is a kernel.

- method "ring": K and V rotate around the group by P2P (batch_isend_irecv), the next block's transfer
  overlapping the current block's attention; the backward rotates K and V again and sends each
  block's dK/dV (float32) along with it, home after the last step.
- method "allgather" (Llama 3): K and V are all-gathered once; the backward reduce-scatters dK/dV.
- load_balance "zigzag": the sequence in 2W chunks, rank r holding chunks r and 2W-1-r (any W);
  "contiguous": W chunks, rank r holding chunk r.

Each (query chunk, key chunk) pair of a step is classified by exact index arithmetic (_pair_call):
empty (skipped), wholly visible (the kernel with no mask), or masked; a masked pair is trimmed to
the rows and keys that see something and runs the causal kernel where the visible set is the
causal triangle of the trimmed rectangle, else the window kernel with the window shifted to the
pair's offset. Partial results merge in float32 with the stable form of _merge; the backward runs
attngen's backward op per step with the merged (global) out and LSE (and the LSE's gradient, which
each call folds into its rows).
"""

from __future__ import annotations

import ast
from typing import NamedTuple

import torch
import torch.distributed as dist

from attngen import expr
from attngen.interfaces import op_arguments, ops
from attngen.reference.forward import InputError
from attngen.spec import FIELDS, SpecError

METHODS = ("ring", "allgather")
LOAD_BALANCES = ("zigzag", "contiguous")
# spec fields a caller may pass through: the kernel's schedule. The others are set here (causal,
# window, softcap, lse), follow from the tensors, or read positions that are local to a step.
SCHEDULE_FIELDS = ("consumers", "k_stages", "v_stages", "block_m", "block_n", "pingpong", "aligned", "steady_loop",
                   "deterministic")
REFUSED = {
    "alibi_slopes": "ALiBi reads q_idx - kv_idx, which is local to each step's kernel call",
    "sinks": "a sink joins each row's denominator once, and each step's LSE would count it again",
    "score_mod": "its q_idx and kv_idx would be each step's local indices, not the sequence's",
    "block_mask": "a block mask lists tiles of the whole sequence, not of one step's chunks (pass its mask_mod "
                  "text with method='allgather')",
}
# with method="ring" (a step's keys are two runs of the sequence); the all-gather takes them
ALLGATHER_ONLY = ("mask_mod", "cu_seqlens")
DOCUMENT = "cp_document"  # the call-time tensor of document ids that cu_seqlens becomes

# TEST-ONLY: a named mutation, so tests can show that they catch it (tests/test_distributed.py).
# None in any real use. "merge_no_rescale": partial outputs summed without the LSE weights;
# "zigzag_order": the attention takes a zigzag rank's two chunks in the wrong order;
# "dkdv_skip_step": the backward drops the last ring step's dK/dV; "causal_flag": a causal
# (diagonal) call runs the full kernel; "mask_offset": a global mask_mod reads the call's local rows;
# "dlse_dropped": the backward ignores the LSE output's gradient.
_TEST_ONLY_MUTANT: str | None = None
MUTANTS = ("merge_no_rescale", "zigzag_order", "dkdv_skip_step", "causal_flag", "mask_offset", "dlse_dropped")


# -- the layout: which chunks of the sequence each rank holds ---------------------------------------


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group", group, "a process group: call torch.distributed.init_process_group first")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_balance(load_balance) -> None:
    if load_balance not in LOAD_BALANCES:
        raise InputError("load_balance", repr(load_balance), f"one of {', '.join(map(repr, LOAD_BALANCES))}")


def num_chunks(world: int, load_balance: str) -> int:
    """How many equal chunks the sequence is cut into: 2W for zigzag, W for contiguous."""
    return 2 * world if load_balance == "zigzag" else world


def chunk_ids(rank: int, world: int, load_balance: str) -> list[int]:
    """The global chunks rank `rank` holds, in the order of its local tensor."""
    return [rank, 2 * world - 1 - rank] if load_balance == "zigzag" else [rank]


def _check_length(name: str, length: int, chunks: int, what: str) -> int:
    """The chunk size of a sequence of `length` cut into `chunks` equal chunks; else a one-line error."""
    if length <= 0 or length % chunks:
        raise InputError(name, length, f"a positive multiple of {chunks} ({what}); pad the sequence to one "
                                       f"(docs/distributed.md, \"Lengths\")")
    return length // chunks


# -- shard_sequence / unshard_sequence -------------------------------------------------------------


def shard_sequence(x: torch.Tensor, *, dim: int = 1, group=None, load_balance: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full tensor `x` (the same on every rank): its chunks of dimension
    `dim`, concatenated in chunk_ids' order. Differentiable (a gradient flows to x's slices)."""
    _check_balance(load_balance)
    world, rank = _world(group)
    dim = dim % x.dim()
    chunks = num_chunks(world, load_balance)
    size = _check_length(f"x.shape[{dim}]", int(x.shape[dim]), chunks,
                         f"{chunks} chunks: {'2 x ' if load_balance == 'zigzag' else ''}the group's {world} ranks")
    return torch.cat([x.narrow(dim, c * size, size) for c in chunk_ids(rank, world, load_balance)], dim=dim)


def _gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """All ranks' x (equal shapes), stacked: [world, *x.shape]."""
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the collectives stack along dimension 0
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    return out.view(world, *x.shape)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x [world, *shape] summed over ranks; this rank's [*shape]."""
    out = x.new_empty(x.shape[1:])
    stacked = x.contiguous().view(x.shape[0] * x.shape[1], *x.shape[2:])
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, stacked, group=group)
    return out


def _rank_major_order(world: int, load_balance: str) -> list[int]:
    """Global chunk ids in the order the ranks' parts are stacked (rank 0's chunks, rank 1's, ...)."""
    return [c for r in range(world) for c in chunk_ids(r, world, load_balance)]


def _to_global(stacked: torch.Tensor, dim: int, world: int, load_balance: str) -> torch.Tensor:
    """[world, ...local...] (local along `dim`) -> the full tensor, chunks in global order."""
    order = _rank_major_order(world, load_balance)
    chunks = num_chunks(world, load_balance)
    x = stacked.movedim(dim + 1, 1)  # [world, local, ...]
    x = x.reshape(chunks, x.shape[1] * world // chunks, *x.shape[2:])  # [chunk in rank-major order, size, ...]
    inverse = torch.tensor(sorted(range(chunks), key=order.__getitem__), device=x.device)
    x = x.index_select(0, inverse)  # chunks in global order
    return x.reshape(-1, *x.shape[2:]).movedim(0, dim)


def _to_rank_major(full: torch.Tensor, dim: int, world: int, load_balance: str) -> torch.Tensor:
    """The full tensor -> [world, ...local...]: the inverse of _to_global."""
    chunks = num_chunks(world, load_balance)
    x = full.movedim(dim, 0)
    x = x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:])
    x = x.index_select(0, torch.tensor(_rank_major_order(world, load_balance), device=x.device))
    x = x.reshape(world, -1, *x.shape[2:])  # [world, local, ...]
    return x.movedim(1, dim + 1)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, load_balance, world):
        ctx.args = (dim, group, load_balance, world)
        return _to_global(_gather(x, group, world), dim, world, load_balance)

    @staticmethod
    def backward(ctx, grad):
        dim, group, load_balance, world = ctx.args
        # every rank's loss may read every part: each part's gradient is the sum over ranks
        return _reduce_scatter(_to_rank_major(grad, dim, world, load_balance), group), None, None, None, None


def unshard_sequence(x_local: torch.Tensor, *, dim: int = 1, group=None, load_balance: str = "zigzag") -> torch.Tensor:
    """The full tensor from every rank's part (an all-gather, chunks put back in global order).
    Differentiable: the backward is a reduce-scatter (each part gets the sum of every rank's gradient)."""
    _check_balance(load_balance)
    world, _ = _world(group)
    dim = dim % x_local.dim()
    per_rank = len(chunk_ids(0, world, load_balance))
    _check_length(f"x_local.shape[{dim}]", int(x_local.shape[dim]), per_rank, f"{per_rank} chunks per rank")
    return _Unshard.apply(x_local, dim, group, load_balance, world)


# -- one step's kernel calls: exact index arithmetic -----------------------------------------------


class Segment(NamedTuple):
    """A run of consecutive sequence positions: global [start, start + length) at local row `offset`."""
    start: int
    length: int
    offset: int


class Call(NamedTuple):
    """One kernel call of a step: local query rows [q0, q1) against the block's keys [k0, k1)."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: tuple  # (left, right), -1 unbounded; (-1, -1) with causal or for a wholly visible rectangle
    q_pos: int = -1  # the global position of row q0 when the call's rows are one run of the sequence, else -1


def _pair_call(qs: Segment, ks: Segment, causal: bool, window: tuple, keys_from_start: bool = False) -> Call | None:
    """The call for query segment qs against key segment ks, or None when no row sees a key there.

    Globally row i sees key j when i - left <= j <= i + right (causal: right = 0). In the pair's
    local indices (a = i - qs.start, b = j - ks.start, delta = qs.start - ks.start) that is
    -lo <= b - a <= hi with lo = left - delta, hi = right + delta (None: unbounded). The rows that
    see a key are a in [max(0, -hi), min(m - 1, n - 1 + lo)], the keys seen b in
    [max(0, -lo), min(n - 1, m - 1 + hi)]; trimmed to them, the kernel (bottom-right aligned: row
    a' sees b' when o - left' <= b' - a' <= o + right', o = n' - m') needs left' = lo + s1 - a1
    and right' = hi + a1 - s1, both >= 0 (lo + hi = left + right >= 0). A bound that every
    (a', b') meets is dropped: no bound left is the full kernel, right' = 0 alone the causal one.
    """
    left = None if window[0] < 0 else window[0]
    right = None if window[1] < 0 else window[1]
    if causal:
        right = 0 if right is None else min(right, 0)
    m, n, delta = qs.length, ks.length, qs.start - ks.start
    lo = None if left is None else left - delta
    hi = None if right is None else right + delta
    a0, a1 = (0 if hi is None else max(0, -hi)), (m - 1 if lo is None else min(m - 1, n - 1 + lo))
    s0, s1 = (0 if lo is None else max(0, -lo)), (n - 1 if hi is None else min(n - 1, m - 1 + hi))
    if a0 > a1 or s0 > s1:
        return None
    if keys_from_start:
        s0 = 0
    rows, keys = a1 - a0 + 1, s1 - s0 + 1
    new_left = None if lo is None else lo + s1 - a1
    new_right = None if hi is None else hi + a1 - s1
    assert (new_left is None or new_left >= 0) and (new_right is None or new_right >= 0), (qs, ks, window)
    if new_left is not None and new_left >= keys - 1:  # b' - a' >= -(rows - 1) = o - (keys - 1) always
        new_left = None
    if new_right is not None and new_right >= rows - 1:  # b' - a' <= keys - 1 = o + (rows - 1) always
        new_right = None
    is_causal = new_left is None and new_right == 0
    win = (-1, -1) if is_causal else (-1 if new_left is None else new_left, -1 if new_right is None else new_right)
    return Call(qs.offset + a0, qs.offset + a1 + 1, ks.offset + s0, ks.offset + s1 + 1, is_causal, win, qs.start + a0)


def _whole(call: Call | None, qs: Segment, ks: Segment) -> bool:
    """The call covers both segments whole with no mask."""
    return (call is not None and not call.causal and call.window == (-1, -1) and call.q1 - call.q0 == qs.length
            and call.k1 - call.k0 == ks.length)


def step_calls(q_segments: list[Segment], k_segments: list[Segment], causal: bool, window: tuple,
               masked: bool = False) -> list[Call]:
    """The kernel calls of one step: each (query, key) segment pair's call, with wholly visible pairs
    merged into one call where they fill all the rows of a key segment, all the keys of a query
    segment, or the whole step (local rows and block keys are contiguous in memory).
    `masked` (a mask_mod over global positions; the all-gather's one key segment, the whole sequence
    from position 0): one call per query segment, its keys from position 0, so the call's q_idx is
    q_pos + q_idx and its kv_idx the global one."""
    if masked:
        return [c for qs in q_segments for ks in k_segments
                if (c := _pair_call(qs, ks, causal, window, keys_from_start=True)) is not None]
    grid = [[_pair_call(qs, ks, causal, window) for ks in k_segments] for qs in q_segments]
    whole = [[_whole(grid[i][j], qs, ks) for j, ks in enumerate(k_segments)] for i, qs in enumerate(q_segments)]
    q_end = q_segments[-1].offset + q_segments[-1].length
    k_end = k_segments[-1].offset + k_segments[-1].length
    if all(all(row) for row in whole):
        return [Call(0, q_end, 0, k_end, False, (-1, -1))]
    calls, done = [], set()
    cols = [j for j in range(len(k_segments)) if all(whole[i][j] for i in range(len(q_segments)))]
    rows = [i for i in range(len(q_segments)) if all(whole[i])]
    if cols and len(cols) * len(q_segments) >= len(rows) * len(k_segments):
        for j in cols:
            ks = k_segments[j]
            calls.append(Call(0, q_end, ks.offset, ks.offset + ks.length, False, (-1, -1)))
            done |= {(i, j) for i in range(len(q_segments))}
    else:
        for i in rows:
            qs = q_segments[i]
            calls.append(Call(qs.offset, qs.offset + qs.length, 0, k_end, False, (-1, -1)))
            done |= {(i, j) for j in range(len(k_segments))}
    calls += [grid[i][j] for i in range(len(q_segments)) for j in range(len(k_segments))
              if (i, j) not in done and grid[i][j] is not None]
    return calls


def segments(ids: list[int], size: int) -> list[Segment]:
    """Chunks `ids` (each `size` long) laid out one after another in a local tensor."""
    return [Segment(c * size, size, n * size) for n, c in enumerate(ids)]


def _q_ids(rank: int, world: int, load_balance: str) -> list[int]:
    ids = chunk_ids(rank, world, load_balance)
    return ids[::-1] if _TEST_ONLY_MUTANT == "zigzag_order" else ids


# -- the merge -----------------------------------------------------------------------------------


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result (part_out [B, r, H, DV], part_lse [B, H, r]) into the float32
    accumulators out [B, S, H, DV] and lse [B, H, S] at `rows`, in place.

    With w = exp(lse_b - lse_new) = sigmoid(lse_b - lse) the merged output is
    out - w (out - out_b), and lse_new = lse - logsigmoid(lse - lse_b): no exp of an LSE, so
    no overflow. Rows without keys carry lse -inf: -inf against -inf keeps out (0) and lse
    (-inf), a finite lse_b against -inf takes out_b and lse_b; never NaN."""
    o, lse_rows = out[:, rows], lse[:, :, rows]
    ob, lb = part_out.float(), part_lse.float()
    lb_t = lb.transpose(1, 2).unsqueeze(-1)  # [B, r, H, 1], out's layout
    l_t = lse_rows.transpose(1, 2).unsqueeze(-1)
    if _TEST_ONLY_MUTANT == "merge_no_rescale":
        w = torch.ones_like(lb_t)
        o.add_(w * ob)
    else:
        w = torch.sigmoid(lb_t - l_t)
        w = torch.where(lb_t == float("-inf"), torch.zeros_like(w), torch.where(l_t == float("-inf"), torch.ones_like(w), w))
        o.sub_(w * (o - ob))
    merged = lse_rows - torch.nn.functional.logsigmoid(lse_rows - lb)
    new = torch.where(lse_rows == float("-inf"), lb, torch.where(lb == float("-inf"), lse_rows, merged))
    lse_rows.copy_(new)


# -- the ring and the all-gather -----------------------------------------------------------------


class _Config(NamedTuple):
    group: object
    world: int
    rank: int
    method: str
    load_balance: str
    causal: bool
    window: tuple
    kernel: dict  # softcap, softmax_scale and schedule fields: the same for every call
    size: int  # the chunk length


def _call_args(kernel: dict, call: Call, q, k, v) -> tuple:
    """torch.ops.attngen.fwd's (and .bwd's) arguments for one call, LSE on. A mask_mod over global
    positions becomes the call's own: the kernel's "global_mask_mod" holds it rewritten (at_rows) for
    each position a call's rows can start at, made before the steps (ast does not trace)."""
    causal = call.causal and _TEST_ONLY_MUTANT != "causal_flag"
    window = call.window if call.window != (-1, -1) else None
    fields = dict(kernel)
    masks = fields.pop("global_mask_mod", None)
    if masks is not None:
        fields["mask_mod"] = masks[call.q_pos]
    args, _ = ops.fwd_arguments(q[:, call.q0:call.q1].contiguous(), k[:, call.k0:call.k1].contiguous(),
                                v[:, call.k0:call.k1].contiguous(), causal=causal, window=window, return_lse=True,
                                **fields)
    return args


def _check_call(kernel: dict, q, k, v, causal: bool, window: tuple) -> None:
    """ops.check_attention of a call of the local q, k and v with the call's keywords (runs nothing)."""
    fields = dict(kernel)
    masks = fields.pop("global_mask_mod", None)
    if masks is not None:
        fields["mask_mod"] = masks[0]
    ops.check_attention(q, k, v, causal=causal, window=None if window == (-1, -1) else window, return_lse=True,
                        **fields)


def at_rows(mask_mod: str, q_pos: int) -> str:
    """A mask_mod over global positions as a call's own: q_idx -> (q_idx + q_pos), and kv_idx ->
    (kv_idx + 0) (the call's keys start at position 0; an index that is not the bare variable leaves
    a tensor's axis free, so a tensor over the whole sequence is not checked against the call's length)."""
    tree = expr.parse(mask_mod, "mask_mod").tree
    if _TEST_ONLY_MUTANT == "mask_offset":
        q_pos = 0

    class Shift(ast.NodeTransformer):
        def visit_Name(self, node):
            offset = {"q_idx": q_pos, "kv_idx": 0}.get(node.id)
            return node if offset is None else ast.BinOp(ast.Name(node.id, ast.Load()), ast.Add(), ast.Constant(offset))

    return ast.unparse(Shift().visit(tree))


def _peers(cfg: _Config) -> tuple[int, int]:
    """(next, previous) ranks of the ring, as global ranks (P2P takes those)."""
    nxt, prev = (cfg.rank + 1) % cfg.world, (cfg.rank - 1) % cfg.world
    if cfg.group is None:
        return nxt, prev
    return dist.get_global_rank(cfg.group, nxt), dist.get_global_rank(cfg.group, prev)


def _rotate(cfg: _Config, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """Start sending `tensors` to the next rank and receiving the previous rank's: (requests, buffers)."""
    nxt, prev = _peers(cfg)
    received = [torch.empty_like(t) for t in tensors]
    p2p = [dist.P2POp(dist.isend, t.contiguous(), nxt, cfg.group) for t in tensors]
    p2p += [dist.P2POp(dist.irecv, r, prev, cfg.group) for r in received]
    return dist.batch_isend_irecv(p2p), received


def _wait(requests) -> None:
    for r in requests:
        r.wait()


def _blocks(cfg: _Config, k: torch.Tensor, v: torch.Tensor):
    """The KV blocks of the forward: (key segments, k, v) per step. Ring: this rank's block, then
    each other rank's as it arrives (the next transfer started before this step's compute);
    all-gather: the whole sequence at once, in global order."""
    if cfg.method == "allgather":
        k_full = _to_global(_gather(k, cfg.group, cfg.world), 1, cfg.world, cfg.load_balance)
        v_full = _to_global(_gather(v, cfg.group, cfg.world), 1, cfg.world, cfg.load_balance)
        yield [Segment(0, k_full.shape[1], 0)], k_full, v_full
        return
    for step in range(cfg.world):
        pending = _rotate(cfg, [k, v]) if step < cfg.world - 1 else None
        src = (cfg.rank - step) % cfg.world
        yield segments(chunk_ids(src, cfg.world, cfg.load_balance), cfg.size), k, v
        if pending is not None:
            _wait(pending[0])
            k, v = pending[1]


def _forward(cfg: _Config, q, k, v):
    """(out float32 [B, S, H, DV], lse float32 [B, H, S]) of this rank's rows, merged over every step."""
    b, s, h, _ = q.shape
    out = torch.zeros((b, s, h, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    q_segments = segments(_q_ids(cfg.rank, cfg.world, cfg.load_balance), cfg.size)
    for k_segments, k_blk, v_blk in _blocks(cfg, k, v):
        _attend(q_segments, k_segments, cfg.causal, cfg.window, cfg.kernel, q, k_blk, v_blk, out, lse)
    return out, lse


def _attend(q_segments, k_segments, causal, window, kernel, q, k_blk, v_blk, out, lse) -> None:
    """One step's kernel calls, merged into out and lse. A function of its own, with no collective
    and no process group among its arguments, so that torch.compile makes it one graph (docs/distributed.md)."""
    for call in step_calls(q_segments, k_segments, causal, window, "global_mask_mod" in kernel):
        part_out, part_lse = ops.fwd(*_call_args(kernel, call, q, k_blk, v_blk))
        _merge(out, lse, slice(call.q0, call.q1), part_out, part_lse)


def _step_grads(q_segments, k_segments, causal, window, kernel, q, k_blk, v_blk, out, lse, dout, dlse, dq,
                skip: bool):
    """One step's backward calls: dq accumulated in place (float32), the block's (dk, dv) in float32
    returned (zero with the test-only `skip`)."""
    dk_blk = torch.zeros(k_blk.shape, dtype=torch.float32, device=k_blk.device)
    dv_blk = torch.zeros(v_blk.shape, dtype=torch.float32, device=v_blk.device)
    for call in step_calls(q_segments, k_segments, causal, window, "global_mask_mod" in kernel):
        rows = slice(call.q0, call.q1)
        args = _call_args(kernel, call, q, k_blk, v_blk)
        g = ops.bwd(dout[:, rows].contiguous(), out[:, rows].contiguous(), lse[:, :, rows].contiguous(), *args,
                    dlse=None if dlse is None else dlse[:, :, rows].contiguous())
        dq[:, rows] += g[0].float()
        if not skip:
            dk_blk[:, call.k0:call.k1] += g[1].float()
            dv_blk[:, call.k0:call.k1] += g[2].float()
    return dk_blk, dv_blk


def _backward(cfg: _Config, q, k, v, out, lse, dout, dlse):
    """(dq, dk, dv) of this rank's parts: per step attngen's backward op with the merged out and LSE
    (P = exp(s - lse) is then the step's share of the global softmax, and d lse / d s its P, so each
    call folds the merged LSE's gradient dlse, or None, into its rows as a whole attention would); dq
    summed here in float32, dK/dV in float32 travelling with their block (ring) or reduce-scattered
    (all-gather)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_segments = segments(_q_ids(cfg.rank, cfg.world, cfg.load_balance), cfg.size)

    def step_grads(k_segments, k_blk, v_blk, skip: bool):
        return _step_grads(q_segments, k_segments, cfg.causal, cfg.window, cfg.kernel, q, k_blk, v_blk, out, lse, dout,
                           dlse, dq, skip)

    blocks = _blocks(cfg, k, v)  # K and V rotate (or are gathered) as in the forward
    if cfg.method == "allgather":
        (k_segments, k_full, v_full), = blocks
        dk_full, dv_full = step_grads(k_segments, k_full, v_full, False)
        dk = _reduce_scatter(_to_rank_major(dk_full, 1, cfg.world, cfg.load_balance), cfg.group)
        dv = _reduce_scatter(_to_rank_major(dv_full, 1, cfg.world, cfg.load_balance), cfg.group)
        return dq, dk, dv
    dkv_pending = None
    for step, (k_segments, k_blk, v_blk) in enumerate(blocks):
        skip = _TEST_ONLY_MUTANT == "dkdv_skip_step" and step == cfg.world - 1
        dk_blk, dv_blk = step_grads(k_segments, k_blk, v_blk, skip)
        if dkv_pending is not None:  # this block's dK/dV so far, from the ranks that held it before
            _wait(dkv_pending[0])
            dk_blk, dv_blk = dk_blk + dkv_pending[1][0], dv_blk + dkv_pending[1][1]
        # on to the next rank, which holds this block at the next step (after the last: its owner)
        dkv_pending = _rotate(cfg, [dk_blk, dv_blk])
    _wait(dkv_pending[0])
    dk, dv = dkv_pending[1]
    return dq, dk, dv


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _forward(cfg, q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)  # an output the loss does not read has gradient None: no work for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous().to(out.dtype)
        if _TEST_ONLY_MUTANT == "dlse_dropped":
            dlse = None
        dq, dk, dv = _backward(ctx.cfg, q, k, v, out, lse, dout, None if dlse is None else dlse.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _check_kwargs(method: str, kwargs: dict) -> dict:
    """The spec fields passed through (the schedule's), a mask_mod and its tensors, after refusing
    what cannot be sharded."""
    for name, value in kwargs.items():
        if name in REFUSED and value is not None:
            raise InputError(name, "given", f"no {name} with context parallelism: {REFUSED[name]}")
        if name in ALLGATHER_ONLY and value is not None and method != "allgather":
            raise InputError(name, "given", f"method='allgather' for {name} (a ring step's keys are two runs of the "
                                            f"sequence, not one)")
        if isinstance(value, torch.Tensor) and name not in FIELDS and kwargs.get("mask_mod") is not None:
            continue  # a call-time tensor of the mask_mod, over global positions
        if name not in SCHEDULE_FIELDS + ALLGATHER_ONLY:
            known = "a spec field set by the call itself or by the tensors" if name in FIELDS else "an unknown keyword"
            raise InputError(name, repr(value), f"a schedule field ({', '.join(SCHEDULE_FIELDS)}); {name} is {known}")
    return {n: x for n, x in kwargs.items() if x is not None}


def _documents(cu_seqlens, length: int, device) -> torch.Tensor:
    """The document id of each of the sequence's `length` positions (float32, as call-time tensors
    are), from cu_seqlens [0, end_1, ..., length]."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        got = f"a {cu_seqlens.dtype} tensor of shape {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        raise InputError("cu_seqlens", got, "a 1-d integer tensor [documents + 1] of the global sequence's offsets")
    cu = cu_seqlens.detach().cpu().long()
    if len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != length or bool((cu[1:] < cu[:-1]).any()):
        raise InputError("cu_seqlens", cu.tolist(), f"non-decreasing offsets from 0 to {length}, the global sequence's "
                                                    f"length (W x the local length)")
    ids = torch.searchsorted(cu[1:], torch.arange(length), right=True)
    return ids.to(device=device, dtype=torch.float32)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, method: str = "ring",
                               load_balance: str = "zigzag", causal: bool = False, window_size=(-1, -1),
                               softcap: float = 0.0, softmax_scale=None, return_lse: bool = False, **kwargs):
    """Attention of this rank's queries against the whole (sharded) sequence's keys.

    q [B, S/W, H, D], k [B, S/W, HKV, D], v [B, S/W, HKV, DV]: this rank's parts (shard_sequence
    with the same load_balance), HKV dividing H (GQA, MQA). causal and window_size=(left, right)
    (-1 unbounded) are over global positions. Returns this rank's out [B, S/W, H, DV] (and with
    return_lse its float32 LSE [B, H, S/W]; a row that sees no key: out 0, LSE -inf).
    Differentiable in q, k and v, through out and the LSE alike (as attngen.attention's).
    kwargs: the kernel's schedule fields (SCHEDULE_FIELDS); with method="allgather" also
    `mask_mod` (attngen's expression text over GLOBAL q_idx and kv_idx, docs/variants.md) with its
    call-time tensors by name (over global positions), and `cu_seqlens` (int [documents + 1], the
    packed documents of the global sequence, the same for every batch row): attention stays within a
    document (bottom-right causal per document is the global causal within it, as lengths are equal).
    score_mod, ALiBi, sinks and block masks are refused with a one-line InputError (REFUSED says why).
    """
    if method not in METHODS:
        raise InputError("method", repr(method), f"one of {', '.join(map(repr, METHODS))}")
    _check_balance(load_balance)
    kernel = _check_kwargs(method, kwargs)
    world, rank = _world(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(name, got, "a 4-d tensor [B, S/W, heads, head_dim]: this rank's part of the sequence")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise InputError("k.shape[1]", int(k.shape[1]), f"{int(q.shape[1])}, q's local length (context parallelism "
                                                        f"shards one sequence: q, k and v alike)")
    left, right = op_arguments.window_arguments(window_size)
    if any(int(x) < -1 for x in (left, right)):
        raise InputError("window_size", tuple(window_size), "(left, right), integers >= -1 (-1: unbounded)")
    per_rank = len(chunk_ids(rank, world, load_balance))
    size = _check_length("q.shape[1]", int(q.shape[1]), per_rank,
                         f"{per_rank} chunks per rank with load_balance={load_balance!r}")
    cu_seqlens, mask = kernel.pop("cu_seqlens", None), kernel.pop("mask_mod", None)
    if mask is not None:  # checked before any collective: one line naming the column
        if not isinstance(mask, str):
            raise SpecError("mask_mod", mask, "an expression string over global q_idx and kv_idx (docs/variants.md)")
        try:
            expr.parse(mask, "mask_mod")
        except expr.ExprError as e:
            raise SpecError("mask_mod", mask, str(e)) from None
    if cu_seqlens is not None:
        kernel[DOCUMENT] = _documents(cu_seqlens, world * int(q.shape[1]), q.device)
        same = f"{DOCUMENT}[q_idx] == {DOCUMENT}[kv_idx]"
        mask = same if mask is None else f"({same}) and ({mask})"
    if mask is not None:  # the all-gather's calls start at their chunk's first row (q_pos; 0 for the check)
        positions = {0} | {seg.start for seg in segments(_q_ids(rank, world, load_balance), size)}
        kernel["global_mask_mod"] = {p: at_rows(mask, p) for p in sorted(positions)}
    kernel.update(softcap=softcap, softmax_scale=softmax_scale)
    # every check of the kernel calls (dtypes, heads, head dims, fields, the CPU time of one call) before
    # any collective: a rank that raised mid-ring would leave the others waiting
    _check_call(kernel, q, k, v, bool(causal), (int(left), int(right)))
    cfg = _Config(group, world, rank, method, load_balance, bool(causal), (int(left), int(right)), kernel, size)
    out, lse = _ContextParallel.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out


__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence", "step_calls", "chunk_ids", "num_chunks",
           "METHODS", "LOAD_BALANCES"]
