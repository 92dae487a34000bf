"""report.html in a real browser: headless Chromium renders it offline, the page is not blank, every figure decodes.

Skipped when no Chromium binary is found (`apt-get install chromium`; .ci/run installs it)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from autotune.report import write_search_report
from autotune.report.writer import FIGURE_NAMES
from tests.unit.test_report import LIMIT, make_profile, make_study

CHROMIUM = next(
    (path for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
     if (path := shutil.which(name))),
    None,
)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary; apt-get install chromium"),
]
WINDOW = (1280, 4000)
GOLD = (255, 215, 0)
"""The chosen config's star in the B/M and history figures."""


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("report")
    result = make_study(folder)
    write_search_report(result, spec=None, profile=make_profile(), config_path=None, report_dir=folder / "report",
                        memory_limit_bytes=LIMIT)
    return folder / "report" / "report.html"


def test_screenshot_is_a_rendered_report_not_a_blank_page(report, tmp_path):
    shot = tmp_path / "shot.png"
    run = chromium(tmp_path, f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}", report.as_uri())
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    with Image.open(shot) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
        colours = len(image.convert("RGB").getcolors(maxcolors=1 << 22) or [])
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    ink = (pixels.min(axis=2) < 245).mean()
    assert ink > 0.05, f"only {ink:.1%} of the page is not white"
    assert colours > 1000, f"only {colours} distinct colours: text alone, no figures?"
    gold = (np.abs(pixels - np.array(GOLD)).max(axis=2) < 10).sum()
    assert gold > 50, "the chosen config's gold star is not on the page: the B/M figure did not draw"


def test_every_figure_decodes_in_the_browser_at_its_size(report, tmp_path):
    html = report.read_text()
    expected = []
    for tag in re.findall(r"<img\b[^>]*>", html):
        src = re.search(r'src="data:image/png;base64,([^"]+)"', tag)
        assert src, f"not an inline PNG: {tag[:120]}"
        size = tuple(int(re.search(rf'{a}="(\d+)"', tag).group(1)) for a in ("width", "height"))
        with Image.open(io.BytesIO(base64.b64decode(src.group(1)))) as image:
            assert image.size == size
        expected.append([*size, True])
    assert len(expected) == len(FIGURE_NAMES) - 1  # all but the loss per step, drawn only when 2BW ran
    # A copy with a probe script (the report itself has none) writes what the browser decoded into the DOM.
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", (
        '<script>window.addEventListener("load", () => document.body.setAttribute("data-probe", JSON.stringify('
        "[...document.images].map(i => [i.naturalWidth, i.naturalHeight, i.complete]))));</script></body>"
    )))
    run = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r'data-probe="([^"]*)"', run.stdout)
    assert found, "the page never finished loading"
    assert json.loads(found.group(1).replace("&quot;", '"')) == expected
