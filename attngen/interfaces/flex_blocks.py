"""FlexAttention's block masks: `create_block_mask` classifies each tile of a mask_mod (translated:
flex_mods.translate) as empty, partial or full (tiles.tile_states), `BlockMask` holds torch's
fields, and `kernel_block_mask` fits a block mask to the tiles a kernel plans with.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

from attngen import expr, tiles
from attngen.interfaces.flex_mods import translate
from attngen.reference.forward import InputError


@dataclasses.dataclass(eq=False)
class BlockMask:
    """FlexAttention's BlockMask fields: per (b, h, Q tile) the KV tiles that are partial
    (kv_num_blocks, kv_indices: the mask runs there) and full (full_kv_num_blocks,
    full_kv_indices: no mask needed), and the transposed q_* lists per KV tile. Empty tiles are in
    neither list. Only the first *_num_blocks entries of an index row are meaningful."""
    seq_lengths: tuple  # (Q_LEN, KV_LEN)
    BLOCK_SIZE: tuple  # (Q block, KV block)
    kv_num_blocks: torch.Tensor  # int32 [B, H, nq]
    kv_indices: torch.Tensor  # int32 [B, H, nq, nk]
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor  # int32 [B, H, nk]
    q_indices: torch.Tensor  # int32 [B, H, nk, nq]
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    mask_mod: object
    states: np.ndarray  # int8 [B, H, nq, nk]: tiles.EMPTY / PARTIAL / FULL
    mask_text: str = ""  # the mask_mod translated (the kernel's spec mask_mod)
    mask_tensors: dict = dataclasses.field(default_factory=dict)  # its captured tensors when the tiles were classified

    @property
    def shape(self) -> tuple:
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def sparsity(self) -> float:
        """Percent of tiles that are empty."""
        return 100.0 * float((self.states == tiles.EMPTY).mean())

    def retiled(self, block_m: int, block_n: int) -> "BlockMask":
        """The same mask over tiles of block_m x block_n, each a whole multiple or divisor of its
        BLOCK_SIZE (tiles.retile_states): the tiles a kernel with other tile sizes visits."""
        st = tiles.retile_states(self.states, self.BLOCK_SIZE, (block_m, block_n), self.seq_lengths)
        return _block_mask(self.seq_lengths, (block_m, block_n), st, self.mask_mod, self.mask_text, self.mask_tensors,
                           self.kv_num_blocks.device)


def _block_mask(lengths, block_size, st, mask_mod, text, tensors, dev) -> BlockMask:
    lists = {n: torch.from_numpy(x).to(dev) for n, x in tiles.mask_lists(st).items()}
    return BlockMask(tuple(lengths), tuple(block_size), mask_mod=mask_mod, states=st, mask_text=text,
                     mask_tensors=dict(tensors), **lists)


def _positive(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise InputError(name, x, "a positive int")
    return int(x)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True, compute_dq_write_order=False, dq_kv_order=True) -> BlockMask:
    """Evaluate mask_mod (translated, with numpy: expr.evaluate) over [B, H, Q_LEN, KV_LEN] and
    classify each BLOCK_SIZE tile (tiles.tile_states). B or H None is 1 (broadcast, as Flex).
    BLOCK_SIZE is an int or (Q block, KV block). `device`: where the index tensors live (CPU
    by default; Flex's default is "cuda"). `_compile` is accepted and changes nothing.
    separate_full_blocks=False lists every visited tile as partial (the mask runs on all), as
    torch's; compute_dq_write_order and dq_kv_order are accepted and change nothing (attngen's
    backward derives its own lists and order: docs/backward.md)."""
    B = 1 if B is None else _positive("B", B)
    H = 1 if H is None else _positive("H", H)
    Q_LEN, KV_LEN = _positive("Q_LEN", Q_LEN), _positive("KV_LEN", KV_LEN)
    bm, bn = (BLOCK_SIZE, BLOCK_SIZE) if not isinstance(BLOCK_SIZE, (tuple, list)) else tuple(BLOCK_SIZE)
    bm, bn = _positive("BLOCK_SIZE", bm), _positive("BLOCK_SIZE", bn)
    tr = translate(mask_mod, "mask_mod")
    e = expr.parse(tr.text, "mask_mod")
    arrays = {n: t.detach().cpu().numpy() for n, t in tr.tensors.items()}  # the tiles' states: values only

    def rows(q0, q1):
        env = {"b": np.arange(B)[:, None, None, None], "h": np.arange(H)[None, :, None, None],
               "q_idx": np.arange(q0, q1)[None, None, :, None], "kv_idx": np.arange(KV_LEN)[None, None, None, :]}
        return np.broadcast_to(expr.evaluate(e, env, arrays), (B, H, q1 - q0, KV_LEN))
    st = tiles.mask_states(rows, Q_LEN, bm, bn)
    if not separate_full_blocks:
        st = np.where(st == tiles.FULL, tiles.PARTIAL, st).astype(st.dtype)
    dev = torch.device("cpu") if device is None else torch.device(device)
    return _block_mask((Q_LEN, KV_LEN), (bm, bn), st, mask_mod, tr.text, tr.tensors, dev)


KERNEL_Q_TILES = (128, 64, 192)  # 64 rows per consumer warpgroup; the default first


def kernel_block_mask(bm, bshape, head_dim: int, dtype, head_dim_v: int, kw: dict, fields: dict) -> BlockMask:
    """The block mask the kernel visits: attngen's own (a torch BlockMask is classified again by
    create_block_mask from its mask_mod), over the kernel's tiles. Its BLOCK_SIZE is taken as
    the tiles when a kernel plans with them; else the first Q tile (128, 64, 192) and the
    largest block_n that plan and divide or are divided by its blocks (BlockMask.retiled). `fields`:
    the call's block_m/block_n (kernel_options), the only tiles then tried."""
    from attngen.kernels.fwd.plan import BLOCK_N_CANDIDATES, make_plan
    from attngen.run.checks import spec_dtype
    from attngen.spec import Spec, SpecError

    if not isinstance(bm, BlockMask):
        size = bm.BLOCK_SIZE if isinstance(bm.BLOCK_SIZE, (tuple, list)) else (bm.BLOCK_SIZE, bm.BLOCK_SIZE)
        bm = create_block_mask(bm.mask_mod, bshape[0], bshape[1], *bm.seq_lengths,
                               BLOCK_SIZE=(int(size[0]), int(size[-1])))
    bq, bk = bm.BLOCK_SIZE
    fields = dict(head_dim=head_dim, dtype=spec_dtype(dtype) or "float16", block_mask=True,
                  mask_mod=kw["mask_mod"], score_mod=kw.get("score_mod", ""), head_dim_v=head_dim_v)

    def plans(m, n) -> bool:
        try:
            make_plan(Spec(**fields, consumers=m // 64, block_n=n))
            return True
        except SpecError:
            return False
    ms = ([bq] if bq in KERNEL_Q_TILES else []) + [t for t in KERNEL_Q_TILES if t != bq and tiles.retiles(bq, t)]
    ns = [bk] + [c for c in BLOCK_N_CANDIDATES if c != bk]
    if "block_m" in fields:  # kernel_options' tiles: those or none
        ms = [fields["block_m"]] if tiles.retiles(bq, fields["block_m"]) else []
    if "block_n" in fields:
        ns = [fields["block_n"]]
    for m in ms:
        for n in ns:
            if n % 16 == 0 and n <= 256 and tiles.retiles(bk, n) and plans(m, n):
                return bm if (m, n) == (bq, bk) else bm.retiled(m, n)
    raise InputError("block_mask.BLOCK_SIZE", (bq, bk), "blocks that kernel tiles divide or are divided by (a Q tile "
                                                        "of 64, 128 or 192 rows, a KV tile a multiple of 16)")


__all__ = ["BlockMask", "create_block_mask", "kernel_block_mask"]
