"""The HTML report: content, escaping, SVG geometry, and what Chromium actually paints."""

from __future__ import annotations

import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from html.parser import HTMLParser
from typing import Any

import numpy as np
import pytest
from png import read_png

from verified_ckpt.report import render_html

SHADE, ROLLBACK, GREEN, RED = (244, 166, 166), (106, 27, 154), (46, 157, 74), (214, 39, 40)
RECOVERED, HEADLINE_OK = (0, 131, 143), (27, 94, 32)


def realistic(**overrides: Any) -> dict[str, Any]:
    """100 steps; replicas disagree at 60-63; the incident is flagged from 56, still open; roll back to 50."""
    steps = list(range(100))
    data: dict[str, Any] = {
        "run": "s3://bucket/runs/llama-7b",
        "generated_at": "2025-11-29T19:30:00+00:00",
        "steps": {
            "step": steps,
            "loss": [2.5 * math.exp(-s / 30) + 0.3 + (0.8 if 60 <= s <= 63 else 0.0) for s in steps],
            "agree": [not 60 <= s <= 63 for s in steps],
        },
        "consensus": [{"step": s, "unanimous": s < 60, "suspects": [] if s < 60 else [2]} for s in range(0, 100, 15)],
        "checkpoints": [
            {"id": f"ckpt-{s:06d}", "step": s, "status": "restorable" if s <= 50 else "suspect"}
            for s in range(10, 100, 10)
        ],
        "incidents": [
            {"kind": "replica-divergence", "from_step": 56, "to_step": None, "detected_step": 63, "ranks": [2],
             "hosts": ["node-07"], "detail": "gradient fingerprint of rank 2 differs", "answered": False}
        ],
        "rollback_target": {"id": "ckpt-000050", "step": 50},
        "exclude_hosts": ["node-07"],
    }
    data.update(overrides)
    return data


