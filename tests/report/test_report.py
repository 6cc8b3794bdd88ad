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


def _estimate_doc(*, fits: bool, margin: float | None) -> dict:
    doc = {"model": "toy", "gpu": "a10g", "capacity_bytes": 8 << 30, "device_used_bytes": 6 << 30, "fits": fits,
           "setup": {"batch": 2, "seq": 64, "dtype": "bf16", "autocast": "none", "checkpointing": "full"},
           "per_rank": [{"rank": 0, "peak_allocated_bytes": 5 << 30, "peak_reserved_bytes": 6 << 30,
                         "device_used_bytes": 6 << 30, "peak_phase": "backward", "breakdown": {}}]}
    if margin is not None:
        doc |= {"margin": margin, "usable_bytes": int((8 << 30) * (1 - margin))}
    return doc


def test_the_page_opens_with_the_verdict_its_capacity_and_margin(traced, tmp_path):
    est = tmp_path / "est.json"
    est.write_text(json.dumps(_estimate_doc(fits=True, margin=0.05)))
    page = build_report([est], tmp_path / "out").read_text()
    body = page[page.index("<body>"):]
    verdict = body.index('class="verdict"')
    assert verdict < body.index("<h2>")  # before the first section
    line = re.search(r'<div class="verdict"><p>([^<]*)</p>', body).group(1)
    assert line == ("Estimate (toy, batch 2 x seq 64, bf16, checkpointing full): fits on a10g: 6.00 GiB device "
                    "used of 7.60 GiB usable (8.00 GiB, 5% margin)")


def test_an_estimate_without_a_margin_says_so_in_its_verdict(tmp_path):
    from memplan.report import estimate_verdict

    assert estimate_verdict(_estimate_doc(fits=False, margin=None)).endswith("(8.00 GiB, no margin)")
    assert estimate_verdict({"per_rank": []}) is None


def test_an_offload_baseline_over_its_budget_is_drawn_as_infeasible_not_as_a_throughput(tmp_path, monkeypatch):
    from memplan.report import figures

    drawn = {}
    real = figures.bars

    def spy(values, ylabel, title, infeasible=frozenset()):
        drawn["values"], drawn["infeasible"] = dict(values), infeasible
        return real(values, ylabel, title, infeasible=infeasible)

    monkeypatch.setattr(figures, "bars", spy)
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"ideal_step_s": 1.0, "planned_step_s": 1.2, "throughput_vs_ideal": 0.83,
                               "feasible": True, "budget_bytes": 4 << 30,
                               "baselines": {"zero-offload": {"throughput_vs_ideal": 1.0, "feasible": False},
                                             "zero-infinity": {"throughput_vs_ideal": 0.5, "feasible": True}}}))
    page = build_report([off], tmp_path / "out").read_text()
    assert drawn["infeasible"] == frozenset({"zero-offload"})
    assert "Over the budget, so not drawn as a throughput: zero-offload." in page


def test_every_panel_names_the_step_it_shows(traced, tmp_path):
    _, trace, _, _ = traced
    reo = tmp_path / "reo.json"
    reo.write_text(json.dumps({"model": "gpt2", "setup": {"batch": 1, "seq": 128, "dtype": "bf16"},
                               "baseline_peak_bytes": 10 << 30, "inductor_peak_bytes": 9 << 30,
                               "optimized_peak_bytes": 8 << 30, "lower_bound_bytes": None}))
    page = build_report([trace, reo], tmp_path / "out").read_text()
    assert "Step: " in page and "batch 2 x seq 64, 32-true, checkpointing full" in page  # the trace's own setup
    assert "Step reordered: gpt2, batch 1 x seq 128, bf16." in page


def test_one_colour_per_category_in_the_figures_and_the_timeline(traced):
    from memplan.report.colors import CATEGORY_COLORS, PHASE_COLORS
    from memplan.report.timeline import timeline_data
    from memplan.trace import load
    from memplan.trace.model import CATEGORIES, PHASES

    _, path, _, _ = traced
    data = timeline_data(load(str(path)), "step")
    assert set(CATEGORY_COLORS) == set(CATEGORIES) and set(PHASE_COLORS) == set(PHASES)
    assert dict(zip(data["categories"], data["category_colors"])) == CATEGORY_COLORS
    assert dict(zip(data["phase_names"], data["phase_colors"])) == PHASE_COLORS
    script = (Path(__file__).resolve().parents[2] / "src/memplan/report/timeline.js").read_text()
    assert "#" not in "".join(line for line in script.splitlines() if "fillStyle = data." in line)


@pytest.fixture(scope="module")
def inference_json(tmp_path_factory):
    """`memplan serve --json` (vLLM, Llama-3.1-8B on an H100) and `memplan generate --json`
    (a tiny Llama, 16 + 4 tokens, on an H100 profile), as the CLI writes them."""
    d = tmp_path_factory.mktemp("inference")
    paths = {}
    for kind, argv in (("serve", ["serve", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-model-len", "8192"]),
                       ("generate", ["generate", "gpt2", "--input-len", "16", "--new-tokens", "4", "--gpu",
                                     "h100-80gb"])):
        out = d / f"{kind}.json"
        with open(out, "w") as fh, __import__("contextlib").redirect_stdout(fh):
            assert main([*argv, "--json"]) == 0
        paths[kind] = out
    return paths


def test_serve_and_generate_json_are_read_as_their_own_kinds(inference_json):
    from memplan.report import read_inputs

    inputs = read_inputs([inference_json["serve"], inference_json["generate"]])
    assert [n for n, _ in inputs.serves] == ["serve.json"] and [n for n, _ in inputs.generates] == ["generate.json"]
    assert not inputs.estimates


def test_the_kv_pool_panel_draws_the_budget_and_names_the_deployment(inference_json, tmp_path):
    index = build_report([inference_json["serve"]], tmp_path / "out")
    page = index.read_text()
    assert (tmp_path / "out" / "serve0_kv_pool.png").is_file()
    deployment = ("llama-3.1-8b on vLLM 0.11.0, h100-80gb, TP 1, max_model_len 8192, max_num_seqs 1024, "
                  "gpu_memory_utilization 0.9")
    line = re.search(r'<div class="verdict"><p>([^<]*)</p>', page).group(1)
    assert line.startswith(f"Serving ({deployment}): starts: KV pool ")
    doc = json.loads(inference_json["serve"].read_text())
    assert f"{doc['kv']['max_concurrency']:g} requests of max_model_len 8192 at once" in line
    assert f"Deployment: {deployment}." in page


def test_the_generation_panel_puts_the_kv_cache_apart_and_names_the_call_and_the_phase(inference_json, tmp_path):
    doc = json.loads(inference_json["generate"].read_text())
    index = build_report([inference_json["generate"]], tmp_path / "out")
    page = index.read_text()
    assert (tmp_path / "out" / "generate0_peak.png").is_file()
    line = re.search(r'<div class="verdict"><p>([^<]*)</p>', page).group(1)
    assert line.startswith("Generation (gpt2 generate(), batch 1, 16 + 4 tokens, dynamic cache, fp32): fits on "
                           "h100-80gb: ")
    assert line.endswith(f"peak in the {doc['peak_phase']}")
    assert "<td>kv cache</td>" in page


def test_a_server_that_does_not_start_says_so_with_the_engines_message():
    from memplan.report.inference import serving_verdict

    doc = {"starts": False, "refusal": "No available memory for the cache blocks."}
    assert serving_verdict(doc) == "does NOT start: No available memory for the cache blocks."
