"""Spec validation: every field, every budget, unknown keys, TOML, names and hashes."""

import ast
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import attngen
from attngen.hw import SMEM_PER_BLOCK
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import FIELDS, Spec, SpecError, from_dict, load, to_toml, toml_value
from strategies import spec_fields, valid_specs


def error_for(**fields) -> SpecError:
    """The SpecError of a spec: a field error from Spec(...), or a budget error from its plan."""
    with pytest.raises(SpecError) as info:
        make_plan(Spec(**fields))
    return info.value


@pytest.mark.parametrize(
    "fields, field, hint",
    [
        ({"head_dim": 100}, "head_dim", "64, 96, 128, 192, 256"),
        ({"head_dim": 128.0}, "head_dim", "got a float"),
        ({"head_dim": True}, "head_dim", "got a boolean"),
        ({"head_dim": "128"}, "head_dim", "expected an integer (one of 64, 96, 128, 192, 256), got a string"),
        ({"dtype": "float32"}, "dtype", "bfloat16"),
        ({"dtype": ["float16"]}, "dtype", "bfloat16"),
        ({"causal": "yes"}, "causal", 'expected true or false, got a string'),
        ({"consumers": 2.5}, "consumers", "expected an integer (from 1 to 3), got a float"),
        ({"gqa_group": 0}, "gqa_group", "from 1"),
        ({"consumers": 4}, "consumers", "from 1 to 3"),
        ({"k_stages": 0}, "k_stages", "from 1 to 4"),
        ({"v_stages": 5}, "v_stages", "from 1 to 4"),
        ({"block_m": 64}, "block_m", "64 * consumers"),
        ({"block_n": 100}, "block_n", "multiple of 16"),
        ({"pingpong": True, "consumers": 1}, "pingpong", "consumers >= 2"),
        ({"aligned": 1}, "aligned", "true or false"),
    ],
)
def test_bad_field_names_field_value_and_valid_range(fields, field, hint):
    err = error_for(**fields)
    assert err.field == field
    assert hint in str(err)
    assert f"= {toml_value(list(fields.values())[0])}:" in str(err)  # the value as TOML writes it


@pytest.mark.parametrize("fields, message", [
    (dict(block_mask=True, mask_mod="q_idx >= kv_idx", causal=True), "`causal` = true: expected false with block_mask = true: "),
    (dict(block_mask=True, mask_mod="q_idx >= kv_idx", window=[3, 3]), "`window` = [3, 3]: expected [-1, -1] with block_mask = true: "),
    (dict(block_mask=True, mask_mod="q_idx >= kv_idx", splits=2), "`splits` = 2: expected 1 with block_mask = true: "),
    (dict(block_mask=True), "`block_mask` = true: expected false with no mask_mod: "),
    (dict(pingpong=True, consumers=1), "`pingpong` = true: expected false (or no pingpong) with consumers = 1: "),
    (dict(page_size=64), "`page_size` = 64: expected no page_size with paged_kv = false: "),
    (dict(layout="varlen", aligned=True), '`aligned` = true: expected false with layout = "varlen": '),
    (dict(splits=2, sinks=True), "`splits` = 2: expected 1 with sinks = true: "),
    (dict(splits=2, window=[3, -1]), "`splits` = 2: expected 1 with window = [3, -1]: "),
])
def test_a_value_another_field_rules_out_says_what_would_be_valid_beside_it(fields, message):
    """issue 25: "`causal` = true: false with block_mask = true" read as if false were the problem."""
    assert message in str(error_for(**fields))


def test_the_deterministic_backward_refusal_says_what_would_be_valid():
    from attngen.kernels.bwd.plan import plan_backward

    with pytest.raises(SpecError, match=r"`deterministic` = true: expected false with block_mask = true and gqa_group = 2: "):
        plan_backward(Spec(block_mask=True, mask_mod="q_idx >= kv_idx", deterministic=True, gqa_group=2))


def test_values_are_shown_as_toml_writes_them():
    assert str(error_for(causal="yes")) == 'spec field `causal` = "yes": expected true or false, got a string'
    assert str(error_for(aligned=1)) == "spec field `aligned` = 1: expected true or false, got an integer"
    assert "= true:" in str(error_for(pingpong=True, consumers=1))


