import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import MemplanBug, UserError
from memplan.hardware.devices import device_profile
from memplan.hardware.links import Hardware, NvmeArray
from memplan.offload.bounds import step_lower_bound_s
from memplan.offload.lifetimes import analyse_lifetimes
from memplan.offload.plan_file import Transfer
from memplan.offload.planner import LinkTimeline, plan_lifetimes, plan_offload
from memplan.offload.simulate import simulate_offload_plan
from memplan.offload.validate import OffloadPlanBug, validate_plan

W, A = 0, 1


def hardware(ssd_bytes_per_s=100.0, pcie_bytes_per_s=200.0, host_bytes=0.0):
    nvme = NvmeArray(1, ssd_bytes_per_s, ssd_bytes_per_s, math.inf, "test")
    return Hardware(device_profile("h100-80gb"), 1, nvme, host_bytes, pcie_bytes_per_s)


def small(make_trace):
    ops = [{"reads": [W]}, {"alloc": [A]}, {}, {}, {}, {}, {}, {"reads": [A]}, {"reads": [W]}, {"free": [A]}]
    return make_trace([100, 100], ["parameter", "activation"], ops, persistent=[W])


def plan_small(make_trace, budget, **hw):
    tr = small(make_trace)
    lt = analyse_lifetimes(tr, np.ones(10))
    return tr, lt, plan_lifetimes(tr, lt, hardware(**hw), budget, min_nbytes=1)


def test_plan_brings_the_peak_within_the_budget(make_trace):
    tr, lt, p = plan_small(make_trace, 150)
    assert p.peak_bytes_before == 200
    assert p.feasible and p.peak_bytes_after <= 150
    validate_plan(tr, p)


def only_activation(make_trace):
    # A written at op 1, read at op 7, freed at op 9; a 100 B temporary over ops 3..5
    ops = [{}, {"alloc": [A]}, {}, {"alloc": [2]}, {}, {"free": [2]}, {}, {"reads": [A]}, {}, {"free": [A]}]
    return make_trace([0, 100, 100], ["other", "activation", "temporary"], ops)


def test_memory_is_saved_only_between_offload_end_and_prefetch_start(make_trace):
    # 100 B at 100 B/s: 1 s each way. A is idle between ops 1 and 7 (each op 1 s):
    # offload 2-3 s, prefetch 6-7 s, so A is away over ops 3, 4, 5.
    tr = only_activation(make_trace)
    p = plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(10)), hardware(), 100, min_nbytes=1)
    (t,) = [t for t in p.transfers if t.buffer == A and t.use_op == 7]
    assert (t.tier, t.after_op, t.done_op, t.return_op) == ("ssd", 1, 3, 6)
    assert (t.offload_start_s, t.offload_end_s, t.prefetch_start_s, t.prefetch_end_s) == (2.0, 3.0, 6.0, 7.0)


def test_the_planner_takes_the_best_benefit_per_cost_first(make_trace):
    # same cost (1 s + 1 s); W saves 50 B over ops 2..6 (250 B.s), A over ops 3..5 only (150 B.s)
    _, _, p = plan_small(make_trace, 150)
    # once W is away over ops 2..6, A's window over 3..5 saves nothing more: it is never taken
    assert any(t.buffer == W and t.after_op == 0 for t in p.transfers)
    assert not any(t.buffer == A and t.use_op == 7 for t in p.transfers)


def test_link_timeline_pushes_later_transfers_out():
    link = LinkTimeline(period_s=10.0, bytes_per_s=1.0)
    link.reserve(0.0, 2.0)
    assert link.earliest_start(1.0, 1.0) == 2.0
    assert link.latest_start(3.0, 2.0) == -2.0  # [2, 3) is too short; before 0 is the previous step
    link.reserve(9.0, 11.0)  # wraps: busy [9, 10) and [0, 1) of the next step
    assert link.earliest_start(9.5, 0.5) == 12.0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 99), st.integers(1, 30)), max_size=12),
       st.integers(0, 99), st.integers(1, 60))
