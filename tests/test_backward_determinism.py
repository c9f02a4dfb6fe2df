"""`deterministic = true` against the CPU model's schedules and block orders (docs/backward.md, "Determinism").

Blocks of a launch are unordered on a GPU and the warpgroups of a block interleave as they
will; the CPU model draws both (policy and seed: the warpgroups' interleaving; block_order
"shuffled": a seeded order of the blocks). Float32 atomics and TMA reduce-adds are added in the
order they run, so a sum of three or more of them shows that order in its last bits.
"""

import numpy as np
import pytest

from attngen.emulator import POLICIES, emulate_backward
from attngen.kernels.bwd.plan import plan_backward
from attngen.kernels.bwd.render import render_backward_source
from test_backward_mutants import NAMES, case, check_grads

ORDERS = ("grid", "shuffled")
RUNS = [(p, s, o) for p in POLICIES for s in (0, 3) for o in ORDERS]

# (spec fields, (batch, heads, kv heads, q_len, kv_len)): several KV tiles add to each dQ row,
# several Q tiles to each key; GQA's group sums dK and dV over 3 query heads.
DET_CASES = [
    (dict(causal=True), (1, 2, 2, 300, 330)),  # the default preset
    (dict(head_dim=64, gqa_group=3, window=(100, 20)), (2, 3, 1, 150, 300)),
    (dict(head_dim=64, causal=True, softcap=3.0, alibi=True), (1, 2, 2, 200, 300)),
]


def runs(fields, shape, schedules=RUNS):
    spec, args, tensors, variant = case(fields, shape)
    out = {r: dict(zip(NAMES, emulate_backward(spec, *args, seed=r[1], policy=r[0], block_order=r[2], **tensors)))
           for r in schedules}
    return spec, args, variant, out


def differing(out, name):
    base = out[RUNS[0]][name]
    return [r for r, g in out.items() if not np.array_equal(g[name], base)]


@pytest.mark.parametrize("fields, shape", DET_CASES, ids=[",".join(f) for f, _ in DET_CASES])
def test_deterministic_gradients_are_bit_identical_in_every_schedule_and_block_order(fields, shape):
    spec, args, variant, out = runs(dict(fields, deterministic=True), shape)
    assert "T.atomic_add" not in render_backward_source(spec)  # no float atomics left to order
    for name in ("dq", "dk", "dv"):
        assert differing(out, name) == [], name
    checks = check_grads(out[RUNS[0]], *args, spec.causal, dtype=spec.dtype, **variant)
    assert all(c.ok for c in checks.values()), checks


def test_deterministic_dsinks_are_bit_identical_in_every_block_order():
    """dsinks by build_dsinks_kernel (one block per head, rows in order) with deterministic = true;
    without it, one float32 atomic per preprocess block, whose bits follow the block order."""
    fields, shape = dict(head_dim=64, causal=True, sinks=True), (2, 2, 2, 200, 300)
    spec, args, variant, out = runs(dict(fields, deterministic=True), shape)
    assert differing(out, "dsinks") == []
    assert all(c.ok for c in check_grads(out[RUNS[0]], *args, spec.causal, dtype=spec.dtype, **variant).values())
    _, _, _, out = runs(fields, shape)
    assert {r[2] for r in differing(out, "dsinks")} == {"shuffled"}


def test_without_deterministic_the_atomics_order_shows_in_the_last_bits():
    """What may differ without it, shown on the CPU model: dQ (several KV tiles' and both MMA
    warpgroups' reduce-adds into one row, in the order the schedule runs them: already across
    policies and seeds in grid order) and GQA's dK and dV (a group of 3 query heads' blocks adding
    to one KV head, in block order). The gradients still pass the tolerance rule each time."""
    spec, args, variant, out = runs(dict(causal=True), (1, 2, 2, 300, 330))
    assert {r[2] for r in differing(out, "dq")} == {"grid", "shuffled"}
    assert differing(out, "dk") == differing(out, "dv") == []  # stored once per key: no atomics
    for grads in out.values():
        assert all(c.ok for c in check_grads(grads, *args, spec.causal, dtype=spec.dtype, **variant).values())

    spec, args, variant, out = runs(dict(head_dim=64, gqa_group=3), (1, 3, 1, 64, 128))
    assert plan_backward(spec).kv_accum
    assert differing(out, "dq") == []  # one KV tile, one warpgroup's share per row pair: (0 + a) + b is exact
    assert any(r[2] == "shuffled" for r in differing(out, "dv") + differing(out, "dk"))
