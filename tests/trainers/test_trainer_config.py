"""Trainers' configuration files read as memplan's setup and layout (`--from FILE`).

The fixtures in tests/data/trainer_configs/ are the projects' own example configs (each file
names its source: axolotl's examples/llama-3/, torchtune's recipes/configs/, torchtitan's
train_configs/, accelerate's config_yaml_templates/; the TrainingArguments JSON is TRL's
`trl/scripts/sft.py` LoRA command line written as the JSON `HfArgumentParser` reads).
Every key of a file is either used or ignored, with a reason; a value memplan does not
know is refused in one line.
"""

import textwrap
from pathlib import Path

import pytest

from memplan.errors import UserError
from memplan.models import TrainingSetup
from memplan.trainers import read_trainer_config

DATA = Path(__file__).resolve().parents[1] / "data" / "trainer_configs"


def leaves(data: dict, prefix: str = "") -> set[str]:
    """`section.key` names of a nested mapping (the way the readers name nested keys)."""
    out = set()
    for key, value in data.items():
        if isinstance(value, dict) and prefix == "" and key in ("fsdp_config", "deepspeed_config"):
            out |= leaves(value, f"{key}.")
        else:
            out.add(prefix + key)
    return out


def assert_every_key_accounted_for(config, keys):
    accounted = set(config.used) | set(config.ignored)
    missing = {k for k in keys if k not in accounted and not any(a.startswith(k + ".") for a in accounted)}
    assert not missing, f"keys neither used nor ignored: {sorted(missing)}"
    assert not set(config.used) & set(config.ignored)
    TrainingSetup(**config.setup)  # what the file sets is a setup memplan can hold


def test_axolotl_qlora_example():
    import yaml

    path = DATA / "axolotl_qlora_1b.yml"
    config = read_trainer_config(path)
    assert config.format == "axolotl" and config.model == "NousResearch/Llama-3.2-1B"
    assert config.setup == {
        "seq": 2048, "allow_long_seq": True, "lora_rank": 32, "lora_alpha": 16.0,
        "lora_targets": ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"),
        "grad_accum": 4, "batch": 2, "optimizer": "adamw8bit", "precision": "bf16-true", "autocast": "bf16",
        "checkpointing": "full", "attn": "flash", "quant": "nf4", "double_quant": True, "quant_storage": "bf16"}
    assert config.layout == {} and config.unresolved == {}
    assert "dropout" in config.ignored["lora_dropout"]
    assert_every_key_accounted_for(config, yaml.safe_load(path.read_text()))


def test_axolotl_fsdp_example_needs_the_launcher_s_world_size():
    config = read_trainer_config(DATA / "axolotl_fft_fsdp.yml")
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.layout == {"zero": 3}
    assert config.setup["optimizer"] == "adamw" and config.setup["attn"] == "flash"
    assert "`world_size=N`" in config.unresolved["world_size"]
    assert config.ignored["fp16"] == "empty"


def test_torchtune_lora_recipe():
    config = read_trainer_config(DATA / "torchtune_1B_lora_single_device.yaml")
    assert config.format == "torchtune" and config.model == "llama-3.2-1b"
    assert config.setup == {
        "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "lora_rank": 64, "lora_alpha": 128.0, "batch": 4, "optimizer": "adamw", "optimizer_impl": "fused",
        "loss": "chunked", "grad_accum": 8, "precision": "bf16-true"}
    assert config.ignored["compile"] == "false"
    assert config.ignored["enable_activation_checkpointing"] == "false"


def test_torchtitan_llama3_8b():
    path = DATA / "torchtitan_llama3_8b.toml"
    config = read_trainer_config(path)
    assert config.format == "torchtitan" and config.model == "llama-3-8b"
    assert config.setup == {"optimizer": "adamw", "seq": 8192, "checkpointing": "selective-op", "batch": 1,
                            "precision": "bf16-mixed"}  # mixed_precision_param bfloat16: FSDP2's param_dtype
    assert config.layout == {"zero": 3}
    assert "data_parallel_shard_degree = -1" in config.unresolved["world_size"]
    import tomllib

    data = tomllib.loads(path.read_text())
    assert_every_key_accounted_for(config, {f"{s}.{k}" for s, t in data.items() for k in t})


