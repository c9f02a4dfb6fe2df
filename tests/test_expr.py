"""The score_mod / mask_mod expression language (attngen/expr.py): whitelist, errors, and that
the TileLang text it emits computes what its float64 evaluation computes."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attngen import expr
from attngen.spec import Spec, SpecError


@pytest.mark.parametrize("text, kind", [
    ("score", "score_mod"),
    ("score * 0.5 + bias[h]", "score_mod"),
    ("where(q_idx >= kv_idx, score, score - 1e3)", "score_mod"),
    ("tanh(score / 30) * 30", "score_mod"),
    ("score + table[h, min(max(q_idx - kv_idx, -8), 8) + 8]", "score_mod"),
    ("q_idx - kv_idx", "score_mod"),  # an integer score is cast to float
    ("doc[b, q_idx] == doc[b, kv_idx]", "mask_mod"),
    ("q_idx >= kv_idx and not (kv_idx < 3 or kv_idx > 100)", "mask_mod"),
    ("0 <= q_idx - kv_idx < 64", "mask_mod"),
])
def test_allowed_expressions_parse(text, kind):
    e = expr.parse(text, kind)
    assert e.text == text
    # the canonical text (what names and hashes a kernel) is a fixed point and emits the same TileLang
    again = expr.parse(e.canonical, kind)
    assert again.canonical == e.canonical
    names = {n: n for n in ("score", *expr.INDEX_VARS)}
    emitted = [expr.emit(x, names, lambda name: f"X_{name}", lambda name, axis: f"{name}_dim{axis}") for x in (e, again)]
    assert emitted[0] == emitted[1]


@pytest.mark.parametrize("text, kind, col, fragment", [
    ("score + foo", "score_mod", 9, "the name `foo`"),
    ("score ** 2", "score_mod", 1, "operator Pow"),
    ("erf(score)", "score_mod", 1, "calling `erf`"),
    ("(q_idx < 3) & 1", "mask_mod", 2, "an operand of & | ^ must be an integer"),
    ("score > 0", "mask_mod", 1, "`score` is only defined in score_mod"),
    ("q_idx > 0", "score_mod", 1, "must give a number"),
    ("q_idx + 1", "mask_mod", 1, "must give a boolean"),
    ("bias[0.5]", "score_mod", 6, "must be an integer expression"),
    ("bias[h] + bias[h, b]", "score_mod", 11, "indexed with 1 and 2 indices"),
    ("score +", "score_mod", None, "not a valid expression"),  # the column is Python's parser's
    ("q[h] + score", "score_mod", 1, "cannot name a tensor"),
    ("score if q_idx else 0", "score_mod", 1, "use where"),
    ("min(score)", "score_mod", 1, "min() takes 2"),
    ("True", "mask_mod", 1, "the literal True"),
    ("__import__('os')", "score_mod", 1, "calling `__import__`"),
    # issue 21: attribute access, literals the kernel's float32/int32 cannot hold, a literal 0 divisor
    ("score.real", "score_mod", 6, "the attribute access `.real` is not allowed"),
    ("bias[h].T + score", "score_mod", 8, "the attribute access `.T`"),
    ("score * 1e39", "score_mod", 9, "the literal 1e+39 is not a finite float32"),
    ("score - -1e39", "score_mod", 10, "not a finite float32"),
    ("score * 1e-50", "score_mod", 9, "is 0 in float32"),
    ("q_idx + 3000000000 > kv_idx", "mask_mod", 9, "does not fit int32"),
    ("score / 0", "score_mod", 9, "division by the literal 0"),
    ("score / 0.0 + 1", "score_mod", 9, "division by the literal 0"),
])
def test_bad_expressions_name_the_column_and_what_is_allowed(text, kind, col, fragment):
    with pytest.raises(expr.ExprError) as info:
        expr.parse(text, kind)
    assert col is None or info.value.col == col, str(info.value)
    assert fragment in str(info.value)


def test_literals_at_the_float32_and_int32_limits_are_allowed():
    for text in ("score * 3.4e38", "score * 1e-45", "score + 2147483647", "score / 1e-3"):
        expr.parse(text, "score_mod")


def balanced_sum(terms):
    if len(terms) == 1:
        return terms[0]
    half = len(terms) // 2
    return f"({balanced_sum(terms[:half])}+{balanced_sum(terms[half:])})"


@pytest.mark.parametrize("text, fragment", [
    ("score" + " + 1" * 1000, "4005 characters long; at most 1000"),  # was a RecursionError
    ("score" + " + 1" * 100, "nests deeper than 64 levels"),
    ("-" * 200 + "score", "nests deeper than 64 levels"),
    ("(" * 250 + "score" + ")" * 250, "too many nested parentheses"),  # Python's parser's own limit
    (balanced_sum(["score"] + ["b"] * 129), "more than 256 syntax nodes"),  # 259 nodes, 9 deep, 700 characters
], ids=["long", "deep-chain", "deep-unary", "parentheses", "many-nodes"])
def test_an_oversized_expression_is_one_spec_error_naming_the_limit(text, fragment):
    with pytest.raises(SpecError) as info:
        Spec(score_mod=text)
    msg = str(info.value)
    assert info.value.field == "score_mod" and fragment in msg and "\n" not in msg
    assert len(msg) < 400  # the text is shown by its start, not repeated whole


def test_the_size_limits_admit_the_presets_with_room():
    for text in ("score + rel_bias[h, min(max(q_idx - kv_idx, -255), 255) + 255]", "doc_id[b, q_idx] == doc_id[b, kv_idx]"):
        expr.parse(text, "score_mod" if "score" in text else "mask_mod")
    expr.parse("score" + " + 1" * (expr.MAX_DEPTH - 2), "score_mod")


def test_a_bad_expression_is_a_spec_error_naming_the_field():
    with pytest.raises(SpecError) as info:
        Spec(score_mod="score + foo")
    msg = str(info.value)
    assert msg.startswith('spec field `score_mod` = "score + foo": at column 9') and "allowed:" in msg
    with pytest.raises(SpecError) as info:
        Spec(mask_mod=3)
    assert info.value.field == "mask_mod"


def test_tensor_axes_follow_their_indices():
    e = expr.parse("bias[h] + t[b, q_idx] + u[q_idx - kv_idx] + t[b, q_idx]", "score_mod")
    assert dict(e.tensors) == {"bias": ("heads",), "t": ("batch", "q_len"), "u": (None,)}
    e = expr.parse("doc[b, q_idx] == doc[b, kv_idx]", "mask_mod")
    assert dict(e.tensors) == {"doc": ("batch", None)}  # q_len and kv_len differ: a free axis


class FakeT:
    """The T.* functions the emitted text uses, in numpy (float32 like the kernel)."""
    tanh, exp, log, abs = staticmethod(np.tanh), staticmethod(np.exp), staticmethod(np.log), staticmethod(np.abs)
    min, max = staticmethod(np.minimum), staticmethod(np.maximum)
    exp2, sin, cos, tan, sqrt, pow = (staticmethod(f) for f in (np.exp2, np.sin, np.cos, np.tan, np.sqrt, np.power))
    bitwise_and, bitwise_or, bitwise_xor = (staticmethod(f) for f in (np.bitwise_and, np.bitwise_or, np.bitwise_xor))
    floordiv, floormod = staticmethod(np.floor_divide), staticmethod(np.mod)

    @staticmethod
    def if_then_else(c, a, b):
        return np.where(c, a, b)

    @staticmethod
    def Cast(dtype, x):
        return np.asarray(x, np.float64)


def _emitted_value(e, env, tensors):
    text = expr.emit(e, {k: k for k in env}, lambda n: f"tensors[{n!r}]", lambda n, axis: f"tensors[{n!r}].shape[{axis}]")
    # `and`/`or`/`not` on arrays: the kernel's TileLang (and the emulator's rewrite) make them element-wise
    text = text.replace(" and ", " & ").replace(" or ", " | ").replace("(not ", "(~")
    return eval(text, {"T": FakeT, "tensors": tensors, **env})


EXPRS = [
    ("score * 0.5 + bias[h]", "score_mod"),
    ("where(q_idx >= kv_idx, tanh(score / 3), exp(score) - abs(score))", "score_mod"),
    ("score + table[min(max(q_idx - kv_idx, -8), 8) + 8] / 2", "score_mod"),
    ("(q_idx - kv_idx) / 3 + max(score, 0)", "score_mod"),
    ("q_idx / 2 >= kv_idx / 3 or doc[q_idx] == doc[kv_idx]", "mask_mod"),
    ("not (kv_idx < 3) and 0 <= q_idx - kv_idx < 20", "mask_mod"),
    ("sin(score) * cos(score / 2) + tan(score / 4) + exp2(score / 3) + sqrt(abs(score) + 1) + pow(abs(score) + 1, 1.5)",
     "score_mod"),
    ("(kv_idx & 3) == 1 or (q_idx | 1) == (kv_idx ^ 2) or ids.int32[q_idx] // (kv_idx - 4) == 1", "mask_mod"),
]


@settings(max_examples=30)
@given(which=st.sampled_from(EXPRS), seed=st.integers(0, 1000))
def test_emitted_text_computes_what_evaluate_computes(which, seed):
    rng = np.random.default_rng(seed)
    e = expr.parse(*which)
    env = {"score": rng.standard_normal((1, 9, 11)), "b": 0, "h": np.arange(3)[:, None, None],
           "q_idx": np.arange(9)[None, :, None], "kv_idx": np.arange(11)[None, None, :]}
    tensors = {"bias": rng.standard_normal(3), "table": rng.standard_normal(17),
               "doc": np.sort(rng.integers(0, 3, 12)).astype(float), "ids": rng.integers(0, 9, 12).astype(np.int32)}
    want = expr.evaluate(e, env, tensors)
    got = _emitted_value(e, env, tensors)
    np.testing.assert_allclose(np.broadcast_to(got, np.shape(want)), want, rtol=1e-12, atol=1e-12)


def test_indices_are_clamped_to_the_extent():
    e = expr.parse("score + table[q_idx - kv_idx]", "score_mod")
    table = np.array([10.0, 20.0, 30.0])
    got = expr.evaluate(e, {"score": 0.0, "q_idx": np.array([0, 5]), "kv_idx": np.array([3, 0])}, {"table": table})
    assert list(got) == [10.0, 30.0]  # -3 -> 0, 5 -> 2
    assert "T.min(T.max(" in expr.emit(e, {"score": "s", "q_idx": "q", "kv_idx": "k"}, str, lambda n, a: "n")


@pytest.mark.parametrize("text", [t for t, kind in EXPRS if kind == "score_mod"])
def test_the_derivatives_emitted_text_computes_what_evaluate_computes(text):
    """expr.derivative gives an expression like any other: the backward kernel's text (emit) and the
    reference's numbers (evaluate) agree."""
    rng = np.random.default_rng(1)
    d = expr.derivative(expr.parse(text, "score_mod"))
    env = {"score": rng.standard_normal((1, 9, 11)), "b": 0, "h": np.arange(3)[:, None, None],
           "q_idx": np.arange(9)[None, :, None], "kv_idx": np.arange(11)[None, None, :]}
    tensors = {"bias": rng.standard_normal(3), "table": rng.standard_normal(17)}
    want = expr.evaluate(d, env, tensors)
    got = _emitted_value(d, env, tensors)
    np.testing.assert_allclose(np.broadcast_to(got, np.shape(want)), np.broadcast_to(want, np.shape(got)), rtol=1e-12)
