"""`memplan run` of DeepSpeed programs: `deepspeed` and `torchrun` launches of a script that
calls `deepspeed.initialize` (tests/program/programs/deepspeed_loop.py), ZeRO run by DeepSpeed
itself on memplan's fake process group.

Ground truth: the same `deepspeed --num_gpus 2` command run for real, 2 processes on gloo with
DeepSpeed's CPU accelerator, each measured by torch.profiler over the same steps
(`measure_program`), ZeRO-1 with every storage alive when the window opens shown to the
profiler whole (`whole_storages`), ZeRO-2 as it runs, and a Hugging Face `Trainer` with a
ZeRO-3 config (`from_pretrained` loads its checkpoint into the partitioned model inside
`GatheredParameters`) with whole storages. The loop's ZeRO-3 comparison is
`bench:deepspeed_groundtruth`'s (docs/run.md, "DeepSpeed"). Where torch's memory-profiler
analysis of a real run fails on every attempt, the comparison is skipped, saying so. fp32
throughout: no bf16 kernel, whose CPU allocations depend on the instruction set. A buffer an
all-gather left to gloo's own thread can count at a rank's peak; as for FSDP2
(test_run_distributed.py), a run that misses on some rank is repeated in fresh processes, up to
twice, and each rank's smallest peak is compared.
"""

import json

import pytest
import torch

from memplan import models
from memplan.program import run_program

from .conftest import PROGRAMS, measured_ranks

DEEPSPEED = str(PROGRAMS / "deepspeed_loop.py")
PARTITION_BYTES = 166_208 // 2 * 4  # half of the tiny Llama's fp32 parameters


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-config")
    models.tiny_config("llama-2-7b").save_pretrained(folder)
    return folder


def _config(tmp_path, stage, **zero):
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, **zero}}))
    return path


def _deepspeed(model, data, config, *extra):
    return ["deepspeed", "--num_gpus", "2", DEEPSPEED, "--model", str(model), "--data", str(data),
            "--deepspeed_config", str(config), *extra]


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize(("stage", "zero", "whole"), [(1, {}, True), (2, {}, False)], ids=["zero1", "zero2"])
def test_cpu_run_of_deepspeed_matches_every_rank_of_the_real_gloo_run(tiny_llama, text_file, tmp_path, stage, zero,
                                                                      whole):
    command = _deepspeed(tiny_llama, text_file, _config(tmp_path, stage, **zero))
    _assert_every_rank_matches_the_real_gloo_run(command, tmp_path, whole)


def _assert_every_rank_matches_the_real_gloo_run(command, tmp_path, whole):
    estimated = [r.peak_allocated_bytes for r in run_program(command, device="cpu", steps=1,
                                                             out_dir=tmp_path / "run").estimate.per_rank]
    measured = measured_ranks(command, steps=1, whole_storages=whole)
    for _ in range(2):  # a buffer gloo still holds on its own thread (test_run_distributed.py): fresh processes
        if all(abs(e - m) <= 0.01 * m for e, m in zip(estimated, measured)):
            break
        measured = [min(a, b) for a, b in zip(measured, measured_ranks(command, steps=1, whole_storages=whole))]
    assert len(estimated) == 2
    for e, m in zip(estimated, measured):
        assert abs(e - m) <= 0.01 * m, (estimated, measured)


