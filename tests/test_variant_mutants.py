"""Deliberately broken variant kernels: the CPU model against the fp64 reference must catch each.

As in tests/test_mutants.py, each mutant is a textual edit of the rendered source: the test
asserts the edit applies, that the unmodified kernel passes for the same spec, shape and
schedule, and that the mutant fails the output check (or the LSE check).
"""

import dataclasses
import re

import pytest

import attngen
from attngen.emulator.driver import check_emulated


@dataclasses.dataclass
class Mutant:
    name: str
    why: str
    spec: dict
    edit: object  # source -> mutated source
    shape: tuple = (1, 1, 300, 333)  # batch, kv heads, q_len, kv_len
    policy: str = "random"


def replace(old, new):
    def edit(source):
        assert old in source, f"edit no longer applies to the rendered source: {old!r}"
        return source.replace(old, new)
    return edit


def softcap_after_mask(source):
    """Swap the score transform and the mask (its `if`, with the diagonal's binding) in every masked tile:
    masked keys get -SOFTCAP, not -inf."""
    pattern = re.compile(
        r"(?P<mod>( +)for i, j in T\.Parallel\(WG_ROWS, BLOCK_N\):  # softcap[^\n]*\n[^\n]*\n)"
        r"(?P<mask>(\2full_tiles = [^\n]*\n)?\2if [^\n]*\n(\2    diag\w* = [^\n]*\n)?"
        r"\2    for i, j in T\.Parallel\(WG_ROWS, BLOCK_N\):\n[^\n]*T\.if_then_else\([^\n]*\n)")
    out, n = pattern.subn(lambda m: m["mask"] + m["mod"], source)
    assert n >= 2, "edit no longer applies: the prologue's and the steady loop's transform, each followed by a mask"
    return out


MUTANTS = [
    Mutant("window_left_off_by_one", "the window's left edge drops its last key (> instead of >=)",
           dict(window=[37, 21], head_dim=64, lse=True),
           replace("j >= i + diag", "j > i + diag")),
    Mutant("window_right_off_by_one", "the window's right edge takes one key too many",
           dict(window=[37, 21], head_dim=64, consumers=3),
           replace(" + 21 >= j", " + 22 >= j")),
    Mutant("softcap_after_mask", "softcap applied to the masked scores: tanh(-inf) gives -softcap, a finite weight",
           dict(causal=True, softcap=2.0), softcap_after_mask),
    Mutant("sink_missing_from_denominator", "the row sum starts at 0, not at the sink's exp(0)",
           dict(sinks=True, causal=True, gqa_group=2),
           replace("T.fill(row_sum, 1.0)  # the sink's own term", "T.fill(row_sum, 0)  # the sink's own term")),
    Mutant("lse_off_by_log2", "the LSE is one log(2) too large",
           dict(causal=True, lse=True, head_dim=64),
           replace("T.log2(row_sum[i])) * LN2", "T.log2(row_sum[i])) * LN2 + LN2")),
    Mutant("tile_skipped_at_window_edge", "the first tile the window reaches into is never loaded",
           dict(window=[200, 0], head_dim=64),
           replace("first_tile = T.floordiv(T.max(q0 + causal_offset - 200, 0), BLOCK_N)",
                   "first_tile = T.floordiv(T.max(q0 + causal_offset - 200, 0), BLOCK_N) + 1")),
    Mutant("window_lead_tiles_unmasked", "the tiles the window's left edge cuts run unmasked",
           dict(window=[100, -1], causal=True, head_dim=64, block_n=32),
           replace("if k < lead or k >= full_tiles:", "if k >= full_tiles:")),
    Mutant("window_lead_from_second_to_last_row",
           "the left-edge count takes the edge of the warpgroup's row WG_ROWS - 2, not its last row: where the last "
           "row's edge is a tile multiple plus 1, the tile it cuts at its first key runs unmasked",
           dict(window=[270, -1], consumers=1),
           replace("WG_ROWS - 1 + causal_offset - 270", "WG_ROWS - 2 + causal_offset - 270"), shape=(1, 1, 64, 400)),
    Mutant("alibi_sign", "ALiBi adds the distance penalty instead of subtracting it",
           dict(alibi=True, head_dim=64), replace(" - Alibi[head] * ", " + Alibi[head] * ")),
    Mutant("alibi_without_offset", "ALiBi measures |i - j|, not from the bottom-right diagonal",
           dict(alibi=True, head_dim=64, causal=True),
           replace("T.abs(q0 + row0 + i + causal_offset - (", "T.abs(q0 + row0 + i - (")),
    Mutant("score_mod_wrong_head", "score_mod reads the scale of batch b instead of head h",
           dict(score_mod="score * (1 + gain[h])", head_dim=64), replace("X_gain[head]", "X_gain[batch_idx]"),
           shape=(2, 4, 130, 140)),
    Mutant("mask_mod_dropped", "the custom mask_mod is left out of the mask",
           dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]", head_dim=64),
           lambda s: re.sub(r" and \(X_doc\[.*\), acc_s\[i, j\], -T", ", acc_s[i, j], -T", s)),
    Mutant("head_dim_v_half_output", "O is normalised over only half of head_dim_v's columns",
           dict(head_dim=64, head_dim_v=128),
           replace("for i, j in T.Parallel(WG_ROWS, HEAD_DIM_V):\n            acc_o[i, j] = T.if_then_else(row_sum[i] == 0",
                   "for i, j in T.Parallel(WG_ROWS, HEAD_DIM):\n            acc_o[i, j] = T.if_then_else(row_sum[i] == 0")),
]


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_variant_mutant_is_caught(m: Mutant):
    plan = attngen.make_plan(attngen.Spec(**m.spec))
    source = attngen.render_source(plan)
    broken = m.edit(source)
    assert broken is not None and broken != source, "the edit changed nothing"
    b, hkv, sq, skv = m.shape
    h = hkv * plan.spec.gqa_group
    ok, text, _ = check_emulated(plan, b, h, hkv, sq, skv, seed=7, policy=m.policy, source=source)
    assert ok, f"the unmodified kernel fails: {text}"
    ok, text, _ = check_emulated(plan, b, h, hkv, sq, skv, seed=7, policy=m.policy, source=broken)
    assert not ok, f"{m.name} passed: {text}"


def test_every_required_variant_mutant_is_present():
    names = {m.name for m in MUTANTS}
    assert {"window_left_off_by_one", "softcap_after_mask", "sink_missing_from_denominator", "lse_off_by_log2",
            "tile_skipped_at_window_edge"} <= names
    assert len(names) == len(MUTANTS)
