"""`memplan.estimate(model, setup, layout, device=...)` is the Python API of the estimate."""

import memplan
import memplan.hardware.devices  # noqa: F401 - importing the package must not shadow the function
from memplan import models
from memplan.parallel import Layout


def test_memplan_estimate_is_a_function_taking_model_setup_layout_and_device():
    result = memplan.estimate(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", seq=32), Layout(world_size=2),
                              device="cpu", allocator="none")
    assert result.layout["world_size"] == 2
    assert result.peak_allocated_bytes > 0


def test_memplan_fit_is_the_fit_search():
    from memplan.estimation.fit import fit

    assert memplan.fit is fit


def test_gradients_kept_as_zeros_between_steps_are_in_the_peak():
    config = models.tiny_config("llama-2-7b")
    freed = memplan.estimate(config, models.TrainingSetup(precision="32-true", batch=2, seq=32), device="cpu", allocator="none").per_rank[0]
    kept = memplan.estimate(config, models.TrainingSetup(precision="32-true", batch=2, seq=32, zero_grad="zeros"), device="cpu",
                            allocator="none").per_rank[0]
    assert freed.breakdown["gradients"] == 0 and kept.breakdown["gradients"] == kept.breakdown["parameters"]


def test_a_cpu_job_holds_one_cpu_rng_state_per_checkpointed_block_and_the_op_level_policy_none():
    from memplan.capture.step import capture_step
    from memplan.estimation.pipeline import CPU_RNG_STATE_BYTES, checkpoint_rng_states

    config = models.tiny_config("llama-2-7b")
    for policy, count in (("full", config.num_hidden_layers), ("selective-op", 0), ("none", 0)):
        setup = models.TrainingSetup(precision="32-true", batch=1, seq=16, checkpointing=policy)
        step = capture_step(config, setup, "cpu")
        extras = checkpoint_rng_states(step.trace, step.blocks_path, setup)
        assert [x.nbytes for x in extras] == [CPU_RNG_STATE_BYTES] * count, policy
