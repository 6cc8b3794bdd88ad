"""The optimizers memplan builds, their state layouts and placement, on fake tensors
(`memplan.models.optimizers`, `memplan.models.tracing`); their real CPU steps are checked
against torch.profiler in tests/estimation/test_optimizer_accuracy.py."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture.step import capture_model
from memplan.errors import UserError
from memplan.models import tracing
from memplan.trace.model import CATEGORY, PHASE

LLAMA = models.tiny_config("llama-2-7b")


def _fake_step(module_factory, setup, device="cuda"):
    """Build `module_factory()` and the setup's optimizer inside one FakeTensorMode and
    run two steps (the first makes the state)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = module_factory()
        optimizer = models.build_optimizer(model, setup, device=device)
        for _ in range(2):
            model(torch.randn(4, model[0].in_features)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def _two_linears():
    return nn.Sequential(nn.Linear(512, 256, bias=False), nn.Linear(256, 16, bias=False))  # 131,072 and 4,096


def test_bitsandbytes_8bit_states_are_uint8_with_fp32_block_maxima_and_a_shared_map():
    def three_linears():  # the third, 1,008 elements, is below min_8bit_size: fp32 states
        return nn.Sequential(*_two_linears(), nn.Linear(16, 63, bias=False))

    model, optimizer = _fake_step(three_linears, models.TrainingSetup(precision="32-true", optimizer="adamw8bit"))
    big, last, tiny = (optimizer.state[p] for p in model.parameters())
    assert big["state1"].dtype == big["state2"].dtype == torch.uint8 and big["state1"].shape == (256, 512)
    assert big["absmax1"].shape == (131072 // 256,) and big["absmax1"].dtype == torch.float32
    assert big["qmap1"] is last["qmap1"]  # one map per optimizer
    assert tiny["state1"].dtype == torch.float32


def test_paged_states_of_large_parameters_are_cuda_managed_host_memory():
    model, optimizer = _fake_step(_two_linears, models.TrainingSetup(precision="32-true", optimizer="paged-adamw8bit"))
    big, small = (optimizer.state[p] for p in model.parameters())
    assert tracing.host_kind(big["state1"].untyped_storage()) == "managed"  # >= 1e5 elements: cudaMallocManaged
    assert tracing.host_kind(big["absmax1"].untyped_storage()) is None
    assert tracing.host_kind(small["state1"].untyped_storage()) is None


def test_a_paged_optimizer_for_a_cpu_job_is_refused():
    with pytest.raises(UserError, match="use `optimizer=adamw8bit` with --device cpu"):
        models.build_optimizer(nn.Linear(4, 4), models.TrainingSetup(precision="32-true", optimizer="paged-adamw8bit"), device="cpu")


def _optimizer_state_bytes(trace):
    cat = trace.buffers["category"]
    return int(trace.buffers["nbytes"][cat == CATEGORY["optimizer_state"]].sum())


def _step_temporary_bytes(trace):
    b = trace.buffers
    made = (b["phase"] == PHASE["optimizer"]) & (b["category"] == CATEGORY["temporary"])
    return int(b["nbytes"][made].sum())


def test_torchao_8bit_states_are_traced_as_codes_scales_and_maps():
    trace = capture_model(LLAMA, models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer="ao-adamw8bit"))
    params = list(models.build_model(LLAMA, models.TrainingSetup(precision="32-true")).parameters())
    quantised = [p.numel() for p in params if p.numel() >= 4096 and p.numel() % 256 == 0]
    plain = [p.numel() for p in params if p.numel() < 4096]
    per_state = sum(n + n // 256 * 4 + 256 * 4 for n in quantised) + sum(4 * n for n in plain)
    assert _optimizer_state_bytes(trace) == 2 * per_state + 4 * len(params)  # two states and a step each


def test_torchaos_compiled_update_allocates_nothing_on_cuda_and_its_eager_temporaries_on_cpu():
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer="ao-adamw-fp8")
    assert _step_temporary_bytes(capture_model(LLAMA, setup, device="cuda")) == 0
    assert _step_temporary_bytes(capture_model(LLAMA, setup, device="cpu")) > 0


def test_optimizer_in_backward_steps_each_parameter_inside_backward_and_frees_its_gradient():
    trace = capture_model(LLAMA, models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_in_backward=True))
    phase = trace.ops["phase"]
    optimizer_ops = (phase == PHASE["optimizer"]).nonzero()[0]
    backward_ops = (phase == PHASE["backward"]).nonzero()[0]
    assert optimizer_ops[0] < backward_ops[-1]  # updates interleave with the backward pass
    grads = trace.buffers["category"] == CATEGORY["gradient"]
    live_grads = trace.live_bytes(grads)
    assert live_grads.max() < trace.buffers["nbytes"][grads].sum()  # never all gradients at once
    assert live_grads[-1] == 0


def test_host_placement_serves_pinned_memory_on_a_cpu_only_host_and_marks_it():
    with tracing.host_placement():
        pinned = torch.empty(8, pin_memory=True)
        copied = torch.ones(8).pin_memory()
        plain = torch.empty(8)
        assert pinned.is_pinned() and copied.is_pinned() and not plain.is_pinned()
        with tracing.host_compute():
            state = torch.zeros_like(plain)
    assert [tracing.host_kind(t.untyped_storage()) for t in (pinned, copied, plain, state)] == \
        ["pinned", "pinned", None, "pageable"]
