"""`memplan rl --from`: each trainer's own configuration, key by key."""

import json

import pytest
import yaml

from memplan.errors import UserError
from memplan.rl.config import read_rl_config


def test_a_trl_grpo_config_sets_batch_generations_lengths_and_the_colocated_engine(tmp_path):
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 4, "num_generations": 8, "max_completion_length": 256,
                                "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.4,
                                "vllm_enable_sleep_mode": True, "learning_rate": 1e-6}))
    values, report = read_rl_config(path)
    assert values["trainer"] == "trl" and values["algo"] == "grpo" and values["rollout"] == "vllm-colocate"
    assert values["setup"]["batch"] == 4 and values["num_generations"] == 8 and values["completion_len"] == 256
    assert values["engine"]["gpu_memory_utilization"] == 0.4 and values["sleep_level"] == 2
    assert report["ignored"] == ["learning_rate"]


def test_verl_overrides_read_nested_and_dotted_alike(tmp_path):
    nested = {"actor_rollout_ref": {"rollout": {"gpu_memory_utilization": 0.6, "n": 5},
                                    "actor": {"ppo_micro_batch_size_per_gpu": 16}},
              "data": {"max_prompt_length": 1024, "max_response_length": 1024}, "algorithm": {"adv_estimator": "grpo"}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(nested))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
                                                     "actor_rollout_ref.rollout.n": 5,
                                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16,
                                                     "data.max_prompt_length": 1024, "data.max_response_length": 1024,
                                                     "algorithm.adv_estimator": "grpo"}))
    assert read_rl_config(tmp_path / "a.yaml")[0] == read_rl_config(tmp_path / "b.yaml")[0]
    values = read_rl_config(tmp_path / "a.yaml")[0]
    assert values["trainer"] == "verl" and values["engine"]["gpu_memory_utilization"] == 0.6
    assert values["num_generations"] == 5 and values["setup"]["batch"] == 16


def test_openrlhf_arguments_set_sleep_level_1_and_colocation(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"actor": {"model_name_or_path": "Qwen/Qwen2.5-7B"}, "train.micro_batch_size": 2,
                                "vllm": {"enable_sleep": True}, "train.colocate_all": True, "ds.zero_stage": 3,
                                "data.max_len": 2048, "rollout.max_new_tokens": 1024}))
    values, _ = read_rl_config(path)
    assert values["prompt_len"] == 1024 and values["completion_len"] == 1024
    assert values["trainer"] == "openrlhf" and values["sleep_level"] == 1 and values["rollout"] == "vllm-colocate"
    assert values["layout"]["zero"] == 3 and values["model"] == "Qwen/Qwen2.5-7B"


def test_a_value_of_the_wrong_type_is_refused(tmp_path):
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps({"num_generations": "eight"}))
    with pytest.raises(UserError, match="num_generations='eight'"):
        read_rl_config(path)


def test_trls_generation_settings_are_read_and_generation_kwargs_win(tmp_path):
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps({"generation_kwargs": {"top_k": 50, "min_new_tokens": 8}, "num_generations": 4,
                                "top_k": 20, "temperature": 0.7, "cache_implementation": "static",
                                "ds3_gather_for_generation": False}))
    values, report = read_rl_config(path)
    assert values["generation"] == {"top_k": 50, "temperature": 0.7, "cache_implementation": "static",
                                    "ds3_gather_for_generation": False}
    assert report["ignored"] == ["generation_kwargs.min_new_tokens"]


def test_verls_param_and_optimizer_offload_and_openrlhfs_deepspeed_sleep_are_offloads_between_phases(tmp_path):
    verl = tmp_path / "verl.yaml"
    verl.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"fsdp_config": {"param_offload": True,
                                                                                     "optimizer_offload": True}}}}))
    assert read_rl_config(verl)[0]["offload"] == {"params": True, "optimizer": True}
    openrlhf = tmp_path / "args.json"
    openrlhf.write_text(json.dumps({"ds.enable_sleep": True, "ds.zero_stage": 3}))
    values = read_rl_config(openrlhf)[0]
    assert values["offload"] == {"optimizer": True} and values["setup"] == {}
