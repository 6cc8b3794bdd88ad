"""Multi-stage pipeline schedules run by PyTorch's own runtime (`torch.distributed.pipelining`).

`--schedule interleaved`, `interleaved-zb` and `zbv` are PyTorch's
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble`
(`torch/distributed/pipelining/schedules.py`), with two stages per rank (torchtitan's
default for multi-stage schedules; ZB-V requires exactly two). The model's decoder
blocks are cut into P x 2 equal chunks (`memplan.capture.pipeline.PipelineChunk`: the
embedding on chunk 0, the final norm and LM head on the last); rank r owns chunks r and
r + P ("loop" placement, the interleaved schedules) or r and 2P - 1 - r ("v" placement,
ZB-V, `generate_stage_to_rank_mapping(style="v")`). Each chunk is a `PipelineStage` with
its input and output shapes given (PyTorch's static metadata mode), and one step is
`schedule.step(tokens, target=labels, losses=[], return_outputs=False)` (torchtitan's
`train.py`) then the optimizer.

The schedule itself decides what runs when: each rank executes its row of
`pipeline_order` (computed by `_calculate_single_rank_operations` for every rank and
lowered with the sends and receives by `_prepare_schedule_with_comms`), through
`_PipelineScheduleRuntime._step_microbatches`. The interleaved 1F1B row is warm-up
forwards, then forward / full-backward pairs, then the remaining backwards, across the
rank's chunks in rounds of P micro-batches (`_get_1f1b_rank_ops`); the zero-bubble rows
split each backward into I (`stage_backward_input`: the gradient of the chunk's input,
through `torch.autograd.grad`, the graph kept) and W (`stage_backward_weight`: the
weights' gradients, later), the W steps placed to fill the bubbles (ZB1P for
interleaved-zb, arXiv 2401.10241; the ZB-V rows of its section 6). PipelineStage
allocates each micro-batch's receive buffers (activations, and gradients) once, at the
first step, and keeps them.

The schedule waits for its sends only at the end of the step (`_step_microbatches`:
"send ops should be waited on before step() exits"); gloo's send work keeps its tensor
(`ProcessGroupGloo::SendWork::tensor_`) as long as the work lives, so on gloo every
activation and gradient a rank sends stays allocated until then. The fake group's works
hold nothing; for a cpu (gloo) job, `gloo_send_retention` keeps the sent tensors with the
works. NCCL stashes a send's tensors only until the watchdog sees the send complete
(`ProcessGroupNCCL::WorkNCCL::stashed_for_allocator_safety_`, released at the next
process-group call after completion), so for a cuda job they are freed with their last
reference, as on the fake group.

The same code runs on real gloo ranks (the ground truth) and on PyTorch's fake process
group (the estimate, `memplan.parallel.traced.capture_stage_step`). On the fake group a
received tensor holds nothing, so the pipeline's warm-up vote on metadata inference
(`_PipelineSchedule._warmup_p2p`: `PipelineStage._warmup_forward_vote` /
`_warmup_backward_result`, a product of one vote per stage passed along the pipeline,
read with `.item()`) is given its result there: every stage built here votes for the
static mode (complete input and output metadata, no DTensor), as each does on a real
group; the static mode exchanges nothing else before the first step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan import models
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.pipeline import PipelineChunk, chunk_loss
from memplan.capture.step import TrainingStep
from memplan.errors import UserError
from memplan.models.build import transformer_blocks, transformer_blocks_path
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import apply_stage_layout
from memplan.parallel.layout import INTERLEAVED_CHUNKS, Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

SCHEDULE_CLASSES = {
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def rank_chunks(schedule: str, stages: int, rank: int) -> list[int]:
    """The chunk (PyTorch "stage") indices pipeline rank `rank` of `stages` owns."""
    if schedule == "zbv":
        return [rank, INTERLEAVED_CHUNKS * stages - 1 - rank]
    return [rank + k * stages for k in range(INTERLEAVED_CHUNKS)]


def _vote_static(runner: Any) -> None:
    """On a fake process group: `runner`'s warm-up P2P (the vote on metadata inference,
    `_PipelineSchedule._warmup_p2p`) replaced by its result on a real group, the static
    mode for every stage (module docstring)."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup_p2p(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    runner._warmup_p2p = warmup_p2p


