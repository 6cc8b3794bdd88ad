"""The README's "## Python" block runs as written, on tiny real objects.

The block's placeholders (`model`, `optimizer`, `train_step`, `step_fn`, `batch`,
`steps`) are bound to a real tiny GPT-2 training step on the CPU; it runs in a
temporary directory holding the files it reads (`problem.csv`, `snapshot.pickle`).
Only what would make a test slow or touch the machine is substituted, each
substitution checked to be there: llama-2-70b at 4096 tokens becomes the tiny GPT-2
config at 64, and the NVMe directory a temporary one.
"""

import re
import shutil
from pathlib import Path

import pytest
import torch

from memplan.capture.step import build_training_step
from memplan.models import TrainingSetup, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def python_block() -> str:
    """The ```python block under the README's "## Python" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md has no ```python block under ## Python"
    return match.group(1)


def substituted(block: str, substitutions: dict[str, str]) -> str:
    for old, new in substitutions.items():
        assert old in block, f"the README's Python block no longer has {old!r}: update this test"
        block = block.replace(old, new)
    return block


@pytest.mark.filterwarnings("ignore")
def test_the_readme_python_block_runs(tmp_path, monkeypatch):
    config = tmp_path / "tiny-gpt2.json"
    tiny_config("gpt2").to_json_file(str(config))
    shutil.copy(ROOT / "tests" / "data" / "snapshot_two_devices.pickle", tmp_path / "snapshot.pickle")
    (tmp_path / "nvme").mkdir()
    (tmp_path / "problem.csv").write_text("id,lower,upper,size\n0,0,2,4\n1,1,3,4\n2,2,4,4\n")
    monkeypatch.chdir(tmp_path)

    torch.manual_seed(0)
    step = build_training_step(tiny_config("gpt2"), TrainingSetup(precision="32-true", batch=2, seq=32), device="cpu")
    batch = step.batches[0]

    def step_fn(batch):
        step.optimizer.zero_grad(set_to_none=True)
        loss = step.model(**batch).loss
        loss.backward()
        step.optimizer.step()

    step.run()  # optimizer state exists before the block captures and reorders the step
    namespace = {"model": step.model, "optimizer": step.optimizer, "train_step": step.run,
                 "step_fn": step_fn, "batch": batch, "steps": 2}
    code = substituted(python_block(), {
        '"llama-2-70b"': repr(str(config)),
        "seq=4096": "seq=64",
        '"/mnt/nvme/memplan"': repr(str(tmp_path / "nvme")),
    })
    exec(compile(code, "README.md (## Python)", "exec"), namespace)

    assert (tmp_path / "step.memtrace").is_file() and (tmp_path / "step.pickle").is_file()
    assert (tmp_path / "report" / "index.html").is_file()
    assert namespace["est"].device_used_bytes > 0 and namespace["solution"].height <= 12
