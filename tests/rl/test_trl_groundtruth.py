"""`memplan rl --device cpu` against real TRL GRPOTrainer and DPOTrainer steps on a tiny
model, each phase's peak measured by torch.profiler (tests/support/trl_truth.py)."""

import pytest
import trl_truth

from memplan.models.registry import tiny_config
from memplan.models.setup import TrainingSetup
from memplan.rl import estimate_rl

pytestmark = pytest.mark.slow
P, C = 16, 8


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_config("qwen2.5-0.5b").save_pretrained(directory)
    return str(directory / "config.json")


@pytest.fixture(scope="module")
def grpo(config_path):
    measured = trl_truth.grpo_phases(tiny_config("qwen2.5-0.5b"), prompt_len=P, completion_len=C, batch=4,
                                     generations=4, beta=0.04)
    result = estimate_rl(config_path, "grpo", "trl", rollout="hf", prompt_len=P, completion_len=C,
                         num_generations=4, setup=TrainingSetup(batch=4, precision="32-true"), beta=0.04, device="cpu")
    return measured, {p.name: p.device_used_bytes for p in result.phases}


def test_grpo_reference_log_prob_phase_is_within_2_percent_of_trl(grpo):
    measured, predicted = grpo
    assert predicted["reference log-probs"] == pytest.approx(measured["reference log-probs"], rel=0.02)


def test_grpo_transformers_rollout_phase_is_within_2_percent_of_trl(grpo):
    measured, predicted = grpo
    assert predicted["rollout (transformers generate)"] == pytest.approx(measured["rollout"], rel=0.02)


def test_grpo_training_step_phase_is_within_2_percent_of_trl(grpo):
    measured, predicted = grpo
    assert predicted["training step"] == pytest.approx(measured["training step"], rel=0.02)


def test_dpo_training_step_with_the_reference_scored_inside_is_within_2_percent_of_trl(config_path):
    measured = trl_truth.dpo_phases(tiny_config("qwen2.5-0.5b"), prompt_len=P, completion_len=C, batch=2)
    result = estimate_rl(config_path, "dpo", "trl", rollout="hf", prompt_len=P, completion_len=C, num_generations=1,
                         setup=TrainingSetup(batch=2, precision="32-true"), device="cpu")
    predicted = {p.name: p.device_used_bytes for p in result.phases}
    assert predicted["training step"] == pytest.approx(measured["training step"], rel=0.02)
