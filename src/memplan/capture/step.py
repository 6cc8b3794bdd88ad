"""The training step memplan captures for a registry model and a training setup.

One iteration is what a Hugging Face-style training loop does:

    for each of setup.grad_accum micro-batches:
        loss = model(**batch).loss / grad_accum      (under autocast if asked)
        loss.backward()                              (each parameter stepped in its gradient's
                                                      hook with setup.optimizer_in_backward)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)            (False with setup.zero_grad="zeros")

The loss is `setup.loss`'s (`memplan.models.losses.step_loss`: the model's own, torchtune's
chunked output and loss, or Liger's fused linear cross-entropy), and the forward runs in
`setup.activation_offload`'s context (`memplan.capture.activation_offload`: torchtune's
`OffloadActivations`), on real and fake tensors alike.

With `fake=True` the model, optimizer and batches are all built inside one
`FakeTensorMode`, as torchtitan's `scripts/estimate/estimation.py` builds them (an
optimizer built over real parameters and traced with fake inputs loses its update:
docs/capture.md, docs/sources.md §8), so any model size traces with no memory.

`capture_model` returns the step's `Trace`; `capture_step` returns it as a `StepTrace`,
with the facts about the model that the estimate's later stages need (where the blocks
are, heads, sequence length).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture.activation_offload import activation_offload_context
from memplan.capture.api import capture
from memplan.capture.compiled import inductor_runs
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.recorder import Recorder
from memplan.errors import UserError
from memplan.models.build import carried_between_steps, transformer_blocks, transformer_blocks_path
from memplan.models.losses import step_loss
from memplan.models.moe import experts_of
from memplan.models.quant import weight_count
from memplan.models.registry import FactorySpec
from memplan.models.setup import TrainingSetup
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig



def make_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    setup: TrainingSetup,
    device: str,
    *,
    cuda_kernels: bool = False,
) -> Callable[[], None]:
    """The training step closure for `capture`: micro-batches, backward, optimizer.

    The whole step runs inside what the optimizer needs around it
    (`memplan.models.step_context`: an offloaded optimizer's pinned memory and streams);
    an optimizer that steps in backward (`setup.optimizer_in_backward`) has nothing left
    to do in `step()` and `zero_grad()`.
    `cuda_kernels`: route attention through CUDA's fused SDPA kernels and autocast
    through CUDA's op lists (for a CUDA job traced on fake cpu tensors; see
    `memplan.capture.cuda_kernels.kernels_as_on_cuda`). The loss takes its CUDA code path
    (`memplan.models.losses.step_loss`, `cuda`) for such a job and for a step that runs on a
    real CUDA device alike.
    """
    accum = len(batches)
    offload = activation_offload_context(model, setup.activation_offload)
    on_head = offload.head_starts if offload is not None else None
    chunks = setup.loss_chunks()
    cuda_loss = cuda_kernels or torch.device(device).type == "cuda"

    def step() -> None:
        with models.step_context(optimizer):
            with kernels_as_on_cuda() if cuda_kernels else contextlib.nullcontext():
                run_micro_batches()
            optimizer.step()
            optimizer.zero_grad(set_to_none=setup.zero_grad == "none")

    def run_micro_batches() -> None:
        for batch in batches:
            with models.autocast(setup, device):
                loss = step_loss(model, batch, setup.loss, chunks=chunks, body=offload, on_head=on_head,
                                 cuda=cuda_loss)
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


@dataclass
class StepTrace:
    """A captured step and what the later stages of an estimate need to know about its
    model: the path of its repeated blocks, its parameter count, attention heads and head
    size, the sequence length, and the number of blocks the trace holds."""

    trace: Trace
    blocks_path: str
    parameters: int
    heads: int
    head_dim: int
    seq: int
    layers: int
    block_parameters: int | None = None  # of one block, counted as `parameters` (None: not counted)

    @classmethod
    def of_model(cls, trace: Trace, config: PretrainedConfig, setup: TrainingSetup, *, blocks_path: str,
                 parameters: int, layers: int, block_parameters: int | None = None) -> StepTrace:
        """The `StepTrace` of `trace`, a step of `config` under `setup`."""
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = getattr(config, "head_dim", None) or (int(getattr(config, "hidden_size", heads)) // heads)
        return cls(trace, blocks_path, int(parameters), heads, int(head_dim),
                   models.sequence_length(setup, config), int(layers), block_parameters)


def build_training_step(
    model_spec: str | PretrainedConfig | FactorySpec,
    setup: TrainingSetup | None = None,
    *,
    device: str = "cpu",
    target_device: str | None = None,
) -> TrainingStep:
    """Build model, optimizer and batches for `setup` on `device` under the current mode.

    `target_device` is the device the job is meant for when it differs from where the
    tensors live: a CUDA job traced on fake cpu tensors takes CUDA's defaults (foreach
    optimizers). Call it inside a `FakeTensorMode` for a fake step.
    """
    setup = setup if setup is not None else TrainingSetup()
    if setup.quant == "int8" and target_device == "cuda" and device != "cuda":
        # bitsandbytes trains int8 layers with MatMul8bitFp on CPU and MatMul8bitLt on CUDA
        # (autograd/_functions.py, `matmul`); the CUDA one splits off the activation columns
        # above the outlier threshold, a data-dependent shape no fake tensor can have
        raise UserError("`quant=int8` is estimated for --device cpu only: bitsandbytes' CUDA int8 matmul "
                        "(LLM.int8 outlier columns) has data-dependent shapes; use `quant=nf4` or fp4")
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
        "parameters": int(sum(weight_count(p) for p in model.parameters())),
        "trainable_parameters": int(sum(weight_count(p) for p in model.parameters() if p.requires_grad)),
        "build_s": round(time.perf_counter() - start, 3),
    }
    if not isinstance(config, FactorySpec) and experts_of(config):
        meta["routing"] = setup.routing  # the assignment the experts were given (memplan.models.moe)
    # A CUDA job traced on fake tensors runs CUDA's attention kernels, not the CPU's
    cuda_kernels = (target_device or device) == "cuda" and models.is_fake_mode_active()
    step = make_step(model, optimizer, batches, setup, device, cuda_kernels=cuda_kernels)
    meta["attention_kernels"] = "cuda" if cuda_kernels else device
    return TrainingStep(model, optimizer, batches, step, meta)


def capture_model(
    model_spec: str | PretrainedConfig | FactorySpec,
    setup: TrainingSetup | None = None,
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
    trace, _ = _captured_training_step(model_spec, setup, fake=fake, device=device, iterations=iterations,
                                       warmup=warmup, record_flops=record_flops)
    return trace


def capture_step(config: PretrainedConfig, setup: TrainingSetup | None = None, device: str = "cuda") -> StepTrace:
    """One training step of `config` under `setup`, traced on fake tensors for `device`
    after one warm-up step (`capture_model`), with the facts about the model an estimate
    needs (`StepTrace`)."""
    setup = setup if setup is not None else TrainingSetup()
    trace, step = _captured_training_step(config, setup, fake=True, device=device, iterations=1, warmup=1,
                                          record_flops=True)
    blocks = transformer_blocks(step.model)
    return StepTrace.of_model(trace, config, setup, blocks_path=transformer_blocks_path(step.model),
                              parameters=step.meta["parameters"], layers=len(blocks),
                              block_parameters=int(sum(weight_count(p) for p in blocks[len(blocks) // 2].parameters())))


def _captured_training_step(
    model_spec: str | PretrainedConfig | FactorySpec,
    setup: TrainingSetup | None,
    *,
    fake: bool,
    device: str,
    iterations: int,
    warmup: int,
    record_flops: bool,
) -> tuple[Trace, TrainingStep]:
    """The trace of `build_training_step`'s step (see `capture_model`) and the step."""
    if not fake and device != "cpu":
        raise UserError(f"a real (non-fake) capture runs on the host's cpu, not {device!r}")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}: use cpu or cuda")
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    compiled = setup is not None and setup.compile != "none"
    # a compiled step: compiled afresh at the warm-up, its generated code recorded as it runs
    # (memplan.capture.compiled)
    with mode, inductor_runs(fake=fake, gpu=device == "cuda") if compiled else contextlib.nullcontext():
        step = build_training_step(model_spec, setup, device="cpu", target_device=device)
        trace = capture(
            step.run,
            model=step.model,
            optimizer=step.optimizer,
            iterations=iterations,
            warmup=warmup,
            meta={**step.meta, "fake": fake},
            record_flops=record_flops,
            inputs=[step.batches, carried_between_steps(step.model)],
            recorder=Recorder(record_flops=record_flops, compiled_regions=True) if compiled else None,
        )
    if device == "cuda":
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    return trace, step