class _HeldTensors:
    """An entry of a list of p2p works that keeps tensors alive while the list lives; its
    `wait` waits for nothing (the real works in the same list do)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self, *args: Any) -> bool:
        return True


@contextlib.contextmanager
def gloo_send_retention() -> Iterator[None]:
    """On a fake process group, the sends of the schedule keep their tensors as gloo's do
    (module docstring): `_batch_p2p`'s list of works also holds the sent tensors."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = original(p2p_ops, desc)
        sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [*works, _HeldTensors(sent)] if sent else works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def build_schedule_step(model: nn.Module, setup: TrainingSetup, *, schedule: str, stages: int, rank: int,
                        microbatches: int, group: dist.ProcessGroup, fake_group: bool = False,
                        distribute: Callable[[list[nn.Module]], None] | None = None,
                        target_device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None],
                                                              list[str]]:
    """(the rank's modules, its optimizer, its training step, its row of the schedule)
    under PyTorch's `schedule` (module docstring) for pipeline rank `rank` of `stages`; the
    row lists the rank's compute actions as "chunk,TYPE,micro-batch" (TYPE: FORWARD,
    FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT). `distribute(owned)` applies a layout
    (TP) to the rank's modules before the optimizer is built; `fake_group`: the process
    group is PyTorch's fake one."""
    from torch.distributed import pipelining

    count = INTERLEAVED_CHUNKS * stages
    seq = models.sequence_length(setup, model)
    decoder = model.get_base_model() if hasattr(model, "get_base_model") else model
    chunks = [PipelineChunk(decoder, count, index, batch=setup.batch, seq=seq)
              for index in rank_chunks(schedule, stages, rank)]
    owned = [m for chunk in chunks for m in chunk.owned()]
    owned_params = {id(p) for mod in owned for p in mod.parameters()}
    for p in model.parameters():
        if id(p) not in owned_params:
            p.requires_grad_(False)
    if distribute is not None:
        distribute(owned)
    pipeline_stages = [pipelining.PipelineStage(chunk, chunk.index, count, torch.device("cpu"), input_args=chunk.example_input(),
                                 output_args=chunk.example_output(), group=group) for chunk in chunks]
    schedule_cls = getattr(pipelining.schedules, SCHEDULE_CLASSES[schedule])
    try:
        runner = schedule_cls(pipeline_stages, microbatches, loss_fn=chunk_loss)
    except ValueError as exc:  # the schedule's own constraints (micro-batches per round)
        raise UserError(f"`schedule={schedule}`: {exc}") from exc
    if fake_group:
        _vote_static(runner)
    row = [f"{a.stage_index},{a.computation_type.name},{a.microbatch_index}"
           for a in runner.pipeline_order[rank] if a is not None]
    stage_model = nn.ModuleList(owned)
    optimizer = models.build_optimizer(stage_model, setup, device=target_device)
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)
    vocab = decoder.config.vocab_size
    tokens = torch.randint(0, vocab, (setup.batch * microbatches, seq), generator=torch.Generator().manual_seed(0))
    cuda_kernels = target_device == "cuda" and models.is_fake_mode_active()

    def step() -> None:
        args = (tokens,) if first else ()
        options: dict[str, Any] = {"target": tokens, "losses": []} if last else {}
        held = gloo_send_retention() if fake_group and target_device == "cpu" else contextlib.nullcontext()
        with kernels_as_on_cuda() if cuda_kernels else contextlib.nullcontext(), models.autocast(setup, "cpu"), held:
            runner.step(*args, return_outputs=False, **options)
        optimizer.step()
        optimizer.zero_grad(set_to_none=setup.zero_grad == "none")

    return stage_model, optimizer, step, row


def schedule_rank_step(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, pp_rank: int,
                       mesh: DeviceMesh, *, target_device: str = "cpu") -> TrainingStep:
    """The step of pipeline rank `pp_rank` of `layout` under its multi-stage schedule, on
    cpu tensors (real or, inside a FakeTensorMode, fake), with `layout`'s TP applied to
    the rank's chunks over `mesh` (`memplan.parallel.apply.pipeline_mesh`), one
    data-parallel rank per stage. `torch.distributed` must be initialised; on PyTorch's
    fake process group the warm-up vote is given its result (module docstring). The same
    step runs on real gloo ranks and on the fake group."""
    import torch.distributed as dist

    fake = models.is_fake_mode_active()
    if not fake:
        torch.manual_seed(setup.seed)  # identical weights on every rank, as a checkpoint load gives
    model = models.build_model(config, setup, device="cpu")
    blocks_path = transformer_blocks_path(model)

    def distribute(owned: list[nn.Module]) -> None:
        # a device mesh's set-up runs on small real tensors (memplan.parallel.apply.build_parallel_step)
        with unset_fake_temporarily() if fake else contextlib.nullcontext():
            apply_stage_layout(model, layout, blocks_path, owned, mesh)

    stage_model, optimizer, run, row = build_schedule_step(
        model, setup, schedule=layout.schedule, stages=layout.pp, rank=pp_rank, microbatches=layout.microbatches,
        group=mesh["pp"].get_group(), fake_group=dist.get_backend() == "fake", distribute=distribute,
        target_device=target_device)
    meta = {"model": type(model).__name__, "setup": setup.to_dict(), "device": target_device,
            "parameters": models.count_parameters(config), "blocks_path": blocks_path,
            "layers": len(transformer_blocks(model)) // layout.pp,
            "pipeline": {"stages": layout.pp, "stage": pp_rank, "microbatches": layout.microbatches,
                         "schedule": layout.schedule, "chunks": rank_chunks(layout.schedule, layout.pp, pp_rank),
                         "order": row}}
    return TrainingStep(stage_model, optimizer, [], run, meta)
