"""Deep models: the step traced at 4 blocks and unrolled to the full depth
(`memplan.estimation.unroll`) is the step traced at the full depth."""

import pytest

from memplan import models
from memplan.estimation import estimate
from memplan.models.depth import with_layers
from memplan.parallel import Layout

CASES = [
    ("llama-2-7b", {"precision": "bf16-true"}, None),
    ("llama-2-7b", {"precision": "bf16-true", "checkpointing": "full"}, None),
    ("gpt2", {"batch": 2, "precision": "32-true"}, None),
    ("mistral-7b", {"lora_rank": 4, "precision": "bf16-mixed"}, None),
    ("llama-2-7b", {"quant": "nf4", "lora_rank": 4, "precision": "bf16-true", "grad_accum": 2}, None),
    ("llama-2-7b", {"precision": "bf16-true", "checkpointing": "full"}, Layout(world_size=8, zero=3)),
    ("llama-2-7b", {"precision": "bf16-true"}, Layout(tp=2)),
    ("llama-2-7b", {"checkpointing": "selective-op", "precision": "32-true"}, Layout(world_size=4, zero=3, fsdp_param_dtype="bf16")),
    ("qwen3-30b-a3b", {"precision": "bf16-true", "routing": "worst"}, Layout(world_size=2, zero=3, ep=2)),
]


def _figures(result):
    return [(r.peak_allocated_bytes, r.peak_reserved_bytes, r.device_used_bytes, r.breakdown, r.peak_phase,
             r.host.peak_bytes) for r in result.per_rank]


@pytest.mark.parametrize(("family", "options", "layout"), CASES)
def test_the_unrolled_step_has_the_figures_of_the_step_traced_at_full_depth(family, options, layout):
    config = with_layers(models.tiny_config(family), 7)
    setup = models.TrainingSetup(seq=64, **options)
    fast = estimate(config, setup, layout, gpu="a100-80gb")
    full = estimate(config, setup, layout, gpu="a100-80gb", extrapolate=False)
    assert fast.method == "extrapolated" and full.method == "full"
    assert _figures(fast) == _figures(full)
    assert fast.parameters == full.parameters


def test_shallow_models_are_traced_at_full_depth():
    result = estimate(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", seq=32), gpu="t4")
    assert result.method == "full"


def test_unrolled_pipeline_tensor_parallel_stages_have_the_figures_of_their_full_depth_traces():
    # 6 blocks per stage: traced at 4 blocks per stage, unrolled to 6
    config = with_layers(models.tiny_config("llama-2-7b"), 12)
    setup = models.TrainingSetup(seq=64, precision="bf16-true")
    layout = Layout(pp=2, tp=2, microbatches=3)
    fast = estimate(config, setup, layout, gpu="a100-80gb")
    full = estimate(config, setup, layout, gpu="a100-80gb", extrapolate=False)
    assert fast.method == "extrapolated" and full.method == "full" and fast.parallel == "traced"
    assert _figures(fast) == _figures(full)
