"""Capture the lifetime trace of a training step, on real or fake tensors.

`capture(step_fn, ...)` (`memplan.capture.api`) runs any training step under the
dispatch-level `Recorder` and returns a validated `Trace`.

`capture_model(model, setup, fake=True)` (`memplan.capture.step`) builds a registry
model, its optimizer and a batch (inside `FakeTensorMode` when `fake`), and captures
its training step: forward, loss, backward for each gradient-accumulation micro-batch,
then the optimizer step and `zero_grad(set_to_none=True)`. `capture_step(config,
setup, device)` captures the same step as a `StepTrace`: the trace plus the model
facts (blocks, heads, sequence) the estimate's later stages need. A torch.compile'd step
is captured inside `inductor_runs` (`memplan.capture.compiled`). See docs/capture.md.
"""

from memplan.capture.api import LiveCapture, capture
from memplan.capture.compiled import inductor_runs
from memplan.capture.recorder import Recorder, set_microbatch
from memplan.capture.step import (
    StepTrace,
    TrainingStep,
    build_training_step,
    capture_model,
    capture_step,
)

__all__ = [
    "LiveCapture",
    "Recorder",
    "StepTrace",
    "TrainingStep",
    "build_training_step",
    "capture",
    "capture_model",
    "capture_step",
    "inductor_runs",
    "set_microbatch",
]
