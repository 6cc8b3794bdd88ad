"""`memplan report`: figures present and visible in a real browser, offline, refused mismatches."""

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
from memplan.trace import save

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=64, checkpointing="full")
    trace = capture_model(models.tiny_config("llama-2-7b"), setup, fake=True, device="cuda")
    path = d / "step.memtrace"
    save(trace, path)
    plan_path = d / "plan.json"
    assert main(["plan", str(path), "-o", str(plan_path)]) == 0
    other = capture_model(models.tiny_config("gpt2"), setup, fake=True, device="cuda")
    other_path = d / "other.memtrace"
    save(other, other_path)
    return d, path, plan_path, other_path


def test_report_writes_an_index_and_one_png_per_figure(traced):
    d, trace, plan, _ = traced
    index = build_report([trace, plan], d / "out")
    page = index.read_text()
    pngs = sorted(p.name for p in index.parent.glob("*.png"))
    assert len(pngs) == 3
    for name in pngs:
        assert f'src="{name}"' in page
    assert page.count("<figcaption>") == 3
    assert "http://" not in page and "https://" not in page
    assert re.findall(r"<script src=\"([^\"]+)\"", page) == ["timeline.js"]  # memplan's own, beside the page


def test_a_plan_for_another_trace_is_refused_before_anything_is_written(traced, tmp_path):
    _, _, plan, other = traced
    out = tmp_path / "out"
    with pytest.raises(UserError, match="does not belong"):
        build_report([other, plan], out)
    assert not out.exists()


def test_report_cli_bad_input_is_exit_2(traced, tmp_path, capsys):
    _, _, plan, other = traced
    assert main(["report", str(other), str(plan), "-o", str(tmp_path / "o")]) == 2
    assert "does not belong" in capsys.readouterr().err


def test_estimate_reorder_and_offload_json_get_their_figures(traced, tmp_path):
    d, trace, _, _ = traced
    est = tmp_path / "est.json"
    est.write_text(json.dumps({
        "model": "toy", "capacity_bytes": 8 << 30,
        "per_rank": [{"rank": r, "peak_allocated_bytes": 5 << 30, "peak_reserved_bytes": 6 << 30,
                      "device_used_bytes": 6 << 30, "peak_phase": "backward",
                      "breakdown": {"parameter": 1 << 30, "activation": 4 << 30}} for r in range(2)],
    }))
    reo = tmp_path / "reo.json"
    reo.write_text(json.dumps({"baseline_peak_bytes": 10 << 30, "inductor_peak_bytes": 9 << 30,
                               "optimized_peak_bytes": 8 << 30, "lower_bound_bytes": None}))
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"ideal_step_s": 1.0, "planned_step_s": 1.2, "throughput_vs_ideal": 0.83,
                               "baselines": {"zero-infinity": {"throughput_vs_ideal": 0.5}}}))
    index = build_report([trace, est, reo, off], tmp_path / "out")
    assert len(list(index.parent.glob("*.png"))) == 6


def test_report_renders_in_headless_chromium_offline_with_every_figure_visible(traced):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    d, trace, plan, _ = traced
    index = build_report([trace, plan], d / "browser")
    errors, requests = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(index.as_uri())
        page.wait_for_load_state("load")
        sizes = page.eval_on_selector_all(
            "img", "els => els.map(e => [e.complete, e.naturalWidth, e.naturalHeight, "
            "e.getBoundingClientRect().width, e.getBoundingClientRect().height])"
        )
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert len(sizes) == 3
    for complete, nw, nh, w, h in sizes:
        assert complete and nw > 100 and nh > 100 and w > 100 and h > 50
    assert errors == []
    assert all(url.startswith("file://") for url in requests), requests
