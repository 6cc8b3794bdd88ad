"""Models and training setups: what a memplan trace is a trace *of*.

A registry of public model configs shipped as Hugging Face `config.json` files
(`registry`), the training setup (`setup`), and builders of
the model and batch for one training step (`build`), its optimizer (`optimizers`), and
what the step's code tells the recorder (`tracing`). See each module.
"""

import importlib
from typing import Any

# Each public name -> the module that owns it, imported on first use (the setup and the job's
# declaration are read without torch, which `build` and `optimizers` import).
_LAZY_NAMES = {
    **dict.fromkeys(("autocast", "build_model", "count_parameters", "forward_loss", "is_fake_mode_active",
                     "make_batch", "model_class", "sequence_length"), "memplan.models.build"),
    **dict.fromkeys(("build_optimizer", "step_context"), "memplan.models.optimizers"),
    **dict.fromkeys(("FactorySpec", "list_models", "load_config", "provenance", "tiny_config"),
                    "memplan.models.registry"),
    "TrainingSetup": "memplan.models.setup",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)


__all__ = [
    "FactorySpec",
    "TrainingSetup",
    "autocast",
    "build_model",
    "build_optimizer",
    "count_parameters",
    "forward_loss",
    "is_fake_mode_active",
    "list_models",
    "load_config",
    "make_batch",
    "model_class",
    "provenance",
    "sequence_length",
    "step_context",
    "tiny_config",
]
