"""Hypothesis: random valid specs x shapes x schedules, emulated and compared with the fp64 reference.

Profiles (tests/conftest.py): ATTNGEN_HYPOTHESIS_PROFILE=ci (default, derandomized, few
examples) or dev (many). Every example must finish without a hazard or a deadlock and be
within the tolerance rule of attngen.reference.forward.
"""

import pytest
from hypothesis import assume, example, given, note, settings, strategies as st

import attngen
from attngen.emulator import POLICIES, emulate_stats
from attngen.reference.forward import check_close, random_inputs
from strategies import softmax_scales

# Keep one example's emulation well under a second on the CI machine: a cap on B*H*Sq*Skv.
WORK_CAP = 1_200_000
# An example costs ~0.15 s on average (2 cores), so this test takes 8x the profile's examples:
# 160 under "ci" (~25 s), 2400 under "dev".
EXAMPLES = 8 * settings().max_examples


@st.composite
def specs(draw):
    fields = {
        "head_dim": draw(st.sampled_from([64, 128, 64, 128, 96, 256])),  # mostly the fast ones
        "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
        "causal": draw(st.booleans()),
        "gqa_group": draw(st.sampled_from([1, 2, 3])),
        "consumers": draw(st.integers(1, 3)),
        "k_stages": draw(st.integers(1, 3)),
        "v_stages": draw(st.integers(1, 3)),
        "aligned": draw(st.booleans()),
        "steady_loop": draw(st.sampled_from(["one", "split"])),
    }
    if fields["consumers"] >= 2:
        fields["pingpong"] = draw(st.booleans())
    if draw(st.booleans()):
        fields["block_n"] = draw(st.sampled_from([32, 48, 64, 96, 128]))
    try:
        return attngen.make_plan(attngen.Spec(**fields)).spec  # resolved: tile sizes known
    except attngen.SpecError:
        assume(False)  # over a register or shared-memory budget


@st.composite
def shapes(draw, spec):
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if spec.aligned:
        q_len = spec.block_m * draw(st.integers(1, 3))
        kv_len = spec.block_n * draw(st.integers(1, 5))
    else:
        q_len, kv_len = draw(st.integers(1, 600)), draw(st.integers(1, 600))
        if draw(st.booleans()):  # exact tile multiples are their own edge
            q_len = spec.block_m * max(1, q_len // spec.block_m)
            kv_len = spec.block_n * max(1, kv_len // spec.block_n)
    if batch * kv_heads * spec.gqa_group * q_len * kv_len > WORK_CAP:
        batch = kv_heads = 1
    return batch, kv_heads, q_len, kv_len


@st.composite
def cases(draw):
    spec = draw(specs())
    return (spec, draw(shapes(spec)), draw(st.integers(0, 2**16)), draw(st.sampled_from(POLICIES)),
            draw(st.booleans()), draw(softmax_scales()))


def run_case(spec, shape, seed, policy, static=False, scale=None):
    """static: emulate the source specialized to this shape (constants instead of T.dynamic);
    scale: the run-time softmax scale, given to the kernel and the reference (None: 1/sqrt(d))."""
    b, hkv, sq, skv = shape
    note(f"{attngen.make_plan(spec).name} B={b} HKV={hkv} Sq={sq} Skv={skv} seed={seed} policy={policy} static={static} "
         f"softmax_scale={scale}")
    h = hkv * spec.gqa_group
    q, k, v = random_inputs(spec.dtype, spec.head_dim, b, h, hkv, sq, skv, seed)
    source = attngen.render_source(spec, attngen.Shape(b, h, hkv, sq, skv)) if static else None
    out, stats = emulate_stats(spec, q, k, v, seed=seed, policy=policy, source=source,
                               softmax_scale=scale)  # a hazard or deadlock raises
    res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype, scale=scale)
    assert res.ok, f"{attngen.make_plan(spec).name} {shape} seed={seed} policy={policy} softmax_scale={scale}: {res}"
    return stats


CANONICAL = [(1, 1), (113, 203), (239, 1), (799, 3), (1023, 1024)]


def _examples(fn):
    # The canonical odd shapes, causal (bottom-right, Sq > Skv rows with no key) and not, MHA and GQA;
    # the default softmax scale, and the scales at the ends of the drawn range.
    for i, (sq, skv) in enumerate(CANONICAL):
        fn = example(case=(attngen.Spec(causal=True), (1, 1, sq, skv), i, POLICIES[i % 3], i % 2 == 1,
                           [None, 1.0, 0.01][i % 3]))(fn)
        fn = example(case=(attngen.Spec(gqa_group=2, head_dim=64, consumers=3), (1, 2, sq, skv), 10 + i,
                           POLICIES[(i + 1) % 3], False, [1.0, None, 0.01][i % 3]))(fn)
    return fn


@pytest.mark.expensive
@settings(max_examples=EXAMPLES)
@given(case=cases())
@_examples
def test_random_specs_shapes_and_schedules_match_reference(case):
    run_case(*case)