class _Elements(HTMLParser):
    """Start tags in document order, which for SVG is also paint order."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))

    def index(self, testid: str) -> int:
        hits = [n for n, (_, attrs) in enumerate(self.found) if attrs.get("data-testid") == testid]
        assert len(hits) == 1, f"{testid}: {len(hits)} elements"
        return hits[0]

    def attrs(self, testid: str) -> dict[str, str | None]:
        return self.found[self.index(testid)][1]


def _num(attrs: dict[str, str | None], name: str) -> float:
    value = attrs.get(name)
    assert value is not None, name
    return float(value)


def test_hostile_strings_are_escaped():
    data = realistic(run="<script>alert(1)</script>", exclude_hosts=["<img src=x onerror=alert(2)>"])
    data["checkpoints"][0]["id"] = 'c"1<b>'
    data["incidents"][0].update(kind="<i>k</i>", hosts=["h&<u>"], detail="</td><script>alert(3)</script>")
    page = render_html(data)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "&lt;/td&gt;&lt;script&gt;alert(3)&lt;/script&gt;" in page
    assert "h&amp;&lt;u&gt;" in page and "&lt;i&gt;k&lt;/i&gt;" in page
    assert 'data-testid="checkpoint-c&quot;1&lt;b&gt;"' in page
    for raw in ("<script", "<img", "<b>", "<i>", "<u>", "alert(1)</"):
        assert raw not in page


def test_page_shows_run_checkpoints_incident_rollback_and_hosts():
    data = realistic(exclude_hosts=["node-07", "node-11"])
    data["incidents"].append(dict(data["incidents"][0], from_step=20, to_step=23, detected_step=25, answered=True))
    page = render_html(data)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "s3://bucket/runs/llama-7b" in page and "2025-11-29T19:30:00+00:00" in page
    verdict = re.search(r'data-testid="verdict">([^<]*)<', page)
    assert verdict and verdict.group(1) == "2 incidents (1 unanswered); roll back to ckpt-000050 (step 50)"
    elements = _Elements(page)
    for c in data["checkpoints"]:
        assert elements.attrs(f"checkpoint-{c['id']}")["data-step"] == str(c["step"])
        assert f'<tr data-testid="checkpoint-row-{c["id"]}"><td>{c["id"]}</td><td>{c["step"]}</td>' in page
    assert "<td>56\u2013open</td><td>63</td>" in page and "<td>20\u201323</td><td>25</td>" in page
    assert ">yes<" in page and ">no<" in page
    assert elements.attrs("rollback-marker")["data-step"] == "50" and "rollback target ckpt-000050" in page
    hosts = re.search(r'data-testid="exclude-hosts">(.*?)</ul>', page)
    assert hosts and hosts.group(1) == "<li>node-07</li><li>node-11</li>"


def test_verdict_without_incidents():
    page = render_html(realistic(incidents=[], rollback_target=None))
    assert 'data-testid="verdict">no incidents<' in page
    assert 'data-testid="incident-0"' not in page and 'data-testid="rollback-marker"' not in page


def test_page_references_nothing_outside_itself():
    page = render_html(realistic())
    for banned in ("http://", "https://", "<script", "@import", "url(", "href", "<img", "<link", "<iframe"):
        assert banned not in page.lower(), banned
    assert not re.search(r"\bsrc\s*=", page)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_incident_shading_spans_its_steps_on_the_axis_and_sits_behind_everything():
    page = render_html(realistic())
    elements = _Elements(page)
    ticks: dict[int, float] = {}
    for n, (tag, attrs) in enumerate(elements.found):
        if tag == "g" and attrs.get("class") == "tick":
            ticks[int(attrs["data-step"] or "")] = _num(elements.found[n + 1][1], "x1")
    assert sorted(ticks) == list(range(0, 100, 10))
    per_step = (ticks[90] - ticks[0]) / 90
    assert all(abs(x - (ticks[0] + s * per_step)) < 0.02 for s, x in ticks.items())  # a linear axis

    def at(step: float) -> float:
        return ticks[0] + step * per_step

    shade = elements.attrs("incident-0")
    left, right = _num(shade, "x"), _num(shade, "x") + _num(shade, "width")
    # Each step owns one slot centred on its tick: [56, last step 99] covers 55.5 .. 99.5.
    assert abs(left - at(55.5)) < 0.02 and abs(right - at(99.5)) < 0.02
    assert shade["fill"] == "#f4a6a6" and not any("opacity" in name for name in shade)  # opaque, exact colour
    ckpt = {s: _num(elements.attrs(f"checkpoint-ckpt-{s:06d}"), "cx") for s in range(10, 100, 10)}
    assert ckpt[50] < left < ckpt[60] < ckpt[90] < right
    line = elements.found[elements.index("rollback-marker") + 1:]
    rollback = next(a for t, a in line if t == "line")
    assert rollback["stroke"] == "#6a1b9a" and rollback["stroke-width"] == "3"
    assert abs(_num(rollback, "x1") - at(50)) <= 0.5 + 1e-9 and _num(rollback, "x1") == _num(rollback, "x2")
    assert _num(rollback, "y1") <= _num(shade, "y") and _num(rollback, "y2") >= _num(shade, "y") + _num(shade, "height")
    red = [a for t, a in elements.found if t == "rect" and a.get("class") == "agree-disagree"]
    assert [a["data-steps"] for a in red] == ["60-63"] and abs(_num(red[0], "x") - at(59.5)) < 0.02
    # Paint order: shading before every data mark, rollback line after all of them.
    marks = [n for n, (t, a) in enumerate(elements.found)
             if str(a.get("class")).startswith(("loss", "agree", "vote", "detected"))
             or (t == "circle" and str(a.get("data-testid")).startswith("checkpoint-"))]
    assert len(marks) == 1 + 3 + 7 + 1 + 9
    assert elements.index("incident-0") < min(marks) and elements.index("rollback-marker") > max(marks)


@pytest.mark.parametrize(
    "case",
    ["no steps", "one step", "all losses unknown", "constant loss", "gaps and nan", "closed incident", "nothing"],
)
def test_edge_cases_render(case):
    data = realistic()
    if case == "no steps":
        data["steps"] = {"step": [], "loss": [], "agree": []}
    elif case == "one step":
        data = realistic(steps={"step": [7], "loss": [1.0], "agree": [False]}, consensus=[], checkpoints=[],
                         incidents=[], rollback_target=None)
    elif case == "all losses unknown":
        data["steps"]["loss"] = [None] * 50 + [float("nan")] * 50
    elif case == "constant loss":
        data["steps"]["loss"] = [0.5] * 100
    elif case == "gaps and nan":
        data["steps"]["loss"][10:12] = [None, float("nan")]
        data["steps"]["loss"][14] = float("inf")
    elif case == "closed incident":
        data["incidents"][0]["to_step"] = 70
    elif case == "nothing":
        data = {"run": "r", "generated_at": "t", "steps": {"step": [], "loss": [], "agree": []}, "consensus": [],
                "checkpoints": [], "incidents": [], "rollback_target": None, "exclude_hosts": []}
    page = render_html(data)
    elements = _Elements(page)
    polylines = [a for t, a in elements.found if t == "polyline"]
    if case == "nothing":
        assert 'data-testid="no-history">no history recorded<' in page and "<svg" not in page
        return
    svg = elements.attrs("timeline")
    assert svg["width"] == "1100" and "no history recorded" not in page
    if case == "no steps":  # the axis comes from checkpoint, incident and rollback steps
        assert (svg["data-step-lo"], svg["data-step-hi"]) == ("0", "90") and not polylines
        assert "loss not recorded" in page and _num(elements.attrs("incident-0"), "width") > 0
    elif case == "one step":
        assert (svg["data-step-lo"], svg["data-step-hi"]) == ("7", "7") and 'data-step="7"' in page
        red = [a["data-steps"] for t, a in elements.found if t == "rect" and a.get("class") == "agree-disagree"]
        assert red == ["7-7"]
    elif case == "all losses unknown":
        assert "loss not recorded" in page and not polylines
    elif case == "constant loss":
        ys = {p.split(",")[1] for p in (polylines[0]["points"] or "").split()}
        assert len(polylines) == 1 and len(ys) == 1
    elif case == "gaps and nan":  # unknown values split the line rather than bridging it
        points = [p for a in polylines for p in (a["points"] or "").split()]
        assert len(polylines) == 3 and len(points) == 97
        assert all(math.isfinite(float(v)) for p in points for v in p.split(","))
    elif case == "closed incident":
        assert elements.attrs("incident-0")["data-to"] == "70" and "56\u201370" in page


# A straightforward, byte-at-a-time PNG encoder straight from the specification: independent of the
# decoder's vectorised tricks, so a round trip through both checks the decoder.
def _filtered(img: np.ndarray, filters: list[int]) -> bytes:
    h, w, c = img.shape
    prev, body = [0] * (w * c), bytearray()
    for row, kind in zip(img.reshape(h, w * c).astype(int).tolist(), filters):
        body.append(kind)
        for i, value in enumerate(row):
            a, b, ul = (row[i - c] if i >= c else 0), prev[i], (prev[i - c] if i >= c else 0)
            p = a + b - ul
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - ul)
            paeth = a if pa <= pb and pa <= pc else b if pb <= pc else ul
            body.append((value - [0, a, b, (a + b) // 2, paeth][kind]) % 256)
        prev = row
    return bytes(body)


def _png(header: tuple[int, ...], filtered: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", *header))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IDAT", zlib.compress(filtered)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("levels", [(0, 256), (0, 2, 255)])  # few levels make Paeth's tie-breaks matter
@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (11, 19)])
@pytest.mark.parametrize("pattern", ["none", "sub", "up", "average", "paeth", "mixed", "sub-up-none"])
def test_png_decoder_round_trips_every_filter(tmp_path, channels, shape, pattern, levels):
    rng = np.random.default_rng(zlib.crc32(f"{channels}{shape}{pattern}{levels}".encode()))
    if len(levels) == 2:
        img = rng.integers(*levels, (*shape, channels), dtype=np.uint8)
    else:
        img = rng.choice(np.array(levels, np.uint8), (*shape, channels))
    rows = range(shape[0])
    if pattern == "mixed":
        filters = [r % 5 for r in rows]
    elif pattern == "sub-up-none":  # the row-by-row path; any Average or Paeth row takes the diagonal one
        filters = [(r + 1) % 3 for r in rows]
    else:
        filters = [["none", "sub", "up", "average", "paeth"].index(pattern)] * shape[0]
    path = tmp_path / "x.png"
    path.write_bytes(_png((shape[1], shape[0], 8, {3: 2, 4: 6}[channels], 0, 0, 0), _filtered(img, filters)))
    out = read_png(path)
    assert out.dtype == np.uint8 and out.shape == img.shape
    np.testing.assert_array_equal(out, img)


@pytest.mark.parametrize(
    "problem", ["signature", "16-bit", "palette", "interlaced", "crc", "truncated", "filter 5", "no IEND"]
)
def test_png_decoder_rejects_what_it_does_not_support(tmp_path, problem):
    filtered = _filtered(np.zeros((4, 5, 3), np.uint8), [0] * 4)
    header = {"16-bit": (5, 4, 16, 2, 0, 0, 0), "palette": (5, 4, 8, 3, 0, 0, 0), "interlaced": (5, 4, 8, 2, 0, 0, 1)}
    if problem == "filter 5":
        filtered = b"\x05" + filtered[1:]
    blob = _png(header.get(problem, (5, 4, 8, 2, 0, 0, 0)), filtered)
    if problem == "signature":
        blob = b"GIF89a" + blob[6:]
    elif problem == "crc":
        blob = blob[:20] + bytes([blob[20] ^ 1]) + blob[21:]
    elif problem == "truncated":
        blob = blob[:-20]
    elif problem == "no IEND":
        blob = blob[:-12]
    path = tmp_path / "x.png"
    path.write_bytes(blob)
    with pytest.raises(ValueError):
        read_png(path)


def shoot(tmp_path, data: dict[str, Any]) -> np.ndarray:
    """The report of ``data`` as headless Chromium paints it (RGB, 1000 x 1300)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("VCKPT_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not installed, and VCKPT_REQUIRE_CHROMIUM=1 forbids skipping")
        pytest.skip("chromium not installed (apt-get install chromium); VCKPT_REQUIRE_CHROMIUM=1 makes this fail")
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    page.write_text(render_html(data), encoding="utf-8")
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,1000",
        # Pin scale and colour profile so a pixel of #f4a6a6 reads back as exactly (244, 166, 166).
        "--force-device-scale-factor=1", "--force-color-profile=srgb",
        f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run", f"--screenshot={shot}", page.as_uri(),
    ]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert shot.exists(), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    img = read_png(shot)[:, :, :3]
    assert img.shape[:2] == (1000, 1300), f"{img.shape} after {time.monotonic() - started:.1f}s"
    return img


