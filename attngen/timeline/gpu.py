"""`attngen timeline --gpu`: the stamped build on a real GPU (see instrument.py)."""

from __future__ import annotations


def gpu_missing() -> str | None:
    """None when an sm_90 CUDA device is usable, else why not (one line)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"the device has compute capability {cap[0]}.{cap[1]}, not 9.0 (Hopper)"
    return None


# -- stamps -> the same chart --------------------------------------------------------------------
def measured_timeline(cta, stamps, total_hint=None):
    """A Timeline from per-warpgroup clock64 stamps of the instrumented kernel (instrument.py).

    stamps[w][j] is warpgroup w's j-th stamp; `stamp_plan` says which traced event each one
    brackets. Waits are exact (stamped before and after); the statements between two stamps share
    the interval, labelled by their role; a wgmma spans issue .. the wait that retired it and a
    TMA load issue .. the first wait that saw its phase complete (upper bounds: the GPU does not
    stamp the tensor cores or the TMA engine).
    """
    from attngen.timeline.instrument import stamp_plan
    from attngen.timeline.latency import classify
    from attngen.timeline.replay import Span, Timeline

    n = len(cta.agents)
    streams = [cta.of(a) for a in range(n)]
    plans = [stamp_plan(s) for s in streams]
    firsts = [stamps[a][0] for a in range(n) if len(plans[a]) and len(stamps[a])]
    t0 = min(firsts) if firsts else 0
    spans, arrows, turns = [], [], []
    at = [dict() for _ in range(n)]  # agent -> {(pos, event index): time}
    for a in range(n):
        for j, key in enumerate(plans[a][:len(stamps[a])]):
            at[a][key] = float(stamps[a][j] - t0)
    waits_done: dict = {}  # (bar, phase) -> earliest wait end seen
    for a in range(n):
        prev_t, prev_i, qk, pv, inflight, loaded = 0.0, -1, 0, 0, [], {}
        for j, (pos, i) in enumerate(plans[a][:len(stamps[a])]):
            t = at[a][(pos, i)]
            e = streams[a][i]
            tile = max(qk - 1, 0) if not cta.producers[a] else None
            between = [x for x in streams[a][prev_i + 1:i] if x.kind in ("parallel", "reduce", "copy", "fill")]
            if pos == "before" or (pos == "after" and e.kind not in ("mbar_wait", "bar_wait", "wgmma_wait")):
                if t > prev_t:
                    roles = [classify(x.info.get("src", "") + x.info.get("dst", "")) if x.kind == "copy" else
                             "softmax" if x.kind == "reduce" else "other" for x in between]
                    role = max(set(roles), key=roles.count) if roles else "other"
                    line = between[0].line if between else e.line
                    spans.append(Span(a, "simt", role, prev_t, t, line, tile, {"statements": len(between), "measured": "stamps"}))
            if pos == "after" and e.kind in ("mbar_wait", "bar_wait", "wgmma_wait"):
                start = at[a].get(("before", i if e.kind != "bar_wait" else i - 1), prev_t)
                what = e.info.get("bar", "wgmma")
                info = {"on": f"named barrier {what}" if e.kind == "bar_wait" else str(what), "measured": "stamps"}
                if e.kind == "mbar_wait":
                    info.update(barrier=e.info["bar"], phase=e.info["need"], parity=e.info["parity"])
                    key = (e.info["bar"], e.info["need"])
                    waits_done[key] = min(waits_done.get(key, t), t)
                elif e.kind == "bar_wait":
                    info.update(barrier=f"named barrier {e.info['bar']}", phase=e.info["gen"])
                if t > start:
                    spans.append(Span(a, "simt", "wait", start, t, e.line, tile, info))
                if e.kind == "wgmma_wait":
                    keep = e.info["keep"]
                    retire, inflight = inflight[:max(len(inflight) - keep, 0)], inflight[max(len(inflight) - keep, 0):]
                    for sp in retire:
                        sp.end = t
            if pos == "after" and e.kind == "wgmma":
                tile_w = qk if e.info["op"] == "QK" else pv
                qk, pv = (qk + 1, pv) if e.info["op"] == "QK" else (qk, pv + 1)
                sp = Span(a, "async", e.info["op"], t, t, e.line, tile_w,
                          {"M": e.info["m"], "N": e.info["n"], "K": e.info["k"], "measured": "issue .. retiring wait"})
                spans.append(sp)
                inflight.append(sp)
            if pos == "after" and e.kind == "tma_issue":
                buf = e.info["dst"].split("[")[0]
                loaded[buf] = loaded.get(buf, -1) + 1
                spans.append(Span(a, "async", "TMA", t, t, e.line, loaded[buf],
                                  {"dst": e.info["dst"], "barrier": e.info["bar"], "phase": e.info["phase"],
                                   "measured": "issue .. first wait that saw it land", "_key": (e.info["bar"], e.info["phase"])}))
            prev_t, prev_i = t, i
    for sp in spans:
        key = sp.info.pop("_key", None)
        if key is not None:
            sp.end = max(sp.start, waits_done.get(key, sp.start))
    total = max([sp.end for sp in spans] + [0.0])
    return Timeline(cta.index, cta.agents, cta.producers, spans, arrows, turns, [], [], {a: 0 for a in range(n)},
                    {a: 1 for a in range(n)}, total)


def synthetic_stamps(cta, model) -> list:
    """The stamps the instrumented kernel would write if the GPU ran exactly as the model says
    (the CPU test of the --gpu chart path)."""
    from attngen.timeline.instrument import stamp_plan

    out = []
    for a in range(len(cta.agents)):
        row = []
        for pos, i in stamp_plan(cta.of(a)):
            start, end = model.times[a][i]
            row.append(int(round(1000 + (start if pos == "before" else end))))
        out.append(row)
    return out


def measured_chart(plan, args, lat, rec, model_tl):
    """Build and run the stamped kernel on the GPU; chart the measured stamps of the chosen block."""
    from attngen.timeline.html import chart_data

    stamps, overhead = run_stamped(plan, args, model_tl.index)
    tl = measured_timeline(next(c for c in rec.ctas if c.index == model_tl.index), stamps)
    measured = {"cycles": round(tl.total, 1), "model_cycles": round(model_tl.total, 1), "overhead": overhead}
    shape = f"B={args.batch} H={args.kv_heads * plan.spec.gqa_group} HKV={args.kv_heads} Sq={args.q_len} Skv={args.kv_len}"
    return chart_data(tl, title=plan.name, source_lines=rec.source.splitlines(), lat=lat, blocks=[(tl.index, tl.total)],
                      grid=rec.grid, shape=shape, origin="measured", measured=measured,
                      note="clock64 stamps of one thread per warpgroup (instrument.py); wgmma and TMA spans are upper bounds")


def run_stamped(plan, args, block, repeats: int = 20):
    """Compile plain and stamped kernels, time both (CUDA events), return (stamps per warpgroup, overhead text)."""
    import tilelang
    import torch
    from tvm.target import Target

    from attngen.build.lower import TARGET, load_module
    from attngen.reference.forward import random_inputs
    from attngen.kernels.fwd.render import render_source
    from attngen.run.forward import compile_kernel
    from attngen.timeline.instrument import SLOTS, instrument

    spec = plan.spec
    heads = args.kv_heads * spec.gqa_group
    from attngen.run.checks import torch_dtype

    q, k, v = (torch.from_numpy(x).to(torch_dtype(spec.dtype)).cuda()  # random_inputs gives float32 numpy arrays
               for x in random_inputs(spec.dtype, spec.head_dim, args.batch, heads, args.kv_heads,
                                      args.q_len, args.kv_len, args.seed))
    out = torch.empty_like(q)
    plain = compile_kernel(plan)
    module = load_module(instrument(render_source(plan), block), plan.name + "_stamped")
    target = Target(TARGET)
    with target:
        prim = module.build_kernel()
    jit = tilelang.compile(prim, out_idx=None, target=target, pass_configs=module.PASS_CONFIGS,
                           compile_flags=list(plan.compile_flags))
    stamps = torch.zeros((plan.threads // 128, SLOTS), dtype=torch.int64, device="cuda")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    t_plain = timed(lambda: plain(q, k, v, out=out, check=False))
    t_stamped = timed(lambda: jit(q, k, v, out, stamps))
    rows = stamps.cpu().tolist()
    counts = [sum(1 for x in r if x) for r in rows]
    overhead = (f"{100 * (t_stamped / t_plain - 1):+.1f}% "
                f"(plain {t_plain * 1000:.1f} us, stamped {t_stamped * 1000:.1f} us, median of {repeats})")
    return [r[:c] for r, c in zip(rows, counts)], overhead


def build_stamped(spec_path: str, block=(0, 0, 0)) -> dict:
    """Lower and nvcc-compile the stamped variant (no GPU needed): the GPU check's dry run."""
    from attngen.build.nvcc import build_source
    from attngen.kernels.fwd.plan import make_plan
    from attngen.kernels.fwd.render import render_source
    from attngen.spec import load
    from attngen.timeline.instrument import instrument

    plan = make_plan(load(spec_path))
    r = build_source(instrument(render_source(plan), block), plan.name + "_stamped", plan.compile_flags)
    return {k: r.report[k] for k in ("kernel", "registers", "spill_store_bytes", "dynamic_smem_bytes", "setmaxnreg_applied")}
