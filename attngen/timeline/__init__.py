"""`attngen timeline`: a cycle timeline of an emitted kernel, from the CPU model or the GPU.

record()  runs the emitted source on the CPU emulator with a `Recorder` observer (trace.py);
replay()  turns one CTA's events into cycles with the latency model (latency.py + latency.toml);
html      renders one self-contained page (chart.html: inline JS and CSS, no network);
instrument.py  makes the stamped variant for `--gpu` (a source transform: the plain text is untouched).
See docs/timeline.md.
"""

from attngen.timeline.latency import Latency, SourceInfo
from attngen.timeline.record import Recording, record
from attngen.timeline.replay import ReplayError, Span, Timeline, replay, summarize
from attngen.timeline.trace import CTATrace, Event, Recorder

__all__ = ["Latency", "SourceInfo", "Recording", "record", "ReplayError", "Span", "Timeline", "replay", "summarize",
           "CTATrace", "Event", "Recorder"]
