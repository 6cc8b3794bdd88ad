"""One stage of a pipeline-parallel training step under the 1F1B schedule.

Pipeline parallelism splits a decoder's blocks into P consecutive stages; stage s runs
the forward of micro-batch m, sends its output on, and later receives the gradient of
that output and runs the backward. Under 1F1B (PipeDream-Flush, as in Megatron-LM and
torch.distributed.pipelining's `Schedule1F1B`) stage s runs `min(P - s - 1, M)` warm-up
forwards, then alternates one forward and one backward, then drains the remaining
backwards — so it holds at most `P - s` micro-batches of activations, and the stage's
memory profile is quite unlike a plain step.

`pipeline_stage_step` builds that stage for a Llama-style Hugging Face decoder
(`model.model.embed_tokens / layers / norm / rotary_emb`, `model.lm_head`): stage 0
owns the embeddings, the last stage the final norm, the LM head and the loss. A
received activation or gradient is a fresh tensor, as a receive buffer would be. The
resulting step is captured like any other (`memplan.capture.capture`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture.api import capture
from memplan.capture.compiled import refuse_compiled_step
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.recorder import set_microbatch
from memplan.errors import UserError
from memplan.models.registry import FactorySpec
from memplan.models.setup import TrainingSetup
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig


def one_f_one_b(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The (op, micro-batch) order of `stage` under 1F1B: ("F", m) or ("B", m)."""
    warmup = min(stages - stage - 1, microbatches)
    order: list[tuple[str, int]] = [("F", m) for m in range(warmup)]
    next_f, next_b = warmup, 0
    while next_f < microbatches:
        order.append(("F", next_f))
        next_f += 1
        order.append(("B", next_b))
        next_b += 1
    order += [("B", m) for m in range(next_b, microbatches)]
    return order


def stage_modules(model: torch.nn.Module, stages: int, stage: int) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(the decoder blocks of `stage`, every module it owns: blocks plus embeddings or head).

    Raises UserError for a model without the Llama-style decoder layout or a stage
    split that leaves a stage without blocks.
    """
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        raise UserError("pipeline stages are built for Llama-style decoders (Llama, Mistral, Qwen2, ...)")
    if not 0 <= stage < stages:
        raise UserError(f"stage {stage} is not one of the {stages} stages")
    blocks = list(inner.layers)
    if len(blocks) < stages:
        raise UserError(f"{len(blocks)} blocks cannot fill {stages} pipeline stages")
    per = len(blocks) // stages
    lo, hi = stage * per, (stage + 1) * per if stage < stages - 1 else len(blocks)
    mine = blocks[lo:hi]
    first, last = stage == 0, stage == stages - 1
    owned: list[torch.nn.Module] = list(mine)
    if first:
        owned.insert(0, inner.embed_tokens)
    if last:
        owned += [inner.norm, model.lm_head]
    return mine, owned


def under_model_paths(model: torch.nn.Module, owned: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding `owned`, each under its path in `model` (`model.layers.5`), in
    order: a stage's trace names its blocks as the whole model's trace does."""
    paths = {id(mod): name for name, mod in model.named_modules()}
    root = torch.nn.Module()
    for mod in owned:
        parent = root
        *prefix, leaf = paths[id(mod)].split(".")
        for part in prefix:
            if part not in dict(parent.named_children()):
                parent.add_module(part, torch.nn.Module())
            parent = parent.get_submodule(part)
        parent.add_module(leaf, mod)
    return root


