"""`memplan run -- torchrun ...`: every rank of a distributed program in one process.

Ground truth: the same torchrun command run for real, 2 processes on gloo, each measured
over the same steps by c10's own running total of its CPU bytes as torch.profiler reports it
(`measure_program_ranks`, `c10_peak_bytes`). FSDP2 with a
`MixedPrecisionPolicy` of fp64 parameters (fp32 shards, fp32 reduction): the mixed-precision
machinery (unsharded parameters of another dtype, casts around the reduce-scatter) without
bf16 matmuls, whose CPU kernels allocate differently on CPUs with native BF16 (oneDNN's
AVX512-BF16 path), which the suite must not depend on. The vocabulary of the test's text
(27 characters) shards unevenly: the two ranks differ, and both are traced.

gloo frees each all-gather's staging buffer on its own thread, which the profiler's
allocation events do not report: their peak kept the buffer until its address was reused and
varied from run to run (rank 1: 3,209,976-3,805,176 B over 4 runs), while c10's total, which
counts every thread's frees, read 3,211,008 / 3,209,984 B on every run. Measured: memplan run
equal to it on both ranks.
"""

import pytest

from memplan.program import run_program
from memplan.program.groundtruth import measure_program_ranks

from .conftest import PROGRAMS
from .test_launchers import FSDP2_CONFIG

FSDP2 = str(PROGRAMS / "fsdp2_loop.py")


def _torchrun(data, dtype):
    return ["torchrun", "--nproc-per-node", "2", FSDP2, "--data", str(data), "--param-dtype", dtype]


@pytest.mark.gloo
@pytest.mark.slow
def test_cpu_run_of_fsdp2_torchrun_matches_every_rank_of_the_real_gloo_run(text_file, tmp_path):
    command = _torchrun(text_file, "fp64")
    estimated = [r.peak_allocated_bytes for r in run_program(command, device="cpu", steps=1,
                                                             out_dir=tmp_path).estimate.per_rank]
    # c10's own running total, which counts the frees on gloo's thread that the profiler's
    # events do not report (they kept a freed all-gather buffer until its address was reused:
    # 3,209,976-3,805,176 B on rank 1 over 4 runs, c10's total 3,209,984 B on every one)
    measured = [r.c10_peak_bytes for r in measure_program_ranks(command, steps=1)]
    assert len(estimated) == 2
    for e, m in zip(estimated, measured):
        assert abs(e - m) <= 0.01 * m, (estimated, measured)


def test_cuda_run_traces_each_rank_whose_shards_differ_with_nccl_in_device_used(text_file, tmp_path):
    result = run_program(_torchrun(text_file, "bf16"), device="cuda", steps=1, out_dir=tmp_path)
    per_rank = result.estimate.per_rank
    assert [(r.rank, r.ranks) for r in per_rank] == [(0, [0]), (1, [1])]
    profile_overhead = 566_231_040 + 32 * 2 * 4_194_304  # h100-80gb's context, one communicator's NCCL buffers
    assert all(r.device_used_bytes - r.peak_reserved_bytes == profile_overhead for r in per_rank)
    layout = result.seen["layout"]
    assert layout["world_size"] == 2 and layout["fsdp2_modules"] == 3
    assert layout["fsdp2_mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert result.seen["parameter_dtypes"] == {"fp32": 20}  # the sharded parameters stay fp32


def test_cuda_run_of_a_trainer_under_accelerate_launch_with_an_fsdp2_config(text_file, tiny_checkpoint, tmp_path):
    config = tmp_path / "fsdp2.yaml"
    config.write_text(FSDP2_CONFIG.replace("num_processes: 4", "num_processes: 2"))
    command = ["accelerate", "launch", "--config_file", str(config), str(PROGRAMS / "hf_trainer.py"),
               "--model", str(tiny_checkpoint), "--data", str(text_file), "--output_dir", str(tmp_path / "trainer"),
               "--per_device_train_batch_size", "2", "--max_steps", "50"]
    result = run_program(command, device="cuda", steps=1, out_dir=tmp_path / "run")
    layout, optimizer = result.seen["layout"], result.seen["optimizer"]
    assert layout["world_size"] == 2 and layout["fsdp2_modules"] >= 3  # accelerate applied fully_shard
    # accelerate maps each parameter to its shard by data_ptr(): every fake parameter has an address of its own
    assert optimizer["state_dtypes"] == {"fp32": 40}
    rank = result.estimate.per_rank[0]
    assert rank.breakdown["optimizer_state"] >= 155_968 * 8 // 2  # Adam's two states of half the parameters


def test_ranks_with_the_same_shards_are_traced_once(tmp_path):
    data = tmp_path / "letters.txt"
    data.write_text("abcdefghijklmnopqrstuvwxyz" * 100)  # 26 characters: every shard the same size
    result = run_program(_torchrun(data, "fp32"), device="cuda", steps=0, out_dir=tmp_path)
    assert [(r.rank, r.ranks) for r in result.estimate.per_rank] == [(0, [0, 1])]
    assert [run.rank for run in result.runs] == [0]


def test_ranks_all_traces_every_rank(tmp_path):
    data = tmp_path / "letters.txt"
    data.write_text("abcdefghijklmnopqrstuvwxyz" * 100)
    result = run_program(_torchrun(data, "fp32"), device="cuda", steps=0, ranks="all", out_dir=tmp_path)
    assert [r.rank for r in result.estimate.per_rank] == [0, 1]
    assert result.estimate.per_rank[0].peak_allocated_bytes == result.estimate.per_rank[1].peak_allocated_bytes