def test_link_timeline_finds_the_earliest_and_latest_free_slot(busy, t, d):
    # Reference: a slot can start at t0 or where a busy interval ends (earliest), and end at
    # the deadline or where one starts (latest); take the best that overlaps no busy
    # interval of the unrolled periods. Integer times: no rounding.
    link = LinkTimeline(period_s=100.0, bytes_per_s=1.0)
    for start, length in busy:
        link.reserve(float(start), float(start + length))
    spans = [(a + k * 100.0, b + k * 100.0) for a, b in zip(link._starts, link._ends) for k in (-1, 0, 1, 2, 3)]

    def free(x: float) -> bool:
        return all(x + d <= a or x >= b for a, b in spans)

    earliest = min(x for x in [float(t)] + [b for _, b in spans if b >= t] + [math.inf] if x == math.inf or free(x))
    assert link.earliest_start(float(t), float(d)) == earliest
    latest = max(x for x in [float(t - d)] + [a - d for a, _ in spans if a - d <= t - d] + [-math.inf]
                 if x == -math.inf or free(x))
    assert link.latest_start(float(t), float(d)) == latest


def test_host_memory_takes_what_the_ssd_link_cannot(make_trace):
    # two activations idle over ops 1..6 and a 200 B temporary at ops 2..3 (budget 200): after
    # the first, the busy SSD link leaves the second a window over op 3 only; the host link covers 2..5
    ops = [{"alloc": [0, 1]}, {}, {"alloc": [2]}, {"free": [2]}, {}, {}, {}, {"reads": [0, 1]}, {"free": [0, 1]}]
    tr = make_trace([100, 100, 200], ["activation", "activation", "temporary"], ops)
    lt = analyse_lifetimes(tr, np.ones(9))
    p = plan_lifetimes(tr, lt, hardware(ssd_bytes_per_s=100.0, pcie_bytes_per_s=200.0, host_bytes=1000), 200, min_nbytes=1)
    returning = [t for t in p.transfers if t.use_op == 7]
    assert sorted(t.tier for t in returning) == ["host", "ssd"]
    assert p.feasible


def test_host_memory_respects_its_limit(make_trace):
    ops = [{"alloc": [0, 1]}, {}, {"alloc": [2]}, {"free": [2]}, {}, {}, {}, {"reads": [0, 1]}, {"free": [0, 1]}]
    tr = make_trace([100, 100, 200], ["activation", "activation", "temporary"], ops)
    lt = analyse_lifetimes(tr, np.ones(9))
    p = plan_lifetimes(tr, lt, hardware(host_bytes=50), 200, min_nbytes=1)
    assert p.transfers
    assert all(t.tier == "ssd" for t in p.transfers)


def test_urgent_transfers_when_no_window_hides_them(make_trace):
    # 1 B/s: moving 100 B takes 100 s, far longer than the 5 s idle window; the GPU must wait
    tr, lt, p = plan_small(make_trace, 150, ssd_bytes_per_s=1.0, pcie_bytes_per_s=1.0)
    assert p.feasible
    assert p.transfers and all(t.urgent for t in p.transfers)
    result = simulate_offload_plan(lt, p, hardware(ssd_bytes_per_s=1.0, pcie_bytes_per_s=1.0).link_bytes_per_s())
    assert result.stall_s > 100
    assert result.within_budget


def test_infeasible_when_only_temporaries_exceed_the_budget(make_trace):
    tr = make_trace([100, 100], ["temporary", "temporary"], [{"alloc": [0, 1]}, {}, {}, {"reads": [0, 1], "free": [0, 1]}])
    p = plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(4)), hardware(), 150, min_nbytes=1)
    assert not p.feasible and p.peak_bytes_after == 200 and p.transfers == []


def test_budget_must_be_positive(make_trace):
    with pytest.raises(UserError, match="budget"):
        plan_offload(small(make_trace), hardware(), budget=0)


def planned_activation(make_trace):
    tr = only_activation(make_trace)
    return tr, plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(10)), hardware(), 100, min_nbytes=1)


def test_validator_rejects_a_buffer_used_while_away(make_trace):
    tr, p = planned_activation(make_trace)
    t = next(t for t in p.transfers if t.buffer == A and t.use_op == 7)
    bad = replace(p, transfers=[replace(t, use_op=8, return_op=8)])
    with pytest.raises(OffloadPlanBug, match="used by op 7 while away") as caught:
        validate_plan(tr, bad)
    # a bad plan of memplan's own planner is a bug (exit 3), not bad input (exit 2)
    assert isinstance(caught.value, MemplanBug) and not isinstance(caught.value, UserError)


def test_validator_rejects_a_budget_overrun(make_trace):
    tr, _, p = plan_small(make_trace, 150)
    with pytest.raises(OffloadPlanBug, match="over the budget"):
        validate_plan(tr, replace(p, transfers=[], feasible=True))


def test_validator_rejects_overlapping_windows_of_one_buffer(make_trace):
    tr, p = planned_activation(make_trace)
    t = next(t for t in p.transfers if t.buffer == A and t.use_op == 7)
    with pytest.raises(OffloadPlanBug, match="overlapping"):
        validate_plan(tr, replace(p, transfers=[t, replace(t, after_op=2, done_op=3)]))


