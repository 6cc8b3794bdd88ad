"""Capturing steps with bitsandbytes layers: the ops inside the 4-bit matmul, the quantisation
constants as parameters, and fake captures equal to real ones."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture import capture
from memplan.capture.step import capture_model
from memplan.trace.model import CATEGORY


def linear4bit_step(fake: bool, double_quant: bool):
    """One forward + backward of a bnb `Linear4bit` [96 x 64] on a [2, 8, 64] input that
    needs a gradient (`MatMul4Bit`), quantised by bitsandbytes itself (real) or as the model
    builder quantises on fake tensors."""
    import bitsandbytes as bnb

    from memplan.models.quant import _load_fake

    options = {"compute_dtype": torch.bfloat16, "quant_type": "nf4", "compress_statistics": double_quant}
    layer = bnb.nn.Linear4bit(64, 96, bias=False, device="meta" if fake else None, **options)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        weight = torch.randn(96, 64, dtype=torch.bfloat16)
        if fake:
            _load_fake(layer, weight, torch.nn.Linear(64, 96, bias=False, device="meta"))
        else:
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                             compress_statistics=double_quant, module=layer).to("cpu")
        x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)

        def step():
            layer(x).sum().backward()

        return capture(step, model=layer, inputs=[x])


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_4bit_matmul_is_recorded_op_by_op_with_its_dequantised_weight(double_quant):
    trace = linear4bit_step(fake=False, double_quant=double_quant)
    names = [trace.op_names[i] for i in trace.ops["name"]]
    assert "bitsandbytes.gemm_4bit.default" not in names  # its composite kernel's ops instead
    dequant = [i for i, n in enumerate(names) if n == "bitsandbytes.dequantize_4bit.default"]
    assert len(dequant) == 2  # forward (gemm_4bit's default kernel) and backward (MatMul4Bit)
    sizes = trace.buffers["nbytes"]
    for op in dequant:
        out = trace.csr["op_outputs"][trace.csr["op_outputs_ptr"][op]:trace.csr["op_outputs_ptr"][op + 1]]
        assert [int(sizes[b]) for b in out] == [96 * 64 * 2]  # the bf16 weight, made and freed
        assert all(trace.buffers["free_event"][b] >= 0 for b in out)
    nested = names.count("bitsandbytes.dequantize_blockwise.default")
    assert nested == (2 if double_quant else 0)


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_fake_4bit_layer_allocates_what_the_real_one_does(double_quant):
    real = linear4bit_step(fake=False, double_quant=double_quant)
    fake = linear4bit_step(fake=True, double_quant=double_quant)

    def allocations(trace):
        return [(trace.op_names[trace.ops["name"][op]], int(n)) for op, n in
                zip(trace.buffers["alloc_op"], trace.buffers["nbytes"], strict=True)]

    assert allocations(fake) == allocations(real)
    assert real.summary()["peak_bytes"] == fake.summary()["peak_bytes"]


def test_quantisation_constants_are_frozen_parameters_in_the_trace():
    config = models.tiny_config("llama-2-7b")
    setup = models.TrainingSetup(batch=2, seq=16, quant="nf4", double_quant=True, lora_rank=4, precision="bf16-true")
    trace = capture_model(config, setup, fake=True, device="cpu")
    pre = trace.buffers["alloc_op"] < 0
    parameter = trace.buffers["category"] == CATEGORY["parameter"]
    # per quantised layer: packed weight, uint8 absmax, code, offset, nested absmax, nested map
    layers = 2 * 7
    expected = layers * 6
    lora = 2 * 2 * 2  # q_proj and v_proj adapters (A, B) per block
    other_params = 1 + 2 * 2 + 1 + 1  # embeddings, two norms per block, final norm, LM head
    assert int(np.sum(pre & parameter)) == expected + lora + other_params


@pytest.mark.parametrize("options", [
    {"quant": "nf4", "double_quant": True, "lora_rank": 4, "precision": "bf16-true", "checkpointing": "full"},
    {"quant": "int8", "lora_rank": 4, "precision": "bf16-true", "lora_targets": ("all-linear",)},
])
def test_fake_capture_of_a_quantised_step_equals_the_real_one(options):
    config = models.tiny_config("llama-2-7b")
    setup = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", **{"precision": "32-true", **options})
    real = capture_model(config, setup, fake=False, device="cpu")
    fake = capture_model(config, setup, fake=True, device="cpu")
    assert fake.summary()["peak_bytes"] == real.summary()["peak_bytes"]

    def buffers(trace):  # a real step also makes a few sub-KiB mask checks (cumsum, all) fake ones skip
        return sorted(n for n in trace.buffers["nbytes"].tolist() if n >= 1024)

    assert buffers(fake) == buffers(real)
