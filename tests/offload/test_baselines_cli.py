import json
import math

import numpy as np
import pytest

from memplan.cli import main
from memplan.hardware.devices import device_profile
from memplan.hardware.links import Hardware, NvmeArray, make_hardware, parse_nvme_spec
from memplan.offload.baselines import ideal, layer_of, run_baselines, torchtune_activations
from memplan.offload.lifetimes import analyse_lifetimes
from memplan.offload.simulate import Move, simulate_offload


def test_nvme_spec_by_drive_name_adds_up_a_raid0():
    array = parse_nvme_spec("4x990pro")
    assert (array.drives, array.read_bytes_per_s, array.write_bytes_per_s) == (4, 4 * 6.7e9, 4 * 6.5e9)
    assert array.capacity_bytes == 4 * 2e12


def test_nvme_spec_by_bandwidth_has_no_capacity_limit():
    array = parse_nvme_spec("2x7GB/s")
    assert array.read_bytes_per_s == array.write_bytes_per_s == 14e9
    assert math.isinf(array.capacity_bytes)


def test_ssd_and_host_channels_share_the_pcie_link():
    hw = make_hardware("h100-nvl-94gb", nvme="4x990pro", pcie="pcie-gen5-x16")
    links = hw.link_bytes_per_s()
    assert links["ssd_read"] == pytest.approx(26.8e9)
    assert links["ssd_read"] + links["host_read"] == pytest.approx(63e9)


def test_unknown_drive_is_a_user_error():
    from memplan.errors import UserError

    with pytest.raises(UserError, match="990pro"):
        parse_nvme_spec("4xfloppy")


def test_simulator_without_moves_runs_ops_back_to_back():
    r = simulate_offload(np.array([1.0, 2.0, 3.0]), np.array([10, 20, 30]), [], {})
    assert (r.step_s, r.stall_s, r.peak_device_bytes) == (6.0, 0.0, 30)


def test_simulator_stalls_an_op_until_its_prefetch_lands():
    # 2 B at 1 B/s issued when op 0 starts; op 1 needs it: it waits from t=1 to t=2
    move = Move("read", 2, 0, False, wait_op=1, device_delta_on_issue=0)
    r = simulate_offload(np.array([1.0, 1.0]), np.array([0, 0]), [move], {"read": 1.0})
    assert r.step_s == pytest.approx(3.0) and r.stall_s == pytest.approx(1.0)
    assert r.link_utilisation["read"] == pytest.approx(2 / 3)


def test_simulator_waits_for_an_offload_before_an_op_over_budget():
    # op 1 needs 100 B with a budget of 60: it waits until the 50 B offload issued after op 0
    # completes (t = 1 + 50/10 = 6); the buffer is given back after op 1
    moves = [Move("write", 50, 0, True, device_delta_on_complete=-50), Move(None, 0, 1, True, device_delta_on_issue=50)]
    r = simulate_offload(np.array([1.0, 1.0]), np.array([50, 100]), moves, {"write": 10.0}, budget_bytes=60)
    assert r.stall_s == pytest.approx(5.0) and r.within_budget and r.peak_device_bytes == 50


def test_layer_of_groups_by_transformer_block():
    assert layer_of("model.layers.12.mlp.up_proj") == "model.layers.12"
    assert layer_of("lm_head") == "lm_head"


def test_ideal_baseline_is_the_sum_of_op_times(make_trace):
    tr = make_trace([8], ["activation"], [{"alloc": [0]}, {"reads": [0]}, {"free": [0]}])
    lt = analyse_lifetimes(tr, np.array([0.5, 1.0, 2.0]))
    hw = Hardware(device_profile("h100-80gb"), 1, NvmeArray(1, 1.0, 1.0, math.inf, "t"), 0.0, 2.0)
    assert ideal(tr, lt, hw).sim.step_s == pytest.approx(3.5)
    assert torchtune_activations(tr, lt, hw, 100).feasible  # nothing in a layer: nothing moves


def test_without_nvme_zero_infinity_is_not_a_baseline(make_trace):
    tr = make_trace([8], ["activation"], [{"alloc": [0]}, {"reads": [0]}, {"free": [0]}])
    lt = analyse_lifetimes(tr, np.array([0.5, 1.0, 2.0]))
    hw = Hardware(device_profile("h100-80gb"), 1, parse_nvme_spec("0"), 0.0, 2.0)
    assert set(run_baselines(tr, lt, hw, 100)) == {"ideal", "zero_offload", "torchtune_activations"}


