"""Deliberately broken backward kernels: the CPU model must catch every one, in every schedule.

Each mutant is a textual edit of the rendered backward module (render_backward_source), so it
follows template changes; the test asserts the edit applies, that the unmodified module passes
for the same spec, shape and schedules, and that the mutant is caught in EVERY schedule
(each policy x SEEDS) and, for a race, in every block order too: a hazard report naming the
buffer, or, for a numeric mutant, a FAIL of reference.backward.check_grads on the gradients it breaks.

The spec is the default preset (`Spec(causal=True)`: hd128 f16 causal, BLOCK_M 64, BLOCK_N 128,
2 MMA warpgroups, 2 Q stages), or the default plus the one feature the mutant needs (softcap,
GQA, a window). The shape has several Q tiles per KV tile (each stage reused), a partial last
KV tile, and causal rows past the first Q tile's diagonal.
"""

import dataclasses

import numpy as np
import pytest

from attngen.emulator import POLICIES, HazardError, emulate_backward
from attngen.emulator.driver import variant_inputs
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import variant_of
from attngen.reference.backward import check_grads
from attngen.kernels.bwd.render import render_backward_source
from attngen.spec import Spec

NAMES = ("dq", "dk", "dv", "dsinks")
SEEDS = (0, 1, 2)
SCHEDULES = [(p, s) for p in POLICIES for s in SEEDS]
BLOCK_ORDERS = ("grid", "shuffled")
DEFAULT = {"causal": True}  # examples/default.toml
SHAPE = (1, 1, 1, 300, 330)  # batch, heads, kv heads, q_len, kv_len: 5 Q tiles, 3 KV tiles (the last 74 keys)

WAIT_RELEASE = ("            T.wait_wgmma(0)\n"
                "            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n"
                "            T.mbarrier_arrive(do_empty[stage])  # dO, dPsum read (dP^T, dV, dS)\n")
DQ_REDUCE_ADD = "T.atomic_add(dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :], dQ_shared[g, :, :], use_tma=True)"
DQ_STORE = "T.copy(dQ_shared[g, :, :], dQ_accum[batch_idx, m0:m0 + BLOCK_M, head, :])"
DK_ADD = "T.atomic_add(dK_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :], acc_dk)"
DK_STORE = "T.copy(acc_dk, dK_accum[batch_idx, key0:key0 + WG_KEYS, kv_head, :])"
SOFTCAP_DZ = " * (1.0 - T.tanh(acc_s[i, j] * softcap_scale) * T.tanh(acc_s[i, j] * softcap_scale))  # (dP^T - dPsum) dz/ds"
WINDOW = {"causal": True, "window": (100, -1)}  # a left edge 100 keys back: Q tiles [q_first, q_first + n_q) per KV tile
WINDOW_N_Q = ("n_q = T.max(T.min(T.ceildiv(q_len, BLOCK_M), T.ceildiv(T.min((kv_block + 1) * BLOCK_N, kv_len) - causal_offset + 100, "
              "BLOCK_M)) - q_first, 0)")
Q_FIRST = "q_first = T.floordiv(T.max(kv_block * BLOCK_N - causal_offset, 0), BLOCK_M)"


@dataclasses.dataclass
class Mutant:
    name: str
    why: str
    edits: list  # (old, new): every occurrence of old is replaced
    expect: str  # "hazard" or "numeric"
    spec: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT))
    shape: tuple = SHAPE
    report: tuple = ()  # hazards: strings the report must contain
    breaks: tuple = ()  # numeric: the gradients that must fail check_grads
    report_any: tuple = ()  # hazards: the report contains one of these


