"""Tracing one rank of a parallel job on a fake process group (FSDP2, DTensor TP)."""

import pytest

from memplan import models
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.parallel import Layout
from memplan.parallel.apply import traceable
from memplan.parallel.traced import capture_rank_step, capture_stage_step, gloo_staging_buffers
from memplan.trace.model import ALLOC, CATEGORY

LLAMA = models.tiny_config("llama-2-7b")
SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")


def _parameter_bytes_at_start(trace):
    pre = trace.buffers["alloc_op"] < 0
    return int(trace.buffers["nbytes"][pre & (trace.buffers["category"] == CATEGORY["parameter"])].sum())


def test_fsdp2_rank_holds_a_shard_of_every_parameter_between_steps():
    single = estimate(LLAMA, SETUP, None, device="cpu", allocator="none").per_rank[0]
    trace = capture_rank_step(LLAMA, SETUP, Layout(world_size=4, zero=3), rank=1).trace
    sharded = _parameter_bytes_at_start(trace)
    # FSDP2 pads each parameter's dim 0 to a multiple of 4 before sharding
    assert single.breakdown["parameters"] / 4 <= sharded <= single.breakdown["parameters"] / 4 * 1.05


def test_fsdp2_frees_each_block_s_gathered_parameters_after_its_forward():
    trace = capture_rank_step(LLAMA, SETUP, Layout(world_size=2, zero=3), rank=0).trace
    names = [trace.op_name(i) for i in range(trace.num_ops)]
    gathers = names.count("c10d._allgather_base_.default")
    assert gathers == 2 * (LLAMA.num_hidden_layers + 1)  # root and every block, forward and backward
    assert names.count("c10d._reduce_scatter_base_.default") == LLAMA.num_hidden_layers + 1


def test_gloo_stages_each_all_gather_output_and_clones_each_reduce_scatter_input():
    trace = capture_rank_step(LLAMA, SETUP, Layout(world_size=2, zero=3), rank=0).trace
    extras = gloo_staging_buffers(trace)
    outputs = [int(trace.buffers["nbytes"][trace.op_outputs(i)].sum()) for i in range(trace.num_ops)
               if trace.op_name(i) == "c10d._allgather_base_.default"]
    # ProcessGroupGloo::reduce_scatter_tensor_coalesced all-reduces a clone of its input
    inputs = [int(trace.buffers["nbytes"][trace.op_inputs(i)].max()) for i in range(trace.num_ops)
              if trace.op_name(i) == "c10d._reduce_scatter_base_.default"]
    assert [x.nbytes for x in extras] == outputs + inputs
    assert len(inputs) == LLAMA.num_hidden_layers + 1 and min(inputs) > 0


def test_gloo_staging_buffer_is_freed_before_fsdp2_allocates_the_unsharded_parameters():
    trace = capture_rank_step(LLAMA, SETUP, Layout(world_size=2, zero=3), rank=0).trace
    allocs = trace.events["kind"] == ALLOC
    unsharded = allocs & (trace.buffers["category"][trace.events["buffer"]] == CATEGORY["parameter"])
    extras = gloo_staging_buffers(trace)
    # the root's all-gather in forward and backward is waited on at once: its copy-out
    # allocations follow the collective directly
    assert sum(unsharded[x.alloc_before] for x in extras) >= 2
    for x in extras:
        end = x.free_before if x.free_before >= 0 else trace.num_events
        assert not unsharded[x.alloc_before:end].any()


def test_tensor_parallel_rank_holds_half_of_each_projection():
    trace = capture_rank_step(LLAMA, SETUP, Layout(tp=2), rank=0).trace
    full = estimate(LLAMA, SETUP, None, device="cpu", allocator="none").per_rank[0].breakdown["parameters"]
    assert _parameter_bytes_at_start(trace) < full * 0.6


def test_estimate_traces_fsdp2_and_tp_and_models_ddp_zero12_and_pipelines():
    def how(layout):
        return estimate(LLAMA, SETUP, layout, device="cpu", allocator="none").parallel

    assert how(Layout(world_size=2, zero=3)) == "traced"
    assert how(Layout(tp=2)) == "traced"
    assert how(Layout(world_size=2)) == "modelled"
    assert how(Layout(world_size=2, zero=1)) == "modelled"
    assert traceable(Layout(pp=2)) is not None
    assert traceable(Layout(tp=2), models.tiny_config("gpt2")) is not None  # no Llama projections


