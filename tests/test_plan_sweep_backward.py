"""A CI sample of `bench/plan_sweep.py --backward`: backward kernels at the register edge build
without spills, with setmaxnreg applied, and a tile the estimate refuses really spills.

The sweep (docs/backward.md, "Registers") builds drawn backward specs; here the edges of the tile
table: hd128 (64 x 128, estimate 240 of 240), hd256 by columns (240 of 240) and its deterministic
dq kernel (240 of 240); and two tiles the estimate refuses, which ptxas spills, so it is not
merely conservative there: hd64's 128-row Q tile (FlashAttention-3's) and the key split of hd128
with softcap and packed sequences (the pair's BWD_VARLEN_VARIANT_REGS send it to the column split).
"""

import sys
from pathlib import Path

import pytest

import attngen
from attngen.build.nvcc import build_backward
from attngen.kernels.bwd.plan import BWD_VARLEN_VARIANT_REGS, plan_backward
from attngen.spec import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import plan_sweep  # noqa: E402

# (fields, the main kernel's (block_m, columns)); each main (and dq) kernel within 8 of its cap
EDGES = {
    "hd128_causal_softcap": (dict(head_dim=128, causal=True, softcap=30.0), (64, False)),
    "hd256_cols_varlen_gqa": (dict(head_dim=256, dtype="bfloat16", gqa_group=2, layout="varlen"), (64, True)),
    "hd256_cols_deterministic": (dict(head_dim=256, causal=True, deterministic=True), (64, True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", EDGES)
def test_edge_backward_builds_without_spills(name, build_cache):
    fields, tile = EDGES[name]
    bp = plan_backward(attngen.Spec(**fields))
    assert (bp.block_m, bp.columns) == tile
    rows = plan_sweep.backward_rows(bp, build_backward(bp, cache_dir=build_cache))
    assert {r.part for r in rows} == ({"main", "dq"} if bp.deterministic else {"main"})
    for r in rows:
        assert r.budget - 8 <= r.estimate <= r.budget, (r.name, r.estimate, "not at the edge any more")
        assert r.spill == 0 and r.setmaxnreg, (r.name, r.spill, r.setmaxnreg)
        assert r.used <= r.budget, (r.name, r.used)


@pytest.mark.slow
def test_the_refused_128_row_tile_of_hd64_spills(build_cache):
    """FlashAttention-3's hd64 tile is 128 x 128; here each MMA warpgroup would hold S^T, dP^T,
    P^T, dS^T of 64 keys x 128 rows and a 128 x 64 dQ tile: the estimate (256 > 240) refuses it
    and ptxas agrees (264 bytes of spill and local memory measured)."""
    spec = attngen.Spec(head_dim=64)
    assert plan_backward(spec).block_m == 64
    near = plan_backward(spec, check_registers=False, block_m=128, columns=False)
    assert near.consumer_regs_needed > near.consumer_regs
    (row,) = plan_sweep.backward_rows(near, build_backward(near, cache_dir=build_cache))
    assert row.spill > 0


SOFTCAP_VARLEN = dict(head_dim=128, dtype="bfloat16", softcap=15.0, layout="varlen")


@pytest.mark.slow
def test_the_refused_key_split_of_softcap_with_packed_sequences_spills(build_cache):
    """Softcap alone (238 of 240 used) and varlen alone fit hd128's 64 x 128 key split; together
    they spilled 28 B, so the plan takes the column split (64 x 64) and the key split spills."""
    bp = plan_backward(attngen.Spec(**SOFTCAP_VARLEN))
    assert (bp.block_m, bp.block_n, bp.columns) == (64, 64, True)
    assert plan_backward(attngen.Spec(**{**SOFTCAP_VARLEN, "layout": "bshd"})).columns is False
    near = plan_backward(attngen.Spec(**SOFTCAP_VARLEN), check_registers=False, block_m=64, columns=False)
    assert near.consumer_regs_needed == near.consumer_regs + BWD_VARLEN_VARIANT_REGS
    (row,) = plan_sweep.backward_rows(near, build_backward(near, cache_dir=build_cache))
    assert row.spill > 0


def test_a_varlen_variant_refusal_says_why():
    fields = dict(head_dim=256, score_mod="score - 0.05 * abs(q_idx - kv_idx)", layout="varlen")
    with pytest.raises(SpecError, match=r"about 248 registers .*8 of them for layout 'varlen' beside an element-wise variant"):
        plan_backward(attngen.Spec(**fields))
    assert plan_backward(attngen.Spec(**{**fields, "layout": "bshd"})).columns
    # with deterministic GQA too: spilled at hd64, hd96 and hd128, by keys and by columns (docs/backward.md)
    grouped = dict(head_dim=64, causal=True, gqa_group=8, window=(511, -1), alibi=True, layout="varlen", deterministic=True)
    with pytest.raises(SpecError, match=r"`deterministic` = true: with layout 'varlen', alibi, a score_mod or a mask_mod, and gqa_group 8"):
        plan_backward(attngen.Spec(**grouped))
    assert plan_backward(attngen.Spec(**{**grouped, "deterministic": False})).block_m == 64
    assert plan_backward(attngen.Spec(**{**grouped, "alibi": False, "softcap": 30.0})).deterministic  # measured: fits
    assert plan_backward(attngen.Spec(**{**grouped, "head_dim": 128, "gqa_group": 1})).consumer_regs_needed == 184  # columns


def test_a_fixed_tile_must_be_a_wgmma_m():
    with pytest.raises(SpecError, match=r"block_m.*80.*multiple of 64"):
        plan_backward(attngen.Spec(head_dim=128), check_registers=False, block_m=80)


def test_the_backward_draw_is_reproducible_and_reaches_the_fields():
    first, again = plan_sweep.draw_backward_specs(40, seed=17), plan_sweep.draw_backward_specs(40, seed=17)
    assert [bp.name for _, bp in first] == [bp.name for _, bp in again]
    assert [bp.spec.head_dim for _, bp in first[:5]] == [64, 96, 128, 192, 256]  # the plain head dims lead
    assert len({bp.hash for _, bp in first}) == 40
    specs = [bp.spec for _, bp in first]
    for field in ("causal", "deterministic", "sinks"):
        assert {getattr(s, field) for s in specs} == {False, True}, field
    assert {bp.columns for _, bp in first} == {False, True}


def test_the_backward_summary_counts_a_spilling_kernel():
    ok = plan_sweep.BwdRow("a", "main", 240, 240, 64, False, used=232, launch=168, setmaxnreg=3, spill=0)
    bad = plan_sweep.BwdRow("b", "dq", 240, 240, 64, True, used=238, launch=168, setmaxnreg=3, spill=24)
    probe = plan_sweep.BwdRow("c", "main", 256, 240, 128, False, used=236, launch=168, setmaxnreg=3, spill=264, probe="m128")
    assert not ok.spills and bad.spills
    line = plan_sweep.summary_backward([ok, bad, probe])
    assert line.startswith("2 kernels with a register budget built (1 main, 1 dq), 1 spill,"), line
    assert "refused neighbours: 1 of 1 spill" in line and "main estimate - SASS: min +8, max +8" in line, line
