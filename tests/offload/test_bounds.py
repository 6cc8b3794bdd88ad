import numpy as np
import pytest

from memplan.offload.bounds import step_lower_bound_s
from memplan.offload.lifetimes import analyse_lifetimes
from memplan.offload.planner import plan_lifetimes
from memplan.offload.simulate import simulate_offload_plan

from .test_planner import hardware

A, B = 0, 1


def two_activations(make_trace):
    # A made at op 0, read at op 4; B made at op 1, read at op 3; 100 B each, ops of 1 s
    ops = [{"alloc": [A]}, {"alloc": [B]}, {}, {"reads": [B], "free": [B]}, {"reads": [A], "free": [A]}]
    tr = make_trace([100, 100], ["activation", "activation"], ops)
    return tr, analyse_lifetimes(tr, np.ones(5))


def test_the_bound_is_the_largest_write_plus_read_stall_around_one_op(make_trace):
    # at op 1: A (written at op 0, no compute since) must leave before op 1 starts: 100 B at
    # 50 B/s = 2 s of stall on the write side. At op 2: A written 1 s before, needed 1 s after:
    # 1 s + 1 s. At op 3: A needed next at op 4, right after: 2 s on the read side.
    tr, lt = two_activations(make_trace)
    hw = hardware(ssd_bytes_per_s=50.0, pcie_bytes_per_s=100.0)
    assert step_lower_bound_s(tr, lt, hw, 100) == pytest.approx(5.0 + 2.0)


def test_what_an_op_makes_itself_takes_budget_from_the_buffers_that_may_be_away(make_trace):
    # A (100 B) made at op 0, read at op 4; op 2 makes and frees a 100 B temporary. Live
    # at op 2's start: only A, which fits the 100 B budget; but during op 2 the temporary
    # needs all of it, so A must be away: written during op 1 (2 s at 50 B/s, 1 s of
    # compute: 1 s of stall) and read back during op 3 (the same): 5 + 2 s. (Before, only
    # bytes live at the op's start counted: no stall at all.)
    ops = [{"alloc": [A]}, {}, {"alloc": [B], "free": [B]}, {}, {"reads": [A], "free": [A]}]
    tr = make_trace([100, 100], ["activation", "temporary"], ops)
    lt = analyse_lifetimes(tr, np.ones(5))
    hw = hardware(ssd_bytes_per_s=50.0, pcie_bytes_per_s=100.0)
    assert step_lower_bound_s(tr, lt, hw, 100) == pytest.approx(7.0)


def test_the_bound_is_the_ideal_step_when_the_budget_holds_the_peak(make_trace):
    tr, lt = two_activations(make_trace)
    assert step_lower_bound_s(tr, lt, hardware(), 200) == lt.step_s == 5.0


def test_the_plan_of_the_hand_case_is_no_faster_than_the_bound(make_trace):
    tr, lt = two_activations(make_trace)
    hw = hardware(ssd_bytes_per_s=50.0, pcie_bytes_per_s=100.0)
    p = plan_lifetimes(tr, lt, hw, 100, min_nbytes=1)
    assert p.feasible
    assert simulate_offload_plan(lt, p, hw.link_bytes_per_s()).step_s >= step_lower_bound_s(tr, lt, hw, 100)


def test_write_and_read_stalls_add_only_when_their_windows_fit_in_one_step():
    from memplan.offload.bounds import _combined_stall_s

    write = (np.array([1.0, 3.0]), np.array([2.0, 5.0]))  # (window span, least stall in it)
    read = (np.array([1.0, 2.0]), np.array([1.0, 4.0]))
    # step 5, op between them 1 s: read 1 s + write 3 s fit (1 + 1 + 3 = 5): 1 + 5 = 6
    assert _combined_stall_s(write, read, 1.0, 5.0) == 6.0
    # step 3: only read 1 s + write 1 s fit (1 + 1 + 1): 1 + 2 = 3, less than the write window alone
    assert _combined_stall_s(write, read, 1.0, 3.0) == 5.0
