"""attngen timeline pages in a real browser: headless Chromium (the Debian package; .ci/run installs it).

Each page is opened twice: `--dump-dom` of `page.html#selftest` (the page hovers its first
span itself and writes the tooltip, its lane count and any error it caught into the DOM)
and `--screenshot` (the pixels must not be blank, into a temporary folder). The screenshots
are the ones in docs/timeline.md; a test run never writes them: with UPDATE_SCREENSHOTS=1 in
the environment, a run copies a screenshot into docs/timeline/ when its pixels differ from the
committed one (see `update_doc_image`).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from attngen.cli import main
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.spec import load as load_spec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "timeline"
UPDATE_SCREENSHOTS = "ATTNGEN_UPDATE_SCREENSHOTS"  # =1: refresh the committed screenshots in DOCS
SHAPE = ["--q-len", "1024", "--kv-len", "1024"]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


pytestmark = pytest.mark.skipif(chromium() is None, reason="no headless Chromium (.ci/run installs the Debian package)")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
         "--font-render-hinting=none", "--disable-lcd-text"]


def run_chromium(*args, timeout=90) -> str:
    proc = subprocess.run([chromium(), *FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def decode_png(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA PNG -> (h, w, channels) uint8, with zlib and struct only (no imaging library)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    w, h, depth, color, _, _, interlace = head
    assert depth == 8 and color in (2, 6) and interlace == 0, head
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.int32)
    prev = np.zeros(w * bpp, np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:
            cur = line.reshape(w, bpp).cumsum(axis=0).reshape(-1) % 256
        elif f == 2:
            cur = (line + prev) % 256
        else:
            cur = np.zeros_like(line)
            for x in range(w * bpp):
                a = cur[x - bpp] if x >= bpp else 0
                b = prev[x]
                if f == 3:
                    cur[x] = (line[x] + (a + b) // 2) % 256
                else:
                    c = prev[x - bpp] if x >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)[:, :, :3].astype(np.uint8)


def update_doc_image(shot: Path, name: str) -> str:
    """Copy the screenshot into docs/timeline/ when it differs from the committed one by more than
    0.1% of its pixels (Chromium's text antialiasing may change a few pixels between versions; the
    page itself has no timestamps, so a change above that is a change of the chart)."""
    target = DOCS / name
    new = shot.read_bytes()
    if target.exists():
        old = target.read_bytes()
        if old == new:
            return "same bytes"
        a, b = decode_png(old), decode_png(new)
        if a.shape == b.shape and np.any(a != b, axis=2).mean() <= 0.001:
            return "same pixels"
    DOCS.mkdir(parents=True, exist_ok=True)
    target.write_bytes(new)
    return "updated"


PAGES = {
    # name: (spec, --compare specs, window height)
    "default": ("examples/default.toml", [], 720),
    "pingpong-off": ("examples/default.toml", ["{tmp}/default_nopp.toml"], 1040),
    "consumers-1-vs-2": ("{tmp}/default_c1.toml", ["examples/default.toml"], 1040),
}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    base = (ROOT / "examples" / "default.toml").read_text()
    (tmp / "default_nopp.toml").write_text(base + "pingpong = false\n")
    (tmp / "default_c1.toml").write_text(base.replace("consumers = 2", "consumers = 1"))
    out = {}
    for name, (spec, compare, height) in PAGES.items():
        page = tmp / f"{name}.html"
        args = ["timeline", spec.format(tmp=tmp), *SHAPE, "-o", str(page)]
        for c in compare:
            args += ["--compare", c.format(tmp=tmp)]
        assert main(args) == 0
        out[name] = (page, height)
    return out


def agents_in(page: Path) -> int:
    return len(re.findall(r'"producer":(?:true|false),"rows"', page.read_text()))


@pytest.mark.parametrize("name", list(PAGES))
def test_page_loads_without_errors_and_hover_shows_the_source_line(pages, name):
    page, _ = pages[name]
    dom = run_chromium("--virtual-time-budget=5000", "--dump-dom", page.as_uri() + "#selftest")
    errors = re.search(r'<pre id="errors" data-count="(\d+)">(.*?)</pre>', dom, re.S)
    assert errors and errors.group(1) == "0", html.unescape(errors.group(2) if errors else dom[-2000:])
    selftest = html.unescape(re.search(r'<pre id="selftest">(.*?)</pre>', dom, re.S).group(1))
    lanes = int(re.search(r"^lanes (\d+)$", selftest, re.M).group(1))
    assert lanes == agents_in(page) == (6 if "vs" in name or "off" in name else 3) - (1 if name.startswith("consumers") else 0)
    tip = selftest.split("tooltip:\n", 1)[1]
    hovered = re.search(r"^line (\d+): (T\.\w+\(.*)$", tip, re.M)
    assert hovered, tip
    # the hovered span is in the first spec's chart: its line is that kernel's emitted line, word for word
    first = Path(PAGES[name][0].format(tmp=page.parent))
    emitted = render_source(make_plan(load_spec(first if first.is_absolute() else ROOT / first))).splitlines()
    assert emitted[int(hovered.group(1)) - 1].strip() == hovered.group(2).strip()
    assert "tile 0" in tip and "cycles" in tip


@pytest.mark.parametrize("name", list(PAGES))
def test_screenshot_is_not_blank_and_documents_the_chart(pages, name, tmp_path):
    page, height = pages[name]
    shot = tmp_path / f"{name}.png"
    run_chromium(f"--window-size=1220,{height}", f"--screenshot={shot}", page.as_uri())
    pixels = decode_png(shot.read_bytes()).astype(np.float64)
    assert pixels.shape[:2] == (height, 1220)
    assert pixels.var() > 500, pixels.var()  # a blank or single-colour page is ~0
    colours = {tuple(c) for c in pixels[::4, ::4].reshape(-1, 3).astype(int)}
    assert len(colours) > 20
    if os.environ.get(UPDATE_SCREENSHOTS) == "1":  # only when asked: a test run leaves the working tree alone
        update_doc_image(shot, f"{name}.png")


def test_a_test_run_leaves_the_committed_screenshots_alone(pages, tmp_path, monkeypatch):
    """The screenshot test writes into DOCS only with ATTNGEN_UPDATE_SCREENSHOTS=1 (here DOCS is a copy
    whose default.png is another picture, so any copy into it would show)."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    other = (docs / "pingpong-off.png").read_bytes()
    (docs / "default.png").write_bytes(other)
    monkeypatch.setitem(globals(), "DOCS", docs)  # update_doc_image reads the module's DOCS
    monkeypatch.delenv(UPDATE_SCREENSHOTS, raising=False)
    (tmp_path / "run").mkdir()
    test_screenshot_is_not_blank_and_documents_the_chart(pages, "default", tmp_path / "run")
    assert (docs / "default.png").read_bytes() == other, "a test run rewrote a committed screenshot"
    monkeypatch.setenv(UPDATE_SCREENSHOTS, "1")  # asked: the differing picture is refreshed
    (tmp_path / "asked").mkdir()
    test_screenshot_is_not_blank_and_documents_the_chart(pages, "default", tmp_path / "asked")
    assert (docs / "default.png").read_bytes() != other