def test_cuda_run_of_deepspeed_zero2_holds_each_ranks_partition_of_the_optimizer_state(tiny_llama, text_file,
                                                                                       tmp_path):
    command = _deepspeed(tiny_llama, text_file, _config(tmp_path, 2))
    result = run_program(command, device="cuda", steps=0, out_dir=tmp_path / "run")
    per_rank = result.estimate.per_rank
    assert [r.rank for r in per_rank] == [0, 1]  # ZeRO's partitions are no DTensors: every rank is traced
    for rank in per_rank:
        # Adam's two states of this rank's half, each in whole 512-byte blocks of the CUDA allocator
        assert rank.breakdown["optimizer_state"] == 2 * (-(-PARTITION_BYTES // 512) * 512)


def test_torchrun_of_a_zero3_program_building_its_model_under_zero_init(tiny_llama, text_file, tmp_path):
    linear = torch.nn.functional.linear
    command = ["torchrun", "--nproc-per-node", "2", DEEPSPEED, "--model", str(tiny_llama), "--data",
               str(text_file), "--deepspeed_config",
               str(_config(tmp_path, 3, stage3_param_persistence_threshold=0)), "--zero-init"]
    result = run_program(command, device="cpu", steps=0, out_dir=tmp_path / "run")
    assert [run.steps for run in result.runs] == [1, 1]
    for rank in result.estimate.per_rank:  # Adam's two states of this rank's flat partition, and its step count
        assert rank.breakdown["optimizer_state"] == 2 * PARTITION_BYTES + 4
    assert torch.nn.functional.linear is linear  # zero.Init's zero3_linear_wrap does not outlive the run


def test_trainer_with_a_deepspeed_zero2_config_under_the_deepspeed_launcher(tiny_checkpoint, text_file, tmp_path):
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 100_000}}))
    command = ["deepspeed", "--num_gpus", "2", str(PROGRAMS / "hf_trainer.py"), "--model", str(tiny_checkpoint),
               "--data", str(text_file), "--output_dir", str(tmp_path / "trainer"), "--per_device_train_batch_size",
               "2", "--max_steps", "50", "--deepspeed", str(config)]
    result = run_program(command, device="cpu", steps=0, out_dir=tmp_path / "run")
    # the Trainer's model, called through DeepSpeed's engine
    assert (result.seen["model"]["class"], result.seen["models_called"]) == ("LlamaForCausalLM", ["DeepSpeedEngine"])
    assert result.seen["optimizer"]["implementation"] == "fused"  # the Trainer's AdamW inside DeepSpeed's engine
    assert [r.rank for r in result.estimate.per_rank] == [0, 1]


def _trainer_zero3(checkpoint, data, tmp_path):
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                  "zero_optimization": {"stage": 3, "reduce_bucket_size": 100_000,
                                                        "stage3_param_persistence_threshold": 0}}))
    return ["deepspeed", "--num_gpus", "2", str(PROGRAMS / "hf_trainer.py"), "--model", str(checkpoint),
            "--data", str(data), "--output_dir", str(tmp_path / "trainer"), "--per_device_train_batch_size",
            "2", "--max_steps", "50", "--deepspeed", str(config)]


def test_trainer_with_a_deepspeed_zero3_config_loads_its_checkpoint_into_the_partitioned_model(tiny_checkpoint,
                                                                                                text_file, tmp_path):
    command = _trainer_zero3(tiny_checkpoint, text_file, tmp_path)
    # from_pretrained builds the model under zero.Init and loads each module's weights inside
    # GatheredParameters(..., modifier_rank=0) (transformers' _load_state_dict_into_zero3_model)
    result = run_program(command, device="cpu", steps=1, out_dir=tmp_path / "run")
    assert (result.seen["model"]["class"], result.seen["models_called"]) == ("LlamaForCausalLM", ["DeepSpeedEngine"])
    for rank in result.estimate.per_rank:  # at the peak, each rank holds its half of every fp32 parameter
        assert rank.breakdown["parameters"] == 155_968 // 2 * 4
    assert [r.rank for r in result.estimate.per_rank] == [0, 1]


@pytest.mark.gloo
@pytest.mark.slow
def test_cpu_run_of_a_trainer_with_a_deepspeed_zero3_config_matches_every_rank_of_the_real_gloo_run(
        tiny_checkpoint, text_file, tmp_path):
    _assert_every_rank_matches_the_real_gloo_run(_trainer_zero3(tiny_checkpoint, text_file, tmp_path), tmp_path,
                                                 whole=True)


def test_cuda_run_of_a_trainer_under_accelerate_launch_with_a_deepspeed_config(tiny_checkpoint, text_file, tmp_path):
    from .test_launchers import DEEPSPEED_CONFIG

    config = tmp_path / "ds.yaml"
    config.write_text(DEEPSPEED_CONFIG)
    command = ["accelerate", "launch", "--config_file", str(config), str(PROGRAMS / "hf_trainer.py"), "--model",
               str(tiny_checkpoint), "--data", str(text_file), "--output_dir", str(tmp_path / "trainer"),
               "--per_device_train_batch_size", "2", "--max_steps", "50"]
    result = run_program(command, device="cuda", steps=0, out_dir=tmp_path / "run")
    # accelerate's prepare ran deepspeed.initialize: the Trainer's model is called through DeepSpeed's engine
    assert (result.seen["model"]["class"], result.seen["models_called"]) == ("LlamaForCausalLM", ["DeepSpeedEngine"])
    assert [r.rank for r in result.estimate.per_rank] == [0, 1]
