"""attngen timeline on the data: trace, latency model, schedule-independent replay, invariants, CLI."""

from __future__ import annotations

import copy
import re
import time

import pytest

from attngen.cli import main
from attngen.kernels.fwd.plan import make_plan
from attngen.spec import load
from attngen.timeline import Latency, SourceInfo, record, replay
from attngen.timeline.invariants import check_all, pingpong_alternates, stages_exclusive, wgmma_depth
from attngen.timeline.latency import DEFAULT

PRESETS = ["examples/default.toml", "examples/hd64_f16_full_nopp.toml", "examples/hd64_bf16_gqa4_c3.toml",
           "examples/hd128_bf16_mqa8_c1.toml"]


def timelines(path_or_spec, q_len=300, kv_len=517, **kw):
    plan = make_plan(load(path_or_spec) if isinstance(path_or_spec, str) else path_or_spec)
    rec = record(plan, q_len=q_len, kv_len=kv_len, blocks={(x, 0, 0) for x in range(8)}, **kw)
    lat, src = Latency.load(), SourceInfo(rec.source)
    return plan, [replay(c, lat, src) for c in rec.ctas]


def test_every_latency_parameter_states_its_source_or_assumption():
    lines = DEFAULT.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\w+\s*=", line):
            said = line.split("#", 1)[1] if "#" in line else ""
            j = i + 1
            while j < len(lines) and lines[j].lstrip().startswith("#"):  # a comment block right below
                said += lines[j]
                j += 1
            assert re.search(r"source|assumption", said), f"latency.toml line {i + 1} has no source or assumption: {line}"


def test_wgmma_cycles_follow_the_measured_tensor_core_rate():
    lat = Latency.load()
    per_sm = 790e12 / (132 * 1.98e9)
    assert lat.flop_per_cycle("bfloat16") == pytest.approx(per_sm)
    assert lat.wgmma_cycles(64, 128, 128, "bfloat16") == pytest.approx(2 * 64 * 128 * 128 / per_sm)  # ~694
    assert lat.wgmma_cycles(64, 256, 128, "float16") == pytest.approx(2 * lat.wgmma_cycles(64, 128, 128, "float16"))


def test_trace_records_every_kind_of_event_with_its_facts():
    plan = make_plan(load("examples/default.toml"))
    rec = record(plan, q_len=256, kv_len=384, blocks={(1, 0, 0)})
    (cta,) = rec.ctas
    assert cta.agents == ["consumer 0", "consumer 1", "producer"]
    kinds = {e.kind for e in cta.events}
    assert {"tma_issue", "tma_land", "mbar_arrive", "mbar_wait", "bar_arrive", "bar_wait", "wgmma", "wgmma_wait",
            "parallel", "reduce", "copy", "fill"} <= kinds
    mma = next(e for e in cta.events if e.kind == "wgmma")
    assert (mma.info["m"], mma.info["n"], mma.info["k"], mma.info["dtype"], mma.info["op"]) == (64, 128, 128, "float16", "QK")
    wait = next(e for e in cta.events if e.kind == "mbar_wait" and e.info["bar"].startswith("k_full"))
    assert wait.info["need"] == 0 and wait.info["parity"] == 0
    assert "T.mbarrier_wait_parity(k_full" in rec.source.splitlines()[wait.line - 1]
    store = [e for e in cta.events if e.kind == "copy" and e.info["scopes"] == "shared->global"]
    assert len(store) == 2  # each consumer's epilogue store


def test_the_trace_is_off_by_default():
    from attngen.emulator.driver import Runtime

    assert Runtime("", "<x>", {}).trace is None


@pytest.mark.parametrize("path", ["examples/default.toml", "examples/hd64_f16_full_nopp.toml"])
def test_the_cycle_timeline_does_not_depend_on_the_emulators_schedule(path):
    runs = []
    for seed, policy in [(0, "random"), (7, "producer-first"), (3, "consumers-first")]:
        _, tls = timelines(path, seed=seed, policy=policy)
        runs.append([[(s.agent, s.row, s.kind, s.start, s.end, s.tile) for s in tl.spans] for tl in tls])
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("path", PRESETS)
def test_replayed_schedules_respect_the_kernels_synchronisation(path):
    plan, tls = timelines(path)
    for tl in tls:
        assert check_all(tl, plan.spec.pingpong) == [], tl.index
        if plan.spec.pingpong and plan.spec.consumers > 1:
            assert len(tl.turns) >= 2 * plan.spec.consumers
            assert len({t[0] for t in tl.turns}) == plan.spec.consumers  # every consumer takes turns


def test_each_invariant_catches_a_tampered_timeline():
    _, tls = timelines("examples/default.toml")
    tl = tls[-1]
    assert check_all(tl, True) == []

    bad = copy.deepcopy(tl)  # consumer 1's turn moved onto consumer 0's
    a, s, e, b = bad.turns[1]
    bad.turns[1] = (a, bad.turns[0][1], e, b)
    assert any("overlap" in v for v in pingpong_alternates(bad))

    bad = copy.deepcopy(tl)  # a QK issued before its turn
    qk = next(sp for sp in bad.spans if sp.kind == "QK" and sp.tile == 2)
    qk.info["issued"] -= 5000
    assert any("outside its ping-pong turn" in v for v in pingpong_alternates(bad))

    bad = copy.deepcopy(tl)  # a wgmma retired late: three in flight
    pv = next(sp for sp in bad.spans if sp.kind == "PV" and sp.agent == 0)
    pv.info["retired"] = 10 ** 9
    assert any("in flight" in v for v in wgmma_depth(bad))

    bad = copy.deepcopy(tl)  # a K stage reloaded while a QK reads it
    a, region, s, e = next(r for r in bad.reads if r[1].startswith("K_shared"))
    bad.loads.append((region, s + 1, e + 1))
    assert any("loaded during" in v for v in stages_exclusive(bad))