def test_misspelt_keyword_is_a_spec_error_with_the_nearest_field():
    with pytest.raises(SpecError) as info:
        Spec(casual=True)
    assert info.value.field == "casual" and "did you mean `causal`" in str(info.value)


def test_spec_holds_only_the_users_choices():
    spec = Spec(causal=True)
    assert spec.block_m is None and spec.block_n is None and spec.pingpong is None
    plan = make_plan(spec)
    assert (plan.spec.block_m, plan.spec.block_n, plan.spec.pingpong) == (128, 128, True)
    assert plan.spec == make_plan(plan.spec).spec  # resolving twice changes nothing


def test_budgets_are_checked_by_the_plan_not_the_spec():
    spec = Spec(head_dim=256, block_n=96, k_stages=1, v_stages=1)  # over the register budget, yet a valid choice
    with pytest.raises(SpecError, match="registers"):
        make_plan(spec)
    assert make_plan(spec, check_registers=False).consumer_regs_needed > make_plan(spec, check_registers=False).consumer_regs


def test_register_budget_names_block_n_and_the_figures():
    err = error_for(head_dim=256, block_n=128, k_stages=1, v_stages=1)
    assert err.field == "block_n"
    assert "registers" in str(err) and "240" in str(err) and "block_n <= 80" in str(err)


def test_head_dim_256_cannot_have_three_consumers():
    err = error_for(head_dim=256, consumers=3)
    assert err.field == "consumers" and "[1, 2]" in str(err)


def test_the_register_error_blames_head_dim_v_when_it_is_the_wide_one():
    err = error_for(head_dim=64, head_dim_v=256, consumers=3)  # issue 21: it blamed head_dim 64
    assert err.field == "consumers" and "head_dim_v 256" in str(err) and "head_dim 64" not in str(err)
    err = error_for(head_dim=256, head_dim_v=256, consumers=3)
    assert "head_dim 256" in str(err) and "head_dim_v" not in str(err)


@pytest.mark.parametrize("fields", [
    dict(head_dim=64, head_dim_v=256, consumers=3),
    dict(head_dim=256, consumers=3),
    dict(head_dim=256, consumers=3, causal=True, window=[64, -1], softcap=30.0),
    dict(head_dim=256, consumers=3, layout="varlen", mask_mod="q_idx >= kv_idx", lse=True),
    dict(head_dim=192, head_dim_v=256, consumers=3, dtype="bfloat16", alibi=True),
])
def test_the_consumers_the_register_error_suggests_are_exactly_the_ones_that_plan(fields):
    """The suggestion uses the plan's own estimate and setmaxnreg split (mask, varlen and
    variant shares included), so every count it names plans and every other count does not."""
    import re

    err = error_for(**fields)
    assert err.field == "consumers"
    suggested = [int(c) for c in re.search(r"use consumers in \[([0-9, ]*)\]", str(err)).group(1).split(",") if c.strip()]
    for c in (1, 2, 3):
        other = Spec(**{**fields, "consumers": c, "block_n": 16})
        try:
            make_plan(other)
            planned = True
        except SpecError:
            planned = False
        assert planned == (c in suggested), (c, suggested, str(err))


def test_three_consumers_get_fewer_registers():
    err = error_for(consumers=3, head_dim=128, block_n=128)
    assert err.field == "block_n" and "160" in str(err)


def test_shared_memory_budget_reports_the_plan_bytes():
    err = error_for(head_dim=256, block_n=80, k_stages=4, v_stages=4)
    assert err.field == "k_stages/v_stages"
    assert str(SMEM_PER_BLOCK) in str(err)
    plan_bytes = 2 * (128 * 256 * 2) + 8 * 80 * 256 * 2  # Q + O, 4 + 4 stages of 80 x 256
    assert str(plan_bytes) in str(err)


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(SpecError) as info:
        from_dict({"head_dims": 128})
    assert info.value.field == "head_dims"
    assert "did you mean `head_dim`" in str(info.value)


