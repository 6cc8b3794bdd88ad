"""Builders: model, optimizer and batch for a TrainingSetup, on real and fake tensors."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memplan.errors import UserError
from memplan.models import (
    TrainingSetup,
    autocast,
    build_model,
    build_optimizer,
    forward_loss,
    make_batch,
    sequence_length,
    tiny_config,
)

FAMILIES = ["gpt2", "llama-3-8b", "mistral-7b", "opt-350m", "bert-base", "mixtral-8x7b",
            "bloom-560m", "qwen2.5-0.5b", "llama-3.1-8b", "phi-3-mini", "gemma-7b", "roberta-base"]


def saved_activation_bytes(model, batch) -> int:
    """Bytes autograd saves for backward during one forward (then runs backward)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward_loss(model, batch)
    loss.backward()
    return total


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_model_runs_a_real_cpu_training_step(name):
    setup = TrainingSetup(precision="32-true", batch=2, seq=32)
    model = build_model(tiny_config(name), setup)
    optimizer = build_optimizer(model, setup)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = forward_loss(model, make_batch(model, setup))
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_build_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone():
    setup = TrainingSetup(precision="32-true", seed=7)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_model(tiny_config("llama-2-7b"), setup).state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    second = build_model(tiny_config("llama-2-7b"), setup).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", seed=8)).state_dict()
    assert not all(torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                    ("fp16", torch.float16)])
def test_parameters_take_the_setup_dtype(dtype, torch_dtype):
    model = build_model(tiny_config("gpt2"), TrainingSetup.from_dtypes(dtype))
    assert {p.dtype for p in model.parameters()} == {torch_dtype}


def test_model_is_built_for_training_without_a_kv_cache():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true"))
    assert model.training and model.config.use_cache is False


def test_bert_builds_the_masked_lm_class_the_config_names():
    model = build_model(tiny_config("bert-base"), TrainingSetup(precision="32-true"))
    assert type(model).__name__ == "BertForMaskedLM"


@pytest.mark.parametrize("name", ["llama-3-8b", "gpt2", "bert-base", "mixtral-8x7b"])
def test_checkpointing_saves_less_for_backward_full_least(name):
    saved = {}
    for mode in ("none", "selective", "full"):
        setup = TrainingSetup(precision="32-true", batch=2, seq=64, checkpointing=mode)
        model = build_model(tiny_config(name), setup)
        saved[mode] = saved_activation_bytes(model, make_batch(model, setup))
    assert saved["full"] < saved["selective"] < saved["none"]


def test_selective_checkpointing_wraps_only_the_attention_of_each_block():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", checkpointing="selective"))
    wrapped = [n for n, m in model.named_modules() if getattr(m, "memplan_checkpointed", False)]
    assert wrapped == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_checkpointed_step_gives_the_same_gradients_as_a_plain_step():
    grads = {}
    for mode in ("none", "full", "selective"):
        setup = TrainingSetup(precision="32-true", batch=1, seq=16, checkpointing=mode)
        model = build_model(tiny_config("llama-2-7b"), setup)
        forward_loss(model, make_batch(model, setup)).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("full", "selective"):
        assert all(torch.allclose(grads["none"][n], grads[mode][n], atol=1e-6) for n in grads["none"])


def test_flash_attention_builds_sdpa_and_records_flash():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", attn="flash"))
    assert model.config._attn_implementation == "sdpa"
    assert (model.memplan_attention, model.memplan_attn_implementation) == ("flash", "sdpa")


def test_eager_attention_is_honoured():
    model = build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", attn="eager"))
    assert model.config._attn_implementation == "eager"


def test_a_family_without_sdpa_falls_back_to_eager():
    model = build_model(tiny_config("bloom-560m"), TrainingSetup(precision="32-true", attn="sdpa"))
    assert model.memplan_attn_implementation == "eager"


def test_lora_rank_4_leaves_only_lora_parameters_trainable():
    setup = TrainingSetup(precision="32-true", lora_rank=4)
    model = build_model(tiny_config("llama-2-7b"), setup)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # q_proj and v_proj of 2 layers, A (4 x 64) and B (out x 4) each: 4 x (4x64 + 64x4)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 4 * (4 * 64 + 64 * 4)
    optimizer = build_optimizer(model, setup)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)


def test_lora_targets_matching_no_module_are_a_user_error():
    with pytest.raises(UserError, match="matches no module"):
        build_model(tiny_config("gpt2"), TrainingSetup(precision="32-true", lora_rank=4, lora_targets=("q_proj",)))


def test_a_lora_target_matching_nothing_is_refused_even_when_another_matches_naming_the_modules():
    setup = TrainingSetup(precision="32-true", lora_rank=4, lora_targets=("c_attn", "q_proj"))
    with pytest.raises(UserError, match="LoRA target q_proj matches no module of GPT2LMHeadModel; its modules are "
                                        "named .*c_attn.*c_fc.*c_proj") as info:
        build_model(tiny_config("gpt2"), setup)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["gpt2", "opt-350m", "bloom-560m", "bert-base", "phi-3-mini"])
