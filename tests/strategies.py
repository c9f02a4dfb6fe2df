"""Hypothesis strategies over spec fields, shared by the spec, render and emulator tests."""

from hypothesis import strategies as st

from attngen.plan import make_plan
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