def test_toml_round_trip(tmp_path):
    spec = Spec(head_dim=64, dtype="bfloat16", causal=True, gqa_group=4, consumers=3)
    path = tmp_path / "s.toml"
    path.write_text(to_toml(spec))
    assert load(path) == spec


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("head_dim = = 3")
    with pytest.raises(SpecError, match="not valid TOML"):
        load(bad)
    with pytest.raises(SpecError, match="no such spec file"):
        load(tmp_path / "nope.toml")
    with pytest.raises(SpecError, match="is a directory"):
        load(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# caf\xe9\nhead_dim = 128\n".encode("latin-1"))
    with pytest.raises(SpecError, match="not UTF-8"):
        load(latin1)


def test_defaults_are_derived_and_frozen_into_name_and_hash():
    implicit = make_plan(Spec(causal=True))
    explicit = make_plan(Spec(causal=True, block_m=128, block_n=128, pingpong=True))
    assert implicit.spec == explicit.spec and implicit.hash == explicit.hash
    assert implicit.name == "fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128"
    assert make_plan(Spec(consumers=1)).spec.pingpong is False
    assert make_plan(Spec(causal=True, gqa_group=4)).hash != implicit.hash


def test_name_encodes_every_axis():
    a = make_plan(Spec(consumers=2, pingpong=False, aligned=True, dtype="bfloat16", gqa_group=4, k_stages=3, v_stages=1))
    assert a.name == "fa3_fwd_hd128_bf16_full_g4_c2_k3v1_m128n128_nopp_aligned"


def test_shape_checks():
    spec = Spec(gqa_group=2, aligned=True)
    make_plan(spec, Shape(1, 4, 2, 256, 256))
    with pytest.raises(SpecError, match="kv_heads \\* gqa_group"):
        make_plan(spec, Shape(1, 3, 2, 256, 256))
    with pytest.raises(SpecError, match="multiple of block_m"):
        make_plan(spec, Shape(1, 4, 2, 200, 256))
    with pytest.raises(SpecError, match="B,H,HKV,SQ,SKV"):
        Shape.parse("1,2,3")
    for shape, field in [(Shape(70000, 8, 4, 128, 128), "shape.batch"), (Shape(1, 140000, 70000, 128, 128), "shape.heads"),
                         (Shape(1, 4, 2, -5, 256), "shape.q_len"), (Shape(1, 4, 2, 3 * 10**9, 256), "shape")]:
        with pytest.raises(SpecError) as info:
            make_plan(Spec(gqa_group=2), shape)
        assert info.value.field == field, (shape, info.value)
    with pytest.raises(SpecError, match="at most 2147483647"):
        make_plan(Spec(), Shape.parse("1,1,1,12345678901234567890123,128"))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(valid_specs())
def test_every_valid_spec_renders_to_python_that_parses(spec):
    plan = make_plan(spec)
    source = attngen.render_source(plan)
    tree = ast.parse(source)
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {"build_kernel", "consumer", plan.name} <= names
    assert f"spec hash: {plan.hash}" in source
    # the consumer body is emitted once, whatever the number of consumers
    assert source.count("def consumer(") == 1
    assert source.count("with T.ws(") == spec.consumers


# Softcaps whose 6-digit forms are invalid in a name (1e-05) or shared (2, 2.0000001, 2.000001), and any other.
SOFTCAPS = st.one_of(st.sampled_from([0.0, 2.0, 2.0000001, 2.000001, 1e-5, 1.0000001e-5, 1e20, 1.0000001e20, 30.0, 0.5]),
                     st.floats(min_value=0.0, allow_nan=False, allow_infinity=False))


NAMED_FIELDS = {"causal": st.booleans(), "softcap": SOFTCAPS, "lse": st.booleans(), "alibi": st.booleans(),
                "window": st.sampled_from([(-1, -1), (0, -1), (5, 3), (-1, 7)]), "head_dim_v": st.sampled_from([None, 64, 128]),
                "splits": st.sampled_from([1, 2, 3, "auto"])}


@st.composite
def named_spec_pairs(draw):
    """Two specs over the fields a name spells out beyond the schedule (head_dim 64), the second
    the first with one field drawn again: names that differ in one token, or collide."""
    a = {name: draw(strategy) for name, strategy in NAMED_FIELDS.items()}
    changed = draw(st.sampled_from(sorted(NAMED_FIELDS)))
    b = {**a, changed: draw(NAMED_FIELDS[changed])}
    if changed == "softcap" and draw(st.booleans()):  # a neighbour: the same 6 significant digits, or nearly
        x = a["softcap"]
        b["softcap"] = draw(st.sampled_from([math.nextafter(x, math.inf), x * (1 + 1e-7), float(f"{x:g}")]))
    plans = []
    for fields in (a, b):
        if fields["splits"] != 1:  # split-KV takes no window
            fields["window"] = (-1, -1)
        plans.append(make_plan(Spec(head_dim=64, **fields)))
    return plans


def kernel_body(plan) -> str:
    """The emitted source without its header's spec and hash lines: the kernel itself."""
    return "\n".join(line for line in attngen.render_source(plan).splitlines()
                     if not line.startswith("#") and not line.startswith("SPEC_HASH"))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(named_spec_pairs())
def test_names_are_identifiers_and_distinct_kernels_never_share_one(pair):
    a, b = pair
    assert a.name.isidentifier() and b.name.isidentifier(), (a.name, b.name)
    if a.name == b.name:  # one generated/<name>.py: it must be the same kernel
        assert kernel_body(a) == kernel_body(b), (a.spec, b.spec)


def test_softcap_names_keep_their_tokens_and_tell_close_values_apart():
    names = {v: make_plan(Spec(softcap=v)).name.removeprefix("fa3_fwd_hd128_f16_full_g1_c2_k2v2_m128n128_")
             for v in (30.0, 0.5, 7.5, 1e20, 2.0, 2.0000001, 2.000001, 1e-5)}
    assert names == {30.0: "sc30", 0.5: "sc0p5", 7.5: "sc7p5", 1e20: "sc1e20", 2.0: "sc2", 2.0000001: "sc2p0000001",
                     2.000001: "sc2p000001", 1e-5: "sc1em05"}


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS + ("stages", "headdim")),
                       st.one_of(st.integers(-5, 300), st.text(max_size=8), st.booleans(), st.none(), st.floats(allow_nan=False)),
                       max_size=5))
