"""Real tiny training steps under the planned allocator: same numbers, arena use, fallbacks."""

import numpy as np
import pytest
import torch

import memplan
from memplan import models
from memplan.capture.step import build_training_step
from memplan.runtime import PlannedAllocator

STEPS = 5
WARMUP = 2


class Training:
    """A tiny model's training loop; `step(seq)` trains on one batch and records its loss."""

    def __init__(self, name: str) -> None:
        setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
        self.built = build_training_step(models.tiny_config(name), setup, device="cpu")
        self.batches = {
            seq: models.make_batch(self.built.model, models.TrainingSetup(precision="32-true", batch=2, seq=seq), seed=seq)
            for seq in (16, 24, 32, 40)
        }
        self.losses: list[float] = []

    def step(self, seq: int = 32) -> None:
        loss = models.forward_loss(self.built.model, self.batches[seq])
        loss.backward()
        self.losses.append(loss.item())
        del loss
        self.built.optimizer.step()
        self.built.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.built.model.parameters()]


def default_run(name: str, seqs: list[int]) -> Training:
    run = Training(name)
    for _ in range(WARMUP):
        run.step()
    for seq in seqs:
        run.step(seq)
    return run


def planned_run(name: str, seqs: list[int]) -> tuple[Training, PlannedAllocator]:
    run = Training(name)
    pa = memplan.planned_allocator.from_step(run.step, warmup=WARMUP)
    with pa:
        for seq in seqs:
            run.step(seq)
            pa.next_iteration()
    return run, pa


def plan_height(plan) -> int:
    return max(int(np.max(np.where(g.offset >= 0, g.offset + g.nbytes, 0), initial=0)) for g in plan.iterations)


@pytest.fixture(scope="module", params=["gpt2", "llama-3.2-1b"])
def static_runs(request, ext):
    seqs = [32] * STEPS
    return default_run(request.param, seqs), *planned_run(request.param, seqs)


def test_static_training_gives_bit_identical_losses(static_runs):
    reference, planned, _ = static_runs
    assert planned.losses == reference.losses


def test_static_training_gives_bit_identical_parameters(static_runs):
    reference, planned, _ = static_runs
    for a, b in zip(reference.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a, b)


def test_static_steps_2_to_5_are_served_from_the_arena_with_no_fallback(static_runs):
    _, _, pa = static_runs
    steps = [e for e in pa.stats["iterations"] if e["requests"]]
    assert len(steps) == STEPS
    for e in steps[1:]:
        assert e["fallbacks"] == 0
        assert e["served_planned"] == e["requests"] > 0


def test_arena_size_is_the_plan_height(static_runs):
    _, _, pa = static_runs
    assert pa.stats["arena_bytes"] == pa.plan.arena_bytes == plan_height(pa.plan)


def test_arena_is_released_after_training(static_runs):
    _, _, pa = static_runs
    assert pa.arena_released


def test_varying_sequence_length_trains_identically_and_counts_fallbacks(ext):
    seqs = [32, 24, 40, 16, 32]
    reference = default_run("gpt2", seqs)
    planned, pa = planned_run("gpt2", seqs)
    assert planned.losses == reference.losses
    for a, b in zip(reference.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a, b)
    stats = pa.stats
    by_step = [e for e in stats["iterations"] if e["requests"]]
    assert by_step[0]["fallbacks"] == 0 and by_step[4]["fallbacks"] == 0  # seq 32: the planned shape
    assert all(e["fallbacks"] > 0 for e in by_step[1:4])  # other shapes: not all of it fits the plan
    assert stats["fallbacks"] == sum(e["fallbacks"] for e in by_step)
    assert stats["served"] + stats["fallbacks"] == stats["requests"]