def test_torchtitan_degrees_give_the_layout(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent("""
        [model]
        name = "llama3"
        flavor = "70B"
        [training]
        local_batch_size = 4
        global_batch_size = 32
        seq_len = 4096
        [parallelism]
        data_parallel_replicate_degree = 2
        data_parallel_shard_degree = 2
        tensor_parallel_degree = 2
        pipeline_parallel_degree = 2
        pipeline_parallel_microbatch_size = 1
        pipeline_parallel_schedule = "Interleaved1F1B"
        [activation_checkpoint]
        mode = "full"
        [compile]
        enable = true
    """))
    config = read_trainer_config(path)
    assert config.model == "llama-3-70b"
    assert config.layout == {"tp": 2, "pp": 2, "microbatches": 4, "schedule": "interleaved", "zero": 3,
                             "world_size": 16, "shard_size": 2}
    assert config.setup["batch"] == 1 and config.setup["grad_accum"] == 2  # 32 / (4 x 2 x 2)
    assert config.setup["checkpointing"] == "full" and config.setup["compile"] == "blocks"
    assert config.unresolved == {}


def test_torchtitan_context_parallelism_and_zero_bubble_schedules(tmp_path):
    path = tmp_path / "cp.toml"
    path.write_text("[model]\nname = 'llama3'\nflavor = '8B'\n[training]\nlocal_batch_size = 2\nseq_len = 8192\n"
                    "[parallelism]\ndata_parallel_shard_degree = 2\ncontext_parallel_degree = 4\n")
    config = read_trainer_config(path)
    # FSDP2 shards over dp_shard x cp (torchtitan's ParallelDims.fsdp_enabled); world = 2 x 4
    assert config.layout == {"cp": 4, "zero": 3, "world_size": 8}
    path.write_text("[model]\nname = 'llama3'\nflavor = '8B'\n[training]\nlocal_batch_size = 4\n"
                    "[parallelism]\ndata_parallel_shard_degree = 1\npipeline_parallel_degree = 4\n"
                    "pipeline_parallel_schedule = 'ZBVZeroBubble'\n")
    assert read_trainer_config(path).layout["schedule"] == "zbv"


def test_accelerate_fsdp_and_deepspeed_templates():
    fsdp = read_trainer_config(DATA / "accelerate_fsdp.yaml")
    assert fsdp.format == "accelerate" and fsdp.model is None
    assert fsdp.layout == {"world_size": 2, "zero": 3} and fsdp.setup == {"precision": "bf16-mixed"}
    assert fsdp.unresolved == {}
    deepspeed = read_trainer_config(DATA / "accelerate_deepspeed.yaml")  # reads zero_stage2_config.json beside it
    assert deepspeed.layout == {"world_size": 2, "zero": 2}
    assert deepspeed.setup["precision"] == "16-mixed"  # DeepSpeed's fp16 mode
    assert "16-mixed" in deepspeed.used["deepspeed_config.deepspeed_config_file.fp16"]


def test_training_arguments_json_with_trl_lora():
    config = read_trainer_config(DATA / "trl_sft_lora.json")
    assert config.format == "hf-trainer" and config.model == "Qwen/Qwen2-0.5B"
    assert config.setup == {"batch": 2, "grad_accum": 8, "checkpointing": "full", "lora_rank": 32,
                            "lora_alpha": 16.0, "precision": "bf16-mixed", "seq": 1024, "optimizer": "adamw",
                            "optimizer_impl": "fused"}