def test_lora_finds_default_targets_for_each_family(name):
    model = build_model(tiny_config(name), TrainingSetup(precision="32-true", lora_rank=2))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_sequence_longer_than_the_model_allows_is_a_user_error():
    with pytest.raises(UserError, match="sequence length 300 exceeds the model's maximum of 256"):
        build_model(tiny_config("llama-2-7b"), TrainingSetup(precision="32-true", seq=300))


def test_allow_long_seq_lets_a_rope_model_run_past_its_maximum():
    setup = TrainingSetup(precision="32-true", seq=300, allow_long_seq=True)
    model = build_model(tiny_config("llama-2-7b"), setup)
    assert make_batch(model, setup)["input_ids"].shape == (1, 300)


def test_allow_long_seq_cannot_stretch_a_learned_position_table():
    with pytest.raises(UserError, match="learned position table"):
        build_model(tiny_config("gpt2"), TrainingSetup(precision="32-true", seq=300, allow_long_seq=True))


def test_default_sequence_is_the_model_maximum_capped_at_1024():
    assert sequence_length(TrainingSetup(precision="32-true"), tiny_config("llama-2-7b")) == 256
    from memplan.models import load_config

    assert sequence_length(TrainingSetup(precision="32-true"), load_config("llama-2-7b")) == 1024
    assert sequence_length(TrainingSetup(precision="32-true"), load_config("bert-base")) == 512
    assert sequence_length(TrainingSetup(precision="32-true"), load_config("roberta-base")) == 512  # 514 - padding offset


def test_causal_batch_has_labels_equal_to_inputs_and_is_seeded():
    setup = TrainingSetup(precision="32-true", batch=3, seq=10)
    config = tiny_config("gpt2")
    batch = make_batch(config, setup, seed=1)
    assert batch["input_ids"].shape == (3, 10) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert int(batch["input_ids"].max()) < config.vocab_size
    assert torch.equal(make_batch(config, setup, seed=1)["input_ids"], batch["input_ids"])
    assert not torch.equal(make_batch(config, setup, seed=2)["input_ids"], batch["input_ids"])


def test_batch_from_a_registry_name_uses_its_vocab_and_default_length():
    batch = make_batch("bert-base", TrainingSetup(precision="32-true", batch=2))
    assert batch["input_ids"].shape == (2, 512)
    assert int(batch["input_ids"].max()) < 30522 and (batch["labels"] == -100).any()


def test_masked_lm_batch_asks_for_about_15_percent_of_tokens():
    setup = TrainingSetup(precision="32-true", batch=8, seq=256)
    batch = make_batch(tiny_config("bert-base"), setup)
    asked = batch["labels"] != -100
    assert 0.10 < asked.float().mean().item() < 0.20
    assert torch.equal(batch["labels"][asked], batch["input_ids"][asked])


@pytest.mark.parametrize(("impl", "flag"), [("foreach", "foreach"), ("fused", "fused"), ("loop", "foreach")])
def test_optimizer_uses_the_implementation_the_setup_names(impl, flag):
    setup = TrainingSetup(precision="32-true", optimizer_impl=impl)
    optimizer = build_optimizer(build_model(tiny_config("gpt2"), setup), setup)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert bool(optimizer.defaults[flag]) is (impl != "loop")


def test_default_optimizer_impl_follows_the_target_device():
    setup = TrainingSetup(precision="32-true")
    model = build_model(tiny_config("gpt2"), setup)
    assert not build_optimizer(model, setup).defaults["foreach"]  # cpu parameters: loop
    assert build_optimizer(model, setup, device="cuda").defaults["foreach"]


@pytest.mark.parametrize(("name", "cls"), [("adam", torch.optim.Adam), ("sgd", torch.optim.SGD),
                                           ("adafactor", torch.optim.Adafactor)])
def test_each_optimizer_steps_the_model(name, cls):
    setup = TrainingSetup(precision="32-true", optimizer=name, batch=1, seq=16)
    model = build_model(tiny_config("gpt2"), setup)
    optimizer = build_optimizer(model, setup)
    assert isinstance(optimizer, cls)
    forward_loss(model, make_batch(model, setup)).backward()
    optimizer.step()


def test_autocast_runs_matmuls_in_the_autocast_dtype():
    setup = TrainingSetup(precision="bf16-mixed", batch=1, seq=8)
    model = build_model(tiny_config("llama-2-7b"), setup)
    with autocast(setup, "cpu"):
        logits = model(input_ids=make_batch(model, setup)["input_ids"]).logits
    assert logits.dtype == torch.bfloat16


