"""What each trainer passes its engine and gathers for the weight sync (hand-computed)."""

import pytest

from memplan.errors import UserError
from memplan.hardware.devices import device_profile
from memplan.models.registry import load_config, tiny_config
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import Layout
from memplan.rl import estimate_rl
from memplan.rl.estimate import (
    RLJob,
    engine_flags,
    generation_gather_bytes,
    hf_generation,
    policy_setup,
    resolved_reference,
    sync_gather_bytes,
    with_trainer_layout,
)
from memplan.rl.passes import no_grad_pass
from memplan.rl.trainers import trainer_rules


def job(**over):
    base = dict(model="qwen2.5-7b", algo="grpo", trainer="trl", rollout="vllm-colocate", prompt_len=512,
                completion_len=1024, num_generations=8, setup=TrainingSetup(batch=4, grad_accum=2),
                layout=Layout(world_size=8, zero=3), gpu="h100-80gb")
    base.update(over)
    return RLJob(**base)


def test_trl_starts_vllm_with_one_sequence_per_generated_row_and_4096_batched_tokens():
    flags = engine_flags(job(engine={"tp": 2}), trainer_rules("trl"))
    # per_device_train_batch_size 4 x steps_per_generation 2 x vllm_tensor_parallel_size 2
    assert flags == {"tp": 2, "max_num_seqs": 16, "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.3}


def test_verl_passes_its_rollout_defaults():
    flags = engine_flags(job(trainer="verl"), trainer_rules("verl"))
    assert flags == {"tp": 1, "max_num_seqs": 256, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.5}


def test_the_zero3_weight_sync_gathers_the_largest_parameter_and_trl_peft_the_whole_model():
    config = load_config("qwen2.5-7b")
    full = 1000
    largest = config.vocab_size * config.hidden_size * 4  # the fp32 embedding (or head)
    assert sync_gather_bytes(job(), trainer_rules("trl"), config, full, 8) == largest
    peft = job(setup=TrainingSetup(batch=4, lora_rank=8))
    assert sync_gather_bytes(peft, trainer_rules("trl"), config, full, 8) == full - full // 8
    assert sync_gather_bytes(job(layout=Layout(world_size=8)), trainer_rules("trl"), config, full, 1) == 0


def test_trl_keeps_no_reference_at_beta_0_and_disables_the_adapter_for_peft():
    rules = trainer_rules("trl")
    assert resolved_reference(job(), rules) == "none"
    assert resolved_reference(job(beta=0.04), rules) == "copy"
    assert resolved_reference(job(beta=0.04, setup=TrainingSetup(batch=4, lora_rank=8)), rules) == "peft"


def test_trl_has_no_ppo_trainer():
    with pytest.raises(UserError, match="trl 1.16.0 trains grpo, dpo, rloo"):
        trainer_rules("trl").check("ppo", "vllm-colocate", None, "none", "qwen2.5-7b")


def test_trls_generate_call_samples_the_generation_batch_with_its_processors():
    call = hf_generation(job(setup=TrainingSetup(batch=4, grad_accum=2), generation={"temperature": 0.7, "top_k": 50}))
    kwargs = call.generate_kwargs()
    # per_device_train_batch_size 4 x steps_per_generation 2 rows, each prompt's completions among them
    assert (call.batch, call.input_len, call.new_tokens, call.cache) == (8, 512, 1024, "dynamic")
    assert kwargs["do_sample"] and kwargs["num_return_sequences"] == 1
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["top_p"]) == (0.7, 50, 1.0)
    assert kwargs["min_new_tokens"] == kwargs["max_new_tokens"] == 1024


def test_the_rollout_gathers_the_whole_model_under_deepspeed_zero3_and_one_block_otherwise():
    full, block = 8000, 300
    assert generation_gather_bytes(job(), full, 8, block) == full - full // 8
    no_gather = job(generation={"ds3_gather_for_generation": False})
    assert generation_gather_bytes(no_gather, full, 8, block) == block
    assert generation_gather_bytes(job(layout=Layout(world_size=8, zero=3, engine="fsdp2")), full, 8, block) == block
    assert generation_gather_bytes(job(layout=Layout(world_size=8)), full, 1, 0) == 0


def test_an_unknown_cache_implementation_is_refused():
    with pytest.raises(UserError, match="cache_implementation='paged'"):
        hf_generation(job(generation={"cache_implementation": "paged"}))


def test_trl_offloads_nothing_between_phases_and_openrlhf_only_its_optimizer_side():
    with pytest.raises(UserError, match="trl 1.16.0 offloads nothing between phases"):
        trainer_rules("trl").check_offload(("params",))
    with pytest.raises(UserError, match="keeps only optimizer on the host \\(--ds.enable_sleep\\)"):
        trainer_rules("openrlhf").check_offload(("params", "optimizer"))
    trainer_rules("verl").check_offload(("params", "optimizer"))


def test_openrlhf_shards_with_deepspeed_under_zero_unless_told():
    rules = trainer_rules("openrlhf")
    assert with_trainer_layout(job(trainer="openrlhf"), rules).layout.engine == "deepspeed"
    assert with_trainer_layout(job(trainer="openrlhf", layout=Layout(world_size=8)), rules).layout.engine is None
    told = job(trainer="openrlhf", layout=Layout(world_size=8, zero=3, engine="fsdp2"))
    assert with_trainer_layout(told, rules).layout.engine == "fsdp2"


def test_verls_reference_lives_on_the_host_and_its_pass_holds_one_gathered_block(tmp_path):
    config = tiny_config("qwen2.5-0.5b", max_position_embeddings=4096)
    config.save_pretrained(tmp_path)
    result = estimate_rl(str(tmp_path / "config.json"), "grpo", "verl", prompt_len=16, completion_len=8,
                         num_generations=2, setup=TrainingSetup(batch=2), reference="copy", beta=0.001)
    ref = {p.name: p for p in result.phases}["reference log-probs"]
    held = {i.label: i.bytes for i in ref.items}
    scored = no_grad_pass(config, policy_setup(result.job, "verl-ref-logprobs"), "cuda", device_profile("h100-80gb"))
    assert held["reference parameters"] == 0
    assert held["activations + scoring"] == scored.transient_bytes + scored.parameters_bytes // 2  # 2 blocks
