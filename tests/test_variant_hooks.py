"""The variant's hooks (kernels/common/variants.py) and the block-mask walk (kernels/common/block_mask.py).

Exact text where a wrong hook would print something else (softcap's derivative, ALiBi's head and
distance in each orientation, the sink's start), the backward's derivative against a finite
difference of the forward's score chain (both evaluated from the emitted text), and the layering:
the backward renderer takes its variant from kernels/common, not from the forward renderer.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

import attngen
from attngen.kernels.common.block_mask import ForwardVisits, backward_walk
from attngen.kernels.common.variants import DQ, MAIN, Variant
from attngen.kernels.fwd.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent


def variant(**fields) -> Variant:
    return Variant.of(make_plan(attngen.Spec(head_dim=64, **fields)))


# -- exact text -----------------------------------------------------------------------------------
def test_softcaps_derivative_is_one_minus_tanh_squared_of_the_same_argument():
    t = "T.tanh(acc_s[i, j] * softcap_scale)"
    assert variant(softcap=30.0).dz_ds() == f"(1.0 - {t} * {t})"
    assert variant(softcap=30.0).dz_ds(dq=True) == f"(1.0 - {t} * {t})"
    assert variant().dz_ds() == "" and variant(alibi=True).dz_ds() == ""  # a bias's derivative is 1


def test_alibi_names_the_head_and_distance_of_each_orientation():
    v = variant(alibi=True, causal=True)
    bias = 'Alibi[head] * T.Cast("float32", T.abs({row} + causal_offset - ({key})))'
    assert v.transform("k") == f"(acc_s[i, j] * softmax_scale - {bias.format(row='q0 + row0 + i', key='k * BLOCK_N + j')}) * LOG2E"
    assert v.log2_score() == f"(acc_s[i, j] * softmax_scale - {bias.format(row=MAIN[0], key=MAIN[1])}) * LOG2E"
    assert v.log2_score(dq=True) == f"(acc_s[i, j] * softmax_scale - {bias.format(row=DQ[0], key=DQ[1])}) * LOG2E"
    packed = Variant.of(make_plan(attngen.Spec(head_dim=64, alibi=True, gqa_group=4, splits=2, consumers=1)))
    assert "Alibi[(head + (q0 + row0 + i) % GQA_GROUP)]" in packed.transform("k")  # the packed row's own head
    assert "T.abs((q0 + row0 + i) // GQA_GROUP + causal_offset" in packed.transform("k")


def test_the_sink_starts_the_max_in_the_units_the_max_holds():
    assert variant(sinks=True).sink_init() == "Sinks[head] / softmax_scale"  # q . k units
    assert variant(sinks=True, softcap=30.0).sink_init() == "Sinks[head] * LOG2E"  # prescaled: base 2
    assert variant().sink_init() == ""
    assert variant().max_floor() == "T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0)"
    assert variant(sinks=True).normalize() == "acc_o[i, j] /= row_sum[i]"  # every row sum >= exp(0)
    assert "row_sum[i] == 0" in variant().normalize()


def test_the_window_mask_in_both_orientations():
    v = variant(window=(32, 16))
    assert v.mask_bind("k") == ("diag = q0 + row0 + causal_offset - (first_tile + k) * BLOCK_N"
                                "  # row i's diagonal in tile (first_tile + k) is key j = i + diag")
    assert v.mask_cond("k") == "j >= i + diag - 32 and i + diag + 16 >= j and (first_tile + k) * BLOCK_N + j < kv_len"
    assert v.bwd_mask_bind() == "diag = m0 + causal_offset - key0  # row m0 + j's diagonal key is key0 + j + diag"
    assert v.bwd_mask_cond() == "i >= j + diag - 32 and j + diag + 16 >= i and key0 + i < kv_len and m0 + j < q_len"
    assert v.bwd_mask_cond(dq=True) == "j >= i + diag - 32 and i + diag + 16 >= j and kv_tile * DQ_BLOCK_N + j < kv_len"
    assert variant(causal=True).bwd_mask_cond() == "j + diag >= i and m0 + j < q_len"  # right edge 0: no kv_len test


def test_the_backward_takes_no_ln2_constant():
    v = variant(softcap=30.0, lse=True, head_dim_v=128)
    assert v.constants() == ["HEAD_DIM_V = 128  # V and O head dim", "SOFTCAP = 30.0  # score = SOFTCAP * tanh(score / SOFTCAP)",
                             f"LN2 = {math.log(2)!r}  # the LSE is returned in natural log"]
    assert v.constants(lse=False) == v.constants()[:2]


# -- the derivative against the forward's chain, evaluated from the emitted text ------------------------
class _T:
    """The TileLang calls the score chain's text makes, on numpy float64 scalars."""
    tanh, exp, exp2, log, sin, cos, tan, sqrt, abs = np.tanh, np.exp, np.exp2, np.log, np.sin, np.cos, np.tan, np.sqrt, np.abs
    pow = staticmethod(np.power)
    min, max = staticmethod(np.minimum), staticmethod(np.maximum)

    @staticmethod
    def Cast(dtype, x):
        return np.float64(x)

    @staticmethod
    def if_then_else(c, a, b):
        return a if c else b


