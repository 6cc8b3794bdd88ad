import numpy as np
import pytest

from memplan.errors import UserError
from memplan.hardware.devices import device_profile
from memplan.hardware.roofline import op_seconds
from memplan.offload.lifetimes import (
    analyse_lifetimes,
    idle_bytes_per_op,
    measured_op_durations_s,
    op_peak_bytes,
    resident_floor_bytes,
)

W, A, T = 0, 1, 2


def small(make_trace):
    # W: parameter used at ops 0 and 8; A: activation written at 1, read at 7, freed at 9
    ops = [{"reads": [W]}, {"alloc": [A]}, {}, {}, {}, {}, {}, {"reads": [A]}, {"reads": [W]}, {"free": [A]}]
    return make_trace([100, 100, 10], ["parameter", "activation", "temporary"], ops, persistent=[W])


def test_inactive_intervals_between_uses_wrap_and_tail(make_trace):
    lt = analyse_lifetimes(small(make_trace), np.ones(10))
    assert lt.inactive_intervals(W) == [(0, 8), (8, 10)]  # (8, 10): wraps to op 0 of the next step
    # A is freed by op 9 with nothing allocated after it there: op 9 is idle too, so the
    # tail runs to op 10 (the next step's op 0)
    assert sorted(lt.inactive_intervals(A)) == [(1, 7), (7, 10)]
    assert lt.inactive_returns[(lt.inactive_buffer == A) & (lt.inactive_after_op == 7)].tolist() == [False]


def test_idle_bytes_per_op_and_the_resident_floor(make_trace):
    tr = small(make_trace)
    lt = analyse_lifetimes(tr, np.ones(10))
    # W idle through ops 1-7 and 9 (wrapping to its next use at op 0); A idle through 2-6, and 8-9 (its tail)
    assert idle_bytes_per_op(tr, lt).tolist() == [0, 100, 200, 200, 200, 200, 200, 100, 100, 200]
    assert lt.op_bytes.tolist() == [100] + [200] * 9
    # the least any plan reaches: one of W and A is in use at ops 0, 1, 7 and 8
    assert resident_floor_bytes(tr) == 100


def test_a_tail_ends_at_the_freeing_op_when_an_allocation_follows_the_free(make_trace):
    # op 9 frees A and then allocates T: T may need the bytes A held, so A counts at op 9
    ops = [{"reads": [W]}, {"alloc": [A]}, {}, {}, {}, {}, {}, {"reads": [A]}, {"reads": [W]},
           {"events": [("free", A), ("alloc", T), ("free", T)]}]
    tr = make_trace([100, 100, 10], ["parameter", "activation", "temporary"], ops, persistent=[W])
    assert sorted(analyse_lifetimes(tr, np.ones(10)).inactive_intervals(A)) == [(1, 7), (7, 9)]


def test_inactive_intervals_in_seconds_run_from_end_of_use_to_start_of_next(make_trace):
    lt = analyse_lifetimes(small(make_trace), np.arange(1, 11, dtype=float))  # op i takes i+1 s
    start = np.concatenate([[0], np.cumsum(np.arange(1, 11))])
    assert lt.inactive_intervals_s(A)[0] == (start[2], start[7])
    assert lt.inactive_intervals_s(W)[1] == (start[9], start[10] + start[0])


def test_active_intervals_are_runs_of_consecutive_ops(make_trace):
    ops = [{"alloc": [0]}, {"reads": [0]}, {}, {"reads": [0]}, {"free": [0]}]
    lt = analyse_lifetimes(make_trace([8], ["activation"], ops), np.ones(5))
    assert lt.active_intervals(0) == [(0, 1), (3, 3)]
    assert lt.active_intervals_s(0) == [(0.0, 2.0), (3.0, 4.0)]


def test_op_bytes_is_the_peak_inside_each_op(make_trace):
    ops = [{"alloc": [0]}, {"alloc": [1], "free": [1]}, {"free": [0]}]
    tr = make_trace([100, 50], ["activation", "temporary"], ops)
    assert op_peak_bytes(tr).tolist() == [100, 150, 100]


def test_roofline_is_the_slower_of_compute_and_memory(make_trace):
    tr = make_trace([8, 8], ["activation", "activation"], [{"alloc": [0]}, {"alloc": [1]}])
    gpu = device_profile("h100-80gb")
    tr.ops["flops"][:] = [gpu.matmul_flops_per_s("fp32") * 2.0, 0.0]
    tr.ops["bytes_moved"][:] = [gpu.memory_bandwidth_bytes_per_s * 1.0, gpu.memory_bandwidth_bytes_per_s * 3.0]
    assert op_seconds(tr, gpu) == pytest.approx([2.0, 3.0])


def test_roofline_times_matmuls_at_the_autocast_rate_of_the_traced_setup(make_trace):
    # fp32 parameters under bf16 autocast: the matmuls run in bf16 (memplan.hardware.roofline)
    tr = make_trace([8, 8], ["activation", "activation"], [{"alloc": [0]}, {"alloc": [1]}])
    tr.meta["setup"] = {"precision": "bf16-mixed"}
    gpu = device_profile("h100-80gb")
    flops = [4e12, 2e12]
    tr.ops["flops"][:] = flops
    tr.ops["bytes_moved"][:] = 0.0  # compute-bound
    bf16, fp32 = gpu.matmul_flops_per_s("bf16"), gpu.matmul_flops_per_s("fp32")
    assert bf16 > 2 * fp32  # the two rates are far apart on this profile
    durations = op_seconds(tr, gpu)
    assert durations == pytest.approx([f / bf16 for f in flops])
    assert analyse_lifetimes(tr, durations).step_s == pytest.approx(sum(flops) / bf16)


def test_measured_times_must_match_the_op_count(make_trace):
    tr = small(make_trace)
    with pytest.raises(UserError, match="10 ops"):
        measured_op_durations_s(tr, [1.0, 2.0])
    with pytest.raises(UserError):
        measured_op_durations_s(tr, [-1.0] * 10)


def test_a_real_capture_measures_each_op_and_a_fake_one_has_no_measured_times():
    from memplan import models
    from memplan.capture.step import capture_model

    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    real = capture_model(models.tiny_config("gpt2"), setup, fake=False, device="cpu")
    measured = measured_op_durations_s(real)
    assert measured.shape == (real.num_ops,) and (measured >= 0).all()
    assert 0 < measured.sum() <= real.meta["capture_s"]  # the kernels, inside the recorded step
    fake = capture_model(models.tiny_config("gpt2"), setup, fake=True, device="cuda")
    with pytest.raises(UserError, match="no measured op times"):
        measured_op_durations_s(fake)


def test_measured_op_times_follow_the_work_of_each_op():
    import torch

    from memplan.capture import capture

    big, small = torch.randn(768, 768), torch.randn(8)

    def step():
        for _ in range(5):
            big @ big  # ~0.9 GFLOP each
            small + 1.0

    trace = capture(step)
    names = [trace.op_names[i] for i in trace.ops["name"]]
    times = measured_op_durations_s(trace)
    mm = [t for n, t in zip(names, times) if n.startswith("aten.mm")]
    add = [t for n, t in zip(names, times) if n.startswith("aten.add")]
    assert len(mm) == len(add) == 5
    assert sorted(mm)[2] > 10 * sorted(add)[2]  # medians
