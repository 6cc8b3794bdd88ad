"""A CUDA job's autocast, traced on fake cpu tensors, follows CUDA's op lists."""

import numpy as np
import pytest
import torch

from memplan import models
from memplan.capture import capture_model
from memplan.capture.cuda_autocast import autocast_as_on_cuda


@pytest.fixture
def half_activation():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        return layer, layer(torch.randn(2, 8))


@pytest.mark.parametrize("run", [
    lambda h: torch.softmax(h, -1),
    lambda h: torch.log_softmax(h, -1),
    lambda h: torch.nn.functional.layer_norm(h, (8,)),
    lambda h: torch.pow(h, 3),
    lambda h: torch.exp(h),
    lambda h: h.sum(),
], ids=["softmax", "log_softmax", "layer_norm", "pow", "exp", "sum"])
def test_ops_of_cuda_fp32_lists_run_in_fp32(half_activation, run):
    _, h = half_activation
    assert h.dtype == torch.float16
    with autocast_as_on_cuda(), torch.autocast("cpu", dtype=torch.float16):
        assert run(h).dtype == torch.float32


def test_an_explicit_dtype_is_kept(half_activation):
    _, h = half_activation
    with autocast_as_on_cuda(), torch.autocast("cpu", dtype=torch.float16):
        assert h.sum(dtype=torch.float16).dtype == torch.float16
        assert torch.softmax(h, -1, dtype=torch.float16).dtype == torch.float16


def test_matmuls_stay_in_the_lower_precision(half_activation):
    layer, h = half_activation
    with autocast_as_on_cuda(), torch.autocast("cpu", dtype=torch.float16):
        assert layer(h.float()).dtype == torch.float16


def test_promote_ops_run_in_the_widest_input_dtype(half_activation):
    _, h = half_activation
    with autocast_as_on_cuda(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.addcmul(h, h, h).dtype == torch.float16
        assert torch.addcmul(h, h, h.float()).dtype == torch.float32


def test_cpu_lists_return_after_the_block(half_activation):
    _, h = half_activation
    with autocast_as_on_cuda():
        pass
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(h, -1).dtype == torch.float16


def test_gradients_flow_through_the_casts():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with autocast_as_on_cuda(), torch.autocast("cpu", dtype=torch.float16):
        loss = torch.log_softmax(layer(x), -1).sum()
    loss.backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


def _outputs_of(trace, op_name):
    made = trace.buffers["alloc_op"] >= 0
    return [int(trace.buffers["nbytes"][b]) for b in np.flatnonzero(made)
            if trace.op_name(int(trace.buffers["alloc_op"][b])) == op_name]


def test_gpt2_gelu_of_a_cuda_fp16_job_raises_to_the_third_power_in_fp32_and_of_a_cpu_job_in_fp16():
    # gelu_new: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    batch, seq = 2, 32
    config = models.tiny_config("gpt2")
    setup = models.TrainingSetup(batch=batch, seq=seq, precision="16-mixed")
    elements = batch * seq * 4 * config.n_embd  # the MLP's inner width
    cuda = capture_model(config, setup, fake=True, device="cuda")
    cpu = capture_model(config, setup, fake=True, device="cpu")
    assert _outputs_of(cuda, "aten.pow.Tensor_Scalar")[:config.n_layer] == [elements * 4] * config.n_layer
    assert _outputs_of(cpu, "aten.pow.Tensor_Scalar")[:config.n_layer] == [elements * 2] * config.n_layer