def gradient_dropped_at_the_end(make_trace, events):
    # G: a gradient used at op 1, dropped by op 3, which also holds a 100 B temporary
    ops = [{"alloc": [G]}, {"reads": [G]}, {}, events, {}]
    return make_trace([0, 0, 100, 100], ["other", "other", "gradient", "temporary"], ops)


G, TMP = 2, 3


def test_a_buffer_dropped_at_the_end_of_an_op_is_away_through_that_op(make_trace):
    # op 3 allocates the temporary, then frees it and G: with G away through op 3 it fits 100 B
    tr = gradient_dropped_at_the_end(make_trace, {"alloc": [TMP], "free": [TMP, G]})
    p = plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(5)), hardware(), 100, min_nbytes=1)
    (t,) = p.transfers
    assert (t.buffer, t.use_op, t.return_op) == (G, None, 4)
    assert p.feasible
    validate_plan(tr, p)


def test_validator_rejects_a_buffer_away_through_an_op_that_allocates_after_freeing_it(make_trace):
    # op 3 frees G and then allocates the temporary: G's bytes may be what the temporary takes
    tr = gradient_dropped_at_the_end(make_trace, {"events": [("free", G), ("alloc", TMP), ("free", TMP)]})
    assert sorted(analyse_lifetimes(tr, np.ones(5)).inactive_intervals(G)) == [(1, 3)]
    p = plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(5)), hardware(), 100, min_nbytes=1)
    away = Transfer(G, 100, "gradient", "ssd", 1, 2, 3, None, False, 2.0, 3.0, None, None)
    validate_plan(tr, replace(p, transfers=[away]))  # away until op 3: allowed
    with pytest.raises(OffloadPlanBug, match="not live from op 1 to op 4"):
        validate_plan(tr, replace(p, transfers=[replace(away, return_op=4)]))


@st.composite
def random_traces(draw):
    n_ops = draw(st.integers(4, 14))
    n_buf = draw(st.integers(1, 6))
    ops = [dict(alloc=[], free=[], reads=[]) for _ in range(n_ops)]
    persistent, cats, sizes = [], [], []
    for b in range(n_buf):
        sizes.append(draw(st.integers(1, 200)))
        cats.append(draw(st.sampled_from(["parameter", "activation", "optimizer_state", "temporary"])))
        uses = draw(st.lists(st.integers(0, n_ops - 1), min_size=1, max_size=4, unique=True))
        if cats[-1] in ("parameter", "optimizer_state"):
            persistent.append(b)
        else:
            a = draw(st.integers(0, n_ops - 1))
            f = draw(st.integers(a, n_ops - 1))
            ops[a]["alloc"].append(b)
            ops[f]["free"].append(b)
            uses = [u for u in uses if a < u <= f]
        for u in uses:
            ops[u]["reads"].append(b)
    for op in ops:
        # some ops free before they allocate (a free that does not end its op)
        if op["free"] and op["alloc"] and not set(op["free"]) & set(op["alloc"]) and draw(st.booleans()):
            op["events"] = [("free", b) for b in op.pop("free")] + [("alloc", b) for b in op.pop("alloc")]
    durations = draw(st.lists(st.floats(0.1, 3.0), min_size=n_ops, max_size=n_ops))
    return sizes, cats, ops, persistent, durations


@settings(max_examples=60, deadline=None)
@given(random_traces(), st.floats(0.3, 1.0), st.floats(5.0, 500.0))
def test_every_plan_passes_the_validator_and_holds_in_simulation(make_trace, case, fraction, bandwidth):
    sizes, cats, ops, persistent, durations = case
    tr = make_trace(sizes, cats, ops, persistent=persistent)
    lt = analyse_lifetimes(tr, np.asarray(durations))
    budget = max(1, int(lt.op_bytes.max() * fraction))
    hw = hardware(ssd_bytes_per_s=bandwidth, pcie_bytes_per_s=2 * bandwidth, host_bytes=100)
    p = plan_lifetimes(tr, lt, hw, budget, min_nbytes=1)
    validate_plan(tr, p)
    result = simulate_offload_plan(lt, p, hw.link_bytes_per_s())
    assert result.step_s >= lt.step_s - 1e-9
    if p.feasible:
        assert result.peak_device_bytes <= budget
    if result.within_budget:  # no plan beats the links' bound
        assert result.step_s >= step_lower_bound_s(tr, lt, hw, budget) * (1 - 1e-9)