def test_arbitrary_input_raises_spec_error_and_nothing_else(data):
    try:
        plan = make_plan(from_dict(data))
    except SpecError as e:
        assert e.field and str(e)
    else:
        assert isinstance(plan.spec, Spec)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(spec_fields())
def test_in_range_fields_either_build_or_name_a_budget(fields):
    try:
        make_plan(Spec(**fields))
    except SpecError as e:
        assert e.field in ("block_n", "k_stages/v_stages", "consumers")


def test_numpy_scalars_and_cpu_0d_tensors_are_the_values_they_hold():
    """Issue 25: window=(np.int64(5), 0) was refused with a message its value seemed to satisfy."""
    import numpy as np
    import torch

    plain = Spec(window=(5, 0), softcap=3.0, causal=True, consumers=1, head_dim=64, splits=1, deterministic=True)
    assert Spec(softcap=np.float64(3.0)) == Spec(softcap=3.0)  # a float subclass, but not a float
    given = Spec(window=(np.int64(5), torch.tensor(0)), softcap=np.float32(3.0), causal=np.bool_(True),
                 consumers=torch.tensor(1), head_dim=np.array(64), splits=np.int32(1), deterministic=torch.tensor(True))
    assert given == plain and hash(given) == hash(plain) and to_toml(given) == to_toml(plain)
    assert type(given.softcap) is float and all(type(x) is int for x in given.window)


@pytest.mark.parametrize("fields, shown", [
    ({"window": (1.5, 0)}, "got a float in it"),
    ({"window": (1, 2, 3)}, "got 3 values"),
    ({"softcap": [3.0]}, "got an array"),
])
def test_a_type_the_spec_cannot_take_is_named(fields, shown):
    with pytest.raises(SpecError, match=shown):
        Spec(**fields)


def test_an_array_or_a_device_0d_tensor_is_named_not_read():
    import numpy as np
    import torch

    with pytest.raises(SpecError, match=r"`softcap` = \[3\. 3\.\]: .*got numpy\.ndarray"):
        Spec(softcap=np.full(2, 3.0))
    # a device tensor's value would need a sync: refused (a meta tensor stands in for a CUDA one here)
    with pytest.raises(SpecError, match=r"`softcap` = a 0-d meta tensor: .*waits for the device"):
        Spec(softcap=torch.tensor(3.0, device="meta"))


def test_the_errors_are_exported_at_the_top_level():
    from attngen.reference.forward import InputError

    assert attngen.InputError is InputError and attngen.SpecError is SpecError
    assert {"InputError", "SpecError"} <= set(attngen.__all__)
