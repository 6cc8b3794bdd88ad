"""`memplan demo`: the main job runs end to end and leaves a report and its inputs."""

import json

from memplan.cli import main
from memplan.cli.demo import offload_rows, render_text
from memplan.units import format_bytes


def test_demo_writes_every_output_and_a_report(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for name in ("trace", "snapshot", "plan", "estimate", "reorder", "offload"):
        assert (out / doc["outputs"][name].split("/")[-1]).is_file(), name
    assert (out / "report" / "index.html").is_file()
    assert len(list((out / "report").glob("*.png"))) >= 6
    # the planned arena is the lower bound of this step; the caching allocator is not
    allocators = doc["allocators"]
    assert allocators["planned"]["peak_reserved_bytes"] <= allocators["ideal"]["peak_reserved_bytes"] * 1.01
    assert allocators["caching"]["peak_reserved_bytes"] > allocators["planned"]["peak_reserved_bytes"]
    assert abs(doc["real_cpu_check"]["error"]) < 0.005
    # the offload panel runs under a budget the step does not fit in, and the methods differ
    off = doc["offload"]
    assert off["budget_bytes"] < off["peak_device_bytes_without_offload"]
    rows = offload_rows(off)
    assert "budget" in rows[0][0] and format_bytes(off["budget_bytes"]) in rows[0][0]
    methods = dict(rows[1:])
    assert len(methods) >= 3 and len(set(methods.values())) >= 2, methods
    assert off["feasible"] and off["peak_device_bytes"] <= off["budget_bytes"]
    # and the answers stay readable at 80 columns
    monkeypatch.setenv("COLUMNS", "80")
    summary = {"peak_bytes": doc["peak_bytes"], "peak_phase": doc["peak_phase"]}
    text = render_text(summary, doc, {"report": out / "report"}, out)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "zero_infinity" in text and "over budget" in text
