"""A trainer's own configuration file, read as memplan's training setup and parallel layout.

`read_trainer_config(path)` reads one of five formats into a `TrainerConfig`
(`memplan.trainers.mapping`): the model it names, the `TrainingSetup` and `Layout` fields it
sets (`to_setup()` and `to_layout()` build the real objects), and, key by key, what each key
did (`used`) or why it was left out (`ignored`). A value memplan does not know is refused in
one line (`UserError`); what the file cannot settle alone (the world size a launcher gives)
is `unresolved` until the caller gives it. One module per format:

| format | module | recognised by | keys written from |
|---|---|---|---|
| axolotl YAML | `axolotl` | `base_model`, `micro_batch_size` or `sequence_len` | axolotl's `examples/`, `src/axolotl/loaders/model.py` |
| torchtune recipe YAML | `torchtune` | `_component_` entries (`model`, `optimizer`, `loss`) | torchtune's `recipes/configs/` |
| torchtitan TOML | `torchtitan` | a `.toml` file | torchtitan's `train_configs/*.toml`, `torchtitan/config/job_config.py` |
| accelerate config YAML | `accelerate` | `distributed_type` or `compute_environment` | the file `accelerate config` writes |
| `TrainingArguments` JSON | `training_arguments` | a `.json` file | `transformers.TrainingArguments` (+ TRL's model options) |

docs/inputs.md lists every key of every format with what it sets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.trainers import accelerate, axolotl, torchtitan, torchtune, training_arguments
from memplan.trainers.mapping import LAYOUT_FIELDS, SETUP_FIELDS, Mapper, TrainerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib

__all__ = ["FORMATS", "LAYOUT_FIELDS", "SETUP_FIELDS", "TrainerConfig", "detect_format", "read_trainer_config"]

# The precision each trainer runs when its file names none, and why.
DEFAULT_PRECISIONS = {
    "axolotl": ("32-true", "axolotl loads the model in fp32 without autocast unless bf16 or fp16 is set"),
    "torchtune": ("32-true", "torchtune's training.get_dtype(None) is fp32"),
    "torchtitan": ("bf16-mixed", "torchtitan's training.mixed_precision_param defaults to bfloat16"),
    "accelerate": ("32-true", "accelerate's mixed_precision defaults to no"),
    "hf-trainer": ("32-true", "TrainingArguments' bf16 and fp16 default to false"),
}
READERS = {"axolotl": axolotl.read, "torchtune": torchtune.read, "torchtitan": torchtitan.read,
           "accelerate": accelerate.read, "hf-trainer": training_arguments.read}
FORMATS = ("axolotl", "torchtune", "torchtitan", "accelerate", "hf-trainer")


def read_trainer_config(path: str | Path) -> TrainerConfig:
    """The model, setup and layout fields a trainer's configuration file sets (module docstring)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --from {path}: {getattr(exc, 'strerror', None) or exc}") from None
    data = _parse(path, text)
    fmt = detect_format(path, data)
    m = Mapper(path, fmt)
    READERS[fmt](m, data)
    m.finish(*DEFAULT_PRECISIONS[fmt])
    return m.config


def _parse(path: Path, text: str) -> dict[str, Any]:
    """The file as a dict: TOML or JSON by its suffix, YAML otherwise."""
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # tomllib, json and yaml each raise their own error types
        raise UserError(f"--from {path} does not parse: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--from {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def detect_format(path: Path, data: dict[str, Any]) -> str:
    """Which trainer wrote `data` (the table in the module docstring)."""
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate"
    if path.suffix == ".toml":
        return "torchtitan"
    if path.suffix == ".json":
        return "hf-trainer"
    if any(isinstance(v, dict) and "_component_" in v for v in data.values()):
        return "torchtune"
    if {"base_model", "micro_batch_size", "sequence_len"} & set(data):
        return "axolotl"
    raise UserError(f"--from {path}: not a configuration memplan reads (an axolotl or torchtune YAML, a "
                    "torchtitan TOML, an accelerate config YAML or a TrainingArguments JSON)")


