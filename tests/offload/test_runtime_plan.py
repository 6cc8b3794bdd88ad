"""`memplan.offload.run(model, optimizer, plan)` applies a plan of the captured step: the
named states and gradients it moves, the saved storages it moves (by their order in the
forward), read back in the plan's order, and refuses a plan of another step."""

import dataclasses
import json

import pytest
import torch

from memplan import models
from memplan.capture import capture
from memplan.capture.step import build_training_step
from memplan.cli import main
from memplan.errors import UserError
from memplan.hardware.links import make_hardware
from memplan.hardware.roofline import op_seconds
from memplan.models.build import instantiate, model_class
from memplan.offload import load_offload_plan, plan_offload, runtime_categories
from memplan.offload.lifetimes import analyse_lifetimes
from memplan.offload.runtime import OffloadError, RunOptions, run
from memplan.offload.runtime import engine as engine_module
from memplan.trace.model import CATEGORY

HARDWARE = make_hardware("h100-nvl-94gb", nvme="1x1GB/s")


def tiny_step(seq=32):
    return build_training_step(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", batch=2, seq=seq), device="cpu")


def captured_trace(seq=32, iterations=1):
    step = tiny_step(seq)
    step.run()  # the optimizer's states exist, as in every step after the first
    return capture(step.run, model=step.model, optimizer=step.optimizer, inputs=step.batches,
                   iterations=iterations)


@pytest.fixture(scope="module")
def trace():
    return captured_trace()


def plan_for_runtime(trace, fraction, streamed_step=False):
    """A plan of `trace` within `fraction` of its peak, among what the runtime mode moves."""
    peak = int(analyse_lifetimes(trace, op_seconds(trace, HARDWARE.gpu)).op_bytes.max())
    p = plan_offload(trace, HARDWARE, budget=int(fraction * peak), min_nbytes=1024,
                  categories=runtime_categories(streamed_step=streamed_step))
    assert p.feasible
    return p


@pytest.fixture(scope="module")
def planned(trace):
    """States and saved activations: what every runtime mode moves."""
    return plan_for_runtime(trace, 0.5)


@pytest.fixture(scope="module")
def planned_streamed(trace):
    """Gradients too: what the streamed step moves."""
    return plan_for_runtime(trace, 0.4, streamed_step=True)


def test_capture_names_every_state_and_gradient_as_the_runtime_keys_them(trace):
    names = trace.meta["tensor_names"]
    category = trace.buffers["category"]
    step = tiny_step()
    for fqn, p in step.model.named_parameters():
        if p.requires_grad:
            for key in (f"state.{fqn}.exp_avg", f"state.{fqn}.exp_avg_sq", f"grad.{fqn}"):
                assert key in names.values(), key
    for buffer, name in names.items():
        expected = "gradient" if name.startswith("grad.") else "optimizer_state"
        assert category[int(buffer)] == CATEGORY[expected], name


def test_the_schedule_lists_one_forward_however_many_iterations_are_captured(trace):
    two = captured_trace(iterations=2)
    one_plan = plan_offload(trace, HARDWARE, budget=10**12)
    two_plan = plan_offload(two, HARDWARE, budget=10**12)
    assert one_plan.tensors.saved_nbytes == two_plan.tensors.saved_nbytes
    assert len(one_plan.tensors.saved_nbytes) > 20  # a tiny GPT-2's forward saves dozens


@pytest.mark.parametrize("mode", [{}, {"streamed_step": True}, {"step_in_backward": True}],
                         ids=["default", "streamed", "in-backward"])
def test_the_runtime_moves_exactly_what_the_plan_moves_and_trains_bit_identically(tmp_path, planned,
                                                                                   planned_streamed, mode):
    planned = planned_streamed if mode.get("streamed_step") else planned
    assert any(planned.tensors.saved_moved) and not all(planned.tensors.saved_moved)
    ref = tiny_step()
    for _ in range(3):
        ref.run()
    off = tiny_step()
    with run(off.model, off.optimizer, planned, RunOptions(directory=tmp_path, **mode)) as engine:
        for _ in range(3):
            off.run()
    named = engine.keys_written
    planned_states = {k for k in planned.tensors.moved if k.startswith("state.")}
    planned_grads = {k for k in planned.tensors.moved if k.startswith("grad.")}
    assert planned_states and (bool(planned_grads) == bool(mode.get("streamed_step")))
    assert named == planned_states | planned_grads
    activations = engine.storages_written
    assert activations == 3 * sum(planned.tensors.saved_moved)  # one key per moved storage per forward
    for (name, a), (_, b) in zip(ref.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name


def test_states_come_back_in_the_order_the_plan_brings_them_back(tmp_path, planned, monkeypatch):
    reads = []

    def fault(op, key):
        if op == "read" and key.startswith("state."):
            reads.append(key)

    monkeypatch.setattr(engine_module, "_fault_hook", fault)
    off = tiny_step()
    with run(off.model, off.optimizer, planned, RunOptions(directory=tmp_path, activations=False, workers=1)):
        for _ in range(2):
            off.run()
    planned_order = [k for k in planned.tensors.moved if k.startswith("state.")]
    assert reads[-len(planned_order):] == planned_order  # the second step's reads
    assert len(set(planned.tensors.moved[k] for k in planned_order)) > 1  # an order to follow


def test_a_plan_of_another_step_is_refused_clearly(tmp_path, planned):
    off = tiny_step(seq=48)
    with pytest.raises(OffloadError, match="the plan was made for another step"):
        with run(off.model, off.optimizer, planned, RunOptions(directory=tmp_path)):
            off.run()


def test_a_plan_that_names_no_tensors_is_refused(tmp_path, planned):
    unnamed = dataclasses.replace(planned, tensors=type(planned.tensors)())
    off = tiny_step()
    with pytest.raises(OffloadError, match="names no tensors"):
        with run(off.model, off.optimizer, unnamed, RunOptions(directory=tmp_path)):
            pass


def test_a_plan_and_resident_bytes_together_are_refused(tmp_path, planned):
    off = tiny_step()
    with pytest.raises(OffloadError, match="either plan or resident_nbytes"):
        with run(off.model, off.optimizer, planned, RunOptions(directory=tmp_path, step_in_backward=True,
                 resident_nbytes=1 << 20)):
            pass


def test_a_plan_that_moves_parameters_is_refused(tmp_path, trace):
    peak = int(analyse_lifetimes(trace, op_seconds(trace, HARDWARE.gpu)).op_bytes.max())
    p = plan_offload(trace, HARDWARE, budget=int(0.4 * peak), min_nbytes=1024)  # every candidate category
    assert p.tensors.unnamed.get("parameter", 0) > 0
    off = tiny_step()
    with pytest.raises(OffloadError, match="tensors the runtime does not move .* of parameters"):
        with run(off.model, off.optimizer, p, RunOptions(directory=tmp_path, streamed_step=True)):
            pass


def test_a_plan_that_moves_gradients_is_refused_without_the_streamed_step(tmp_path, planned_streamed):
    off = tiny_step()
    with pytest.raises(OffloadError, match="only streamed_step=True moves"):
        with run(off.model, off.optimizer, planned_streamed, RunOptions(directory=tmp_path, step_in_backward=True)):
            pass


def test_a_plan_for_another_model_is_refused(tmp_path, planned):
    other = build_training_step(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32), device="cpu")
    with pytest.raises(OffloadError, match="parameters this model does not have"):
        with run(other.model, other.optimizer, planned, RunOptions(directory=tmp_path)):
            pass


def test_a_plan_written_as_json_loads_and_applies_the_same(tmp_path, planned):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(planned.to_json()))
    loaded = load_offload_plan(path)
    assert loaded.tensors == planned.tensors and loaded.transfers == planned.transfers
    off = tiny_step()
    (tmp_path / "files").mkdir()
    with run(off.model, off.optimizer, loaded, RunOptions(directory=tmp_path / "files")) as engine:
        for _ in range(2):
            off.run()
    assert {k for k in engine.keys_written if k.startswith("state.")} == {
        k for k in planned.tensors.moved if k.startswith("state.")}