class PipelineChunk(torch.nn.Module):
    """Chunk `index` of `count` of a Llama-style decoder as one module, the unit a
    `torch.distributed.pipelining.PipelineStage` wraps (torchtitan's
    `pipeline_module_split`, for a Hugging Face model): its share of the blocks
    (`stage_modules`), the token embedding on chunk 0, the final norm and LM head on the
    last. `forward` takes the tokens (chunk 0) or the hidden states received from the
    previous chunk, and returns the hidden states, or the logits on the last chunk (the
    schedule's `loss_fn`, `chunk_loss`, takes them). Its modules are the model's own."""

    def __init__(self, model: torch.nn.Module, count: int, index: int, *, batch: int, seq: int) -> None:
        super().__init__()
        blocks, _ = stage_modules(model, count, index)
        inner = model.model
        self.index, self.first, self.last = index, index == 0, index == count - 1
        self.blocks = torch.nn.ModuleList(blocks)
        self.embed = inner.embed_tokens if self.first else None
        self.norm = inner.norm if self.last else None
        self.head = model.lm_head if self.last else None
        self._rotary = [inner.rotary_emb]  # shared by every chunk, not one of this chunk's modules
        self._shape = (batch, seq)
        self._hidden = model.config.hidden_size
        self._vocab = model.config.vocab_size
        self._dtype = next(model.parameters()).dtype

    def owned(self) -> list[torch.nn.Module]:
        """The modules whose parameters this chunk trains."""
        return [m for m in (self.embed, *self.blocks, self.norm, self.head) if m is not None]

    def example_input(self) -> torch.Tensor:
        """A meta tensor of the chunk's input (PipelineStage's static metadata: shape,
        dtype, and whether a gradient flows back through it)."""
        if self.first:
            return torch.empty(self._shape, dtype=torch.long, device="meta")
        return torch.empty(*self._shape, self._hidden, dtype=self._dtype, device="meta", requires_grad=True)

    def example_output(self) -> torch.Tensor:
        """A meta tensor of the chunk's output."""
        width = self._vocab if self.last else self._hidden
        return torch.empty(*self._shape, width, dtype=self._dtype, device="meta", requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        batch, seq = h.shape[:2]
        positions = torch.arange(seq, device=h.device).unsqueeze(0).expand(batch, -1)
        rope = self._rotary[0](h, positions)
        for block in self.blocks:
            out = block(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        if self.head is None:
            return h
        return self.head(self.norm(h))


def chunk_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss on the last chunk's logits: cross-entropy in fp32, as the
    1F1B step (`pipeline_stage_step`) computes it."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(0, 1))


def pipeline_stage_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stages: int,
    stage: int,
    microbatches: int,
    batch: int,
    seq: int,
    device: str = "cpu",
    setup: TrainingSetup | None = None,
    cuda_kernels: bool = False,
) -> Callable[[], None]:
    """The training step of `stage` (0-based): its 1F1B forwards and backwards, then
    the optimizer step over its own parameters. `setup` (optional) supplies the
    autocast dtype of the forward, as `memplan.capture.step` applies it;
    `cuda_kernels`: CUDA's attention kernels and autocast lists, as there."""
    mine, _ = stage_modules(model, stages, stage)
    inner = model.model
    first, last = stage == 0, stage == stages - 1
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    vocab = model.config.vocab_size

    def forward(m: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(m)
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        if first:
            h = inner.embed_tokens(tokens)
        else:  # the activation received from the previous stage
            h = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
        rope = inner.rotary_emb(h, positions)
        for block in mine:
            out = block(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        if not last:
            return h
        logits = model.lm_head(inner.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1))

    def step() -> None:
        with kernels_as_on_cuda() if cuda_kernels else contextlib.nullcontext():
            run_schedule()
        optimizer.step()
        optimizer.zero_grad(set_to_none=setup is None or setup.zero_grad == "none")

    def run_schedule() -> None:
        outputs: dict[int, torch.Tensor] = {}
        for op, m in one_f_one_b(stages, stage, microbatches):
            set_microbatch(m)
            if op == "F":
                with models.autocast(setup, "cpu") if setup is not None else contextlib.nullcontext():
                    outputs[m] = forward(m)
            else:
                out = outputs.pop(m)
                if last:
                    (out / microbatches).backward()
                else:  # the gradient received from the next stage
                    out.backward(torch.randn_like(out))
                del out

    return step


def capture_pipeline_stage(
    model_spec: str | PretrainedConfig | FactorySpec,
    setup: TrainingSetup,
    *,
    stages: int,
    stage: int,
    microbatches: int,
    fake: bool = True,
    iterations: int = 1,
    warmup: int = 1,
    device: str = "cuda",
) -> Trace:
    """Capture one 1F1B pipeline stage of `model_spec` (batch and seq from `setup`) as it
    runs on `device` (a fake "cuda" capture runs CUDA's kernels and autocast lists)."""
    refuse_compiled_step(setup, "on pipeline stages")
    config = models.load_config(model_spec) if isinstance(model_spec, str) else model_spec
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        if not fake:
            torch.manual_seed(setup.seed)
        model = models.build_model(config, setup, device="cpu")
        stage_model, optimizer, step = build_pipeline_stage(model, setup, stages=stages, stage=stage,
                                                            microbatches=microbatches, target_device=device)
        meta = {"model": model_spec if isinstance(model_spec, str) else type(model).__name__,
                "setup": setup.to_dict(), "pipeline": {"stages": stages, "stage": stage,
                "microbatches": microbatches, "schedule": "1f1b"}, "fake": fake}
        return capture(step, model=stage_model, optimizer=optimizer, iterations=iterations,
                       warmup=warmup, meta=meta)


def build_pipeline_stage(
    model: torch.nn.Module,
    setup: TrainingSetup,
    *,
    stages: int,
    stage: int,
    microbatches: int,
    distribute: Callable[[list[torch.nn.Module]], None] | None = None,
    target_device: str = "cuda",
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """(the stage's modules, its optimizer, its 1F1B step) for `stage` of a built `model`.

    The other stages' weights live on other GPUs: they stop requiring gradients and the
    optimizer never sees them. `distribute(owned)`, when given, applies a parallel layout
    to the stage's modules (`memplan.parallel.apply.apply_stage_layout`) before the
    optimizer is built over the resulting parameters."""
    seq = models.sequence_length(setup, model)
    # a peft model (LoRA): its adapters sit inside the base model's modules
    decoder = model.get_base_model() if hasattr(model, "get_base_model") else model
    _, owned = stage_modules(decoder, stages, stage)
    owned_params = {id(p) for mod in owned for p in mod.parameters()}
    for p in model.parameters():
        if id(p) not in owned_params:
            p.requires_grad_(False)
    if distribute is not None:
        distribute(owned)
    stage_model = under_model_paths(decoder, owned)
    optimizer = models.build_optimizer(stage_model, setup, device=target_device)
    step = pipeline_stage_step(decoder, optimizer, stages=stages, stage=stage, microbatches=microbatches,
                               batch=setup.batch, seq=seq, setup=setup,
                               cuda_kernels=target_device == "cuda" and models.is_fake_mode_active())
    return stage_model, optimizer, step
