"""`memplan run` on trainers' own entry points: TRL's `SFTTrainer` (a script and `trl sft`),
a Lightning `Trainer` script and LitGPT's `litgpt finetune lora`.

Ground truth as in test_run.py: the same command run for real on the CPU in a fresh process,
measured by torch.profiler's memory timeline over the same optimizer steps
(`memplan.program.groundtruth.measure_program`), against `memplan run --device cpu`'s peak,
within 1%. Every real run is in fp32: bf16 CPU kernels allocate differently on CPUs with
AVX-512 (oneDNN's path), which the suite must not depend on.
"""

import pytest

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
