"""`--engine fsdp2|fsdp1|deepspeed`: the checks, FSDP1 traced on the fake process group, and
DeepSpeed's modelled ZeRO buffers against hand-computed sizes (the real gloo runs are in
test_groundtruth.py for FSDP1 and in benchmarks/bench_deepspeed_gloo.py for DeepSpeed)."""

import math

import numpy as np
import pytest

from memplan import models
from memplan.capture.step import capture_step
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.parallel import Layout, rank_trace
from memplan.parallel.apply import traceable
from memplan.parallel.layout import DeepSpeedConfig
from memplan.parallel.traced import capture_rank_step
from memplan.trace.model import CATEGORY

LLAMA = models.tiny_config("llama-2-7b")
SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")
BF16 = models.TrainingSetup(batch=2, seq=32, optimizer_impl="foreach", precision="bf16-true")
PARAMETERS = 166_208  # the tiny Llama: 2 blocks of 46,208, embedding and head 32,768 each, final norm 64


@pytest.mark.parametrize(("layout", "message"), [
    ({"world_size": 2, "engine": "fsdp1"}, "`zero=0` \\(DDP\\) shards nothing"),
    ({"world_size": 2, "zero": 1, "engine": "fsdp2"}, "implements ZeRO stage 3, not 1"),
    ({"world_size": 2, "zero": 2, "engine": "fsdp1"}, "implements ZeRO stage 3, not 2"),
    ({"world_size": 4, "zero": 3, "tp": 2, "engine": "fsdp1"}, "estimated alone"),
    ({"world_size": 2, "zero": 3, "engine": "deepspeed", "fsdp_param_dtype": "bf16"}, "DeepSpeed trains in"),
    ({"world_size": 2, "zero": 3, "deepspeed": DeepSpeedConfig(reduce_bucket_size=10)}, "configures DeepSpeed's ZeRO"),
    ({"world_size": 2, "zero": 3, "engine": "deepspeed", "deepspeed": {"prefetch_bucket_size": -1}}, "whole number"),
    ({"world_size": 2, "zero": 3, "engine": "megatron"}, "`engine` must be one of"),
])
def test_an_engine_that_cannot_shard_the_layout_is_a_one_line_user_error(layout, message):
    with pytest.raises(UserError, match=message) as info:
        Layout(**layout)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_an_engine_without_zero_in_one_line_with_exit_2(capsys):
    from memplan.cli import main

    code = main(["estimate", "llama-2-7b", "--world-size", "2", "--engine", "fsdp1", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--zero" in err


def test_each_stage_has_its_default_engine():
    assert Layout(world_size=2).zero_engine is None
    assert Layout(world_size=2, zero=3).zero_engine == "fsdp2"
    assert Layout(world_size=2, zero=2).zero_engine == "deepspeed"
    assert Layout(world_size=2, zero=3, engine="fsdp1").to_dict()["engine"] == "fsdp1"


def test_fsdp1_is_traced_with_a_sharded_flat_parameter_per_block_and_for_the_root():
    assert traceable(Layout(world_size=2, zero=3, engine="fsdp1")) is None
    assert traceable(Layout(world_size=2, zero=3, engine="deepspeed")) is not None
    trace = capture_rank_step(LLAMA, SETUP, Layout(world_size=2, zero=3, engine="fsdp1"), rank=0).trace
    gathers = [i for i in range(trace.num_ops) if trace.op_name(i) == "c10d.allgather_.default"]
    assert len(gathers) == 5  # root and both blocks in forward, both blocks again in backward
    unsharded = sorted({int(trace.buffers["nbytes"][np.unique(trace.op_outputs(i))].sum()) for i in gathers})
    assert len(unsharded) == 2 and sum(unsharded) >= PARAMETERS * 4 / 2  # a block's flat parameter, the root's
    pre = trace.buffers["alloc_op"] < 0
    params = trace.buffers["nbytes"][pre & (trace.buffers["category"] == CATEGORY["parameter"])]
    block, root = unsharded
    # between steps: each flat parameter's half on this rank, and the root's gathered one, which
    # FSDP1 keeps after the backward (the root is not resharded: it runs first in the next forward)
    assert sorted(params[params > 0].tolist()) == sorted([block // 2, block // 2, root // 2, root])


@pytest.fixture(scope="module")
def single():
    return capture_step(LLAMA, BF16, device="cpu")


def _params(trace):
    return trace.buffers["nbytes"][trace.buffers["category"] == CATEGORY["parameter"]]


def test_deepspeed_zero3_partitions_every_parameter_above_the_persistence_threshold(single):
    full = _params(single.trace)
    sharded = rank_trace(single, Layout(world_size=2, zero=3, engine="deepspeed", deepspeed=DeepSpeedConfig(
                                        param_persistence_threshold=0, reduce_bucket_size=1000)), BF16, 0)
    numel = full // 2
    assert np.array_equal(_params(sharded)[: len(full)], np.ceil(numel / 2).astype(np.int64) * 2)
    kept = rank_trace(single, Layout(world_size=2, zero=3, engine="deepspeed", deepspeed=DeepSpeedConfig(reduce_bucket_size=1000)), BF16, 0)
    assert np.array_equal(_params(kept)[: len(full)], full)  # every tiny parameter is below 1e5 elements


def _extra_sizes(layout, single):
    trace = rank_trace(single, layout, BF16, 0)
    return sorted(int(n) for n in trace.buffers["nbytes"][single.trace.num_buffers:])


def test_deepspeed_zero3_adds_its_master_weights_gradient_partitions_and_reduce_bucket(single):
    layout = Layout(world_size=2, zero=3, engine="deepspeed", deepspeed=DeepSpeedConfig(reduce_bucket_size=1000))
    sizes = _extra_sizes(layout, single)
    half = math.ceil(PARAMETERS / 2)
    # fp32 master half and the fp32 gradient buffer (4 B each), the bf16 gradient partition,
    # the bf16 reduce bucket of 1000 elements
    for nbytes in (half * 4, half * 4, half * 2, 1000 * 2):
        assert nbytes in sizes
        sizes.remove(nbytes)


def test_deepspeed_zero2_adds_master_weights_fp32_step_gradients_and_bucket(single):
    sizes = _extra_sizes(Layout(world_size=2, zero=2, deepspeed=DeepSpeedConfig(reduce_bucket_size=1000)), single)
    half = math.ceil(PARAMETERS / 2)
    # fp32 master half, fp32 gradient half for the step, the bf16 gradient partition, one bucket
    for nbytes in (half * 4, half * 4, half * 2, 1000 * 2):
        assert nbytes in sizes
        sizes.remove(nbytes)
    with_overlap = _extra_sizes(Layout(world_size=2, zero=2, deepspeed=DeepSpeedConfig(reduce_bucket_size=1000, overlap_comm=True)), single)
    assert with_overlap.count(2000) == 2  # double buffers with overlap_comm


def test_deepspeed_zero1_keeps_whole_gradients_and_fp32_states_over_the_partition(single):
    layout = Layout(world_size=2, zero=1, deepspeed=DeepSpeedConfig(reduce_bucket_size=1000))
    trace = rank_trace(single, layout, BF16, 0)
    cat, n = single.trace.buffers["category"], single.trace.num_buffers
    states = cat == CATEGORY["optimizer_state"]
    # bf16 states -> fp32 (x 2) over half of them (/ 2): the same bytes, rounded up
    assert np.array_equal(trace.buffers["nbytes"][:n][states], single.trace.buffers["nbytes"][states])
    # the whole gradients (until the backward's end), then the bf16 partition and its fp32 copy
    grads = int(single.trace.buffers["nbytes"][cat == CATEGORY["gradient"]].sum())
    extra = trace.buffers["nbytes"][n:][trace.buffers["category"][n:] == CATEGORY["gradient"]]
    half = math.ceil(PARAMETERS / 2)
    assert int(extra.sum()) == grads + half * 2 + half * 4


def test_deepspeed_estimate_is_modelled_and_its_default_bucket_dominates_a_tiny_model():
    result = estimate(LLAMA, BF16, Layout(world_size=2, zero=2), device="cpu", allocator="none")
    assert result.parallel == "modelled" and result.layout["engine"] == "deepspeed"
    assert result.peak_allocated_bytes > 5e8 * 2  # reduce_bucket_size 5e8 bf16 elements, DeepSpeed's default
