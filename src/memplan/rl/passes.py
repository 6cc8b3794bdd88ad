"""No-gradient passes of an RL step, traced: the log-probabilities of the old policy and of
the reference, and a reward model's score.

A pass is the trainer's own code on one micro-batch of `[rows, P + C]` tokens under
`torch.no_grad()`: the model's forward and, for log-probabilities, the trainer's scoring
of the completion tokens (`memplan.models.rl_losses`, e.g. `trl-logprobs:C`), or a
sequence-classification head for a reward model. It is recorded with memplan's capture
(`memplan.capture.capture`) on fake tensors, with CUDA's kernels where the job is CUDA's,
and replayed through PyTorch's caching allocator (`memplan.estimation.pipeline`), as a
training step is. A deep model is traced at 3 and 4 blocks and its figures extrapolated
linearly to the model's depth: a no-gradient forward keeps no activations from one block
to the next, so its peak (at the head, or in the heaviest block) grows by one block's
parameters per block.

The answer is split into what the pass finds resident (the model's parameters) and what
it adds on top (`transient_bytes`: activations, the head's tiles and statistics, the
allocator's rounding): the phase model (`memplan.rl.phases`) puts the transient on top of
whatever else the trainer keeps on the GPU at that time.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture.api import capture
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.step import StepTrace
from memplan.estimation import layers
from memplan.estimation.pipeline import TRACE_BLOCKS, gpu_view, replay_counters
from memplan.hardware.devices import DeviceProfile
from memplan.models.build import transformer_blocks, transformer_blocks_path
from memplan.models.depth import num_layers, with_layers
from memplan.models.losses import step_loss
from memplan.models.setup import TrainingSetup
from memplan.trace import edit as trace_edit
from memplan.trace.model import CATEGORY, Trace

DEEP_BLOCKS = 6  # from this depth on a pass is traced at 3 and 4 blocks and extrapolated


@dataclass(frozen=True)
class PassFigures:
    """One no-gradient pass on one device, in bytes."""

    parameters_bytes: int  # the model's parameters (and buffers) the pass reads
    peak_allocated_bytes: int
    peak_reserved_bytes: int

    @property
    def transient_bytes(self) -> int:
        """What the pass allocates above the parameters at its peak."""
        return max(self.peak_allocated_bytes - self.parameters_bytes, 0)

    @property
    def cached_bytes(self) -> int:
        """What the caching allocator keeps reserved above the allocated peak."""
        return max(self.peak_reserved_bytes - self.peak_allocated_bytes, 0)


_CACHE: dict[str, PassFigures] = {}


def no_grad_pass(config: object, setup: TrainingSetup, device: str, profile: DeviceProfile | None) -> PassFigures:
    """The figures of one no-gradient pass of `config` under `setup` (its `batch` rows,
    `seq` tokens, `loss` the trainer's scoring, `head` lm or seq-cls) on `device`."""
    key = json.dumps([config.to_dict() if hasattr(config, "to_dict") else str(config), setup.to_dict(), device,
                      profile.key if profile is not None else None], sort_keys=True, default=str)
    if key not in _CACHE:
        depth = num_layers(config)
        if depth is not None and depth >= DEEP_BLOCKS:
            pair = [_figures(with_layers(config, k), setup, device, profile) for k in (TRACE_BLOCKS, TRACE_BLOCKS + 1)]
            values = [layers.extrapolate(getattr(pair[0], f), getattr(pair[1], f), TRACE_BLOCKS, depth)
                      for f in ("parameters_bytes", "peak_allocated_bytes", "peak_reserved_bytes")]
            _CACHE[key] = PassFigures(*(int(round(float(v))) for v in values))
        else:
            _CACHE[key] = _figures(config, setup, device, profile)
    return _CACHE[key]


def _figures(config: object, setup: TrainingSetup, device: str, profile: DeviceProfile | None) -> PassFigures:
    step = capture_pass(config, setup, device)
    trace = gpu_view(step, setup, profile) if device == "cuda" else step.trace
    counters = replay_counters(trace_edit.without_host(trace), "caching" if device == "cuda" else "none", None)
    return PassFigures(_parameter_bytes(trace), int(counters.allocated.max()), int(counters.reserved.max()))


def _parameter_bytes(trace: Trace) -> int:
    """Bytes of the parameters and buffers the pass reads (all alive from its start)."""
    device = trace_edit.without_host(trace)
    kinds = np.isin(device.buffers["category"], [CATEGORY["parameter"], CATEGORY["other"]])
    return int(device.live_bytes(kinds).max()) if device.num_events else 0


def capture_pass(config: object, setup: TrainingSetup, device: str) -> StepTrace:
    """The trace of one no-gradient pass (module docstring), on fake tensors, after one
    warm-up pass."""
    cuda = device == "cuda"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = models.build_model(config, setup, device="cpu")
        model.eval()  # the trainers turn dropout off in the models they score with
        batch = models.make_batch(model, setup, device="cpu", seed=setup.seed)

        def run() -> None:  # autocast on the cpu the tensors live on; CUDA's op lists where the job is CUDA's
            with torch.no_grad(), kernels_as_on_cuda() if cuda else contextlib.nullcontext(), \
                    models.autocast(setup, "cpu"):
                step_loss(model, batch, setup.loss, cuda=cuda)

        trace = capture(run, model=model, iterations=1, warmup=1, inputs=[batch],
                        meta={"setup": setup.to_dict(), "device": device, "fake": True, "pass": "no-grad"})
    if cuda:
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    return StepTrace.of_model(trace, config, setup, blocks_path=transformer_blocks_path(model), parameters=0,
                              layers=len(transformer_blocks(model)))
