"""`memplan run -- torchrun --nproc-per-node 2 -m torchtitan.train --job.config_file F`:
torchtitan's trainer with its Llama 3 debug model, traced on 2 ranks of the fake process group.

torchtitan imports triton, which memplan's CPU build of torch does not bring, so it lives in
its own folder, `sys.prefix/torchtitan` (the Makefile installs requirements-torchtitan.lock
there; `MEMPLAN_TORCHTITAN_PATH` names another), put first on PYTHONPATH of a fresh process.
The tests skip, saying so, where the folder is missing.

The job is torchtitan's own: its TOML (`[model] flavor = "debugmodel"`, 6 layers of 256, a
vocabulary of 2048), its `c4_test` loader reading a local JSON folder (`dataset_path`), a
WordLevel tokenizer built here, FSDP2 over both ranks with bf16 parameters and fp32
reductions (its defaults), selective activation checkpointing.

No ground truth: torchtitan cannot run on a CPU. It takes the device type
`_get_available_device_type() or "cuda"` (torchtitan/tools/utils.py, `get_device_info`) and
calls `torch.cuda.set_device` in `Trainer.__init__`, so a real run needs a GPU per rank. What
these tests check is what the run saw and the optimizer state's size, computed by hand: AdamW's
two fp32 states of each rank's half of the 6,163,712 parameters (FSDP2 shards dim 0 over 2
ranks), each state rounded up to the caching allocator's 512-byte blocks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memplan

SRC = str(Path(memplan.__file__).resolve().parents[1])
TORCHTITAN = Path(os.environ.get("MEMPLAN_TORCHTITAN_PATH", Path(sys.prefix) / "torchtitan"))

pytestmark = pytest.mark.skipif(not (TORCHTITAN / "torchtitan").is_dir(),
                                reason=f"torchtitan is not installed in {TORCHTITAN} "
                                       "(make setup installs requirements-torchtitan.lock there)")

PARAMETERS = 6_163_712  # torchtitan's llama3 debugmodel
TENSORS = 57  # its parameter tensors: embedding, 6 x (4 attention, 3 MLP, 2 norms), final norm, output

CONFIG = """[job]
dump_folder = "{out}"

[metrics]
log_freq = 1

[model]
name = "llama3"
flavor = "{flavor}"
hf_assets_path = "{files}/tokenizer"

[optimizer]
name = "AdamW"
lr = 8e-4

[lr_scheduler]
warmup_steps = 2

[training]
local_batch_size = 2
seq_len = 64
steps = 10
dataset = "c4_test"
dataset_path = "{files}/c4_test"

[parallelism]
data_parallel_shard_degree = -1

[activation_checkpoint]
mode = "selective"

[checkpoint]
enable = false
"""


@pytest.fixture(scope="module")
def titan_files(tmp_path_factory, text_file) -> Path:
    """JSON rows of text in a folder (`load_dataset(path)`, as c4_test is read) and a WordLevel
    tokenizer of its words with BOS and EOS, as torchtitan's HuggingFaceTokenizer loads one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    files = tmp_path_factory.mktemp("titan")
    words = text_file.read_text().split()
    (files / "c4_test").mkdir()
    (files / "c4_test" / "train.json").write_text(
        "".join(json.dumps({"text": " ".join(words[i:i + 60])}) + "\n" for i in range(0, 64 * 60, 60)))
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *sorted(set(words))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (files / "tokenizer").mkdir()
    tokenizer.save(str(files / "tokenizer" / "tokenizer.json"))
    (files / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return files


def _memplan_run(tmp_path, files, flavor, *flags) -> dict:
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.format(out=tmp_path / "outputs", files=files, flavor=flavor))
    command = ["torchrun", "--nproc-per-node", "2", "-m", "torchtitan.train", "--job.config_file", str(config), *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TORCHTITAN), SRC])}
    done = subprocess.run([sys.executable, "-c", "import sys; from memplan.cli import main; sys.exit(main(sys.argv[1:]))",
                           "run", "--json", "-o", str(tmp_path / "run"), "--", *command],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()  # torchtitan's dump folder went under the run's output
    return json.loads(done.stdout)


def _per_rank_adamw_state_bytes() -> int:
    shard = PARAMETERS // 2 * 4
    return 2 * shard  # exp_avg and exp_avg_sq


@pytest.mark.slow
@pytest.mark.parametrize("flavor, flags", [("debugmodel", []), ("debugmodel_flex_attn", ["--compile.enable"])],
                         ids=["sdpa", "flex-attention-compiled"])
def test_torchtitans_trainer_on_two_fsdp2_ranks_is_traced_with_half_the_optimizer_state_per_rank(
        titan_files, tmp_path, flavor, flags):
    doc = _memplan_run(tmp_path, titan_files, flavor, *flags)
    assert doc["layout"]["world_size"] == 2 and doc["layout"]["dtensor_meshes"] == {"fsdp=2": ["S(0)"]}
    assert doc["layout"]["fsdp2_mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert doc["parameters"] == PARAMETERS and doc["runs"][0]["steps"] == 3
    assert doc["seen"]["forward_calls_per_step"] == [1, 1, 1]
    # the OptimizersContainer steps one AdamW (one model part): its states are the run's
    assert doc["seen"]["optimizer"]["class"] == "AdamW"
    assert doc["seen"]["optimizer"]["state_dtypes"] == {"fp32": 2 * TENSORS}
    state = doc["per_rank"][0]["breakdown"]["optimizer_state"]
    assert _per_rank_adamw_state_bytes() <= state <= _per_rank_adamw_state_bytes() + 2 * TENSORS * 512
