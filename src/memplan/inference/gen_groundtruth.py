"""Ground truth for tensor-parallel `generate()`: real processes on gloo, each loading the
model as users do and measured by torch.profiler.

`measure_tp_generation` starts T processes (`memplan.parallel.groundtruth.measure_rank_calls`:
the gloo backend, one warm-up call, then one measured by torch.profiler's memory timeline).
Each loads the model by the users' path, `from_pretrained(None, config=..., state_dict=...,
distributed_config=DistributedConfig(tp_size=T))` (transformers 5.23 `modeling_utils.py`
`from_pretrained`: a state dict of the seeded weights `gen_capture.build_generation_model`
makes, in place of a checkpoint, sliced into each rank's shards by transformers' loader), and
runs `generate()` on the same seeded prompts as every other rank. The estimate it is held to
traces rank 0 on a fake process group (`memplan.inference.gen_parallel`).

Assumes a small model: every rank builds the whole model once on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memplan.inference.gen_capture import (
    GenerationSetup,
    build_generation_model,
    generation_inputs,
    run_generate,
)
from memplan.models.build import model_class
from memplan.models.dtypes import TORCH_DTYPES
from memplan.models.setup import TrainingSetup
from memplan.parallel.groundtruth import measure_rank_calls

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig


def load_tensor_parallel(config: PretrainedConfig, setup: TrainingSetup, tp: int) -> torch.nn.Module:
    """The model as users load it with TP on a real process group of `tp` ranks: the seeded
    weights `build_generation_model` makes, as a state dict, through `from_pretrained` with
    `DistributedConfig(tp_size=tp)`, in eval mode with the cache on."""
    from transformers.distributed import DistributedConfig

    built = build_generation_model(config, setup)
    state = {name: tensor.detach().clone() for name, tensor in built.state_dict().items()}
    attention = built.config._attn_implementation
    del built
    model = model_class(config).from_pretrained(
        None, config=config, state_dict=state, dtype=TORCH_DTYPES[setup.dtype], attn_implementation=attention,
        distributed_config=DistributedConfig(tp_size=tp))
    model.eval()
    model.config.use_cache = True
    return model


def _tp_generation_call(case: tuple[PretrainedConfig, TrainingSetup, GenerationSetup, int],
                        rank: int) -> Callable[[], Any]:
    """One rank's `generate()` call of `case` on the real process group (module docstring)."""
    config, setup, generation, tp = case
    model = load_tensor_parallel(config, setup, tp)
    inputs = generation_inputs(config, generation)  # seeded: the same prompts on every rank
    return lambda: run_generate(model, inputs, generation)


def measure_tp_generation(cases: list[tuple[PretrainedConfig, TrainingSetup, GenerationSetup]],
                          tp: int) -> list[list[int]]:
    """Per case, the profiler peak bytes of one real TP `generate()` call on each of `tp` gloo
    ranks (rank order), after a warm-up call."""
    return measure_rank_calls(_tp_generation_call, [(c, s, g, tp) for c, s, g in cases], tp)
