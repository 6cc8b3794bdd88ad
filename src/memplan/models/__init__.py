"""Models and training setups: what a memplan trace is a trace *of*.

A registry of public model configs shipped as Hugging Face `config.json` files
(`registry`), the training setup (`setup`), and builders of
the model and batch for one training step (`build`), its optimizer (`optimizers`), and
what the step's code tells the recorder (`tracing`). See each module.
"""

from memplan.models.build import (
    autocast,
    build_model,
    count_parameters,
    forward_loss,
    is_fake_mode_active,
    make_batch,
    model_class,
    sequence_length,
)
from memplan.models.optimizers import build_optimizer, step_context
from memplan.models.registry import (
    FactorySpec,
    list_models,
    load_config,
    provenance,
    tiny_config,
)
from memplan.models.setup import TrainingSetup

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
