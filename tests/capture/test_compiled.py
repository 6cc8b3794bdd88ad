"""torch.compile'd training steps (`TrainingSetup.compile`): real CPU steps against
torch.profiler, the recorder on the real compiled code, fake against real.

Each real case compiles for real (Inductor's C++ kernels, built by the host's compiler), so
there are four: tiny Llama and GPT-2, whole model and per block. The optimizer is SGD:
on these tiny models AdamW's step (parameters, gradients, two states and the foreach
temporaries) is the peak and no compile changes it, while with SGD the peak is in the
backward, where the partitioner's and Inductor's choices are. Every compile starts from
nothing: Dynamo's compiled frames are reset and the FX-graph and AOTAutograd caches are
off (`memplan.capture.compiled.inductor_runs`, and `_fresh_compile` here for the real
steps), so no case can pass on another's compiled code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch._inductor import config as inductor_config

from memplan import models
from memplan.capture import Recorder, capture_model
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.capture.step import build_training_step
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.models.build import transformer_blocks

# one real compiled step against the profiler (each costs ~40-110 s of Inductor builds on 2
# cores); the whole-model and GPT-2 cases are the documented table (docs/estimation.md),
# and the recorder test below compiles the whole model for real
CASES = [("llama-2-7b", "blocks")]
TRUTH: dict[tuple[str, str], int] = {}  # profiler peaks of the real compiled steps, per case


def setup_for(compile_mode: str) -> models.TrainingSetup:
    return models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer="sgd", optimizer_impl="foreach", compile=compile_mode)


@contextlib.contextmanager
def _fresh_compile() -> Iterator[None]:
    """Genuine torch.compile (no memplan patch), compiled in this block and forgotten after."""
    torch._dynamo.reset()
    try:
        with inductor_config.patch(force_disable_caches=True):
            yield
    finally:
        torch._dynamo.reset()


def profiled_peak(family: str, compile_mode: str) -> int:
    """torch.profiler's peak of the real compiled step (after a warm-up step that compiles it)."""
    if (family, compile_mode) not in TRUTH:
        with _fresh_compile():
            step = build_training_step(models.tiny_config(family), setup_for(compile_mode), device="cpu")
            step.run()
            TRUTH[family, compile_mode] = profiler_peak_bytes(step.run)
    return TRUTH[family, compile_mode]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "compile_mode"), CASES)
def test_compiled_estimate_matches_the_profiler_of_the_real_compiled_step_within_one_percent(family, compile_mode):
    truth = profiled_peak(family, compile_mode)
    config = models.tiny_config(family)
    predicted = estimate(config, setup_for(compile_mode), device="cpu", allocator="none").peak_allocated_bytes
    assert abs(predicted - truth) / truth <= 0.01, f"estimate {predicted} vs profiler {truth}"
    eager = estimate(config, setup_for("none"), device="cpu", allocator="none").peak_allocated_bytes
    # the compiled step's memory is not the eager step's: the test would fail on a trace that ignored compile
    assert abs(eager - truth) / truth > 0.02, f"eager {eager} vs compiled {truth}"


@pytest.mark.slow
def test_the_recorder_sees_every_allocation_of_the_real_compiled_code_and_fake_equals_real():
    config, setup = models.tiny_config("llama-2-7b"), setup_for("blocks")
    real = capture_model(config, setup, fake=False, device="cpu")
    fake = capture_model(config, setup, fake=True, device="cpu")
    assert real.peak()[0] == fake.peak()[0]
    # the compiled code's allocations and kernel calls, in order, are the same in both
    assert inductor_ops(real) == inductor_ops(fake)
    assert len(inductor_ops(real)) > 50
    truth = profiled_peak("llama-2-7b", "blocks")
    assert abs(real.peak()[0] - truth) / truth <= 0.005, f"real capture {real.peak()[0]} vs profiler {truth}"


def inductor_ops(trace) -> list[tuple[str, int]]:
    """The ops of Inductor's wrappers in `trace`: each allocation with its bytes, each kernel call."""
    out = []
    for op, name in enumerate(trace.ops["name"].tolist()):
        label = trace.op_names[name]
        if label == "memplan.inductor_kernel.default":
            out.append((label, 0))
        elif label == "aten.empty_strided.default":
            allocated = trace.buffers["nbytes"][trace.buffers["alloc_op"] == op]
            out.append((label, int(allocated.sum())))
    return out


def test_blocks_refuses_a_model_whose_forward_computes_its_loss_inline():
    with pytest.raises(UserError, match="`compile=model`"):
        models.build_model(models.tiny_config("bert-base"), models.TrainingSetup(precision="32-true", batch=2, seq=32, compile="blocks"))


def test_compile_wraps_each_block_and_the_loss_and_a_recorder_stays_eager_by_default():
    model = models.build_model(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32,
                                                                                      compile="blocks"))
    blocks = transformer_blocks(model)
    assert all(type(block).__name__ == "OptimizedModule" for block in blocks)
    assert hasattr(model.loss_function, "_torchdynamo_orig_callable")  # torch.compile's wrapper
    whole = models.build_model(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", batch=2, seq=32, compile="model"))
    assert whole._compiled_call_impl is not None
    assert not Recorder().ignore_compile_internals()
    assert Recorder(compiled_regions=True).ignore_compile_internals()


@pytest.mark.parametrize("change", [{"quant": "nf4", "lora_rank": 8}, {"dora": True, "lora_rank": 8},
                                    {"cpu_offload": "optimizer"}])
def test_compile_blocks_with_a_technique_that_breaks_the_block_s_graph_is_refused_in_one_line(change):
    setup = models.TrainingSetup(batch=2, seq=32, compile="blocks", **{"precision": "32-true", **change})
    with pytest.raises(UserError, match="breaks that graph: use `compile=model`") as info:
        models.build_model(models.tiny_config("llama-2-7b"), setup)
    assert "\n" not in str(info.value)
