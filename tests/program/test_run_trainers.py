"""`memplan run` on trainers' own entry points: TRL's `SFTTrainer` (a script and `trl sft`),
a Lightning `Trainer` script (on one device, and as DDP under `torchrun` on 2 gloo ranks) and
LitGPT's `litgpt finetune lora`.

Ground truth as in test_run.py: the same command run for real on the CPU in a fresh process,
measured by torch.profiler's allocation events over the same optimizer steps
(`memplan.program.groundtruth.measure_program`), against `memplan run --device cpu`'s peak,
within 1%. Every real run is in fp32: bf16 CPU kernels allocate differently on CPUs with
AVX-512 (oneDNN's path), which the suite must not depend on.
"""

import pytest

from memplan.cli import main
from memplan.program import measure_program, run_program

from .conftest import PROGRAMS

TRL_SFT = str(PROGRAMS / "trl_sft.py")
LIGHTNING = str(PROGRAMS / "lightning_loop.py")


def _within_one_percent(estimated, measured):
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


def _sft_flags(output_dir):
    """SFTConfig in fp32 (TRL's default is bf16), 2 sequences of at most 32 tokens a step."""
    return ["--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--max_length", "32",
            "--max_steps", "50", "--logging_steps", "1", "--bf16", "false", "--report_to", "none"]


@pytest.mark.slow
def test_cpu_run_of_a_trl_sft_script_matches_the_profiler_of_the_real_run(tiny_chat_model, text_dataset, tmp_path):
    command = ["python", TRL_SFT, "--model", str(tiny_chat_model), "--data", str(text_dataset),
               *_sft_flags(tmp_path / "sft")]
    result = run_program(command, device="cpu", out_dir=tmp_path / "run")
    _within_one_percent(result.estimate.peak_allocated_bytes, measure_program(command)[0])
    assert result.seen["model"]["class"] == "LlamaForCausalLM"


@pytest.mark.slow
def test_cpu_run_of_trl_sft_cli_matches_the_profiler_of_the_real_run(tiny_chat_model, text_dataset, tmp_path):
    command = ["trl", "sft", "--model_name_or_path", str(tiny_chat_model), "--dataset_name", str(text_dataset),
               "--dtype", "float32", *_sft_flags(tmp_path / "sft")]
    result = run_program(command, device="cpu", out_dir=tmp_path / "run")
    assert result.seen["model"]["class"] == "LlamaForCausalLM"
    assert not (tmp_path / "sft").exists()  # TRL's output folder went under the run's output
    _within_one_percent(result.estimate.peak_allocated_bytes, measure_program(command)[0])


def test_cuda_run_of_trl_sft_trains_with_trls_defaults_bf16_and_gradient_checkpointing(tiny_chat_model, text_dataset,
                                                                                       tmp_path):
    # TRL's CLI checks, while it parses, that the GPU supports its default bf16: it sees the run's h100
    command = ["trl", "sft", "--model_name_or_path", str(tiny_chat_model), "--dataset_name", str(text_dataset),
               "--output_dir", str(tmp_path / "sft"), "--per_device_train_batch_size", "2", "--max_length", "32",
               "--max_steps", "50"]
    seen = run_program(command, device="cuda", steps=1, out_dir=tmp_path / "run").seen
    assert seen["autocast"] == "bf16" and seen["recomputed_ops"] > 0
@pytest.mark.slow
def test_cpu_run_of_a_lightning_trainer_matches_the_profiler_of_the_real_run(text_file, tmp_path):
    command = ["python", LIGHTNING, "--data", str(text_file), "--accelerator", "cpu", "--devices", "1"]
    result = run_program(command, device="cpu", out_dir=tmp_path)
    assert result.seen["optimizer"]["class"] == "AdamW"
    _within_one_percent(result.estimate.peak_allocated_bytes, measure_program(command)[0])


def test_cuda_run_of_a_lightning_trainer_runs_on_the_profile_gpu_in_bf16_mixed(text_file, tmp_path):
    command = ["python", LIGHTNING, "--data", str(text_file), "--accelerator", "gpu", "--devices", "1",
               "--precision", "bf16-mixed"]
    result = run_program(command, device="cuda", out_dir=tmp_path)
    assert result.seen["autocast"] == "bf16" and result.seen["model"]["class"] == "GPT"
    assert result.runs[0].steps == 3 and result.estimate.per_rank[0].peak_allocated_bytes > 0


