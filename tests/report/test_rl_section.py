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


def test_an_rl_step_s_verdict_opens_the_page(tmp_path):
    from memplan.report import build_report

    doc = {"model": "qwen2.5-7b", "algo": "grpo", "trainer": "trl", "gpu": "h100-80gb", "capacity_bytes": 80 << 30,
           "margin": 0.05, "usable_bytes": 76 << 30, "fits": False, "failing_phase": "rollout",
           "over_by_bytes": 2 << 30, "peak_phase": "rollout", "peak_bytes": 78 << 30,
           "settings": {"setup": {"batch": 4, "seq": 1536, "dtype": "bf16"}},
           "phases": [{"name": "rollout", "device_used_bytes": 78 << 30, "needed_bytes": 78 << 30,
                       "by_allocator": {"torch": 40 << 30, "cumem": 36 << 30, "outside": 2 << 30}}]}
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(doc))
    page = build_report([path], tmp_path / "out").read_text()
    assert ("RL step (grpo on trl, qwen2.5-7b, batch 4 x seq 1536, bf16): does NOT fit on h100-80gb: rollout is "
            "over 76.0 GiB usable (80.0 GiB, 5% margin) by 2.00 GiB") in page
