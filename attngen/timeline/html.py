"""One self-contained HTML page (inline CSS and JS from chart.html, data as JSON) per timeline."""

from __future__ import annotations

import json
from pathlib import Path

from attngen.timeline.multi_sm import list_schedule
from attngen.timeline.replay import Timeline, summarize

TEMPLATE = Path(__file__).with_name("chart.html")
KINDS = ["QK", "PV", "softmax", "rescale", "epilogue", "TMA", "wait", "other"]
ROWS = ["simt", "async"]


def _num(x: float) -> float:
    return round(float(x), 1)


def estimate_kernel(blocks: list, total_blocks: int, sms: int) -> float:
    """Kernel cycles if every block ran alone on an SM, one CTA per SM, longest first onto the least loaded SM."""
    if not blocks:
        return 0.0
    cycles = sorted((c for _, c in blocks), reverse=True)
    if total_blocks % len(cycles) == 0:  # every query block of head 0: the other heads and batches repeat them
        cycles = sorted(cycles * (total_blocks // len(cycles)), reverse=True)
    else:  # sampled: scale the mean
        mean = sum(cycles) / len(cycles)
        return mean * -(-total_blocks // sms)
    return list_schedule(cycles, sms).makespan


def chart_data(tl: Timeline, *, title: str, source_lines: list, lat, blocks: list, grid: tuple,
               shape: str, origin: str = "model", measured: dict | None = None, note: str = "") -> dict:
    """The JSON one chart draws: lanes, spans, hand-over arrows, summary, source lines used."""
    used = {sp.line for sp in tl.spans if sp.line}
    spans = []
    for sp in sorted(tl.spans, key=lambda s: (s.agent, ROWS.index(s.row), s.start)):
        info = {k: v for k, v in sp.info.items() if v not in (None, "", 0) or k in ("phase", "queued")}
        spans.append([sp.agent, ROWS.index(sp.row), KINDS.index(sp.kind), _num(sp.start), _num(sp.end),
                      sp.line or 0, -1 if sp.tile is None else sp.tile, info])
    lanes = [{"name": n, "producer": p, "rows": ["issue + waits", "TMA loads"] if p else ["SIMT", "tensor core"]}
             for n, p in zip(tl.agents, tl.producers)]
    total_blocks = grid[0] * grid[1] * grid[2]
    sms = int(lat["gpu.sms"])
    return {
        "title": title, "origin": origin, "shape": shape, "note": note,
        "block": list(tl.index), "grid": list(grid), "clock_ghz": lat.clock_ghz,
        "total": _num(tl.total), "lanes": lanes, "spans": spans,
        "arrows": [[a, _num(t0), b, _num(t1), label] for a, t0, b, t1, label in tl.arrows],
        "lines": {str(n): source_lines[n - 1].strip() for n in sorted(used) if 0 < n <= len(source_lines)},
        "summary": summarize(tl),
        "blocks": [[list(i), _num(c)] for i, c in blocks],
        "kernel_estimate": _num(estimate_kernel(blocks, total_blocks, sms)),
        "total_blocks": total_blocks, "sms": sms,
        "measured": measured,
        "latency_file": Path(lat.path).name,
    }


def render_page(charts: list, *, heading: str) -> str:
    payload = json.dumps({"heading": heading, "kinds": KINDS, "charts": charts}, separators=(",", ":"), sort_keys=True)
    payload = payload.replace("</", "<\\/")
    return TEMPLATE.read_text().replace("/*DATA*/null", payload).replace("{{HEADING}}", _escape(heading))


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
