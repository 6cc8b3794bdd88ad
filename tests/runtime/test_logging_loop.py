"""A new user's logging loop under `memplan.planned_allocator.from_step`.

The step returns its loss and gradient norm, as a loop's step function does; the loop
keeps every loss (`losses.append(loss.detach())`), logs the norm, the learning rate of
an LR scheduler and a perplexity tensor it computes, and reads `.item()`. These tensors
outlive their iteration: the plan must leave them to the fallback, so that no planned
request finds its bytes still held (0 conflicts), with training bit-identical to the
default allocator.
"""

import pytest
import torch

import memplan
from memplan import models
from memplan.capture.step import build_training_step
from memplan.layout.plan import LONG_LIVED
from memplan.runtime import FALLBACK_REASONS

STEPS = 5
WARMUP = 2


class LoggingLoop:
    def __init__(self, name: str) -> None:
        setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
        built = build_training_step(models.tiny_config(name), setup, device="cpu")
        self.model, self.optimizer = built.model, built.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.batch = models.make_batch(self.model, setup, seed=1)
        self.losses: list[torch.Tensor] = []
        self.log: list[dict] = []

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss = models.forward_loss(self.model, self.batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        perplexity = torch.exp(loss.detach())  # a metric the loop computes and keeps
        self.log.append({"loss": loss.item(), "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                         "perplexity": perplexity})


def default_loop(name: str) -> LoggingLoop:
    loop = LoggingLoop(name)
    for _ in range(WARMUP):
        loop.step()
    for _ in range(STEPS):
        loop.log_step(*loop.step())
    return loop


def planned_loop(name: str):
    loop = LoggingLoop(name)
    pa = memplan.planned_allocator.from_step(loop.step, warmup=WARMUP)
    with pa:
        for _ in range(STEPS):
            loss, grad_norm = loop.step()
            loop.log_step(loss, grad_norm)
            del loss, grad_norm
            pa.next_iteration()
    return loop, pa


@pytest.fixture(scope="module", params=["gpt2", "llama-3.2-1b"])
def runs(request, ext):
    return default_loop(request.param), *planned_loop(request.param)


def test_logging_loop_trains_bit_identically(runs):
    reference, planned, _ = runs
    assert [e["loss"] for e in planned.log] == [e["loss"] for e in reference.log]
    assert torch.equal(torch.stack(planned.losses), torch.stack(reference.losses))
    assert [float(e["grad_norm"]) for e in planned.log] == [float(e["grad_norm"]) for e in reference.log]
    for a, b in zip(reference.model.parameters(), planned.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_kept_tensors_cause_no_conflict_and_few_fallbacks(runs):
    _, _, pa = runs
    stats = pa.stats
    assert stats["conflicts"] == 0
    assert stats["fallbacks"] < 0.01 * stats["requests"]
    assert stats["requests"] > 500 * STEPS  # the whole step ran under the plan


def test_every_fallback_has_its_reason(runs):
    _, _, pa = runs
    stats = pa.stats
    reasons = stats["fallback_reasons"]
    assert set(reasons) == set(FALLBACK_REASONS)
    assert sum(reasons.values()) == stats["fallbacks"]
    # per step: the returned loss and gradient norm are long-lived, the perplexity the
    # loop computes after the step is a request beyond the plan
    assert reasons["outlived_iteration"] == 2 * STEPS
    assert reasons["beyond_plan"] == STEPS
    assert reasons["conflict"] == 0


def test_long_lived_requests_are_marked_in_the_plan(runs):
    _, _, pa = runs
    assert pa.plan.stats["long_lived"] >= 2
    assert int((pa.plan.iterations[-1].offset == LONG_LIVED).sum()) == pa.plan.stats["long_lived"]
