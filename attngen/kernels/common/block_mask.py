"""A call-time block mask (FlexAttention's BlockMask): the walk over its lists, both passes.

Each agent (a producer warp, every consumer warpgroup) walks the two ascending lists of its row
(the forward's KV tiles of a Q tile; the backward's Q tiles of a KV tile, or its dq kernel's KV
tiles of a Q tile), partial and full, with a cursor per list, and visits the lower head first:
the tiles in ascending order, the dense kernel's order, so that skipping the empty tiles (which
add exactly 0 and rescale by exactly 1 there) leaves every bit of the result as it was.
The lists' tensors are kernels/common/plan.py's ABI; which tiles exist is attngen/tiles.py's.
"""

from __future__ import annotations

from attngen.kernels.common.plan import BLOCK_MASK_TENSORS, BWD_BLOCK_MASK_TENSORS, DQ_BLOCK_MASK_TENSORS
from attngen.kernels.common.variants import has_first_tile

# (condition, comment) of a visit that needs the element mask: a partial tile of the lists
BLOCK_MASK_TEST = ("partial", "a partial tile of the block mask: masked (a full tile needs no mask)")
ROW_VALUES = ["bm_b", "bm_h", "bm_partial_n", "bm_full_n"]  # what the setup binds and a walk reads


class ListWalk:
    """One kernel's walk over a row of the lists `tensors` ((name, param, axes) of the partial counts,
    partial indices, full counts, full indices): `row` is the block's tile along the lists' row axis,
    `extent` the listed axis's size (the "none left" value), `tile` the variable each step binds and
    `count` the name of the visit count (both lists' counts); `cuts`/`whole` comment the two counts."""

    def __init__(self, tensors, row: str, extent: str, tile: str, count: str, cuts: str, whole: str):
        self.tensors = tensors
        self.row, self.extent, self.tile, self.count = row, extent, tile, count
        self.cuts, self.whole = cuts, whole
        self.partial, self.full = tensors[1][1], tensors[3][1]

    def setup(self) -> list[str]:
        """The block's row of the lists (a batch or head extent of 1 broadcasts) and its two counts."""
        return ["bm_b = T.min(batch_idx, bm_batch - 1)  # the block mask's batch and head: an extent of 1 broadcasts",
                "bm_h = T.min(head, bm_heads - 1)",
                f"bm_partial_n = {self.tensors[0][1]}[bm_b, bm_h, {self.row}]  # {self.cuts}",
                f"bm_full_n = {self.tensors[2][1]}[bm_b, bm_h, {self.row}]  # {self.whole}"]

    def cursors(self) -> list[str]:
        """An agent's cursors into the two lists, before its first visit."""
        return [f'bm_next_p = T.alloc_var("int32", 0)  # the next unvisited entry of {self.partial} (partial tiles)',
                f'bm_next_f = T.alloc_var("int32", 0)  # and of {self.full} (full tiles)']

    def step(self) -> list[str]:
        """One visit's step: `tile` is the lower head, `partial` says which list it came from, and
        that list's cursor steps."""
        at, n = f"bm_b, bm_h, {self.row}", self.extent
        return [(f"bm_p = T.if_then_else(bm_next_p < bm_partial_n, {self.partial}[{at}, T.min(bm_next_p, {n} - 1)], {n})"
                 f"  # the next partial tile ({n}: none left)"),
                (f"bm_f = T.if_then_else(bm_next_f < bm_full_n, {self.full}[{at}, T.min(bm_next_f, {n} - 1)], {n})"
                 "  # the next full tile"),
                f"{self.tile} = T.min(T.min(bm_p, bm_f), {n} - 1)  # the lower of the two: tiles in ascending order",
                f"partial = bm_p <= bm_f  # never equal: a visit has a tile left in one list ({self.count} counts both)",
                "bm_next_p = bm_next_p + T.if_then_else(partial, 1, 0)  # a T.alloc_var: assigning stores it",
                "bm_next_f = bm_next_f + T.if_then_else(partial, 0, 1)"]

    def args(self) -> list[str]:
        """What a consumer macro's walk reads: the block's row of the lists and its two index tensors."""
        return ROW_VALUES + [self.partial, self.full]


def backward_walk(forward_plan, dq: bool = False) -> ListWalk | None:
    """The backward's walk: the main kernel's transposed q_* lists per KV tile, or the dq kernel's
    kv_* lists per Q tile (plan.BWD_BLOCK_MASK_TENSORS, DQ_BLOCK_MASK_TENSORS); None without a block mask."""
    if not forward_plan.block_mask:
        return None
    if dq:
        return ListWalk(DQ_BLOCK_MASK_TENSORS, "q_block", "bm_dq_kv_tiles", "kv_tile", "n_kv",
                        "KV tiles of these rows that the mask cuts", "... and that it sees whole")
    return ListWalk(BWD_BLOCK_MASK_TENSORS, "kv_block", "bm_q_tiles", "q_tile", "n_q",
                    "Q tiles of this KV tile that the mask cuts", "... and that it sees whole")


class ForwardVisits:
    """The forward's visits under a block mask (the template's `bmask`): every method is empty
    without one, except `comments`, which names the visits of every kernel."""

    def __init__(self, plan):
        self.plan = plan
        self.on = bool(plan.block_mask)
        self.walk = ListWalk(BLOCK_MASK_TENSORS, "q_block", "bm_kv_tiles", "kv_tile", "n_tiles",
                             "KV tiles of this Q tile that the mask cuts", "KV tiles it sees whole")

    @classmethod
    def of(cls, plan) -> ForwardVisits:
        return cls(plan)

    def setup(self) -> list[str]:
        return self.walk.setup() if self.on else []

    def init(self) -> list[str]:
        """An agent's cursors, before its first visit."""
        return self.walk.cursors() if self.on else []

    def lines(self) -> list[str]:
        """At the start of each visit: its KV tile (kv_tile) and whether it is partial; the cursors step."""
        return self.walk.step() if self.on else []

    def first_test(self) -> tuple[str, str]:
        """(condition, comment) under which the prologue's visit is masked."""
        return BLOCK_MASK_TEST if self.on else ("", "")

    def guard(self) -> tuple:
        """(condition, comment) under which a consumer visits any tile, or (): only a block mask's Q tile
        can list none (random block sparsity makes them). Such a block loads no K/V tile and skips the
        prologue, the steady loop and the last PV; every consumer of the block skips together (the lists
        are per Q tile), so the ping-pong ring keeps the primer's one arrival, as every block leaves it."""
        if not self.on:
            return ()
        return ("n_tiles > 0", "a Q tile with no listed tile visits none: O = 0, LSE -inf (or the sink's own)")

    def no_visit_init(self) -> list[str]:
        """What the skipped prologue would have set for a row that sees no key: the row sum it starts
        (0; with a sink it starts at the sink's 1). The running max is at its start and alpha 1, so the
        epilogue writes what the dense kernel writes for such a row, bit for bit."""
        if not self.on or self.plan.spec.sinks:
            return []
        return ["T.fill(row_sum, 0)  # read by the epilogue only if the block visits no tile (the prologue sets it)"]

    def comments(self) -> tuple[str, str]:
        """What the prologue's and the steady loop's visits are, for their comments."""
        if self.on:
            return "the block mask's first listed tile", "visit k (the block mask's k-th listed tile, kv_tile)"
        if has_first_tile(self.plan):
            return "the first visited tile", "visit k (K tile first_tile + k)"
        return "tile 0", "tile k"