MUTANTS = [
    Mutant("dpsum_not_subtracted", "dS = P dP instead of P (dP - dPsum): the softmax Jacobian's row term is lost",
           [("acc_s[i, j] * (acc_dp[i, j] - dPsum_shared[stage, j])", "acc_s[i, j] * acc_dp[i, j]")],
           "numeric", breaks=("dq", "dk")),
    Mutant("lse_not_in_log2_units", "the preprocess writes the natural-log LSE where the main kernel's exp2 needs LSE * log2(e)",
           [("0, LSE[batch_idx, head, r0 + i] * LOG2E)", "0, LSE[batch_idx, head, r0 + i])")],
           "numeric", breaks=("dq", "dk", "dv")),
    Mutant("dq_stored_not_reduce_added", "dQ_accum is written with a plain (TMA) store: the other warpgroup's and the "
           "other KV tiles' shares of the same rows are overwritten",
           [(DQ_REDUCE_ADD, DQ_STORE)], "hazard", report=("dQ_accum",)),
    Mutant("causal_mask_missing", "the diagonal's bound is dropped from the backward's mask: keys after the diagonal get P > 0",
           [("j + diag >= i and ", "")], "numeric", breaks=("dq", "dk", "dv")),
    Mutant("softcap_derivative_missing", "dS leaves out softcap's 1 - tanh^2",
           [(SOFTCAP_DZ, "  # (dP^T - dPsum), dz/ds dropped")], "numeric",
           spec=dict(DEFAULT, softcap=5.0), breaks=("dq", "dk")),
    Mutant("gqa_dk_overwritten_per_query_head", "each query head's block stores its dK into the KV head's accumulator "
           "instead of adding: the group's heads overwrite each other",
           [(DK_ADD, DK_STORE)], "hazard", spec=dict(DEFAULT, gqa_group=2), shape=(1, 2, 1, 300, 330),
           report=("dK_accum",)),
    Mutant("q_stage_released_before_dk_gemm_retires", "q_empty is arrived on before wait_wgmma(0) retires dK += dS^T Q, "
           "which reads Q_shared[stage]: the producer loads the next Q tile into it",
           [(WAIT_RELEASE, "            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n"
                           "            T.wait_wgmma(0)\n"
                           "            T.mbarrier_arrive(do_empty[stage])  # dO, dPsum read (dP^T, dV, dS)\n")],
           "hazard", report=("writes Q_shared[", "in-flight wgmma")),
    Mutant("q_and_do_stages_released_before_the_gemms_retire", "both stages' releases above wait_wgmma(0): dK += dS^T Q "
           "still reads Q_shared[stage] and dV += P^T dO dO_shared[stage] (the producer loads Q first, so the report "
           "names Q_shared or dO_shared)",
           [(WAIT_RELEASE, "            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n"
                           "            T.mbarrier_arrive(do_empty[stage])  # dO, dPsum read (dP^T, dV, dS)\n"
                           "            T.wait_wgmma(0)\n")],
           "hazard", report=("in-flight wgmma",), report_any=("writes Q_shared[", "writes dO_shared[")),
    Mutant("postprocess_scale_missing", "dQ = dQ_accum, without the softmax scale",
           [("dQ_accum[batch_idx, r0 + i, head, d] * softmax_scale", "dQ_accum[batch_idx, r0 + i, head, d]")],
           "numeric", breaks=("dq",)),
    Mutant("q_tile_skipped_at_window_left_edge", "n_q one short: the last Q tile, whose rows reach this KV tile only "
           "through the window's left edge, is never visited",
           [(WINDOW_N_Q, WINDOW_N_Q.replace(" - q_first, 0)", " - q_first - 1, 0)"))], "numeric",
           spec=dict(WINDOW), breaks=("dq", "dk", "dv")),
    Mutant("q_tile_skipped_at_the_diagonal", "q_first one late: the first Q tile, whose rows reach this KV tile only "
           "up to the diagonal, is never visited",
           [(Q_FIRST, Q_FIRST + " + 1")], "numeric", spec=dict(WINDOW), breaks=("dq", "dk", "dv")),
]


def mutate(source: str, edits) -> str:
    out = source
    for old, new in edits:
        assert old in out, f"edit no longer applies to the rendered source: {old!r}"
        out = out.replace(old, new)
    assert out != source
    return out


