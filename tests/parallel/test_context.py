"""Context parallelism (`--cp`): PyTorch's `context_parallel` traced on a fake process group,
its refusals, and its rank numbering. The real gloo runs are in test_groundtruth.py."""

import pytest

from memplan import models
from memplan.cli import main
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.parallel import Layout

LLAMA = models.tiny_config("llama-2-7b")
SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")


@pytest.mark.parametrize(("argv", "message"), [
    (["--cp", "2", "--zero", "3", "--seq", "30"], "sequence 30 is not divisible by 4"),
    (["--cp", "2", "--zero", "3", "--seq", "32", "--attn", "eager"], "--cp needs --attn sdpa or flash"),
    (["--cp", "2", "--seq", "32"], "add --zero 3"),
    (["--cp", "2", "--zero", "3", "--pp", "2", "--seq", "32"], "not composed with --pp"),
    (["--cp", "2", "--zero", "3", "--world-size", "3", "--seq", "32"], "not divisible by tp x pp x cp"),
])
def test_bad_context_parallel_input_is_one_line_and_exit_code_2(capsys, argv, message):
    code = main(["estimate", "llama-2-7b", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_a_sliding_window_model_is_refused_as_accelerate_refuses_it():
    with pytest.raises(UserError, match="sliding_attention"):
        estimate(models.tiny_config("mistral-7b"), SETUP, Layout(world_size=2, cp=2, zero=3), device="cpu",
                 allocator="none")


def test_world_size_defaults_to_the_product_of_the_degrees_and_dp_excludes_cp():
    layout = Layout(cp=2, zero=3)
    assert layout.world_size == 2 and layout.dp == 1 and layout.shard_degree == 2
    layout = Layout(world_size=8, cp=2, zero=3)
    assert layout.dp == 4 and layout.shard_degree == 8  # FSDP2 over dp_shard x cp, torchtitan's dp_shard_cp


def test_every_cp_rank_is_traced_and_stands_for_its_data_parallel_copies():
    result = estimate(LLAMA, SETUP, Layout(world_size=4, cp=2, zero=3), device="cpu", allocator="none")
    assert result.parallel == "traced"
    # torchtitan's mesh order (dp, cp): global rank = dp index x 2 + cp index
    assert [(r.rank, r.ranks) for r in result.per_rank] == [(0, [0, 2]), (1, [1, 3])]
    # the ring differs by rank: rank 0 attends with the second half of its queries at step 1,
    # rank 1 with all of them to half the keys; the peaks differ
    assert result.per_rank[0].peak_allocated_bytes != result.per_rank[1].peak_allocated_bytes


def test_the_traced_step_runs_the_ring_and_splits_the_sequence():
    from memplan.parallel.traced import capture_rank_step

    step = capture_rank_step(LLAMA, SETUP, Layout(world_size=2, cp=2, zero=3), 0)
    names = [step.trace.op_name(i) for i in range(step.trace.num_ops)]
    blocks = LLAMA.num_hidden_layers
    # one attention kernel per ring step and block, forward and backward; the backward
    # rotates the key/value gradients with all-to-all (PyTorch's _templated_ring_attention_backward)
    assert names.count("aten._scaled_dot_product_flash_attention_for_cpu.default") == 2 * blocks
    assert names.count("aten._scaled_dot_product_flash_attention_for_cpu_backward.default") == 2 * blocks
    assert names.count("_c10d_functional.all_to_all_single.default") == 2 * blocks
    embedding = next(i for i, n in enumerate(names) if n == "aten.embedding.default")
    out = step.trace.op_outputs(embedding)[0]
    hidden = LLAMA.hidden_size * 4  # fp32
    assert int(step.trace.buffers["nbytes"][out]) == SETUP.batch * (SETUP.seq // 2) * hidden  # this rank's half
