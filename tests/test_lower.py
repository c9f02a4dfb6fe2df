"""Every valid spec lowers with TileLang for sm_90a (hypothesis; each example costs ~10 s)."""

import os

from hypothesis import HealthCheck, given, settings

import attngen
from attngen.build.lower import LowerError, lower_source
from attngen.kernels.common.plan import Shape
from strategies import valid_specs

import pytest

LOWER_EXAMPLES = int(os.environ.get("ATTNGEN_LOWER_EXAMPLES", "3"))


@settings(max_examples=LOWER_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_specs())
def test_valid_spec_lowers_to_cuda(spec):
    cuda = attngen.render_source(spec)
    lowered = lower_source(cuda, attngen.make_plan(spec).name).cuda_source
    assert f"__launch_bounds__({attngen.make_plan(spec).threads}, 1)" in lowered
    assert "int q_len" in lowered and "int kv_len" in lowered  # dynamic shapes stay runtime values
    assert lowered.count("tl::tma_load") >= 3  # Q, K, V


def test_static_shape_specializes():
    spec = attngen.Spec(head_dim=64, consumers=1, causal=True)
    lowered = lower_source(attngen.render_source(spec, Shape(2, 4, 4, 100, 300)), "static").cuda_source
    assert "int q_len" not in lowered


def test_lowering_failure_names_the_kernel():
    source = attngen.render_source(attngen.Spec())
    broken = source.replace("T.reduce_max(acc_s, m_cur, dim=1, clear=False)", "T.reduce_max(acc_s, m_cur, dim=7)", 1)
    with pytest.raises(LowerError, match="fa3_fwd_hd128"):
        lower_source(broken, "fa3_fwd_hd128_broken")
