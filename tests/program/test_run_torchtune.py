"""`memplan run -- tune run RECIPE --config F`: torchtune's recipes, traced as they run.

torchtune 0.6.1 imports only with a torchao older than memplan's (requirements-torchtune.lock),
so it lives in its own folder, `sys.prefix/torchtune` (the Makefile installs it there;
`MEMPLAN_TORCHTUNE_PATH` names another), and every process that runs it is a fresh one with
that folder first on PYTHONPATH: `memplan run --json` and the ground truth
(`measure_program`) alike. The tests skip, saying so, where the folder is missing.

The recipes are torchtune's own (`full_finetune_single_device`, `lora_finetune_single_device`)
with torchtune's component builders at tiny sizes (`llama3_2` / `lora_llama3_2` with the
dimensions of `models.tiny_config("llama-3.2-1b")`), its HF checkpointer reading the tiny
bf16 checkpoint (`tiny_checkpoint`, loaded into fp32 parameters), a SentencePiece character
tokenizer trained here on the data, and `text_completion_dataset` over a local JSON file.
fp32 throughout: the ground truth must not depend on the CPU's bf16 kernels.

Ground truth: the same command run for real, measured by torch.profiler over the same
optimizer steps, within 1% (measured: +3,040 B of 4,261,628 B for the full recipe with
torchtune's default optimizer in backward, +2,940 B of 3,016,320 B for LoRA).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memplan

SRC = str(Path(memplan.__file__).resolve().parents[1])
TORCHTUNE = Path(os.environ.get("MEMPLAN_TORCHTUNE_PATH", Path(sys.prefix) / "torchtune"))

pytestmark = pytest.mark.skipif(not (TORCHTUNE / "torchtune").is_dir(),
                                reason=f"torchtune is not installed in {TORCHTUNE} "
                                       "(make setup installs requirements-torchtune.lock there)")

MODEL = """  vocab_size: 512
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  embed_dim: 64
  intermediate_dim: 256
  max_seq_len: 256
"""

CONFIG = """output_dir: {out}
model:
  _component_: {model}
{model_args}tokenizer:
  _component_: torchtune.models.llama2.llama2_tokenizer
  path: {files}/tok.model
  max_seq_len: 64
  prompt_template: null
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {checkpoint}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: {out}
  model_type: LLAMA3_2
resume_from_checkpoint: False
save_adapter_weights_only: True
dataset:
  _component_: torchtune.datasets.text_completion_dataset
  source: json
  data_files: {files}/data.json
  column: text
  split: train
seed: 0
shuffle: True
batch_size: 2
epochs: 1
max_steps_per_epoch: 10
gradient_accumulation_steps: 1
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-4
{extra}loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
clip_grad_norm: null
compile: False
device: cpu
dtype: fp32
enable_activation_checkpointing: False
enable_activation_offloading: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: {out}/logs
log_every_n_steps: 1
log_peak_memory_stats: False
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
"""

FULL = {"model": "torchtune.models.llama3_2.llama3_2", "model_args": MODEL,
        "extra": "optimizer_in_bwd: True\n"}  # the default of torchtune's single-device full configs
LORA = {"model": "torchtune.models.llama3_2.lora_llama3_2",
        "model_args": "  lora_attn_modules: [q_proj, v_proj, output_proj]\n  apply_lora_to_mlp: True\n"
                      "  lora_rank: 8\n  lora_alpha: 16\n" + MODEL,
        "extra": "lr_scheduler:\n  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup\n"
                 "  num_warmup_steps: 2\n"}


def _in_torchtune_process(args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    """A fresh Python with torchtune's folder first on its path, then memplan's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TORCHTUNE), SRC])}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def tune_files(tmp_path_factory, text_file) -> Path:
    """The recipes' data (JSON rows of text) and a SentencePiece character tokenizer trained on it."""
    files = tmp_path_factory.mktemp("tune")
    words = text_file.read_text().split()
    rows = [{"text": " ".join(words[i:i + 40])} for i in range(0, 64 * 40, 40)]
    (files / "data.json").write_text(json.dumps(rows))
    (files / "corpus.txt").write_text("\n".join(r["text"] for r in rows))
    done = _in_torchtune_process(["-c", f"""import sentencepiece as spm
spm.SentencePieceTrainer.train(input={str(files / 'corpus.txt')!r}, model_prefix={str(files / 'tok')!r},
    vocab_size=40, model_type="char", pad_id=0, unk_id=1, bos_id=2, eos_id=3)"""])
    assert done.returncode == 0, done.stderr[-2000:]
    return files


