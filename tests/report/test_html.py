"""The HTML page: self-contained, escaped, deterministic, and rendered by headless Chromium with
its three charts drawn, no console errors, and a non-trivial screenshot."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from functools import cache
from pathlib import Path

import pytest

from fuel.circuit import zoo
from fuel.circuit.policy import build_policy
from fuel.cost.devices import device
from fuel.report.build import build_report, device_info, rule_set_for
from fuel.report.html import render_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


@cache
def _doc(model: str = "smollm2-135m", device_name: str = "h100-sxm") -> dict:
    spec = device(device_name)
    return build_report(model, zoo.load(model), device_info(spec),
                        rule_set_for(spec.title, spec.kind.value), build_policy())


def test_page_loads_nothing_from_the_network():
    page = render_html(_doc())
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    # The only URL is the SVG namespace, which is an identifier, never fetched.
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    assert "default-src 'none'" in page


def test_page_has_three_charts_and_every_section():
    page = render_html(_doc())
    assert page.count('<svg class="chart"') == 3
    for heading in ("Roofline per case", "Step time by op", "Roofline of the plan's groups",
                    "Memory fit", "Coverage matrix", "Gaps and JIT requests", "Fused plans"):
        assert f"<h2>{heading}</h2>" in page


def test_report_text_is_escaped():
    doc = dict(_doc())
    doc["model"] = {**doc["model"], "name": "<script>alert(1)</script>"}
    page = render_html(doc)
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_same_document_renders_the_same_page():
    assert render_html(_doc()) == render_html(_doc())


def _png_pixels(path: Path) -> tuple[int, int, set[bytes]]:
    """Width, height and the distinct pixels of an 8-bit RGB/RGBA PNG (a minimal decoder)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    prev = bytearray(stride)
    pixels: set[bytes] = set()
    for y in range(height):
        row_start = y * (stride + 1)
        kind, line = raw[row_start], bytearray(raw[row_start + 1:row_start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, up_left = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                line[i] = (line[i] + pred) & 0xFF
        if y % 8 == 0:
            pixels.update(bytes(line[x:x + 3]) for x in range(0, stride, channels * 4))
        prev = line
    return width, height, pixels


# CI installs Debian's chromium (.ci/run), so there a missing browser is a failure, not a skip.
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian `chromium` is not installed here (CI installs it and runs this)")
def test_page_renders_in_headless_chromium_with_charts_and_no_console_errors(tmp_path):
    page = tmp_path / "plan.html"
    page.write_text(render_html(_doc()), encoding="utf-8")
    profile = tmp_path / "profile"
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
         "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    assert 'data-rendered="true"' in body and 'data-charts="3"' in body
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []

    shot = tmp_path / "plan.png"
    run = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
         "--window-size=1400,2400", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == (1400, 2400)
    # Text, tables and coloured charts: far from a blank page.
    assert len(pixels) > 50