def test_tied_embeddings_stay_one_vocabulary_sharded_parameter_under_tensor_parallel():
    import torch.distributed as dist
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memplan.parallel.apply import apply_layout

    config = models.tiny_config("qwen2.5-0.5b")
    assert config.tie_word_embeddings
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = models.build_model(config, SETUP, device="cpu")
        apply_layout(model, Layout(tp=2), "model.layers")
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert head.weight is embed.weight
        assert embed.weight.placements == (Shard(0),)
        assert embed.weight.to_local().shape[0] == config.vocab_size // 2
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_of_a_tied_embedding_model_is_traced():
    config = models.tiny_config("qwen2.5-0.5b")
    assert estimate(config, SETUP, Layout(tp=2), device="cpu", allocator="none").parallel == "traced"


@pytest.mark.parametrize(("family", "options", "layout", "reason"), [
    ("gpt2", {}, Layout(tp=2), "q/k/v and gate/up"),
    ("llama-2-7b", {"lora_rank": 4}, Layout(world_size=4, tp=2), "frozen parameters trainable"),
    ("qwen2.5-0.5b", {}, Layout(world_size=4, tp=2), "tied input/output embeddings"),
])
def test_estimate_refuses_tensor_parallel_it_cannot_trace(family, options, layout, reason):
    setup = models.TrainingSetup(batch=2, seq=32, **{"precision": "32-true", **options})
    with pytest.raises(UserError, match=reason):
        estimate(models.tiny_config(family), setup, layout, device="cpu", allocator="none")