@pytest.mark.parametrize(("name", "text", "message"), [
    ("a.yml", "base_model: x/y\noptimizer: lamb\n", "optimizer: 'lamb' is not a value memplan knows"),
    ("a.yml", "base_model: x/y\nadapter: lora\n", "adapter lora needs lora_r"),
    ("a.yml", "base_model: x/y\nliger_rms_norm: true\n", "liger_rms_norm: true is not modelled"),
    ("a.yml", "base_model: x/y\noptimizer: adafactor\n", "transformers' Adafactor"),
    ("t.yaml", "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\noptimizer:\n"
               "  _component_: torch.optim.RAdam\n", "optimizer._component_: 'torch.optim.RAdam'"),
    ("j.toml", "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = 'DualPipeV'\n",
     "pipeline_parallel_schedule: 'DualPipeV'"),
    ("j.toml", "[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = '2'\n", "selective_ac_option 2"),
    ("c.yaml", "distributed_type: MEGATRON_LM\n", "distributed_type: 'MEGATRON_LM'"),
    ("c.yaml", "distributed_type: NO\nmixed_precision: fp8\n", "mixed_precision: 'fp8'"),
    ("args.json", '{"per_device_train_batch_size": 0}', "per_device_train_batch_size: 0"),
    ("other.yaml", "foo: 1\n", "not a configuration memplan reads"),
    ("bad.yaml", "a: [1\n", "does not parse"),
])
def test_a_value_memplan_does_not_know_is_refused_in_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        read_trainer_config(path)
    assert "\n" not in str(info.value)


def test_an_unknown_torchtune_model_leaves_the_model_to_the_command_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  _component_: torchtune.models.qwen3.qwen3_8b\nbatch_size: 2\n")
    config = read_trainer_config(path)
    assert config.model is None and "give MODEL" in config.unresolved["model"]
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    path.write_text(path.read_text() + f"checkpointer:\n  checkpoint_dir: {checkpoint}\n")
    config = read_trainer_config(path)  # a local checkpoint's config.json is the model itself
    assert config.model == str(checkpoint) and "model" not in config.unresolved


@pytest.mark.parametrize(("name", "text", "closest"), [
    ("a.yml", "base_model: gpt2\nmicro_batch_sise: 8\n", "micro_batch_size"),
    ("r.yaml", "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_sise: 2\n", "batch_size"),
    ("j.toml", "[trainng]\nlocal_batch_size = 2\n", "training"),
    ("c.yaml", "distributed_type: NO\nmixed_precison: bf16\n", "mixed_precision"),
    ("args.json", '{"per_device_train_batch_sise": 4}', "per_device_train_batch_size"),
])
def test_a_misspelt_key_is_refused_naming_the_key_memplan_knows(tmp_path, name, text, closest):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=f"did you mean '{closest}'") as info:
        read_trainer_config(path)
    assert "\n" not in str(info.value)


def test_a_key_the_trainer_knows_without_memory_effect_stays_ignored(tmp_path):
    path = tmp_path / "args.json"
    path.write_text('{"per_device_train_batch_size": 4, "learning_rate": 1e-4, "full_determinism": true}')
    config = read_trainer_config(path)
    assert config.ignored["learning_rate"] == "does not change the memory of one training step"
    assert config.ignored["full_determinism"] == "not a key memplan maps"


def test_a_file_builds_a_real_setup_and_layout_once_the_launcher_s_world_size_is_given():
    config = read_trainer_config(DATA / "axolotl_fft_fsdp.yml")
    with pytest.raises(UserError, match="`world_size=N`"):
        config.to_layout()
    layout = config.to_layout(world_size=8)
    assert (layout.world_size, layout.zero, layout.zero_engine) == (8, 3, "fsdp2")
    assert config.to_setup().attn == "flash"


def test_a_file_that_names_no_precision_is_the_trainer_s_own_default_said_back(tmp_path):
    path = tmp_path / "args.json"
    path.write_text('{"per_device_train_batch_size": 4}')
    config = read_trainer_config(path)  # the HF Trainer runs fp32 unless bf16 or fp16 is set
    assert config.setup["precision"] == "32-true" and "bf16 and fp16 default to false" in config.defaults["precision"]