def test_cuda_run_of_a_lightning_trainer_under_torchrun_runs_ddp_on_the_fake_group(text_file, tmp_path):
    command = ["torchrun", "--nproc-per-node", "2", LIGHTNING, "--data", str(text_file), "--accelerator", "gpu",
               "--devices", "2"]
    result = run_program(command, device="cuda", steps=1, out_dir=tmp_path)
    assert [(r.rank, r.ranks) for r in result.estimate.per_rank] == [(0, [0, 1])]  # DDP: every rank the same
    assert result.runs[0].process_groups == 1
    assert result.seen["model"]["class"] == "CharGPT"  # the LightningModule inside DDP, called through DDP


def test_a_lightning_trainer_that_would_start_its_own_processes_is_refused_naming_torchrun(text_file, tmp_path,
                                                                                         capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a node of 2 GPUs: Lightning would start 2 processes
    code = main(["run", "-o", str(tmp_path), "--", "python", LIGHTNING, "--data", str(text_file), "--accelerator",
                 "gpu", "--devices", "2"])
    assert code == 2
    assert "run it as `torchrun --nproc-per-node 2 SCRIPT ...`" in capsys.readouterr().err


def test_every_rank_of_a_lightning_ddp_run_is_traced_past_its_broadcast_of_the_log_folder(text_file, tmp_path):
    # Lightning's strategy.broadcast(log_dir) is broadcast_object_list, whose receive buffer on
    # rank 1 would be sized from the fake group's unwritten sizes
    command = ["torchrun", "--nproc-per-node", "2", LIGHTNING, "--data", str(text_file), "--accelerator", "cpu",
               "--devices", "2"]
    result = run_program(command, device="cpu", steps=0, ranks="all", out_dir=tmp_path)
    peaks = [r.peak_allocated_bytes for r in result.estimate.per_rank]
    assert len(peaks) == 2 and peaks[0] == peaks[1] > 0


@pytest.mark.gloo
@pytest.mark.slow
def test_cpu_run_of_a_lightning_ddp_torchrun_matches_every_rank_of_the_real_gloo_run(text_file, tmp_path):
    # the real run's ground truth is the profiler's allocation events: its memory timeline refuses
    # this run ("version mismatch": DDP's rebuilt buckets take the address of one freed unseen)
    command = ["torchrun", "--nproc-per-node", "2", LIGHTNING, "--data", str(text_file), "--accelerator", "cpu",
               "--devices", "2"]
    result = run_program(command, device="cpu", ranks="all", out_dir=tmp_path)
    estimated = [r.peak_allocated_bytes for r in result.estimate.per_rank]
    measured = measure_program(command)
    assert len(estimated) == len(measured) == 2
    for e, m in zip(estimated, measured):
        _within_one_percent(e, m)


def _litgpt_finetune_lora(checkpoint, data, out_dir):
    """LitGPT's LoRA fine-tuning in fp32 on its JSON data module: 2 sequences of 32 tokens a step."""
    return ["litgpt", "finetune_lora", str(checkpoint), "--data", "JSON", "--data.json_path", str(data),
            "--data.val_split_fraction", "0.1", "--out_dir", str(out_dir), "--precision", "32-true",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
            "--train.max_steps", "50", "--train.lr_warmup_steps", "1", "--eval.interval", "1000",
            "--eval.final_validation", "false", "--logger_name", "csv"]


@pytest.mark.slow
def test_cpu_run_of_litgpt_finetune_lora_matches_the_profiler_of_the_real_run(tiny_litgpt_checkpoint,
                                                                                instruction_json, tmp_path):
    command = _litgpt_finetune_lora(tiny_litgpt_checkpoint, instruction_json, tmp_path / "lora")
    result = run_program(command, device="cpu", out_dir=tmp_path / "run")
    assert result.seen["model"]["class"] == "GPT" and not (tmp_path / "lora").exists()
    _within_one_percent(result.estimate.peak_allocated_bytes, measure_program(command)[0])
