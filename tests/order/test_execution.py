"""The reordered step runs for real: same parameters as eager, the predicted peak measured."""

from __future__ import annotations

import copy

import pytest
import torch

import memplan
from memplan import models
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.order.run import reordered_module

NO_DROPOUT = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _pair(name, foreach, overrides=None):
    """Two identical real models with their own SGD-momentum step, warmed up once."""
    config = models.tiny_config(name, **(overrides or {}))
    setup = models.TrainingSetup(precision="32-true", batch=1, seq=8)
    torch.manual_seed(0)
    eager_model = models.build_model(config, setup)
    ours_model = copy.deepcopy(eager_model)
    batch = models.make_batch(eager_model, setup)

    def make_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=foreach)

        def step(b):
            loss = models.forward_loss(model, b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    eager, ours = make_step(eager_model), make_step(ours_model)
    torch.manual_seed(1)
    eager(batch)
    torch.manual_seed(1)
    ours(batch)
    return eager_model, ours_model, eager, ours, batch


@pytest.mark.parametrize(
    ("name", "foreach", "overrides"),
    [("gpt2", False, NO_DROPOUT), ("llama-3.2-1b", True, None)],
    ids=["gpt2-loop", "llama-foreach"],
)
def test_reordered_step_matches_eager_bitwise_and_its_predicted_peak(name, foreach, overrides):
    eager_model, ours_model, eager, ours, batch = _pair(name, foreach, overrides)
    step = memplan.reorder(ours, batch, time_limit_s=2)
    result = step.result
    assert result.verified
    assert result.optimized_peak_bytes < result.baseline_peak_bytes  # early updates pay off here
    measured = []
    for i in range(3):
        torch.manual_seed(10 + i)
        eager(batch)
        torch.manual_seed(10 + i)
        measured.append(profiler_peak_bytes(step, batch))
    for a, b in zip(eager_model.parameters(), ours_model.parameters()):
        assert torch.equal(a, b)
    for peak in measured:
        assert abs(peak - step.predicted_peak_bytes) <= 0.01 * peak


def test_program_order_graph_measures_its_predicted_peak():
    _eager_model, _ours_model, _eager, ours, batch = _pair("llama-3.2-1b", False)
    step = memplan.reorder(ours, batch, time_limit_s=2)
    program = reordered_module(step.graph, list(range(step.graph.num_ops)))
    with torch.no_grad():
        measured = profiler_peak_bytes(program, batch)
    assert abs(measured - step.result.baseline_peak_bytes) <= 0.01 * measured


def test_with_dropout_the_reordered_graph_draws_the_same_random_numbers():
    # make_fx decomposes dropout (bernoulli_), so eager's fused kernels draw differently;
    # the reorder keeps random operators in program order, so the graph agrees with itself
    from memplan.order.graph import reachable_tensors

    _eager_model, ours_model, _eager, ours, batch = _pair("gpt2", True)
    step = memplan.reorder(ours, batch, time_limit_s=2)
    program = reordered_module(step.graph, list(range(step.graph.num_ops)))
    assert any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in step.graph.ops)
    state = reachable_tensors(ours)  # parameters and momentum buffers
    before = [t.detach().clone() for t in state]
    torch.manual_seed(5)
    with torch.no_grad():
        program(batch)
    after_program = [p.detach().clone() for p in ours_model.parameters()]
    with torch.no_grad():
        for t, value in zip(state, before):
            t.copy_(value)
    torch.manual_seed(5)
    step(batch)
    for a, b in zip(after_program, ours_model.parameters()):
        assert torch.equal(a, b)
