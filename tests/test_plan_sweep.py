"""A CI sample of bench/plan_sweep.py: specs at the register budget's edges build without spills.

The full sweep (220 seeded specs across every field) runs from bench/; here the 3-consumer
specs whose estimate sits closest to their 160 registers, the issue-21 reproducer among them,
the varlen spec the sweep found spilling at 240, and the refused neighbour of the reproducer,
which ptxas must show spilling (else the estimate refuses a tile that fits).
"""

import sys
from pathlib import Path

import pytest

import attngen
from attngen.build.nvcc import build
from attngen.spec import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import plan_sweep  # noqa: E402

VARLEN_EDGE = dict(head_dim=256, dtype="bfloat16", gqa_group=16, consumers=2, k_stages=1, v_stages=3,
                   mask_mod="doc_id[b, q_idx] == doc_id[b, kv_idx]", layout="varlen")
BAND_EDGE = dict(head_dim=64, gqa_group=4, consumers=3, causal=True, window=[127, -1])
# (fields, the block_n the plan must choose or accept); each within 8 registers of its cap
EDGES = {
    "issue21_hd64_c3_causal": (plan_sweep.REPRODUCER, 112),
    "hd64_c3_full": (dict(head_dim=64, consumers=3, k_stages=3, v_stages=2, gqa_group=8), 128),
    "hd128_c3_causal": (dict(head_dim=128, consumers=3, causal=True), 80),
    # packed sequences at the 240 edge: block_n 48 (estimate 240 without the varlen share) spilled 8 B
    "hd256_c2_varlen_mask_mod": (VARLEN_EDGE, 32),
    # a band (causal with a left edge): 192x112 spilled 180 B and 192x96 12 B on the merged template
    "hd64_c3_causal_band": (BAND_EDGE, 80),
}
# The rest of the 240-register edge is in tests/test_build.py's presets: hd192_f16_full (240 of
# 240) and the variant presets (236 of 240).


@pytest.mark.parametrize("name", EDGES)
def test_edge_spec_builds_without_spills(name, build_cache):
    fields, block_n = EDGES[name]
    plan = attngen.make_plan(attngen.Spec(**fields))
    assert plan.spec.block_n == block_n
    assert plan.consumer_regs - 8 <= plan.consumer_regs_needed <= plan.consumer_regs, "not at the edge any more"
    report = build(plan, cache_dir=build_cache).report
    assert plan_sweep.spills_of(report) == 0, {k: report[k] for k in ("spill_store_bytes", "stack_frame_bytes", "sass")}


def test_the_refused_neighbour_of_the_reproducer_spills(build_cache):
    """The estimate refuses block_n 128 for the reproducer, naming 112; ptxas agrees: 128 spills."""
    spec = attngen.Spec(**plan_sweep.REPRODUCER, block_n=128)
    with pytest.raises(SpecError, match=r"block_n <= 112 fits"):
        attngen.make_plan(spec)
    report = build(attngen.make_plan(spec, check_registers=False), cache_dir=build_cache).report
    assert plan_sweep.spills_of(report) > 0


def test_the_refused_neighbour_of_the_band_spills(build_cache):
    """A band's larger share refuses 192x96 for hd64 causal window [127, -1], naming 80; ptxas
    agrees: 96 spills (12 B measured), so the share is not refusing a tile that fits."""
    spec = attngen.Spec(**BAND_EDGE, block_n=96)
    with pytest.raises(SpecError, match=r"block_n <= 80 fits"):
        attngen.make_plan(spec)
    report = build(attngen.make_plan(spec, check_registers=False), cache_dir=build_cache).report
    assert plan_sweep.spills_of(report) > 0


def test_the_sweep_draws_accepted_specs_reproducibly():
    first, again = plan_sweep.draw_specs(30, seed=21), plan_sweep.draw_specs(30, seed=21)
    assert [p.name for p, _ in first] == [p.name for p, _ in again]
    assert first[0][0].spec.head_dim == 64 and first[0][0].spec.consumers == 3  # the reproducer leads
    assert len({p.hash for p, _ in first}) == 31
    spec_fields = [p.spec for p, _ in first]
    for field in ("causal", "lse", "alibi", "sinks", "paged_kv"):  # the draw reaches the variant and serving fields
        assert {getattr(s, field) for s in spec_fields} == {False, True}, field


def test_the_summary_counts_a_spilling_row():
    ok = plan_sweep.Row("a", {}, 150, 160, 32, launch=128, used=148, spill_st=0, spill_ld=0, stack=0, ldl=0, stl=0)
    bad = plan_sweep.Row("b", {}, 160, 160, 32, launch=128, used=158, spill_st=24, spill_ld=24, stack=8, ldl=6, stl=6)
    assert not ok.spills and bad.spills
    line = plan_sweep.summary([ok, bad])
    assert line.startswith("2 specs, 1 spill (1 of them within the estimate's budget)"), line
    assert "min +2, max +2" in line  # estimate - SASS registers over the spill-free row


def test_packed_sequences_cost_registers_in_the_estimate():
    with pytest.raises(SpecError, match=r"varlen 4\) but setmaxnreg gives it 240 .*block_n <= 32 fits"):
        attngen.make_plan(attngen.Spec(**VARLEN_EDGE, block_n=48))
    bshd = {k: v for k, v in VARLEN_EDGE.items() if k != "layout"}
    assert attngen.make_plan(attngen.Spec(**bshd, block_n=48)).consumer_regs_needed == 240


def test_a_paged_producer_with_two_consumers_does_not_spill(build_cache):
    """The sweep's paged spec whose 24-register producer spilled 4 bytes: it now has 40."""
    spec = attngen.Spec(head_dim=192, dtype="bfloat16", causal=True, gqa_group=16, consumers=2, k_stages=1, v_stages=2,
                        softcap=15.0, paged_kv=True, page_size=128)
    plan = attngen.make_plan(spec)
    assert (plan.producer_regs, plan.consumer_regs, plan.spec.block_n) == (40, 232, 64)
    report = build(plan, cache_dir=build_cache).report
    assert plan_sweep.spills_of(report) == 0, {k: report[k] for k in ("spill_store_bytes", "stack_frame_bytes", "sass")}


def test_alibi_with_split_kv_at_three_consumers_stays_in_registers(build_cache):
    """The sweep's one local-memory kernel: ALiBi, split-KV, 3 consumers at block_n 80 kept S in a
    160-byte stack frame; the plan now takes 64 and refuses 80 with a one-line reason."""
    fields = dict(head_dim=64, consumers=3, k_stages=2, v_stages=3, alibi=True, splits=4)
    with pytest.raises(SpecError, match=r"block_n <= 64 fits"):
        attngen.make_plan(attngen.Spec(**fields, block_n=80))
    plan = attngen.make_plan(attngen.Spec(**fields))
    assert plan.spec.block_n == 64
    assert attngen.make_plan(attngen.Spec(**{**fields, "consumers": 2})).spec.block_n == 128  # only at 3
    report = build(plan, cache_dir=build_cache).report
    assert plan_sweep.spills_of(report) == 0, {k: report[k] for k in ("spill_store_bytes", "stack_frame_bytes", "sass")}
