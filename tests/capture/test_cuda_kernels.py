"""A CUDA job traced on fake cpu tensors runs CUDA's fused attention and dropout kernels."""

import numpy as np
import pytest
import torch

from memplan import models
from memplan.capture import capture_model
from memplan.capture.cuda_kernels import (
    cuda_dropout,
    cuda_sdpa,
    dropout_as_on_cuda,
    sdpa_as_on_cuda,
)


def attention_matrices(trace, batch, heads, seq):
    # buffers shaped like an attention matrix [B, H, S, S] (bf16 or fp32), made by ops
    # of the math path (softmax over scores, dropout)
    sizes = {batch * heads * seq * seq * k for k in (1, 2, 4)}
    made = trace.buffers["alloc_op"] >= 0
    count = 0
    for b in np.flatnonzero(made):
        name = trace.op_name(int(trace.buffers["alloc_op"][b]))
        if int(trace.buffers["nbytes"][b]) in sizes and "softmax" in name and "log_softmax" not in name:
            count += 1
    return count


@pytest.mark.parametrize("dtype,kernel", [("bf16", "flash"), ("fp32", "efficient")])
def test_cuda_job_uses_the_kernel_a_gpu_would_pick(dtype, kernel):
    setup = models.TrainingSetup.from_dtypes(dtype, batch=2, seq=64)
    trace = capture_model(models.tiny_config("gpt2"), setup, fake=True, device="cuda")
    names = set(trace.op_names)
    assert f"aten._scaled_dot_product_{kernel}_attention.default" in names
    assert f"aten._scaled_dot_product_{kernel}_attention_backward.default" in names


def test_gpt2_with_dropout_keeps_no_attention_matrix_on_cuda_but_does_on_cpu():
    # GPT-2 trains with attention dropout, which sends CPU SDPA down the math path
    config = models.tiny_config("gpt2", n_positions=512)
    setup = models.TrainingSetup(batch=2, seq=256, precision="bf16-true")
    heads = config.n_head
    cpu = capture_model(config, setup, fake=True, device="cpu")
    cuda = capture_model(config, setup, fake=True, device="cuda")
    assert attention_matrices(cpu, 2, heads, 256) > 0
    assert attention_matrices(cuda, 2, heads, 256) == 0
    assert cuda.peak()[0] < cpu.peak()[0]


def test_checkpointed_recomputation_runs_the_same_kernels():
    setup = models.TrainingSetup(batch=2, seq=64, precision="bf16-true", checkpointing="full")
    trace = capture_model(models.tiny_config("llama-2-7b"), setup, fake=True, device="cuda")
    flash = trace.op_names.index("aten._scaled_dot_product_flash_attention.default")
    # forward + recomputation, once per layer
    assert int(np.sum(trace.ops["name"] == flash)) == 2 * models.tiny_config("llama-2-7b").num_hidden_layers


def test_the_swap_is_undone_after_the_block():
    original = torch.nn.functional.scaled_dot_product_attention
    with sdpa_as_on_cuda():
        assert torch.nn.functional.scaled_dot_product_attention is cuda_sdpa
    assert torch.nn.functional.scaled_dot_product_attention is original


def saved_for_backward(fn, x):
    """(dtype, shape) of each tensor autograd keeps for the backward of `fn(x)`."""
    kept = []

    def pack(tensor):
        kept.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(x)
    return kept


def test_dropout_on_cuda_keeps_a_bool_mask_where_the_cpu_keeps_noise_of_the_input_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert saved_for_backward(lambda t: torch.nn.functional.dropout(t, 0.1), x) == [(torch.bfloat16, (4, 8))]
    with dropout_as_on_cuda():
        assert saved_for_backward(lambda t: torch.nn.functional.dropout(t, 0.1), x) == [(torch.bool, (4, 8))]


@pytest.mark.parametrize("p,training,inplace", [(0.0, True, False), (0.1, False, False), (1.0, True, False)])
def test_dropout_that_cuda_does_not_fuse_keeps_the_cpu_path(p, training, inplace):
    x = torch.randn(4, 8, requires_grad=True)
    expected = saved_for_backward(lambda t: torch.nn.functional.dropout(t, p, training, inplace), x)
    assert saved_for_backward(lambda t: cuda_dropout(t, p, training, inplace), x) == expected


def test_gpt2_on_cuda_holds_one_byte_less_per_bf16_dropout_element_than_on_cpu():
    # tiny GPT-2 with SDPA dropout off, so that only nn.Dropout differs: embedding, attention
    # output and MLP output dropout of each block hold B*S*H elements each (3 per layer + 1)
    config = models.tiny_config("gpt2", attn_pdrop=0.0)
    setup = models.TrainingSetup(batch=2, seq=64, precision="bf16-true")
    cuda = capture_model(config, setup, fake=True, device="cuda")
    assert "aten.native_dropout.default" in cuda.op_names
    masks = [b for b in range(cuda.num_buffers)
             if cuda.op_name(int(cuda.buffers["alloc_op"][b])) == "aten.native_dropout.default"
             and int(cuda.buffers["nbytes"][b]) == 2 * 64 * config.n_embd]  # bool: 1 byte each
    assert len(masks) == 2 * config.n_layer + 1