def test_estimate_cli_refuses_gpt2_tensor_parallel_with_one_line_and_exit_2(capsys):
    from memplan.cli import main

    code = main(["estimate", "gpt2", "--tp", "2", "--seq", "32", "--device", "cpu", "--allocator", "none"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--tp 2" in err


def test_estimate_can_be_told_to_model_a_traceable_layout():
    result = estimate(LLAMA, SETUP, Layout(world_size=2, zero=3), device="cpu", allocator="none",
                      parallel_tracing=False)
    assert result.parallel == "modelled"


def test_ddp_with_tensor_parallel_is_traced_with_local_parameters_and_modelled_buckets():
    layout = Layout(world_size=4, tp=2)
    trace = capture_rank_step(LLAMA, SETUP, layout, rank=0).trace
    tp_only = estimate(LLAMA, SETUP, Layout(tp=2), device="cpu", allocator="none").per_rank[0]
    result = estimate(LLAMA, SETUP, layout, device="cpu", allocator="none")
    assert result.parallel == "traced + modelled"
    # DDP's parameter transform: the optimizer steps rank-local tensors, the TP shards
    assert trace.meta["trainable_bytes"] == _parameter_bytes_at_start(trace)
    assert trace.meta["trainable_bytes"] < tp_only.breakdown["parameters"] * 1.01 < 2 * trace.meta["trainable_bytes"]
    # the buckets: one more copy of the rank's gradients for the whole step
    assert result.per_rank[0].breakdown["other"] - tp_only.breakdown["other"] == trace.meta["trainable_bytes"]


def test_ddp_on_a_fake_process_group_gets_only_its_parameter_transform():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memplan.parallel.apply import apply_layout, device_mesh

    layout = Layout(world_size=4, tp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = models.build_model(LLAMA, SETUP, device="cpu")
        trained = apply_layout(model, layout, "model.layers", device_mesh(layout), reducer=False)
        assert trained is model
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    finally:
        dist.destroy_process_group()
        from memplan.parallel.traced import _forget_previous_meshes

        _forget_previous_meshes()


def test_zero_1_with_tensor_parallel_shards_the_tp_shards_of_the_optimizer_states():
    tp_only = estimate(LLAMA, SETUP, Layout(tp=2), device="cpu", allocator="none").per_rank[0]
    zero1 = estimate(LLAMA, SETUP, Layout(world_size=4, zero=1, tp=2), device="cpu", allocator="none")
    assert zero1.parallel == "traced + modelled"
    # DeepSpeed's ZeRO-1 over the 2 data-parallel ranks: the fp32 states of the rank's half of
    # its TP shards, plus the fp32 master copy of that half (every parameter is trainable)
    expected = tp_only.breakdown["optimizer_state"] / 2 + tp_only.breakdown["parameters"] / 2
    assert zero1.per_rank[0].breakdown["optimizer_state"] == pytest.approx(expected, abs=64)


PP_LLAMA = models.tiny_config("llama-2-7b", num_hidden_layers=4)


def test_pipeline_with_tensor_parallel_is_traced_once_per_distinct_stage():
    result = estimate(PP_LLAMA, SETUP, Layout(pp=2, tp=2, microbatches=2), device="cpu", allocator="none")
    assert result.parallel == "traced"
    assert [(r.rank, r.ranks) for r in result.per_rank] == [(0, [0, 1]), (2, [2, 3])]


def test_pipeline_without_tensor_parallel_stays_modelled():
    result = estimate(PP_LLAMA, SETUP, Layout(pp=2, microbatches=2), device="cpu", allocator="none")
    assert result.parallel == "modelled"


def _owned_parameter_bytes(stage, tp):
    """Hand rule: the stage's parameter bytes, projections, embedding and head split by tp."""
    from memplan.capture.pipeline import stage_modules
    from memplan.parallel.apply import COLWISE, ROWWISE

    model = models.build_model(PP_LLAMA, SETUP, device="meta")
    _, owned = stage_modules(model, 2, stage)
    split = (*COLWISE, *ROWWISE, "embed_tokens", "lm_head")
    total = 0
    for top in owned:
        names = {id(m): n for n, m in model.named_modules()}
        for module in top.modules():
            for p in module.parameters(recurse=False):
                leaf = names[id(module)].rpartition(".")[2]
                total += p.numel() * p.element_size() // (tp if leaf in split else 1)
    return total


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stage_under_tensor_parallel_holds_its_own_modules_with_projections_split(stage):
    step = capture_stage_step(PP_LLAMA, SETUP, Layout(pp=2, tp=2, microbatches=2), stage)
    trace = step.trace
    assert trace.meta["rank"] == stage * 2 and step.layers == 2
    assert _parameter_bytes_at_start(trace) == _owned_parameter_bytes(stage, 2)


def test_last_pipeline_stage_under_tensor_parallel_all_reduces_what_the_tp_plan_makes_partial():
    microbatches, blocks = 2, 2
    trace = capture_stage_step(PP_LLAMA, SETUP, Layout(pp=2, tp=2, microbatches=microbatches), 1).trace
    names = [trace.op_name(i) for i in range(trace.num_ops)]
    reduces = sum(1 for n in names if n.startswith("_c10d_functional.all_reduce"))
    # per micro-batch and block: o_proj and down_proj outputs in forward, and in backward
    # the input gradient of each of the 5 colwise projections; plus the LM head's input gradient
    assert reduces == microbatches * (blocks * (2 + 5) + 1)


def test_traced_pipeline_stages_agree_with_the_modelled_rule_where_blocks_dominate():
    """With TP 1 the traced 1F1B stage and the modelled rule (one micro-batch's trace x
    micro-batches in flight) describe the same step: within 3% on a tiny Mistral."""
    config = models.tiny_config("mistral-7b", num_hidden_layers=6)
    layout = Layout(pp=2, microbatches=4)
    modelled = estimate(config, SETUP, layout, device="cpu", allocator="none")
    for rank in modelled.per_rank:
        trace = capture_stage_step(config, SETUP, layout, rank.rank).trace
        traced = int(trace.peak()[0])
        assert rank.peak_allocated_bytes == pytest.approx(traced, rel=0.03), rank.rank


def test_tied_embeddings_under_pipeline_and_tensor_parallel_are_traced():
    config = models.tiny_config("qwen2.5-0.5b")
    result = estimate(config, SETUP, Layout(pp=2, tp=2, microbatches=2), device="cpu", allocator="none")
    assert result.parallel == "traced" and len(result.per_rank) == 2


def test_multi_stage_schedules_are_traced_with_pytorchs_runtime_on_every_rank():
    layout = Layout(tp=2, pp=2, microbatches=2, schedule="interleaved")
    result = estimate(PP_LLAMA, SETUP, layout, device="cpu", allocator="none")
    assert result.parallel == "traced"
    assert [(r.rank, r.ranks) for r in result.per_rank] == [(0, [0, 1]), (2, [2, 3])]
    # more data-parallel ranks per stage: the schedule traced, FSDP2 modelled on it
    result = estimate(PP_LLAMA, SETUP, Layout(world_size=8, zero=3, tp=2, pp=2, microbatches=2, schedule="zbv"),
                      device="cpu", allocator="none")
    assert result.parallel == "traced + modelled"


def test_pipeline_with_tensor_and_data_parallel_traces_one_data_parallel_rank_per_stage():
    result = estimate(PP_LLAMA, SETUP, Layout(world_size=8, zero=3, tp=2, pp=2, microbatches=2), device="cpu",
                      allocator="none")
    assert result.parallel == "traced + modelled"
    assert [(r.rank, r.ranks) for r in result.per_rank] == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7])]


