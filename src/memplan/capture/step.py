"""The training step memplan captures for a registry model and a training setup.

One iteration is what a Hugging Face-style training loop does:

    for each of setup.grad_accum micro-batches:
        loss = model(**batch).loss / grad_accum      (under autocast if asked)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)            (False with setup.zero_grad="zeros")

With `fake=True` the model, optimizer and batches are all built inside one
`FakeTensorMode` (facts.md §5: an optimizer built over real parameters and traced
with fake inputs silently loses its update), so any model size traces with no memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import UserError
from memplan.trace.model import Trace


def make_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    setup: Any,
    device: str,
    *,
    cuda_kernels: bool = False,
) -> Any:
    """The training step closure for `capture`: micro-batches, backward, optimizer.

    `cuda_kernels`: route attention through CUDA's fused SDPA kernels and autocast
    through CUDA's op lists (for a CUDA job traced on fake cpu tensors; see
    `memplan.capture.cuda_kernels.kernels_as_on_cuda`).
    """
    from memplan.capture.cuda_kernels import kernels_as_on_cuda
    from memplan.models import autocast, forward_loss

    accum = len(batches)

    def step() -> None:
        with kernels_as_on_cuda() if cuda_kernels else contextlib.nullcontext():
            run_micro_batches()
        optimizer.step()
        optimizer.zero_grad(set_to_none=setup.zero_grad == "none")

    def run_micro_batches() -> None:
        for batch in batches:
            with autocast(setup, device):
                loss = forward_loss(model, batch)
                if accum > 1:
                    loss = loss / accum
            loss.backward()
            del loss

    return step


@dataclass
class TrainingStep:
    """A built training step: the model, its optimizer, the micro-batches and `run()`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[dict[str, torch.Tensor]]
    run: Callable[[], None]
    meta: dict[str, Any]


def build_training_step(
    model_spec: Any, setup: Any = None, *, device: str = "cpu", target_device: str | None = None
) -> TrainingStep:
    """Build model, optimizer and batches for `setup` on `device` under the current mode.

    `target_device` is the device the job is meant for when it differs from where the
    tensors live: a CUDA job traced on fake cpu tensors takes CUDA's defaults (foreach
    optimizers). Call it inside a `FakeTensorMode` for a fake step.
    """
    from memplan import models

    setup = setup if setup is not None else models.TrainingSetup()
    config = models.load_config(model_spec) if isinstance(model_spec, str) else model_spec
    start = time.perf_counter()
    if not models.is_fake_mode_active():
        torch.manual_seed(setup.seed)
    model = models.build_model(config, setup, device=device)
    optimizer = models.build_optimizer(model, setup, device=target_device or device)
    batches = [
        models.make_batch(model, setup, device=device, seed=setup.seed + mb)
        for mb in range(setup.grad_accum)
    ]
    meta = {
        "model": model_spec if isinstance(model_spec, str) else type(model).__name__,
        "setup": setup.to_dict(),
        "device": target_device or device,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "trainable_parameters": int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
        "build_s": round(time.perf_counter() - start, 3),
    }
    # A CUDA job traced on fake tensors runs CUDA's attention kernels, not the CPU's
    cuda_kernels = (target_device or device) == "cuda" and models.is_fake_mode_active()
    step = make_step(model, optimizer, batches, setup, device, cuda_kernels=cuda_kernels)
    meta["attention_kernels"] = "cuda" if cuda_kernels else device
    return TrainingStep(model, optimizer, batches, step, meta)


def capture_model(
    model_spec: Any,
    setup: Any = None,
    *,
    fake: bool = True,
    device: str = "cuda",
    iterations: int = 1,
    warmup: int = 1,
    record_flops: bool = True,
) -> Trace:
    """Build `model_spec` (registry name, config.json path, factory spec or config)
    under `setup` and capture `iterations` steps after `warmup`.

    With `fake`, model, optimizer and batches are built inside one `FakeTensorMode`, so
    any size traces with no memory. With `fake=False` the step runs for real (small
    models, device "cpu").

    A "cuda" job is traced on fake *cpu* tensors: a CPU-only PyTorch cannot run
    autograd on fake cuda tensors (its gradient accumulators need a CUDA device guard
    and abort the process). CUDA's code paths that change memory are chosen
    explicitly instead (foreach optimizer by default; SDPA's CPU flash kernel keeps the
    same output + logsumexp as CUDA's flash and memory-efficient kernels), the buffers
    are labelled with the target device, and CUDA-only terms (allocator rounding,
    context, workspaces) are left to the allocator simulator and the estimator.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.capture import capture

    if not fake and device != "cpu":
        raise UserError(f"a real (non-fake) capture runs on this machine's cpu, not {device!r}")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}: use cpu or cuda")
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        step = build_training_step(model_spec, setup, device="cpu", target_device=device)
        trace = capture(
            step.run,
            model=step.model,
            optimizer=step.optimizer,
            iterations=iterations,
            warmup=warmup,
            meta={**step.meta, "fake": fake},
            record_flops=record_flops,
            inputs=step.batches,
        )
    if device == "cuda":
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    return trace
