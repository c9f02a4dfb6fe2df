"""Hypothesis strategies over spec fields, shared by the spec, render and emulator tests."""

from hypothesis import strategies as st

from attngen.kernels.fwd.plan import make_plan
from attngen.spec import HEAD_DIMS, MAX_CONSUMERS, MAX_STAGES, Spec, SpecError


@st.composite
def spec_fields(draw, head_dims=HEAD_DIMS):
    """Any combination of in-range fields; budgets may still reject it (SpecError)."""
    fields = {
        "head_dim": draw(st.sampled_from(head_dims)),
        "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
        "causal": draw(st.booleans()),
        "gqa_group": draw(st.sampled_from([1, 2, 4, 8])),
        "consumers": draw(st.integers(1, MAX_CONSUMERS)),
        "k_stages": draw(st.integers(1, MAX_STAGES)),
        "v_stages": draw(st.integers(1, MAX_STAGES)),
        "aligned": draw(st.booleans()),
        "steady_loop": draw(st.sampled_from(["one", "split"])),
    }
    if draw(st.booleans()):
        fields["block_n"] = draw(st.sampled_from([32, 64, 80, 96, 128, 176, 256]))
    if fields["consumers"] >= 2 and draw(st.booleans()):
        fields["pingpong"] = False
    return fields


@st.composite
def valid_specs(draw, head_dims=HEAD_DIMS):
    """Specs within every budget, resolved (block_m, block_n and pingpong filled in by the plan)."""
    fields = draw(spec_fields(head_dims))
    try:
        return make_plan(Spec(**fields)).spec
    except SpecError:
        # over a budget: drop the optional block_n and the deepest stages, which always fits
        fields.pop("block_n", None)
        fields["k_stages"] = fields["v_stages"] = 1
        if fields["head_dim"] == 256:  # needs more registers than 3 consumers can have
            fields["consumers"] = min(fields["consumers"], 2)
        return make_plan(Spec(**fields)).spec


# -- serving: ragged batches (issue 11, docs/serving.md) ------------------------------------------
def _special_lengths(block_m: int, block_n: int, page_size: int | None) -> list:
    """Empty, length 1, and lengths one either side of the tile (and page) multiples."""
    steps = {block_m, block_n, 2 * block_n} | ({page_size} if page_size else set())
    return sorted({0, 1, 2} | {n + d for n in steps for d in (-1, 0, 1)})


@st.composite
def ragged_batches(draw, block_m: int = 128, block_n: int = 64, max_batch: int = 4, max_tiles: int = 3,
                   layouts=("varlen", "bshd"), paged=(False, True), head_dims=(64,), dtypes=("float16", "bfloat16"),
                   groups=(1, 2, 4), kv_heads=(1, 2)):
    """One serving call's batch: a dict with `inputs` (attngen.reference.serving.random_serving_inputs's
    keywords), `block_m`, `block_n` and a `num_splits` from 1 to two more than the KV tiles.

    Lengths mix 0 (an empty sequence; varlen queries, any paged or varlen key length), 1, the
    multiples of block_m, block_n and the page size plus and minus one, and any length up to
    max_tiles * block_n; one sequence is drawn with q_len > kv_len when the layout allows it;
    page tables are shuffled (or not), padding rows and spare pages hold 1e4 (or random values).
    bshd has one query length (and, with a dense KV, one key length) for the whole batch.
    `groups` (query heads per KV head) and `kv_heads` are drawn from the given choices, so that a
    caller can match a spec's gqa_group.
    """
    layout = draw(st.sampled_from(layouts))
    is_paged = draw(st.sampled_from(paged))
    page_size = draw(st.sampled_from([block_n, 2 * block_n])) if is_paged else None
    special = _special_lengths(block_m, block_n, page_size)
    cap = max_tiles * block_n

    def length(low=0):
        n = draw(st.one_of(st.sampled_from(special), st.integers(0, cap)))
        return max(low, min(n, cap))

    batch = draw(st.integers(1, max_batch))
    if layout == "varlen":
        lq = [length() for _ in range(batch)]
    else:
        lq = [length(1)] * batch
    if layout == "bshd" and not is_paged:
        lk = [length(1)] * batch
    else:
        lk = [length() for _ in range(batch)]
        b = draw(st.integers(0, batch - 1))
        if lq[b] >= 1 and draw(st.booleans()):  # this sequence has more queries than keys
            lk[b] = draw(st.integers(0, lq[b] - 1))
    if layout == "varlen" and not is_paged and sum(lk) == 0:
        lk[draw(st.integers(0, batch - 1))] = 1  # a dense KV needs one row for its TMA descriptor
    n_kv_heads = draw(st.sampled_from(kv_heads))
    group = draw(st.sampled_from(groups))
    tiles = max(1, -(-max(lk) // block_n))
    return {
        "inputs": dict(
            layout=layout, paged=is_paged, page_size=page_size, dtype=draw(st.sampled_from(dtypes)),
            head_dim=draw(st.sampled_from(head_dims)), head_dim_v=None, seq_lens_q=lq, seq_lens_k=lk,
            heads=n_kv_heads * group, kv_heads=n_kv_heads, seed=draw(st.integers(0, 2**16)),
            shuffle_pages=draw(st.booleans()), neighbour_fill=draw(st.sampled_from([None, 1e4])),
        ),
        "block_m": block_m,
        "block_n": block_n,
        "num_splits": draw(st.integers(1, tiles + 2)),
    }


# -- window edges (issue 21): a bound off by one shows only where an edge meets a tile boundary ----
def window_edge_kv_lens(plan, q_len: int, max_kv: int, deltas=(-1, 0, 1)) -> list:
    """Key lengths at which a window edge of a warpgroup's first or last row, or of the last
    valid row, falls on key m * BLOCK_N + d (d in `deltas`), for the plan's window and this q_len.

    Row r's left edge is r + (kv_len - q_len) - left, its right edge r + (kv_len - q_len) + right;
    solving for kv_len puts an edge exactly there. `window = [270, -1]`, 1 consumer, q_len 64:
    kv_len 400 puts the last row's left edge at 129 = 128 + 1 (where `WG_ROWS - 2` would miscount).
    """
    rows = {q_len - 1}
    for q0 in range(0, q_len, plan.spec.block_m):
        for g in range(plan.spec.consumers):
            rows |= {q0 + g * plan.wg_rows, q0 + g * plan.wg_rows + plan.wg_rows - 1}
    reach = [-plan.window_left] if plan.window_left is not None else []
    reach += [plan.window_right] if plan.window_right is not None else []
    bn = plan.spec.block_n
    lens = set()
    for r in rows:
        if r >= q_len:
            continue
        for e in reach:
            for m in range(0, max_kv // bn + 2):
                kv = m * bn - r + q_len - e  # edge r + kv - q_len + e = m * bn
                lens |= {kv + d for d in deltas if 1 <= kv + d <= max_kv}
    return sorted(lens)


# -- the run-time softmax scale (issue 18) ---------------------------------------------------------
def softmax_scales():
    """None (the default 1/sqrt(head_dim)), the ends 1.0 (peaked rows) and 0.01 (nearly uniform), and
    any scale between them, log-uniform."""
    return st.one_of(st.sampled_from([None, None, 1.0, 0.01]),
                     st.floats(-2.0, 0.0).map(lambda e: float(10.0 ** e)))
