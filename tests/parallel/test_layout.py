"""Parallel layouts: checks, and the *modelled* sharding rules on hand-computable tiny steps
(`parallel_tracing=False`; the traced layouts are tested in test_traced.py and test_groundtruth.py)."""

import pytest

from memplan import models
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.parallel import Layout

SETUP = models.TrainingSetup(seq=32, precision="bf16-true")


def _rank0(layout, family="llama-2-7b", **options):
    setup = models.TrainingSetup(seq=32, precision="bf16-true", **options)
    return estimate(models.tiny_config(family), setup, layout, allocator="none", device="cpu",
                    parallel_tracing=False).per_rank[0]


def test_world_size_defaults_to_tp_times_pp_and_dp_is_what_remains():
    assert Layout(tp=2, pp=2).world_size == 4
    assert Layout(world_size=16, tp=2, pp=2).dp == 4


def test_world_size_not_divisible_by_tp_times_pp_is_a_user_error():
    with pytest.raises(UserError, match="not divisible"):
        Layout(world_size=6, tp=4)


def test_shard_size_must_divide_the_data_parallel_degree_and_needs_zero_3():
    with pytest.raises(UserError, match="must divide"):
        Layout(world_size=8, zero=3, shard_size=3)
    with pytest.raises(UserError, match="needs `zero=3`"):
        Layout(world_size=8, zero=2, shard_size=2)


def test_tp_must_divide_attention_and_kv_heads():
    config = models.tiny_config("llama-2-70b")  # 4 heads, 2 KV heads
    with pytest.raises(UserError, match="key/value heads"):
        Layout(tp=4).check(config, SETUP)
    Layout(tp=2).check(config, SETUP)


def test_pipeline_stages_must_split_the_blocks_evenly():
    with pytest.raises(UserError, match="do not split evenly"):
        Layout(pp=2, schedule="interleaved").check(models.tiny_config("gpt2"), SETUP)


def test_zero_1_shards_optimizer_state_by_the_data_parallel_degree():
    single = _rank0(None).breakdown
    zero1 = _rank0(Layout(world_size=4, zero=1)).breakdown
    # DeepSpeed's ZeRO-1 (the default engine of stages 1-2): the bf16 states become fp32 over a
    # quarter of them (x 4 / 2 / 4), plus the fp32 master quarter of the bf16 parameters (x 2 / 4)
    states, params = single["optimizer_state"] / 2, single["parameters"] / 2
    assert states + params <= zero1["optimizer_state"] <= states + params + 64 * 4


def test_zero_3_shards_parameters_and_adds_gathered_blocks():
    single = _rank0(None)
    zero3 = _rank0(Layout(world_size=8, zero=3), checkpointing="full")
    assert zero3.breakdown["parameters"] <= single.breakdown["parameters"] / 8 + 4096
    assert zero3.breakdown["other"] > 0  # all-gathered unsharded parameters


def test_ddp_keeps_one_gradient_sized_bucket_copy():
    single = _rank0(None, optimizer="sgd")
    ddp = _rank0(Layout(world_size=2), optimizer="sgd")
    assert ddp.peak_allocated_bytes > single.peak_allocated_bytes


def test_tensor_parallel_lowers_the_peak():
    assert _rank0(Layout(tp=2)).peak_allocated_bytes < _rank0(None).peak_allocated_bytes


def test_pipeline_reports_first_middle_and_last_stage_ranks():
    config = models.tiny_config("gpt2", num_hidden_layers=4)
    result = estimate(config, SETUP, Layout(pp=4, microbatches=8), device="cpu", allocator="none")
    assert [r.rank for r in result.per_rank] == [0, 1, 3]
    assert result.per_rank[1].ranks == [1, 2]


def test_fsdp_mixed_precision_needs_zero_3():
    with pytest.raises(UserError, match="`zero=3`"):
        Layout(world_size=2, zero=2, fsdp_param_dtype="bf16")


def test_fsdp_mixed_precision_is_refused_where_fsdp2_is_modelled():
    from memplan import models
    from memplan.estimation import estimate

    with pytest.raises(UserError, match="fsdp_param_dtype"):
        estimate(models.tiny_config("llama-2-7b", num_hidden_layers=4), models.TrainingSetup(precision="32-true", batch=1, seq=16),
                 Layout(world_size=8, zero=3, pp=2, tp=2, microbatches=2, fsdp_param_dtype="bf16"), device="cpu")


@pytest.mark.parametrize("layout", [Layout(world_size=2, tp=2), Layout(world_size=2, pp=2)])
def test_a_factory_model_is_refused_tensor_and_pipeline_parallelism(layout):
    with pytest.raises(UserError, match="factory mypkg.models:make builds its own model"):
        layout.check(models.FactorySpec("mypkg.models", "make"), models.TrainingSetup(precision="32-true"))


@pytest.mark.parametrize(("layout", "offload", "message"), [
    (Layout(world_size=2, zero=2), "params", "add `zero=3` and `world_size=2`"),
    (Layout(), "params", "add `zero=3` and `world_size=2`"),
    (Layout(world_size=2, zero=1), "optimizer", "add `zero=2` or 3"),
    (Layout(world_size=2), "optimizer", "add `zero=2` or 3"),
    (Layout(world_size=4, zero=3, tp=2), "params", "leave out `tp`, `pp`, `cp`"),
])
def test_cpu_offload_is_refused_where_no_layout_can_take_it(layout, offload, message):
    with pytest.raises(UserError, match=message):
        layout.check(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", cpu_offload=offload))


def test_fsdp2_cpu_offload_is_refused_where_fsdp2_is_modelled():
    with pytest.raises(UserError, match="leave out --modelled-layout"):
        _rank0(Layout(world_size=2, zero=3), cpu_offload="params")


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_offload_moves_the_ranks_optimizer_states_and_gradients_to_the_host(zero):
    """DeepSpeed's ZeRO-Offload over 2 ranks (modelled): the states and the gradient shards
    the step reads are host memory, the device keeps neither, and DeepSpeedCPUAdam's step
    has no temporaries."""
    plain = _rank0(Layout(world_size=2, zero=zero))
    offloaded = _rank0(Layout(world_size=2, zero=zero), cpu_offload="optimizer")
    assert offloaded.breakdown["optimizer_state"] == 0 < plain.breakdown["optimizer_state"]
    assert offloaded.host.pageable_bytes == plain.breakdown["optimizer_state"]  # the states live all step
    assert offloaded.host.pinned_bytes > 0  # the gradient shards
    assert offloaded.peak_allocated_bytes < plain.peak_allocated_bytes