def test_zero_3_under_pipeline_parallelism_keeps_each_block_gathered_from_forward_to_backward():
    from memplan.parallel.transform import _fsdp_buffers, block_spans

    trace = capture_rank_step(LLAMA, SETUP, Layout(tp=2), rank=0).trace
    spans = block_spans(trace, "model.layers")
    blocks = sorted(spans)
    extras = _fsdp_buffers(trace, "model.layers", {b: 1000 for b in blocks}, {}, 0, 0, reshard_after_forward=False)
    assert [(x.nbytes, x.free_before) for x in extras] == [(1000, spans[b]["backward"][1]) for b in blocks]


def test_lora_layers_under_tensor_parallel_shard_the_frozen_base_and_the_adapter_half_on_the_split_side():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from memplan.models.build import transformer_blocks
    from memplan.parallel.apply import tensor_parallel_plan

    model = models.build_model(LLAMA, models.TrainingSetup(precision="32-true", batch=1, seq=8, lora_rank=4), device="meta")
    blocks = transformer_blocks(model)
    path = next(name for name, mod in model.named_modules() if mod is blocks)
    plan = tensor_parallel_plan(model, path)
    q, o = f"{path}.0.self_attn.q_proj", f"{path}.0.self_attn.o_proj"
    assert isinstance(plan[q + ".base_layer"], ColwiseParallel) and isinstance(plan[q + ".lora_B.default"],
                                                                                ColwiseParallel)
    assert q + ".lora_A.default" not in plan and q not in plan  # replicated by _replicate_the_rest
    assert isinstance(plan[f"{path}.0.self_attn.v_proj.base_layer"], ColwiseParallel)
    assert isinstance(plan[o], RowwiseParallel)  # no adapter on o_proj (peft's Llama targets: q_proj, v_proj)


def test_lora_under_tensor_parallel_keeps_only_the_adapters_trainable():
    result = estimate(LLAMA, models.TrainingSetup(precision="32-true", batch=2, seq=32, lora_rank=4), Layout(tp=2), device="cpu",
                      allocator="none")
    plain = estimate(LLAMA, SETUP, Layout(tp=2), device="cpu", allocator="none")
    assert result.parallel == "traced"
    assert 0 < result.per_rank[0].breakdown["optimizer_state"] < plain.per_rank[0].breakdown["optimizer_state"] / 20


def test_lora_under_pipeline_and_tensor_parallel_is_traced_with_adapter_only_optimizer_states():
    lora = estimate(PP_LLAMA, models.TrainingSetup(precision="32-true", batch=2, seq=32, lora_rank=4),
                    Layout(tp=2, pp=2, microbatches=2), device="cpu", allocator="none")
    full = estimate(PP_LLAMA, SETUP, Layout(tp=2, pp=2, microbatches=2), device="cpu", allocator="none")
    assert lora.parallel == "traced"
    for adapted, plain in zip(lora.per_rank, full.per_rank):
        assert 0 < adapted.breakdown["optimizer_state"] < plain.breakdown["optimizer_state"] / 20
