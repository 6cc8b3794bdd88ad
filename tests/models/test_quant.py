"""Quantised bases (`memplan.models.quant`): what transformers + bitsandbytes + peft build for
real, built on fake tensors with the same bytes."""

from __future__ import annotations

import resource

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memplan.errors import UserError
from memplan.models import TrainingSetup, build_model, tiny_config
from memplan.models.quant import compute_dtype, is_quantised, quantisation_constants, quantise_base

QUANT_SETUPS = [
    {"quant": "nf4", "lora_rank": 4, "precision": "bf16-true"},
    {"quant": "nf4", "double_quant": True, "lora_rank": 4, "precision": "bf16-true"},
    {"quant": "fp4", "quant_storage": "bf16", "lora_rank": 4, "precision": "16-true"},
    {"quant": "nf4", "quant_storage": "fp32", "double_quant": True, "frozen_base": True},
    {"quant": "int8", "lora_rank": 4, "precision": "bf16-true"},
    {"quant": "nf4", "kbit_prep": False, "lora_rank": 4, "precision": "bf16-true", "lora_targets": ("all-linear",)},
]


def tensor_layout(model):
    """(name, class, shape, dtype, requires_grad) of every parameter and buffer, then the
    shapes and dtypes of the quantisation constants."""
    params = [(n, type(p).__name__ if is_quantised(p) else "-", tuple(p.shape), p.dtype, p.requires_grad)
              for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]
    constants = [(n, tuple(t.shape), t.dtype) for n, t in quantisation_constants(model)]
    return params, buffers, constants


def total_bytes(model) -> int:
    seen = {}
    tensors = [*model.parameters(), *model.buffers(), *(t for _, t in quantisation_constants(model))]
    for t in tensors:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("options", QUANT_SETUPS)
def test_the_fake_quantised_model_has_the_real_bitsandbytes_models_tensors(options):
    config = tiny_config("llama-2-7b")
    setup = TrainingSetup(**{"precision": "32-true", **options})
    real = build_model(config, setup)
    with FakeTensorMode():
        fake = build_model(config, setup)
    assert tensor_layout(fake) == tensor_layout(real)
    assert total_bytes(fake) == total_bytes(real)
    assert any(is_quantised(p) for p in fake.parameters())
    assert all(isinstance(p, FakeTensor) for p in fake.parameters())


def test_every_linear_layer_but_the_lm_head_is_quantised_as_transformers_does():
    import bitsandbytes as bnb

    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", quant="nf4", frozen_base=True))
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantised = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert linear - quantised == {"lm_head"}
    assert len(quantised) == 2 * 7  # q, k, v, o, gate, up, down per block


def test_gpt2s_conv1d_projections_are_quantised_with_their_weights_transposed():
    import bitsandbytes as bnb

    config = tiny_config("gpt2")
    with FakeTensorMode():
        model = build_model(config, TrainingSetup(precision="32-true", quant="nf4", lora_rank=4))
    c_fc = model.base_model.model.transformer.h[0].mlp.c_fc  # not a LoRA target: the bnb layer itself
    assert isinstance(c_fc, bnb.nn.Linear4bit)
    assert tuple(c_fc.weight.quant_state.shape) == (4 * config.n_embd, config.n_embd)  # [out, in]


def test_a_70b_base_is_quantised_on_fake_tensors_with_no_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    setup = TrainingSetup(quant="nf4", double_quant=True, lora_rank=16, precision="bf16-true")
    with FakeTensorMode():
        model = build_model("llama-2-70b", setup)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    packed = sum(p.untyped_storage().nbytes() for p in model.parameters() if is_quantised(p))
    # 80 blocks of 4 x 8192^2 / 8 (GQA: k, v are 1024 wide) attention and 3 x 8192 x 28672 MLP weights, 4 bits each
    block = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672
    assert packed == 80 * block // 2
    assert grown_kib < 2 * 1024 * 1024  # the real 4-bit weights alone would be 32 GiB


def test_a_quantised_model_counts_the_weights_it_stands_for():
    from memplan.capture.step import build_training_step

    config = tiny_config("llama-2-7b")
    plain = build_training_step(config, TrainingSetup(precision="32-true", batch=1, seq=8, lora_rank=4))
    with FakeTensorMode():
        quantised = build_training_step(config, TrainingSetup(precision="32-true", batch=1, seq=8, lora_rank=4, quant="nf4"))
    assert quantised.meta["parameters"] == plain.meta["parameters"]
    assert quantised.meta["trainable_parameters"] == plain.meta["trainable_parameters"]


