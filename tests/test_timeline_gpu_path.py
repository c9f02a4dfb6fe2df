"""The `--gpu` path of attngen timeline without a GPU: the stamped variant is a pure source
transform (the golden text is untouched), it lowers and compiles for sm_90a, and its stamps
render the same chart (fed here with the stamps the model predicts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.spec import load
from attngen.timeline import Latency, SourceInfo, record, replay
from attngen.timeline.gpu import measured_timeline, synthetic_stamps
from attngen.timeline.html import chart_data, render_page
from attngen.timeline.instrument import instrument, stamp_plan

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "generated" / "fa3_fwd_hd128_f16_causal_g1_c2_k2v2_m128n128.py"


def test_instrumenting_does_not_change_the_plain_kernel():
    plan = make_plan(load(ROOT / "examples" / "default.toml"))
    plain = render_source(plan)
    assert plain == GOLDEN.read_text()
    stamped = instrument(plain, (1, 0, 0))
    assert render_source(plan) == plain == GOLDEN.read_text()  # nothing leaks back into the template or cache
    assert stamped != plain and "clock64" in stamped and "clock64" not in plain
    ast.parse(stamped)
    # every wait is bracketed by stamps, every issue followed by one
    lines = stamped.splitlines()
    for i, line in enumerate(lines):
        if "T.mbarrier_wait_parity(" in line or "T.wait_wgmma(" in line or "T.sync_threads(" in line:
            assert "if stamp_block:" in lines[i - 5] and "if stamp_block:" in lines[i + 1], line
        elif "T.wgmma_gemm(" in line or "T.tma_copy(" in line or "T.mbarrier_arrive(" in line:
            assert "if stamp_block:" in lines[i + 1], line
    assert "stamp_block = q_block == 1 and head == 0 and (batch_idx == 0)" in stamped


def test_stamps_render_the_same_chart():
    plan = make_plan(load(ROOT / "examples" / "default.toml"))
    rec = record(plan, q_len=512, kv_len=512, blocks={(3, 0, 0)})
    (cta,) = rec.ctas
    lat = Latency.load()
    model = replay(cta, lat, SourceInfo(rec.source))
    stamps = synthetic_stamps(cta, model)
    assert [len(r) for r in stamps] == [len(stamp_plan(cta.of(a))) for a in range(3)]
    tl = measured_timeline(cta, stamps)
    assert tl.total == pytest.approx(model.total, rel=0.01)
    kinds = {sp.kind for sp in tl.spans}
    assert {"QK", "PV", "TMA", "wait", "softmax"} <= kinds
    waits = sorted(round(sp.end - sp.start) for sp in tl.spans if sp.kind == "wait")
    model_waits = sorted(round(sp.end - sp.start) for sp in model.spans if sp.kind == "wait")
    assert sum(waits) == pytest.approx(sum(model_waits), rel=0.02)  # waits are stamped on both sides: exact
    measured = {"cycles": tl.total, "model_cycles": model.total, "overhead": "n/a (synthetic stamps)"}
    charts = [chart_data(t, title=plan.name, source_lines=rec.source.splitlines(), lat=lat, blocks=[(t.index, t.total)],
                         grid=rec.grid, shape="B=1", origin=o, measured=m)
              for t, o, m in ((model, "model", None), (tl, "measured", measured))]
    page = render_page(charts, heading="model vs measured")
    assert '"origin":"measured"' in page and '"overhead":"n/a (synthetic stamps)"' in page


@pytest.mark.slow
def test_the_stamped_kernel_lowers_and_compiles_for_sm90a(tmp_path):
    pytest.importorskip("tilelang")
    from attngen.build.nvcc import BuildError, build_source

    plan = make_plan(load(ROOT / "examples" / "default.toml"))
    try:
        result = build_source(instrument(render_source(plan), (0, 0, 0)), plan.name + "_stamped", plan.compile_flags)
    except BuildError as e:
        if "nvcc not found" in str(e):
            pytest.skip(str(e))
        raise
    assert "clock64" in result.cuda_source
    assert result.report["spill_store_bytes"] == 0