def _tune_command(tmp_path, files, checkpoint, recipe, parts) -> list[str]:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(out=tmp_path / "out", files=files, checkpoint=checkpoint, **parts))
    return ["tune", "run", recipe, "--config", str(config)]


def _memplan_run(command, out_dir) -> dict:
    done = _in_torchtune_process(["-c", "import sys; from memplan.cli import main; sys.exit(main(sys.argv[1:]))",
                                  "run", "--json", "--device", "cpu", "-o", str(out_dir), "--", *command])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _profiler_peaks(command) -> list[int]:
    done = _in_torchtune_process(["-c", "import json, sys; from memplan.program import measure_program; "
                                  "print(json.dumps(measure_program(json.loads(sys.argv[1]))))", json.dumps(command)])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _within_one_percent(estimated, measured):
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


@pytest.mark.slow
def test_cpu_run_of_torchtunes_full_recipe_with_its_optimizer_in_backward_matches_the_profiler(
        tune_files, tiny_checkpoint, tmp_path):
    command = _tune_command(tmp_path, tune_files, tiny_checkpoint, "full_finetune_single_device", FULL)
    doc = _memplan_run(command, tmp_path / "run")
    _within_one_percent(doc["peak_allocated_bytes"], _profiler_peaks(command)[0])
    assert doc["seen"]["optimizer"]["in_backward"] == 20  # one AdamW per parameter, stepped in backward
    assert doc["seen"]["optimizer"]["state_dtypes"] == {"fp32": 40}
    assert doc["runs"][0]["steps"] == 3 and doc["seen"]["forward_calls_per_step"] == [1, 1, 1]


@pytest.mark.slow
def test_cpu_run_of_torchtunes_lora_recipe_matches_the_profiler(tune_files, tiny_checkpoint, tmp_path):
    command = _tune_command(tmp_path, tune_files, tiny_checkpoint, "lora_finetune_single_device", LORA)
    doc = _memplan_run(command, tmp_path / "run")
    assert not (tmp_path / "out").exists()  # the recipe's folders went under the run's output
    # the recipe gives AdamW every parameter; the trainable ones are the adapters, A and B of 6 linears x 2 layers
    assert doc["seen"]["optimizer"]["state_dtypes"] == {"fp32": 2 * 24}
    _within_one_percent(doc["peak_allocated_bytes"], _profiler_peaks(command)[0])  # the real run writes its folders


def test_tune_run_is_read_by_torchtunes_own_parser_and_recipe_lookup(tmp_path):
    commands = [["tune", "run", "lora_finetune_single_device", "--config", "llama3_2/1B_lora_single_device",
                 "batch_size=2"],
                ["tune", "run", "--nproc_per_node", "4", "full_finetune_distributed", "--config", "my.yaml"],
                ["tune", "run", "recipes/my_recipe.py", "--config", "my.yaml"]]
    done = _in_torchtune_process(["-c", """import dataclasses, json, sys
from memplan.program.launchers import parse_command
print(json.dumps([dataclasses.asdict(parse_command(c)) for c in json.loads(sys.argv[1])]))""", json.dumps(commands)])
    assert done.returncode == 0, done.stderr[-2000:]
    builtin, distributed, custom = json.loads(done.stdout.splitlines()[-1])
    assert builtin["target"].endswith("recipes/lora_finetune_single_device.py") and not builtin["module"]
    assert builtin["args"][1].endswith("recipes/configs/llama3_2/1B_lora_single_device.yaml")
    assert builtin["args"][2] == "batch_size=2" and builtin["world_size"] == 1 and not builtin["distributed"]
    assert (distributed["world_size"], distributed["distributed"]) == (4, True)
    assert distributed["target"].endswith("recipes/full_finetune_distributed.py")
    assert (custom["target"], custom["module"], custom["args"]) == ("recipes.my_recipe", True, ["--config", "my.yaml"])
    assert custom["path_after"] == [os.getcwd()]


def test_torchtune_imported_to_read_a_cuda_run_decides_flex_attention_for_the_runs_gpu():
    # torchtune sets _SUPPORTS_FLEX_ATTENTION at import (CUDA of capability >= 7.5); the recipe
    # then runs in the same process, so the import must see the GPU the run is for
    done = _in_torchtune_process(["-c", """from memplan.hardware.devices import device_profile
from memplan.program import cuda_api
from memplan.program.launchers import parse_command
import torch
parse_command(["tune", "run", "full_finetune_single_device", "--config", "llama3_2/3B_full_single_device"],
              lambda: cuda_api.answering(device_profile("a100-80gb")))
from torchtune.utils import _import_guard
print(_import_guard._SUPPORTS_FLEX_ATTENTION, torch.cuda.is_available())"""])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]  # flex for the A100; the host's own answer is back