def test_kbit_prep_casts_every_unquantised_parameter_to_fp32_and_freezes_it():
    config = tiny_config("llama-2-7b")
    prepared = build_model(config, TrainingSetup(quant="nf4", lora_rank=4, precision="bf16-true"))
    plain = build_model(config, TrainingSetup(quant="nf4", lora_rank=4, precision="bf16-true", kbit_prep=False))
    for model, dtype in ((prepared, torch.float32), (plain, torch.bfloat16)):
        base = [p for n, p in model.named_parameters() if "lora_" not in n and not is_quantised(p)]
        assert {p.dtype for p in base} == {dtype}
        assert not any(p.requires_grad for p in base)


def test_frozen_base_without_lora_trains_exactly_the_unquantised_parameters():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", quant="nf4", frozen_base=True))
    for param in model.parameters():
        assert param.requires_grad == (not is_quantised(param))


def test_packed_storage_keeps_its_dtype_through_peft_s_fp32_cast():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", quant="nf4", quant_storage="bf16", lora_rank=4))
    packed = [p for p in model.parameters() if is_quantised(p)]
    assert packed and {p.dtype for p in packed} == {torch.bfloat16}


def test_compute_dtype_defaults_to_autocast_then_the_parameter_dtype():
    assert compute_dtype(TrainingSetup(quant="nf4", lora_rank=1, precision="bf16-mixed")) == "bf16"
    assert compute_dtype(TrainingSetup(quant="nf4", lora_rank=1, precision="16-true")) == "fp16"
    assert compute_dtype(TrainingSetup(quant="nf4", lora_rank=1, compute_dtype="fp32", precision="bf16-true")) == "fp32"
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(quant="nf4", lora_rank=1, precision="16-mixed"))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert q_proj.compute_dtype == torch.float16


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_quantisation_constants_are_what_quantize_4bit_keeps(double_quant):
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", quant="nf4", double_quant=double_quant,
                                                                 frozen_base=True))
    q_proj = model.model.layers[0].self_attn.q_proj
    blocks = 64 * 64 // 64  # one absmax per 64 weights
    constants = [(tuple(t.shape), t.dtype) for n, t in quantisation_constants(model) if n.endswith("0.self_attn.q_proj")]
    if double_quant:  # uint8 absmax, its 16-entry NF4 code; fp32 nested absmax per 256, 256-entry map, offset
        assert constants == [((blocks,), torch.uint8), ((16,), torch.float32), ((), torch.float32),
                             ((1,), torch.float32), ((256,), torch.float32)]
    else:
        assert constants == [((blocks,), torch.float32), ((16,), torch.float32)]
    assert q_proj.weight.untyped_storage().nbytes() == 64 * 64 // 2


def test_quant_on_a_factory_model_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "memplan_quant_factory.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="the factory 'memplan_quant_factory:make' builds its own"):
        build_model("memplan_quant_factory:make", TrainingSetup(precision="32-true", quant="nf4", lora_rank=4, lora_targets=("0",)))


def test_a_model_without_linear_layers_to_quantise_is_a_user_error():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama-2-7b", num_hidden_layers=0))
    with pytest.raises(UserError, match="has no linear layer to quantise"):
        quantise_base(model, TrainingSetup(precision="32-true", quant="nf4", lora_rank=4), fake=False)


def test_a_quantised_base_cannot_be_traced_under_fsdp2_or_tp():
    from memplan.estimation import estimate
    from memplan.parallel.layout import Layout

    setup = TrainingSetup(precision="32-true", quant="nf4", lora_rank=4, batch=1, seq=16)
    with pytest.raises(UserError, match="not traced over bitsandbytes' quantised weights"):
        estimate(tiny_config("llama-2-7b"), setup, Layout(world_size=2, zero=3))


def test_int8_is_refused_for_a_cuda_job():
    from memplan.capture.step import capture_model

    setup = TrainingSetup(precision="32-true", quant="int8", lora_rank=4, batch=1, seq=16)
    with pytest.raises(UserError, match="`quant=int8` is estimated for --device cpu only"):
        capture_model(tiny_config("llama-2-7b"), setup, device="cuda")