def case(fields, shape):
    spec = Spec(**fields)
    b, h, hkv, sq, skv = shape
    q, k, v, tensors = variant_inputs(make_plan(spec), b, h, hkv, sq, skv, 11)
    dout = np.random.default_rng(12).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
    variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                         {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
    return spec, (q, k, v, dout), tensors, variant


def grads_and_checks(spec, args, tensors, variant, source, policy, seed, block_order="grid"):
    grads = dict(zip(NAMES, emulate_backward(spec, *args, seed=seed, policy=policy, source=source,
                                             block_order=block_order, **tensors)))
    return grads, check_grads(grads, *args, spec.causal, dtype=spec.dtype, **variant)


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_backward_mutant_is_caught_in_every_schedule(m: Mutant):
    spec, args, tensors, variant = case(m.spec, m.shape)
    source = render_backward_source(spec)
    broken = mutate(source, m.edits)
    orders = BLOCK_ORDERS if m.expect == "hazard" else ("grid",)
    for policy, seed in SCHEDULES:
        # the unmodified module passes this schedule (no false positive) ...
        _, checks = grads_and_checks(spec, args, tensors, variant, source, policy, seed)
        assert all(c.ok for c in checks.values()), f"unmodified, {policy} seed {seed}: {checks}"
        # ... and the mutant is caught in it
        for order in orders:
            where = f"{m.name}: {policy} seed {seed} blocks {order}"
            if m.expect == "hazard":
                with pytest.raises(HazardError) as info:
                    grads_and_checks(spec, args, tensors, variant, broken, policy, seed, order)
                for text in m.report:
                    assert text in info.value.report, f"{where}:\n{info.value.report}"
                assert not m.report_any or any(t in info.value.report for t in m.report_any), f"{where}:\n{info.value.report}"
                assert f"policy={policy}" in info.value.report
                continue
            _, checks = grads_and_checks(spec, args, tensors, variant, broken, policy, seed, order)
            failed = {n for n, c in checks.items() if not c.ok}
            assert set(m.breaks) <= failed, f"{where}: {checks}"


def test_the_mutants_cover_the_issues_list():
    """Issue 17's list: each item has a mutant, and both kinds are represented."""
    names = {m.name for m in MUTANTS}
    assert len(names) == len(MUTANTS)
    for word in ("dpsum", "log2", "dq_stored", "causal_mask", "softcap", "gqa_dk", "stage_released", "scale", "q_tile_skipped"):
        assert any(word in n for n in names), word
    assert {m.expect for m in MUTANTS} == {"hazard", "numeric"}


def test_do_released_alone_before_the_wait_is_not_a_race():
    """do_empty arrived on before wait_wgmma(0) while dV += P^T dO may still read dO_shared[stage]
    looks like a race but is not: the producer's next load into the stage waits for q_empty[stage]
    first (it loads Q, then dO), and q_empty is still arrived on after that wait_wgmma(0), which
    retires dV too (wgmmas retire oldest first). So the dO load is ordered after dV through q_empty,
    in every schedule; the same move of q_empty is a race (above). The CPU model reports no race
    because there is none, and the gradients pass."""
    spec, args, tensors, variant = case(DEFAULT, SHAPE)
    moved = mutate(render_backward_source(spec), [(WAIT_RELEASE,
        "            T.mbarrier_arrive(do_empty[stage])  # dO, dPsum read (dP^T, dV, dS)\n"
        "            T.wait_wgmma(0)\n"
        "            T.mbarrier_arrive(q_empty[stage])  # Q, LSE2 read (S^T, dK, P)\n")])
    for policy, seed in SCHEDULES:
        for order in BLOCK_ORDERS:
            _, checks = grads_and_checks(spec, args, tensors, variant, moved, policy, seed, order)
            assert all(c.ok for c in checks.values()), f"{policy} seed {seed} blocks {order}: {checks}"