@pytest.mark.timeout(120)
def test_chromium_paints_the_incident_band_right_of_the_rollback_marker(tmp_path):
    img = shoot(tmp_path, realistic())

    def where(rgb: tuple[int, int, int]) -> np.ndarray:
        return np.all(img == np.array(rgb, np.uint8), axis=2)

    def longest_run(line: np.ndarray) -> tuple[int, int]:
        edges = np.diff(np.concatenate([[0], line.astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            return 0, 0
        k = int(np.argmax(ends - starts))
        return int(ends[k] - starts[k]), int(starts[k])

    purple = where(ROLLBACK)
    runs = {x: longest_run(purple[:, x]) for x in np.flatnonzero(purple.any(axis=0))}
    assert runs, "no rollback-marker pixels"
    marker_x = max(runs, key=lambda x: runs[x][0])
    height, top = runs[marker_x]
    assert height >= 100, f"rollback marker only {height}px tall"

    band = where(SHADE)[top : top + height]  # the plot's rows; the legend swatch lies below them
    columns, rows = np.flatnonzero(band.any(axis=0)), np.flatnonzero(band.any(axis=1))
    assert band.sum() >= 500 and len(columns) and len(rows), f"{band.sum()} shading pixels in the plot"
    assert max(longest_run(r)[0] for r in band) >= 100 and len(rows) >= 0.8 * height  # a full-height band
    assert marker_x < columns.min(), f"rollback marker at x={marker_x}, shading starts at x={columns.min()}"
    assert columns.min() - marker_x > 20  # steps 50 and 56 are ~55px apart at this width

    green = where(GREEN)[top : top + height]
    assert max(longest_run(r)[0] for r in green) >= 200, "no agreement strip"
    red = np.flatnonzero(where(RED)[top : top + height].any(axis=0))
    assert len(red) and red.min() >= columns.min(), "disagreement should lie inside the incident band"


def recovered() -> dict[str, Any]:
    """The realistic run after its recovery: the incident answered by a rollback to step 50, training went on."""
    data = realistic(exclude_hosts=[], recovery={"detected_step": 63, "rolled_back_to": 50},
                     rollback_target={"id": "ckpt-000090", "step": 90})
    data["incidents"][0]["answered"] = True
    return data


def test_a_recovered_run_says_so_in_its_headline_and_draws_the_rollback():
    page = render_html(recovered())
    verdict = re.search(r'<p class="verdict ok" data-testid="verdict">([^<]*)</p>', page)
    assert verdict and "recovered at step 63 (rolled back to step 50)" in verdict.group(1)
    assert "roll back to" not in verdict.group(1)
    drawn = _Elements(page).attrs("rollback-drawn")
    assert (drawn["data-from"], drawn["data-to"]) == ("63", "50")
    assert '<li class="empty">none</li>' in page  # no host to exclude once the incident is answered
    assert 'class="verdict bad"' in render_html(realistic())  # still open: the call to act stays red


@pytest.mark.timeout(120)
def test_chromium_paints_the_recovered_headline_and_the_rollback_jump_from_the_detection_back_to_the_target(tmp_path):
    img = shoot(tmp_path, recovered())
    teal = np.all(img == np.array(RECOVERED, np.uint8), axis=2)
    ys, xs = np.flatnonzero(teal.any(axis=1)), np.flatnonzero(teal.any(axis=0))
    assert teal.sum() >= 150, f"{teal.sum()} pixels of the drawn rollback"
    # The jump spans the steps 50..63 of the timeline (about 10 px per step at this width), above the loss.
    plot = teal[:, 60:1100]
    span = np.flatnonzero(plot.any(axis=0))
    assert span.max() - span.min() >= 100, (span.min(), span.max())
    green_text = np.all(img == np.array(HEADLINE_OK, np.uint8), axis=2)[:140]
    assert green_text.sum() >= 30 and ys.min() > 0 and len(xs)  # the headline in the "recovered" colour


def single_replica() -> dict[str, Any]:
    """The report data of a one-rank run, built from the rows its guard writes (nothing is ever compared)."""
    from test_history import single_replica_events

    from verified_ckpt.history import Columns, report_data

    return report_data("/runs/solo", "t", Columns.of(single_replica_events(40)),
                       [{"id": "ckpt-40", "step": 40, "status": "unverified"}], [], [], None)


def test_a_single_replica_run_draws_no_agreement_and_says_no_consensus_was_possible():
    page = render_html(single_replica())
    bands = [a for t, a in _Elements(page).found if t == "rect" and str(a.get("class")).startswith("agree-")]
    assert [(a["class"], a["data-steps"]) for a in bands] == [("agree-uncompared", "1-40")]  # checked, not compared
    assert 'data-testid="not-compared"' in page and "single replica: no consensus possible</text>" in page
    checked = re.search(r'data-testid="checked">([^<]*)<', page)
    assert checked and checked.group(1) == ("checks: 40 step(s) checked, 0 of them compared across ranks; 0 consensus "
                                            "vote(s), 0 audit(s); single replica: no consensus possible")


@pytest.mark.timeout(120)
def test_chromium_paints_no_agreement_band_for_a_single_replica(tmp_path):
    img = shoot(tmp_path, single_replica())
    green = int(np.all(img == np.array(GREEN, np.uint8), axis=2).sum())
    grey = int(np.all(img == np.array((0xCF, 0xD8, 0xDC), np.uint8), axis=2).sum())
    # Only the legend's square and dot of that green (152 pixels); a 40-step band of it would be ~16,000.
    assert green <= 200, f"{green} green pixels: more than the legend's swatches"
    assert grey >= 10_000, f"{grey} pixels of the checked-not-compared band"


def test_every_legend_entry_lies_inside_the_picture():
    from verified_ckpt.report import LEGEND

    page = render_html(realistic())
    height = _num(_Elements(page).attrs("timeline"), "height")
    for _, _, label in LEGEND:
        found = re.search(rf'<text x="[\d.]+" y="([\d.]+)">{re.escape(label)}</text>', page)
        assert found and float(found.group(1)) + 4 <= height, (label, found and found.group(1), height)


def test_no_ledger_says_nothing_was_checked():
    from verified_ckpt.history import report_data

    page = render_html(report_data("/runs/plain", "t", None, [{"id": "c1", "step": 1, "status": "unverified"}], [], [],
                                   None))
    assert "checks: none recorded (the run has no ledger" in page and "agree-" not in page


@pytest.mark.timeout(120)
def test_the_report_of_a_real_single_replica_run_compares_nothing_and_says_so(tmp_path):
    from verified_ckpt import CheckpointManager

    run, root = str(tmp_path / "run"), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "examples/ddp_train.py", "--world-size", "1", "--steps", "10", "--save-every",
                           "5", "--run", run], cwd=root, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = CheckpointManager(run).history_report()
    assert data["steps"]["step"] == list(range(1, 11)) and data["steps"]["agree"] == [None] * 10
    assert data["checked"] == {"steps": 10, "compared": 0, "consensus": 0, "audits": 0, "ranks": 1}
    page = render_html(data)
    assert 'class="agree-agree"' not in page and "single replica: no consensus possible</text>" in page