def test_pingpong_off_and_one_consumer_have_no_turns():
    for path in ("examples/hd64_f16_full_nopp.toml", "examples/hd128_bf16_mqa8_c1.toml"):
        _, tls = timelines(path)
        assert all(tl.turns == [] and tl.arrows == [] for tl in tls)


def test_cli_writes_one_self_contained_page(tmp_path, capsys):
    out = tmp_path / "t.html"
    assert main(["timeline", "examples/default.toml", "--q-len", "256", "--kv-len", "384", "-o", str(out),
                 "--compare", "examples/hd64_f16_full_nopp.toml"]) == 0
    page = out.read_text()
    assert page.count('"title":') == 2
    external = re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|<link\b|@import|url\(\s*["']?https?:""", page)
    assert external == []
    assert [u for u in re.findall(r"https?://[^\s\"'<>]+", page) if u != "http://www.w3.org/2000/svg"] == []
    assert "wrote" in capsys.readouterr().out


def test_cli_rejects_a_block_outside_the_grid(tmp_path, capsys):
    assert main(["timeline", "examples/default.toml", "--q-len", "256", "--block", "2", "-o", str(tmp_path / "x.html")]) == 2
    assert "--block 2" in capsys.readouterr().err


def test_gpu_flag_without_a_gpu_exits_2_with_one_line(tmp_path, capsys):
    from attngen.timeline.gpu import gpu_missing

    if gpu_missing() is None:
        pytest.skip("an sm_90 GPU is present")
    assert main(["timeline", "examples/default.toml", "--gpu", "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--gpu" in err


def test_2048_causal_renders_fast_and_small(tmp_path, capsys):
    """Issue 12: 1x2x2048x2048 hd128 causal in under 5 s on a 2-core machine, HTML under 2 MB."""
    out = tmp_path / "big.html"
    t0 = time.perf_counter()
    assert main(["timeline", "examples/default.toml", "--batch", "1", "--kv-heads", "2", "--q-len", "2048",
                 "--kv-len", "2048", "-o", str(out)]) == 0
    seconds = time.perf_counter() - t0
    assert out.stat().st_size < 2 * 1024 * 1024
    assert seconds < 5.0, seconds


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace("clock_ghz = 1.98", "clock_ghz = 0"), "[gpu] clock_ghz"),
    (lambda t: t.replace("bytes_per_cycle = 32.0", "bytes_per_cycle = -1.0", 1), "[tma] bytes_per_cycle"),
    (lambda t: t.replace("latency_cycles = 700", "latency_cycles = \"slow\""), "[tma] latency_cycles"),
    (lambda t: t.replace("exp2_per_cycle = 16.0", ""), "[simt] exp2_per_cycle"),
    (lambda t: "head_dim = 128\n", "[gpu] name"),
    (lambda t: "= = not toml", "readable latency TOML"),
])
def test_a_users_latency_file_is_checked_against_the_default(tmp_path, edit, why):
    from attngen.reference.forward import InputError
    from attngen.timeline.latency import DEFAULT, Latency

    path = tmp_path / "lat.toml"
    path.write_text(edit(DEFAULT.read_text()))
    with pytest.raises(InputError) as info:
        Latency.load(path)
    assert info.value.argument == "--latency" and why in str(info.value)
    copy = tmp_path / "copy.toml"
    copy.write_text(DEFAULT.read_text())
    assert Latency.load(copy).params == Latency.load().params  # an unedited copy loads


def test_an_fp8_kernel_is_charted_with_its_pv_its_one_byte_tiles_and_its_transpose():
    """fp8 (docs/fp8.md): PV reads P from shared memory (a PV, not a second QK), tiles are 1 byte an
    element, and the producer's V transpose is priced as shared-memory traffic (read + write)."""
    from attngen.spec import Spec

    plan = make_plan(Spec(head_dim=64, dtype="float8_e4m3fn", block_n=64))
    rec = record(plan, q_len=128, kv_len=256, blocks={(0, 0, 0)})
    src = SourceInfo(rec.source)
    tl = replay(rec.ctas[0], Latency.load(), src)
    kinds = [sp.kind for sp in tl.spans]
    assert kinds.count("QK") == kinds.count("PV") == 2 * 4  # 2 consumers x 4 tiles of 64 keys
    k_loads = [sp.info["bytes"] for sp in tl.spans if sp.kind == "TMA" and sp.info["dst"].startswith("K_shared")]
    assert k_loads and set(k_loads) == {64 * 64}
    transposes = [st for st in src.loops.values() if st.smem_bytes]
    assert transposes and all("Vt_shared" in st.text and st.smem_bytes == 2 for st in transposes)
    assert not any(st.smem_bytes for st in SourceInfo(record(make_plan(Spec(head_dim=64)), q_len=64, kv_len=64,
                                                                 blocks={(0, 0, 0)}).source).loops.values())


def test_a_transposed_v_is_recorded_with_no_transpose():
    from attngen.spec import Spec

    plan = make_plan(Spec(head_dim=64, dtype="float8_e4m3fn", block_n=64, v_layout="transposed"))
    rec = record(plan, q_len=128, kv_len=256, blocks={(0, 0, 0)})
    src = SourceInfo(rec.source)
    tl = replay(rec.ctas[0], Latency.load(), src)
    assert [sp.kind for sp in tl.spans].count("PV") == 2 * 4 and not any(st.smem_bytes for st in src.loops.values())
    v_loads = [sp.info["bytes"] for sp in tl.spans if sp.kind == "TMA" and sp.info["dst"].startswith("Vt_shared")]
    assert len(v_loads) == 4 and set(v_loads) == {64 * 64}
