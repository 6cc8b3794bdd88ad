"""The offload runtime under FSDP2 (`fully_shard`), 2 ranks on gloo: every mode trains
bit-identically to the same FSDP2 run without offloading, and moves this rank's shards."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gloo

MODES = {"default": {}, "streamed": {"streamed_step": True}, "in-backward": {"step_in_backward": True}}


def _rank_main(rank: int, workdir: str) -> None:
    import torch.distributed as dist

    from memplan import models
    from memplan.hardware.links import make_hardware
    from memplan.hardware.roofline import op_seconds
    from memplan.offload import plan_offload, runtime_categories
    from memplan.offload.lifetimes import analyse_lifetimes
    from memplan.offload.runtime import OffloadError, RunOptions, run
    from memplan.parallel import Layout
    from memplan.parallel.apply import build_parallel_step
    from memplan.parallel.traced import parallel_step_trace

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2)
    config, setup, layout = models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32), Layout(world_size=2, zero=3)
    out = {}
    try:
        ref = build_parallel_step(config, setup, layout)
        for _ in range(3):
            ref.run()
        # a plan of this rank's own step, captured on its real tensors (DTensor-aware recorder)
        cap = build_parallel_step(config, setup, layout)
        trace = parallel_step_trace(cap, warmup=1)
        hardware = make_hardware("h100-nvl-94gb", nvme="1x1GB/s")
        peak = int(analyse_lifetimes(trace, op_seconds(trace, hardware.gpu)).op_bytes.max())
        plan = plan_offload(trace, hardware, budget=int(0.5 * peak), min_nbytes=1024, categories=runtime_categories())
        # FSDP2's sharded gradients are views of one reduce-scatter buffer: a plan that moves one is refused
        with_grads = plan_offload(trace, hardware, budget=int(0.4 * peak), min_nbytes=1024,
                               categories=runtime_categories(streamed_step=True))
        off = build_parallel_step(config, setup, layout)
        directory = Path(workdir, f"grads-{rank}")
        directory.mkdir()
        try:
            with run(off.model, off.optimizer, with_grads, RunOptions(directory=directory, streamed_step=True)):
                off.run()
            out["gradient plan"] = {"error": None}
        except OffloadError as exc:
            out["gradient plan"] = {"error": str(exc)}
        out["gradient plan"]["planned_grads"] = sum(k.startswith("grad.") for k in with_grads.tensors.moved)
        for name, mode in {**MODES, **{f"planned {k}": v for k, v in MODES.items()}}.items():
            off = build_parallel_step(config, setup, layout)
            directory = Path(workdir, f"{name}-{rank}".replace(" ", "-"))
            directory.mkdir()
            planned = name.startswith("planned")
            options = RunOptions(directory=directory, checksum=True, **({} if planned else {"min_nbytes": 1024}), **mode)
            with run(off.model, off.optimizer, plan if planned else None, options) as engine:
                for _ in range(3):
                    off.run()
            out[name] = {
                "identical": all(torch.equal(a.to_local(), b.to_local())
                                 for a, b in zip(ref.model.parameters(), off.model.parameters())),
                "states_identical": all(torch.equal(x.to_local(), y.to_local())
                                        for a, b in zip(ref.model.parameters(), off.model.parameters())
                                        for x, y in zip(ref.optimizer.state[a].values(), off.optimizer.state[b].values())
                                        if hasattr(x, "to_local")),
                "written": engine.bytes_written,
                "read": engine.bytes_read,
                "degraded": engine.degraded,
                "left": os.listdir(directory),
                "states_written": sorted(k for k in engine.keys_written if k.startswith("state.")),
                "activations_written": engine.storages_written,
                "planned_states": sorted(k for k in plan.tensors.moved if k.startswith("state.")),
                "planned_activations": 3 * sum(plan.tensors.saved_moved),
            }
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def per_rank():
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory(prefix="memplan-offload-fsdp2-") as workdir:
        mp.spawn(_rank_main, args=(workdir,), nprocs=2, join=True)
        return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_training_with_offloading_is_bit_identical_on_both_ranks(per_rank, mode):
    for rank in per_rank:
        out = rank[mode]
        assert out["identical"] and out["states_identical"], out
        assert out["written"] > 0 and out["read"] > 0 and out["left"] == [] and not out["degraded"], out


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_training_applies_a_plan_of_the_rank_s_captured_step_bit_identically(per_rank, mode):
    for rank in per_rank:
        out = rank[f"planned {mode}"]
        assert out["identical"] and out["states_identical"], out
        assert out["states_written"] == out["planned_states"] and out["planned_states"], out
        assert out["activations_written"] == out["planned_activations"] > 0, out
        assert out["left"] == [] and not out["degraded"], out


def test_fsdp2_refuses_a_plan_that_moves_a_sharded_gradient(per_rank):
    for rank in per_rank:
        out = rank["gradient plan"]
        assert out["planned_grads"] > 0, out
        assert out["error"] is not None and "cannot leave by itself" in out["error"], out