def _eval(text: str, raw: float, scale: float, softcap: float, orient) -> float:
    names = {"T": _T, "acc_s": {(1, 2): np.float64(raw)}, "softmax_scale": scale, "SOFTCAP": softcap,
             "softcap_scale": scale / softcap if softcap else 0.0, "Alibi": np.array([0.3, 0.7]), "head": 1,
             "batch_idx": 0, "causal_offset": 5, "i": 1, "j": 2, "m0": 64, "key0": 128, "q0": 0, "row0": 64,
             "kv_tile": 2, "DQ_BLOCK_N": 64, "LOG2E": 1.0}
    return float(eval(text, names))  # the kernel's own expression text


CHAINS = [{"softcap": 30.0}, {"softcap": 7.0, "alibi": True},
          {"score_mod": "score * score * 0.1 + kv_idx"},
          {"softcap": 20.0, "score_mod": "2 * tanh(score / 5) + exp(-score * score / 8) * h + sqrt(abs(score) + 1)"},
          {"alibi": True, "score_mod": "where(score > 1, score * score, score) + pow(score, 3) * 0.01 + log(abs(score) + 2)"}]


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("fields", CHAINS, ids=lambda f: "+".join(f))
def test_dz_ds_is_the_derivative_of_the_forward_score_chain(fields, dq):
    """d(final score)/d(q . k * scale) from the emitted dz_ds agrees with a central difference of the
    emitted score chain (log2_score with LOG2E = 1), at scores on both sides of every kink."""
    v = variant(**fields)
    scale, softcap = 0.125, fields.get("softcap", 0.0)
    chain, slope = v.log2_score(dq), v.dz_ds(dq)
    assert slope, "every chain here has a derivative other than 1"
    for raw in (-23.0, -4.1, -0.3, 0.7, 5.3, 19.0):
        h = 1e-4
        fd = (_eval(chain, raw + h, scale, softcap, dq) - _eval(chain, raw - h, scale, softcap, dq)) / (2 * h * scale)
        got = _eval(slope, raw, scale, softcap, dq)
        assert got == pytest.approx(fd, rel=1e-5, abs=1e-6), (raw, got, fd)


# -- the block-mask walk: each kernel reads its own lists, on its own row ---------------------------------
def test_each_kernel_walks_its_own_lists():
    plan = make_plan(attngen.Spec(head_dim=64, mask_mod="q_idx >= kv_idx", block_mask=True))
    fwd = ForwardVisits.of(plan)
    assert fwd.setup()[2] == "bm_partial_n = KV_num_blocks[bm_b, bm_h, q_block]  # KV tiles of this Q tile that the mask cuts"
    assert fwd.lines()[0].startswith("bm_p = T.if_then_else(bm_next_p < bm_partial_n, KV_indices[bm_b, bm_h, q_block, "
                                     "T.min(bm_next_p, bm_kv_tiles - 1)], bm_kv_tiles)")
    assert fwd.lines()[2] == "kv_tile = T.min(T.min(bm_p, bm_f), bm_kv_tiles - 1)  # the lower of the two: tiles in ascending order"
    main, dq = backward_walk(plan), backward_walk(plan, dq=True)
    assert main.setup()[3] == "bm_full_n = Full_q_num_blocks[bm_b, bm_h, kv_block]  # ... and that it sees whole"
    assert "Q_indices[bm_b, bm_h, kv_block, T.min(bm_next_p, bm_q_tiles - 1)]" in main.step()[0]
    assert main.step()[2].startswith("q_tile = ") and dq.step()[2].startswith("kv_tile = ")
    assert "Full_kv_indices[bm_b, bm_h, q_block, T.min(bm_next_f, bm_dq_kv_tiles - 1)]" in dq.step()[1]
    assert main.args() == ["bm_b", "bm_h", "bm_partial_n", "bm_full_n", "Q_indices", "Full_q_indices"]
    dense = make_plan(attngen.Spec(head_dim=64, causal=True))
    assert backward_walk(dense) is None and ForwardVisits.of(dense).lines() == [] and ForwardVisits.of(dense).guard() == ()
    assert ForwardVisits.of(make_plan(attngen.Spec(head_dim=64, window=(32, 0)))).comments()[0] == "the first visited tile"


# -- layering ---------------------------------------------------------------------------------------------
def forward_imports(path: Path) -> list[str]:
    """The names a module imports from the forward family (attngen.kernels.fwd.*), function-level included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attngen.kernels.fwd"):
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("attngen.kernels.fwd")]
    return found


def test_the_backward_renderer_takes_no_variant_text_from_the_forward_renderer():
    assert [n for n in forward_imports(ROOT / "attngen/kernels/bwd/render.py") if ".render" in n] == []


def test_the_shared_hooks_import_no_kernel_family():
    for module in ("variants.py", "block_mask.py"):
        assert forward_imports(ROOT / "attngen/kernels/common" / module) == []
