"""The training step memplan captures for a registry model and a training setup.

One iteration is what a Hugging Face-style training loop does:

    for each of setup.grad_accum micro-batches:
        loss = model(**batch).loss / grad_accum      (under autocast if asked)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

With `fake=True` the model, optimizer and batches are all built inside one
`FakeTensorMode` (facts.md §5: an optimizer built over real parameters and traced
with fake inputs silently loses its update), so any model size traces with no memory.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from memplan.errors import UserError
from memplan.trace.model import Trace

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def loss_of(output: Any) -> torch.Tensor:
    """The loss tensor of a model output: `.loss`, `["loss"]`, or the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise UserError(
            "the model's forward returned no loss: give it labels, or return a loss tensor "
            "(or an object with .loss) from the factory model"
        )
    return loss


def make_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    *,
    autocast: str = "none",
    device_type: str = "cpu",
) -> Any:
    """The training step closure for `capture`: micro-batches, backward, optimizer."""
    accum = len(batches)
    dtype = _AUTOCAST_DTYPES.get(autocast)

    def step() -> None:
        for batch in batches:
            ctx = (
                torch.autocast(device_type=device_type, dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            )
            with ctx:
                loss = loss_of(model(**batch))
                if accum > 1:
                    loss = loss / accum
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def training_step_capture(
    model_spec: str,
    setup: Any = None,
    *,
    fake: bool = True,
    device: str = "cuda",
    iterations: int = 1,
    warmup: int = 1,
    record_flops: bool = True,
) -> Trace:
    """Build `model_spec` under `setup` and capture `iterations` steps after `warmup`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan import models
    from memplan.capture import capture

    setup = setup if setup is not None else models.TrainingSetup()
    if not fake and device != "cpu":
        raise UserError(f"a real (non-fake) capture runs on this machine's cpu, not {device!r}")
    config = models.load_config(model_spec)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    start = time.perf_counter()
    with mode:
        if not fake:
            torch.manual_seed(0)
        model = models.build_model(config, setup, device=device)
        optimizer = models.build_optimizer(model, setup)
        batches = [
            models.make_batch(model, setup, device=device, seed=mb) for mb in range(setup.grad_accum)
        ]
        build_s = time.perf_counter() - start
        step = make_step(
            model,
            optimizer,
            batches,
            autocast=setup.autocast,
            device_type=torch.device(device).type,
        )
        meta = {
            "model": model_spec,
            "setup": setup.to_dict(),
            "fake": fake,
            "device": device,
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "trainable_parameters": int(
                sum(p.numel() for p in model.parameters() if p.requires_grad)
            ),
            "build_s": round(build_s, 3),
        }
        return capture(
            step,
            model=model,
            optimizer=optimizer,
            iterations=iterations,
            warmup=warmup,
            meta=meta,
            record_flops=record_flops,
            inputs=batches,
        )
