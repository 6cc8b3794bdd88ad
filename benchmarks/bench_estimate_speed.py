"""Speed of `memplan estimate` against PyTorch's MemTracker over the same fake step.

Target: llama-2-70b, seq 4096, full checkpointing, --zero 3 over 64 GPUs in
<= 10 s, and >= 10x faster than `torch.distributed._tools.mem_tracker.MemTracker`
tracking the same fake training step. MemTracker runs on the full-depth single-device
step (FSDPMemTracker needs FSDP2 applied on a process group, which it cannot do on
fake tensors without a GPU); memplan's figure is the whole `estimate()` call
(tracing at 4 blocks and unrolling to 80, the ZeRO-3 rank model, GPU terms,
caching-allocator replay of the full-depth step). memplan is timed twice: FSDP2 applied
for real on a fake process group (the default: `fully_shard` traced at 4 blocks) and
the modelled ZeRO-3 rules over a
single-device trace (`parallel_tracing=False`). Both run in this one process after the
imports; medians of `--repeat` runs.
Writes the `bench:estimate_speed` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_estimate_speed.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from memplan import models
from memplan.capture.step import build_training_step
from memplan.estimation import estimate
from memplan.parallel import Layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import write_section  # noqa: E402

MODEL = "llama-2-70b"
SETUP = {"seq": 4096, "precision": "bf16-true", "checkpointing": "full"}
LAYOUT = {"world_size": 64, "zero": 3}
MARK = "estimate_speed"


def memtracker_seconds(model_name: str, setup: models.TrainingSetup) -> tuple[float, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(allow_non_fake_inputs=True):
        step = build_training_step(model_name, setup, device="cpu", target_device="cuda")
        step.run()  # optimizer state exists, as in memplan's traced step
        start = time.perf_counter()
        tracker = MemTracker()
        tracker.track_external(step.model, step.optimizer)
        with tracker:
            step.run()
        elapsed = time.perf_counter() - start
    return elapsed, 0


def memplan_seconds(model_name: str, setup: models.TrainingSetup, layout: Layout,
                    parallel_tracing: bool = True) -> tuple[float, object]:
    start = time.perf_counter()
    result = estimate(model_name, setup, layout, gpu="h100-80gb", parallel_tracing=parallel_tracing)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="memplan runs")
    parser.add_argument("--repeat-reference", type=int, default=1, help="MemTracker runs (about 4 min each)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    setup = models.TrainingSetup(**{"precision": "32-true", **SETUP})
    layout = Layout(**LAYOUT)
    memplan_estimate_s(setup, layout)  # warm the lazy imports of both paths
    ours, modelled, theirs, result, result_modelled = [], [], [], None, None
    for _ in range(args.repeat):
        seconds, result = memplan_seconds(MODEL, setup, layout)
        ours.append(seconds)
        seconds, result_modelled = memplan_seconds(MODEL, setup, layout, parallel_tracing=False)
        modelled.append(seconds)
    for _ in range(args.repeat_reference):
        theirs.append(memtracker_seconds(MODEL, setup)[0])
    m_ours, m_modelled, m_theirs = statistics.median(ours), statistics.median(modelled), statistics.median(theirs)
    rank, rank_modelled = result.per_rank[0], result_modelled.per_rank[0]
    text = (
        "### Estimate speed: llama-2-70b, seq 4096, full checkpointing, ZeRO-3 over 64 GPUs\n\n"
        "Command: `.venv/bin/python benchmarks/bench_estimate_speed.py`\n\n"
        f"Medians of {args.repeat} memplan and {args.repeat_reference} MemTracker run(s), one process, after imports (x86_64, 2 cores). *memplan*: the whole "
        "`memplan.estimate` call (FSDP2 `fully_shard` applied on a fake process group and traced at 4 blocks, "
        "or the modelled ZeRO-3 rules, the step unrolled to 80 blocks, then GPU terms and caching-allocator "
        "replay of the full-depth step). *MemTracker*: `torch.distributed._tools.mem_tracker.MemTracker` tracking the same fake step "
        "at full depth (80 blocks) on one device (it has no sharding model without a process group). "
        "A fresh `memplan estimate` CLI process adds about 6 s of torch/transformers imports.\n\n"
        "| tool | median (s) | runs (s) |\n|---|---:|---:|\n"
        f"| memplan estimate (FSDP2 traced) | {m_ours:.2f} | {', '.join(f'{s:.2f}' for s in ours)} |\n"
        f"| memplan estimate (ZeRO-3 modelled) | {m_modelled:.2f} | {', '.join(f'{s:.2f}' for s in modelled)} |\n"
        f"| MemTracker | {m_theirs:.2f} | {', '.join(f'{s:.2f}' for s in theirs)} |\n"
        f"| **speed-up (traced)** | **{m_theirs / m_ours:.1f}x** | |\n"
        f"| **speed-up (modelled)** | **{m_theirs / m_modelled:.1f}x** | |\n\n"
        f"memplan's answer, traced: peak allocated {rank.peak_allocated_bytes / 2**30:.2f} GiB, peak reserved "
        f"{rank.peak_reserved_bytes / 2**30:.2f} GiB, device used {rank.device_used_bytes / 2**30:.2f} GiB per rank "
        f"(phase {rank.peak_phase}); modelled: {rank_modelled.peak_allocated_bytes / 2**30:.2f} / "
        f"{rank_modelled.peak_reserved_bytes / 2**30:.2f} / {rank_modelled.device_used_bytes / 2**30:.2f} GiB "
        f"(phase {rank_modelled.peak_phase}). Only the traced FSDP2 path is checked against real runs "
        "(CPU, gloo; `bench:parallel_groundtruth`).\n"
    )
    print(text)
    if not args.no_write:
        write_section(MARK, text)


def memplan_estimate_s(setup: models.TrainingSetup, layout: Layout) -> None:
    estimate(MODEL, models.TrainingSetup(seq=128, precision="bf16-true"), None, gpu="h100-80gb")


if __name__ == "__main__":
    main()