@pytest.mark.slow
def test_cli_prints_the_report_keys_as_one_json_object(capsys):
    code = main(["offload", "llama-3.2-1b", "--batch", "1", "--seq", "128", "--gpu", "h100-80gb",
                 "--budget", "6GiB", "--host-mem", "32GB", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("ideal_step_s", "planned_step_s", "throughput_vs_ideal", "baselines", "offloaded_bytes",
                "peak_device_bytes", "plan_elapsed_s"):
        assert key in doc
    assert set(doc["baselines"]) == {"zero_offload", "zero_infinity", "torchtune_activations"}
    for b in doc["baselines"].values():
        assert set(b) >= {"step_s", "throughput_vs_ideal", "feasible"}
    assert doc["peak_device_bytes"] <= 6 * 2**30
    assert 0 < doc["throughput_vs_ideal"] <= doc["throughput_upper_bound"] <= 1
    assert doc["planned_step_s"] >= doc["step_lower_bound_s"] >= doc["ideal_step_s"]


def test_cli_bad_nvme_spec_is_one_line_and_exit_2(capsys):
    code = main(["offload", "gpt2", "--gpu", "h100-80gb", "--nvme", "4xfloppy", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "floppy" in err


def test_saved_activations_are_the_ones_used_in_forward_and_again_in_backward(make_trace):
    from memplan.offload.baselines import saved_activations
    from memplan.trace.model import PHASE

    # b0: saved (forward, then backward); b1: a forward transient; b2: made in backward
    tr = make_trace([4096, 4096, 4096], ["activation"] * 3,
                    [{"alloc": [0, 1]}, {"reads": [0, 1], "free": [1]}, {"reads": [0], "alloc": [2], "free": [0, 2]}])
    tr.ops["phase"][2] = PHASE["backward"]
    lt = analyse_lifetimes(tr, np.array([1.0, 1.0, 1.0]))
    assert saved_activations(tr, lt).tolist() == [0]


@pytest.fixture(scope="module")
def tiny_traces():
    """A tiny Llama step on fake CUDA tensors, without and with full activation checkpointing."""
    from memplan.capture.step import capture_model
    from memplan.models import TrainingSetup, tiny_config

    config = tiny_config("llama-2-7b")
    setup = TrainingSetup(batch=8, seq=256, precision="32-true", optimizer="adamw", optimizer_impl="loop")
    plain = capture_model(config, setup, fake=True, device="cuda")
    ckpt = capture_model(config, TrainingSetup(**{**setup.to_dict(), "checkpointing": "full"}), fake=True, device="cuda")
    return plain, ckpt


def test_zero_baselines_recompute_when_activations_on_the_gpu_do_not_fit(tiny_traces):
    from memplan.hardware.roofline import op_seconds
    from memplan.offload.baselines import zero_infinity, zero_offload

    plain, ckpt = tiny_traces
    hw = make_hardware("h100-nvl-94gb", nvme="4x990pro", host_mem="1.5TB", gpus=1, pcie="pcie-gen5-x16")
    lt = analyse_lifetimes(plain, op_seconds(plain, hw.gpu))
    ck_lt = analyse_lifetimes(ckpt, op_seconds(ckpt, hw.gpu))
    budget = ck_lt.op_bytes.max()  # the checkpointed step fits, the plain one does not
    assert lt.op_bytes.max() > 2 * budget
    for baseline in (zero_offload, zero_infinity):
        alone = baseline(plain, lt, hw, budget)
        assert not alone.feasible and "no activation checkpointing" in alone.note
        best = baseline(plain, lt, hw, budget, (ckpt, ck_lt))
        assert best.feasible and best.note.startswith("activation checkpointing, checkpoints in host memory")
        assert best.sim.step_s >= compute(ckpt, ck_lt) > 1.2 * compute(plain, lt)  # it pays for the recomputation


def compute(trace, lt):
    """Seconds of the step's GPU ops other than the optimizer's (which the ZeRO baselines run on the CPU)."""
    from memplan.trace.model import PHASE

    return lt.op_durations_s[trace.ops["phase"] != PHASE["optimizer"]].sum()


@pytest.mark.slow
def test_cli_try_checkpointing_reports_the_fastest_policy_against_the_ideal_without_recomputation(capsys):
    code = main(["offload", "llama-3.2-1b", "--batch", "4", "--seq", "512", "--gpu", "h100-80gb",
                 "--budget", "16GiB", "--try-checkpointing", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    search = doc["checkpointing_search"]
    assert set(search) == {"none", "selective", "selective-op", "full"}
    fastest = min((p for p in search if search[p]["feasible"]), key=lambda p: search[p]["planned_step_s"])
    assert doc["checkpointing"] == fastest and doc["planned_step_s"] == search[fastest]["planned_step_s"]
    for figures in search.values():  # every policy against the same ideal: the step without recomputation
        assert figures["throughput_vs_ideal"] == pytest.approx(doc["ideal_step_s"] / figures["planned_step_s"])
    assert doc["plan_elapsed_s"] == pytest.approx(sum(f["plan_elapsed_s"] for f in search.values()))


def test_cli_try_checkpointing_with_a_checkpointing_policy_is_one_line_and_exit_2(capsys):
    code = main(["offload", "gpt2", "--gpu", "h100-80gb", "--checkpointing", "full", "--try-checkpointing"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "drop --checkpointing full" in err


@pytest.mark.slow
def test_cli_zero3_plans_one_fsdp2_rank_and_keeps_the_baselines_on_the_whole_step(capsys):
    args = ["offload", "llama-3.2-1b", "--batch", "1", "--seq", "128", "--gpu", "h100-80gb", "--gpus", "2",
            "--budget", "6GiB", "--host-mem", "32GB", "--json"]
    assert main(args) == 0
    replica = json.loads(capsys.readouterr().out)
    assert main(args + ["--zero", "3"]) == 0
    rank = json.loads(capsys.readouterr().out)
    assert (replica["zero"], rank["zero"]) == (0, 3)
    # one rank holds half of the fp32 parameters, gradients and AdamW states: 16 B x 1.24B / 2 less
    saved = replica["peak_device_bytes_without_offload"] - rank["peak_device_bytes_without_offload"]
    assert saved > 0.4 * 16 * 1.24e9 / 2
    assert rank["ideal_step_s"] == pytest.approx(replica["ideal_step_s"], rel=0.05)
    # the ZeRO baselines shard by --gpus themselves, on the whole step either way
    for name in ("zero_offload", "zero_infinity"):
        assert rank["baselines"][name]["step_s"] == pytest.approx(replica["baselines"][name]["step_s"])


def test_cli_zero3_on_one_gpu_is_one_line_and_exit_2(capsys):
    code = main(["offload", "gpt2", "--gpu", "h100-80gb", "--zero", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--gpus" in err


def test_an_x8_link_halves_the_channels_of_an_x16_link_of_its_generation():
    x8 = make_hardware("h100-80gb", nvme="4x990pro", pcie="pcie-gen5-x8")
    x16 = make_hardware("h100-80gb", nvme="4x990pro", pcie="pcie-gen5-x16")
    assert x8.pcie_bytes_per_s == x16.pcie_bytes_per_s / 2 == 31.5e9
    # 4x 990 PRO write 26 GB/s: within x8's 31.5, so the SSD keeps it and the host channel gets the rest
    assert x8.link_bytes_per_s()["ssd_write"] == x16.link_bytes_per_s()["ssd_write"] == 26e9
    assert x8.link_bytes_per_s()["host_write"] == pytest.approx(5.5e9)


def test_evaluate_without_baselines_plans_the_same_and_leaves_them_empty(tiny_traces):
    from memplan.offload.evaluate import evaluate

    plain, _ = tiny_traces
    hw = make_hardware("h100-80gb", nvme="4x990pro")
    budget = int(0.6 * np.max(analyse_lifetimes(plain, np.ones(plain.num_ops)).op_bytes))
    full, _ = evaluate(plain, hw, budget)
    bare, _ = evaluate(plain, hw, budget, with_baselines=False)
    assert set(full["baselines"]) == {"zero_offload", "zero_infinity", "torchtune_activations"}
    assert bare["baselines"] == {}
    assert bare["planned_step_s"] == full["planned_step_s"] and bare["feasible"] == full["feasible"]
