"""Baselines, key points, the CP-SAT windows and the optimiser's guarantees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.errors import UserError
from memplan.order import capture_step_graph, peak_of_order
from memplan.order.baselines import (
    inductor_order,
    program_order,
    topological_sort_bfs,
    topological_sort_dfs,
    topological_sort_lpmf,
)
from memplan.order.graph import split_foreach
from memplan.order.memory import last_uses
from memplan.order.solve import _solve_window, hoist_updates, key_points, optimize_order
from memplan.order.validate import validate_order
from memplan.trace.model import PHASE, PHASES


def two_branches(x):
    # program order makes both big tensors first: peak holds big_a + big_b
    big_a = x.repeat(16)
    big_b = (x + 1).repeat(16)
    small_a = big_a.sum()
    small_b = big_b.sum()
    (small_a + small_b).sum()


def _is_topological(graph, order):
    position = {v: p for p, v in enumerate(order)}
    return sorted(order) == list(range(graph.num_ops)) and all(
        position[u] < position[v] for v in range(graph.num_ops) for u in graph.preds[v]
    )


@pytest.fixture(scope="module")
def branches():
    return capture_step_graph(two_branches, torch.ones(16))


def test_cpsat_window_reaches_the_hand_computed_optimum(branches):
    # x: 64 B input; x + 1: 64; each repeat: 1024; each sum: 4.
    # program: repeat (1024), add (+64), repeat_1 (+1024) -> 2112 transient.
    # best: add (64), repeat_1 (1088; add dies), sum (big_b dies), repeat, sum ... -> 1088
    order = program_order(branches)
    solved, peak, current = _solve_window(branches, order, 0, len(order), last_uses(branches, order), 5.0)
    assert current == 2 * 1024 + 64
    assert peak == 1024 + 64
    assert _is_topological(branches, solved)
    assert peak_of_order(branches, solved).peak_bytes == 64 + peak


def test_optimised_order_is_below_program_order_when_branches_can_interleave(branches):
    result = optimize_order(branches, time_limit_s=5)
    assert result.verified
    assert result.optimized_peak_bytes < result.baseline_peak_bytes
    assert result.optimized_peak_bytes == validate_order(branches.gm, [branches.ops[v].name for v in result.order])


@pytest.mark.parametrize("sort", [topological_sort_lpmf, topological_sort_bfs, topological_sort_dfs])
def test_inductor_sorts_are_topological(branches, sort):
    assert _is_topological(branches, sort(branches))


def test_lpmf_finishes_a_branch_before_starting_the_next(branches):
    order = topological_sort_lpmf(branches)
    assert peak_of_order(branches, order).peak_bytes < peak_of_order(branches, program_order(branches)).peak_bytes


def test_key_points_of_a_chain_are_every_operator():
    def chain(x):
        ((x * 2) * 3).sum()

    graph = capture_step_graph(chain, torch.ones(4))
    assert key_points(graph, ignore_sources=False) == list(range(graph.num_ops))


def test_parallel_branches_are_not_key_points(branches):
    names = {branches.ops[v].name for v in key_points(branches, ignore_sources=False)}
    assert "repeat" not in names and "repeat_1" not in names
    assert branches.ops[-1].name in names  # the final sum joins both branches


def test_foreach_updates_are_split_per_parameter_and_can_run_early():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    x = torch.ones(2, 8)
    step(x)
    graph = capture_step_graph(step, x)
    assert graph.meta["foreach_split"] >= 2
    assert not any("_foreach_" in str(node.target) for node in graph.ops)
    early = hoist_updates(graph, program_order(graph))
    assert _is_topological(graph, early)


def test_split_foreach_computes_the_same_values():
    def step(xs, ys):
        torch._foreach_mul_(xs, 0.5)
        torch._foreach_addcdiv_(xs, ys, ys, [0.1, 0.2])
        return torch._foreach_sqrt(xs)

    from torch.fx.experimental.proxy_tensor import make_fx

    def inputs():
        return [torch.arange(4.0), torch.arange(3.0)], [torch.ones(4), torch.full((3,), 2.0)]

    gm = make_fx(step)(*inputs())
    expected = gm(*inputs())
    assert split_foreach(gm) == 3
    assert not any("_foreach_" in str(node.target) for node in gm.graph.nodes)
    got = gm(*inputs())
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_time_limit_of_zero_is_a_user_error(branches):
    with pytest.raises(UserError, match="time limit"):
        optimize_order(branches, time_limit_s=0)


def test_a_data_dependent_step_is_a_user_error():
    def step(x):
        if x.sum() > 0:
            (x * 2).sum()

    with pytest.raises(UserError, match="tensor value"):
        capture_step_graph(step, torch.ones(4))


def test_inductor_order_is_the_best_of_its_methods(branches):
    order, peaks = inductor_order(branches)
    assert _is_topological(branches, order)
    assert peak_of_order(branches, order).peak_bytes == min(peaks.values())


# random straight-line programs: new tensors, reductions, views and in-place updates
OPS = st.lists(
    st.tuples(st.sampled_from(["repeat", "sum", "add", "view", "mul_", "cat"]),
              st.integers(0, 10), st.integers(0, 10), st.integers(1, 4)),
    min_size=3, max_size=14,
)


def _random_step(ops):
    def step(x):
        values = [x * 1]
        for kind, i, j, k in ops:
            a = values[i % len(values)]
            b = values[j % len(values)]
            if kind == "repeat":
                values.append(a.reshape(-1).repeat(k))
            elif kind == "sum":
                values.append(a.sum().reshape(1))
            elif kind == "add":
                values.append(a.reshape(-1)[:1] + b.reshape(-1)[:1])
            elif kind == "view":
                values.append(a.view(-1))
            elif kind == "mul_":
                a.mul_(2)
            else:
                values.append(torch.cat([a.reshape(-1), b.reshape(-1)]))
        sum(v.sum() for v in values[-3:])
    return step


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_optimised_orders_are_valid_and_never_worse_than_the_baselines(ops):
    graph = capture_step_graph(_random_step(ops), torch.ones(8))
    result = optimize_order(graph, time_limit_s=2, node_limit=12)
    names = [graph.ops[v].name for v in result.order]
    assert validate_order(graph.gm, names) == result.optimized_peak_bytes
    assert result.optimized_peak_bytes <= result.baseline_peak_bytes
    assert result.optimized_peak_bytes <= result.inductor_peak_bytes
    assert result.lower_bound_bytes <= result.optimized_peak_bytes


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_every_order_the_model_scores_runs_to_the_same_values(ops):
    from memplan.order.run import reordered_module

    graph = capture_step_graph(_random_step(ops), torch.ones(8))
    for order in (topological_sort_lpmf(graph), topological_sort_dfs(graph), topological_sort_bfs(graph)):
        validate_order(graph.gm, [graph.ops[v].name for v in order])
        out = reordered_module(graph, order)
        x1, x2 = torch.arange(8.0), torch.arange(8.0)
        graph.gm(x1)
        out(x2)
        assert torch.equal(x1, x2)


def test_the_api_refuses_a_time_limit_of_zero_before_tracing():
    import memplan

    called = []
    with pytest.raises(UserError, match="time limit"):
        memplan.reorder(lambda x: called.append(x), torch.ones(1), time_limit_s=0)
    assert called == []


def test_early_updates_run_each_update_right_after_its_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    x = torch.ones(2, 8)
    step(x)
    graph = capture_step_graph(step, x)
    order = hoist_updates(graph, program_order(graph))
    position = {v: p for p, v in enumerate(order)}
    last_backward = max(position[v] for v in range(graph.num_ops) if graph.phase[v] == PHASE["backward"])
    first_update = min(position[v] for v in range(graph.num_ops) if graph.phase[v] == PHASE["optimizer"])
    assert first_update < last_backward  # the last layer's update runs inside the backward pass
    assert {PHASES[p] for p in graph.phase} == {"forward", "backward", "optimizer"}  # the trace's codes


def test_a_step_that_keeps_zeroed_gradients_is_refused_before_tracing():
    from memplan import models
    from memplan.order.graph import capture_model_step

    with pytest.raises(UserError, match="drop `zero_grad=zeros`"):
        capture_model_step(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", batch=1, seq=8, zero_grad="zeros"))
