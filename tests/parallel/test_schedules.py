"""PyTorch's multi-stage pipeline schedules (`--schedule interleaved|interleaved-zb|zbv`):
chunk placement, what is refused, and the traced step following PyTorch's own rows of
actions. The real gloo run of the interleaved schedule is in test_groundtruth.py."""

import pytest

from memplan import models
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.parallel import Layout
from memplan.parallel.schedules import rank_chunks

SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")
LLAMA4 = models.tiny_config("llama-2-7b", num_hidden_layers=4)


@pytest.mark.parametrize(("schedule", "style"), [("interleaved", "loop"), ("interleaved-zb", "loop"),
                                                 ("zbv", "v")])
def test_chunks_sit_where_pytorchs_schedule_expects_them(schedule, style):
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for stages in (2, 4):
        owner = generate_stage_to_rank_mapping(stages, 2 * stages, style=style)
        for rank in range(stages):
            assert sorted(rank_chunks(schedule, stages, rank)) == sorted(c for c, r in owner.items() if r == rank)


def test_a_multi_stage_schedule_needs_two_chunks_of_blocks_per_rank():
    with pytest.raises(UserError, match="4 pipeline chunks"):
        Layout(pp=2, schedule="zbv").check(models.tiny_config("llama-2-7b"), SETUP)  # 2 blocks


def test_a_multi_stage_schedule_of_a_non_llama_model_is_refused_not_modelled():
    with pytest.raises(UserError, match="traced over Llama-style decoder chunks"):
        estimate(models.tiny_config("gpt2", n_layer=4), SETUP, Layout(pp=2, microbatches=2, schedule="interleaved"),
                 device="cpu", allocator="none")
    with pytest.raises(UserError, match="tracing is off"):
        estimate(LLAMA4, SETUP, Layout(pp=2, microbatches=2, schedule="interleaved"), device="cpu",
                 allocator="none", parallel_tracing=False)


def test_pytorchs_own_microbatch_constraint_is_one_line():
    # ScheduleInterleaved1F1B: micro-batches a multiple of the rounds (9 // 4 = 2 rounds)
    config = models.tiny_config("llama-2-7b", num_hidden_layers=8)
    with pytest.raises(UserError, match="`schedule=interleaved`: .*multiple of the number of rounds") as info:
        estimate(config, SETUP, Layout(pp=4, microbatches=9, schedule="interleaved"), device="cpu",
                 allocator="none")
    assert "\n" not in str(info.value)


def _forward_starts(trace, first_modules):
    """The chunk of each forward the trace holds, in order: a forward enters its chunk's
    first module (the rank's module list holds one block per chunk here) from outside it
    (the rotary embedding and positions run before the blocks, outside any of them)."""
    import numpy as np

    from memplan.trace.model import PHASE

    fwd = np.flatnonzero(trace.ops["phase"] == PHASE["forward"])
    tops = [trace.modules[trace.ops["module"][i]].split(".")[0] for i in fwd]
    return [first_modules[top] for previous, top in zip([None, *tops], tops)
            if top in first_modules and top != previous]


@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb", "zbv"])
def test_the_traced_rank_runs_its_row_of_pytorchs_pipeline_order(schedule):
    from memplan.parallel.traced import capture_stage_step

    layout = Layout(pp=2, microbatches=4, schedule=schedule)
    step = capture_stage_step(LLAMA4, SETUP, layout, 1, "cpu")
    row = [a.split(",") for a in step.trace.meta["pipeline"]["order"]]
    forwards = [int(chunk) for chunk, kind, _ in row if kind == "FORWARD"]
    chunks = rank_chunks(schedule, 2, 1)
    assert sorted(set(forwards)) == sorted(chunks) and len(forwards) == 2 * layout.microbatches
    assert _forward_starts(step.trace, {"0": chunks[0], "1": chunks[1]}) == forwards
    kinds = {kind for _, kind, _ in row}
    split = {"BACKWARD_INPUT", "BACKWARD_WEIGHT"}
    assert kinds >= split if schedule != "interleaved" else kinds.isdisjoint(split)
