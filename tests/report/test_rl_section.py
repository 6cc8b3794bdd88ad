"""`memplan report` draws `memplan rl --json` as a shaded phase timeline with its table."""

import json

from memplan.report import build_report

GIB = 1 << 30


def test_an_rl_estimate_gets_a_phase_timeline_and_a_table(tmp_path):
    phases = [{"name": name, "device_used_bytes": used * GIB, "fails": None,
               "by_allocator": {"torch": (used - 1) * GIB, "cumem": 0, "outside": GIB}}
              for name, used in (("engine start (step 1)", 30), ("rollout (vLLM generate)", 60),
                                 ("training step", 70))]
    doc = {"model": "qwen2.5-7b", "algo": "grpo", "trainer": "trl", "phases": phases, "peak_phase": "training step",
           "peak_bytes": 70 * GIB, "fits": True, "capacity_bytes": 80 * GIB, "usable_bytes": 76 * GIB}
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(doc))
    page = build_report([path], tmp_path / "out")
    text = page.read_text()
    assert "RL step: grpo on trl" in text and "rollout (vLLM generate)" in text
    assert (tmp_path / "out" / "rl0_phases.png").stat().st_size > 0
