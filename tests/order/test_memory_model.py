"""The memory model of an order: storages, aliasing, hazards, frees at last use, peak."""

from __future__ import annotations

import pytest
import torch

from memplan.errors import MemplanBug
from memplan.order import capture_step_graph, peak_of_order
from memplan.order.graph import INPUT, INTERMEDIATE
from memplan.order.validate import OrderBug, validate_order

F32 = 4


def _graph(step, *inputs):
    return capture_step_graph(step, *inputs)


def _program(graph):
    return list(range(graph.num_ops))


def _op(graph, name):
    return next(i for i, node in enumerate(graph.ops) if node.name == name)


def test_input_is_persistent_and_fresh_outputs_are_intermediate():
    def step(x):
        return None if (x * 2).sum() is None else None

    graph = _graph(step, torch.ones(4, 4))
    assert graph.storage_kind.count(INPUT) == 1
    assert graph.persistent_bytes == 16 * F32
    assert sorted(graph.storage_nbytes[s] for s, k in enumerate(graph.storage_kind) if k == INTERMEDIATE) == [F32, 16 * F32]


def test_view_shares_the_storage_of_its_base():
    def step(x):
        a = x * 2
        v = a.view(-1)
        (v + 1).sum()

    graph = _graph(step, torch.ones(4, 4))
    mul, view = _op(graph, "mul"), _op(graph, "view")
    assert graph.creates[view] == []
    assert graph.uses[view] == graph.creates[mul]


def test_peak_is_inputs_alive_while_outputs_are_allocated():
    # x: 64 B. a = x*2 (64), b = a*3 (64; a dies), c = b.sum() (4; b dies), d = c+1 (4).
    # transient: 64 | 128 | 68 | 8  -> peak 64 + 128
    def step(x):
        a = x * 2
        b = a * 3
        c = b.sum()
        c + 1

    graph = _graph(step, torch.ones(4, 4))
    memory = peak_of_order(graph, _program(graph))
    assert memory.peak_bytes == 64 + 128
    assert memory.peak_position == _op(graph, "mul_1")


def test_an_unused_output_is_freed_right_after_it_is_made():
    # a (64) never used: freed after its op; b = x*3 (64) -> peak 64 + 64, not 64 + 128
    def step(x):
        x * 2
        x * 3

    graph = _graph(step, torch.ones(4, 4))
    assert peak_of_order(graph, _program(graph)).peak_bytes == 128


def test_a_view_keeps_its_base_alive_until_the_view_is_last_used():
    # a (64) -> v = a[0] (view) ; b = x*3 (64) ; c = v + 1 (16): a alive through c
    def step(x):
        a = x * 2
        v = a[0]
        b = x * 3
        (v + b[0]).sum()

    graph = _graph(step, torch.ones(4, 4))
    # at b: a (64) + b (64) alive, input 64
    assert peak_of_order(graph, _program(graph)).peak_bytes >= 64 + 128


def test_an_inplace_write_waits_for_earlier_reads_and_later_reads_wait_for_it():
    def step(x):
        a = x * 2
        b = a * 3
        a.add_(1)
        c = a * 4
        (b + c).sum()

    graph = _graph(step, torch.ones(4))
    read, write, after = _op(graph, "mul_1"), _op(graph, "add_"), _op(graph, "mul_2")
    assert read in graph.preds[write]
    assert write in graph.preds[after]


def test_the_validator_rejects_a_write_moved_before_an_earlier_read():
    def step(x):
        a = x * 2
        b = a * 3
        a.add_(1)
        (b + a).sum()

    graph = _graph(step, torch.ones(4))
    names = [node.name for node in graph.ops]
    i, j = names.index("mul_1"), names.index("add_")
    swapped = list(names)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(OrderBug):
        validate_order(graph.gm, swapped)


def test_the_validator_rejects_an_operator_before_its_input():
    def step(x):
        (x * 2 + 1).sum()

    graph = _graph(step, torch.ones(4))
    names = [node.name for node in graph.ops]
    with pytest.raises(OrderBug):
        validate_order(graph.gm, names[::-1])
    assert issubclass(OrderBug, MemplanBug)  # memplan's own mistake, not bad input


def test_the_validator_recomputes_the_models_peak():
    def step(x):
        a = x * 2
        v = a.view(-1)
        b = v * 3
        a.mul_(2)
        (b + a.view(-1)).sum()

    graph = _graph(step, torch.ones(4, 4))
    names = [node.name for node in graph.ops]
    assert validate_order(graph.gm, names) == peak_of_order(graph, _program(graph)).peak_bytes


def test_parameters_and_optimizer_state_are_persistent_and_updated_in_place():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    x = torch.ones(2, 4)
    step(x)
    graph = _graph(step, x)
    # weight 64 + bias 16, two momentum buffers 64 + 16, input 32
    assert graph.persistent_bytes == 64 + 16 + 64 + 16 + 32
    updates = [i for i, node in enumerate(graph.ops) if node.target is torch.ops.aten.add_.Tensor]
    assert updates and all(graph.creates[i] == [] for i in updates)


def test_layout_aware_peak_is_never_below_the_theoretical_peak():
    from memplan.order import layout_peak

    def step(x):
        a = x.repeat(4)
        b = (x + 1).repeat(2)
        c = a.sum() + b.sum()
        d = x.repeat(3)
        (c + d.sum()).sum()

    graph = _graph(step, torch.ones(16))
    order = _program(graph)
    assert layout_peak(graph, order, time_limit_s=2) >= peak_of_order(graph, order).peak_bytes