@pytest.mark.parametrize("text, message", [("{", "is not JSON"), ("[]", "is not an offload plan"),
                                           ('{"transfers": []}', "no 'budget_bytes'")])
def test_a_damaged_plan_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_offload_plan(path)


def test_the_cli_plan_names_the_registry_model_s_states(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code = main(["offload", "gpt2", "--gpu", "h100-80gb", "--budget", "1GiB", "--plan-output", str(path), "--json"])
    assert code == 0
    plan = load_offload_plan(path)
    states = [k for k in plan.tensors.moved if k.startswith("state.")]
    assert states and plan.tensors.saved_nbytes
    config = models.load_config("gpt2")
    with torch.device("meta"):
        model = instantiate(model_class(config), config)
    names = {name for name, _ in model.named_parameters()}
    assert {k[len("state."):].rpartition(".")[0] for k in states} <= names


def test_a_llama_plan_applies_where_q_k_v_each_save_a_view_of_one_input(tmp_path):
    """Each projection saves its own 2-D view of the normed input, a view that dies with the op:
    the runtime must still see one storage, as the trace does, or the plan's order slips."""

    def llama():
        return build_training_step(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32),
                                   device="cpu")

    cap = llama()
    cap.run()
    trace = capture(cap.run, model=cap.model, optimizer=cap.optimizer, inputs=cap.batches)
    p = plan_for_runtime(trace, 0.7)
    assert any(p.tensors.saved_moved)
    ref = llama()
    for _ in range(2):
        ref.run()
    off = llama()
    with run(off.model, off.optimizer, p, RunOptions(directory=tmp_path)) as engine:
        for _ in range(2):
            off.run()
    assert engine.storages_written == 2 * sum(p.tensors.saved_moved)
    for a, b in zip(ref.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)