def test_planned_stall_is_the_runs_max_excess_over_bandwidth_spread_by_excess():
    from memplan.offload.planner import stall_padding_s

    excess = np.array([0.0, 2.0, 4.0, 2.0, 0.0, 6.0, 6.0])
    phase = np.array([0, 0, 0, 0, 0, 0, 3])
    # runs: ops 1-3 (max 4, 2 s in all, weights 2:4:2), op 5 alone, op 6 alone (another phase)
    pad = stall_padding_s(excess, phase, 2.0)
    assert pad.tolist() == [0.0, 0.5, 1.0, 0.5, 0.0, 3.0, 3.0]


def optimizer_crunch(make_trace):
    # four 100 B states, each used by one short "optimizer" op at the end of the step; eight
    # idle ops before them. 400 B live everywhere, budget 250 B: 150 B must be away at every
    # op, including the optimizer ops, where what is away must come back within the phase.
    ops = [{} for _ in range(8)] + [{"reads": [b], "writes": [b]} for b in range(4)]
    tr = make_trace([100] * 4, ["optimizer_state"] * 4, ops, persistent=[0, 1, 2, 3])
    durations = np.array([1.0] * 8 + [0.01] * 4)
    return tr, analyse_lifetimes(tr, durations)


def test_planned_stalls_beat_urgent_transfers_in_an_optimizer_crunch(make_trace):
    tr, lt = optimizer_crunch(make_trace)
    hw = hardware(ssd_bytes_per_s=100.0, pcie_bytes_per_s=100.0)
    p = plan_lifetimes(tr, lt, hw, 250, min_nbytes=1)
    first = p.rounds[0]
    assert first["planned_stall_s"] == 0 and first["urgent"] > 0
    assert len(p.rounds) > 1 and p.planned_stall_s > 0
    step_s = simulate_offload_plan(lt, p, hw.link_bytes_per_s()).step_s
    assert step_s < first["simulated_step_s"]
    assert p.feasible
    validate_plan(tr, p)


def test_one_round_when_overlapped_transfers_fit(make_trace):
    tr = only_activation(make_trace)
    p = plan_lifetimes(tr, analyse_lifetimes(tr, np.ones(10)), hardware(), 100, min_nbytes=1)
    assert len(p.rounds) == 1 and p.planned_stall_s == 0 and p.rounds[0]["urgent"] == 0


def test_scores_equal_but_for_rounding_noise_tie_and_others_do_not():
    from memplan.offload.planner import _quantized

    # identical layers: the same benefit summed in another order differs in the last bits only
    assert 0.1 + 0.2 != 0.3 and _quantized(0.1 + 0.2) == _quantized(0.3)
    assert _quantized(1.0) < _quantized(1.0 + 1e-8)


def test_each_round_pads_halfway_to_the_stalls_simulated_in_the_round_before(make_trace):
    from memplan.offload.planner import _plan_round, stall_padding_s

    tr, lt = optimizer_crunch(make_trace)
    hw = hardware(ssd_bytes_per_s=100.0, pcie_bytes_per_s=100.0)
    p = plan_lifetimes(tr, lt, hw, 250, min_nbytes=1)
    # round 0 plans on the bare timeline; its simulated stall is its step less the ideal one
    _, excess_left, _ = _plan_round(tr, lt, hw, 250, np.arange(lt.inactive_buffer.size), ["optimizer_state"] * 4)
    stalled_s = p.rounds[0]["simulated_step_s"] - lt.step_s
    padding_s = stall_padding_s(excess_left, tr.ops["phase"], 100.0).sum()
    assert stalled_s > 0 and padding_s > 0
    assert p.rounds[1]["planned_stall_s"] == pytest.approx(0.5 * (0.0 + stalled_s) + padding_s)


def test_rounds_end_after_patience_rounds_that_do_not_beat_the_fastest(make_trace):
    tr, lt = optimizer_crunch(make_trace)
    hw = hardware(ssd_bytes_per_s=100.0, pcie_bytes_per_s=100.0)
    steps = [r["simulated_step_s"] for r in plan_lifetimes(tr, lt, hw, 250, min_nbytes=1, max_rounds=16,
                                                            patience=16).rounds]
    assert len(steps) == 16  # stalls remain in every round: only max_rounds stops it
    fastest = steps.index(min(steps))  # the first round at the fastest step
    p = plan_lifetimes(tr, lt, hw, 250, min_nbytes=1, max_rounds=16, patience=2)
    assert [r["simulated_step_s"] for r in p.rounds] == steps[: fastest + 1 + 2]
