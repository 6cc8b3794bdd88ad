"""The report's interactive timeline: self-contained, carries what hover shows, draws and
answers hover in a real browser offline."""

import json
import re
import shutil
from pathlib import Path

import pytest

from memplan import models
from memplan.capture import capture_model
from memplan.cli import main
from memplan.errors import UserError
from memplan.report import build_report
from memplan.report.timeline import drawn_buffers, sample_events, timeline_data
from memplan.trace import save
from memplan.trace.model import CATEGORIES

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOVER_FIELDS = ("name", "category", "module", "op", "nbytes", "size", "alloc", "free", "phase", "addr", "plan")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    config, setup = models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32)
    estimated = d / "estimated.memtrace"
    save(capture_model(config, setup, fake=True, device="cuda"), estimated)
    measured = d / "measured.memtrace"
    save(capture_model(config, setup, fake=False, device="cpu"), measured)
    plan = d / "plan.json"
    assert main(["plan", str(estimated), "-o", str(plan)]) == 0
    return d, estimated, measured, plan


def embedded(index):
    return [json.loads(m.replace("<\\/", "</")) for m in
            re.findall(r'<script type="application/json" id="timeline\d+">(.*?)</script>', index.read_text())]


def test_the_page_is_self_contained_and_carries_every_field_hover_shows(steps):
    d, estimated, measured, plan = steps
    out = d / "out"
    assert main(["report", str(estimated), str(plan), "--compare", str(measured), "-o", str(out)]) == 0
    page = (out / "index.html").read_text()
    script = (out / "timeline.js").read_text()
    for text in (page, script):
        assert not re.search(r"https?://", text)
    assert re.findall(r'<script src="([^"]+)"', page) == ["timeline.js"]
    (data,) = embedded(out / "index.html")
    blocks = data["blocks"]
    n = len(blocks["id"])
    assert n == data["buffers"] > 0
    for field in HOVER_FIELDS:
        assert len(blocks[field]) == n, field
    names = {data["strings"][i] for i in blocks["name"]}
    assert any(name.startswith("grad.") for name in names)
    assert any(data["strings"][i] for i in blocks["module"]) and any(data["strings"][i] for i in blocks["op"])
    assert data["categories"] == list(CATEGORIES)
    assert all(a < f for a, f in zip(blocks["alloc"], blocks["free"], strict=True))
    assert any(p >= 0 for p in blocks["plan"]) and data["arena_bytes"] > 0
    assert len(data["segments"]["start"]) > 0
    (overlay,) = data["overlays"]
    assert overlay["label"].startswith("measured:") and data["label"].startswith("estimated:")
    assert overlay["peak"] == max(overlay["bytes"])


def test_compare_refuses_what_is_not_a_trace(steps, tmp_path):
    _, estimated, _, _ = steps
    result = tmp_path / "reorder.json"
    result.write_text(json.dumps({"baseline_peak_bytes": 1, "optimized_peak_bytes": 1}))
    with pytest.raises(UserError, match="--compare takes traces"):
        build_report([estimated], tmp_path / "o", compare=[result])
    assert not (tmp_path / "o").exists()


def test_a_large_trace_stays_compact_and_keeps_its_peak(steps):
    from memplan.trace import load

    _, estimated, _, _ = steps
    trace = load(estimated)
    ids = drawn_buffers(trace, max_blocks=20)
    assert len(ids) == 20
    sizes = trace.buffers["nbytes"]
    assert sizes[ids].min() >= sorted(sizes, reverse=True)[19]
    total = trace.live_bytes()
    picked = sample_events(total, max_samples=16)
    assert len(picked) == 16 and total[picked].max() == total.max()
    data = timeline_data(trace, "step", max_blocks=20)
    assert len(data["blocks"]["id"]) == 20 and data["small"]["count"] == data["buffers"] - 20
    assert max(d + sum(c[k] for c in data["small"]["by_category"])
               for k, d in enumerate(data["small"]["drawn"])) == data["peak"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is missing (make test installs it)")
def test_the_timeline_draws_and_hover_names_the_tensor_in_headless_chromium(steps):
    from playwright.sync_api import sync_playwright

    d, estimated, measured, plan = steps
    index = build_report([estimated, plan], d / "browser", compare=[measured])
    errors, requests = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(index.as_uri())
        page.wait_for_load_state("load")
        canvases = page.locator(".mp-timeline canvas")
        assert canvases.count() == 3
        canvases.nth(0).scroll_into_view_if_needed()
        box = canvases.nth(0).bounding_box()
        # the bottom of the stack at the end of the step: the first parameter, alive throughout
        page.mouse.move(box["x"] + box["width"] - 12, box["y"] + box["height"] - 24)
        tip = page.locator(".mp-tip")
        assert tip.is_visible()
        text = tip.inner_text()
        # near the top of the caching allocator's panel at the end of the step: inside the last segment,
        # a quarter of the axis above its highest block (at 35% of the height the point sat on a block's
        # edge, and a page laid out a fraction of a pixel lower hovered the block)
        canvases.nth(1).scroll_into_view_if_needed()
        box = canvases.nth(1).bounding_box()
        page.mouse.move(box["x"] + box["width"] - 12, box["y"] + 0.15 * box["height"])
        segment = tip.inner_text() if tip.is_visible() else ""
        page.mouse.wheel(0, -400)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".mp-timeline").screenshot(path=str(ARTIFACTS / "timeline.png"))
        browser.close()
    assert errors == []
    assert all(url.startswith("file://") for url in requests), requests
    assert segment.startswith("segment of") and "cudaMalloc:" in segment, segment
    for field in ("category:", "module:", "made by:", "size:", "lifetime:", "planned offset:"):
        assert field in text, text