def test_llama_2_70b_builds_under_fake_tensors_with_fake_bf16_parameters():
    setup = TrainingSetup(precision="bf16-true", seq=4096, checkpointing="full")
    with FakeTensorMode():
        model = build_model("llama-2-70b", setup)
    params = list(model.parameters())
    assert all(isinstance(p, FakeTensor) and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == 68_976_648_192


def test_fake_tensor_training_step_runs_with_lora_and_checkpointing():
    setup = TrainingSetup(batch=2, seq=64, lora_rank=4, checkpointing="full", precision="bf16-true")
    with FakeTensorMode():
        model = build_model(tiny_config("mistral-7b"), setup)
        optimizer = build_optimizer(model, setup, device="cuda")
        batch = make_batch(model, setup)
        assert isinstance(batch["input_ids"], FakeTensor)
        forward_loss(model, batch).backward()
        optimizer.step()
    assert optimizer.defaults["foreach"]


def test_build_on_fake_cuda_places_parameters_and_adapters_on_cuda():
    setup = TrainingSetup(precision="32-true", lora_rank=2)
    with FakeTensorMode():
        model = build_model(tiny_config("llama-2-7b"), setup, device="cuda")
        batch = make_batch(model, setup, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert batch["input_ids"].device.type == "cuda"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fake_lora_model_has_the_real_models_trainable_parameters(dtype):
    setup = TrainingSetup.from_dtypes(dtype, lora_rank=4)

    def trainable(model):
        return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters() if p.requires_grad]

    real = build_model(tiny_config("llama-3-8b"), setup)
    with FakeTensorMode():
        fake = build_model(tiny_config("llama-3-8b"), setup)
    assert trainable(fake) == trainable(real)
    assert sum(p.numel() for p in fake.parameters()) == sum(p.numel() for p in real.parameters())


FACTORY_MODULE = textwrap.dedent('''
    import torch
    from torch import nn


    class TwoLayer(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])

        def forward(self, x, target):
            for block in self.blocks:
                x = torch.relu(block(x))
            return {"loss": ((x - target) ** 2).mean()}

        def make_batch(self, setup, device, seed):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(setup.batch, 8, generator=g).to(device)
            return {"x": x, "target": torch.zeros_like(x)}


    def make_plain():
        return TwoLayer(8)


    def make_for_setup(setup):
        return TwoLayer(8 * setup.batch)


    def not_a_module():
        return 42
''')


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "memplan_test_factory.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "memplan_test_factory"


def test_factory_spec_builds_a_model_that_steps(factory_module):
    setup = TrainingSetup(precision="32-true", batch=2, checkpointing="full")
    model = build_model(f"{factory_module}:make_plain", setup)
    optimizer = build_optimizer(model, setup)
    loss = forward_loss(model, make_batch(model, setup))
    loss.backward()
    optimizer.step()
    assert all(getattr(block, "memplan_checkpointed", False) for block in model.blocks)


def test_factory_taking_one_argument_gets_the_setup(factory_module):
    model = build_model(f"{factory_module}:make_for_setup", TrainingSetup(precision="32-true", batch=3))
    assert model.blocks[0].in_features == 24


def test_factory_returning_a_non_module_is_a_user_error(factory_module):
    with pytest.raises(UserError, match="not a torch.nn.Module"):
        build_model(f"{factory_module}:not_a_module", TrainingSetup(precision="32-true"))


def test_factory_in_a_missing_module_is_a_user_error():
    with pytest.raises(UserError, match="cannot import module 'no_such_memplan_module'"):
        build_model("no_such_memplan_module:factory", TrainingSetup(precision="32-true"))


@pytest.mark.parametrize("impl", ["foreach", "loop"])
def test_adafactor_steps_under_fake_tensors_with_the_real_state(impl):
    setup = TrainingSetup(precision="32-true", optimizer="adafactor", optimizer_impl=impl, batch=1, seq=16)

    def state_after_step():
        model = build_model(tiny_config("llama-2-7b"), setup)
        optimizer = build_optimizer(model, setup)
        forward_loss(model, make_batch(model, setup)).backward()
        optimizer.step()
        return [(k, tuple(v.shape), v.dtype) for state in optimizer.state.values()
                for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]

    real = state_after_step()
    with FakeTensorMode():
        fake = state_after_step()
    assert fake == real and len(real) > 0


def test_op_level_selective_checkpointing_recomputes_every_second_matmul_of_each_block():
    import numpy as np

    from memplan import models
    from memplan.capture import capture_model
    from memplan.trace.model import PHASE

    config = models.tiny_config("llama-2-7b")
    trace = capture_model(config, models.TrainingSetup(precision="32-true", batch=2, seq=32, checkpointing="selective-op"), fake=True,
                          device="cpu")
    mm = [i for i in range(trace.num_ops) if trace.op_name(i) == "aten.mm.default"]
    phases = trace.ops["phase"][np.array(mm)]
    # 7 projections per Llama block (q, k, v, o, gate, up, down) + the LM head; the 2nd,
    # 4th and 6th of each block are recomputed in backward
    assert int((phases == PHASE["forward"]).sum()) == 7 * config.num_hidden_layers + 1
    assert int((phases == PHASE["recompute"]).sum()) == 3 * config.num_hidden_layers
