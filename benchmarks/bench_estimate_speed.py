"""Speed of `memplan estimate` against PyTorch's MemTracker over the same fake step.

Target (issue 4): llama-2-70b, seq 4096, full checkpointing, --zero 3 over 64 GPUs in
<= 10 s, and >= 10x faster than `torch.distributed._tools.mem_tracker.MemTracker`
tracking the same fake training step. MemTracker runs on the full-depth single-device
step (FSDPMemTracker needs FSDP2 applied on a process group, which it cannot do on
fake tensors without a GPU here); memplan's figure is the whole `estimate()` call
(tracing at 3 and 4 blocks, the ZeRO-3 rank model, GPU terms, caching-allocator
replay). Both run in this one process after the imports; medians of `--repeat` runs.
Writes the `bench:estimate_speed` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_estimate_speed.py
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

from memplan import models
from memplan.capture.step import build_training_step
from memplan.estimation import estimate
from memplan.parallel import Layout

MODEL = "llama-2-70b"
SETUP = {"seq": 4096, "dtype": "bf16", "checkpointing": "full"}
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


def memplan_seconds(model_name: str, setup: models.TrainingSetup, layout: Layout) -> tuple[float, object]:
    start = time.perf_counter()
    result = estimate(model_name, setup, layout, gpu="h100-80gb")
    return time.perf_counter() - start, result


def write_table(text: str) -> None:
    path = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"<!-- bench:{MARK} -->\n{text}<!-- /bench:{MARK} -->\n"
    pattern = re.compile(rf"<!-- bench:{MARK} -->.*?<!-- /bench:{MARK} -->\n?", re.S)
    new = pattern.sub(lambda _m: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="memplan runs")
    parser.add_argument("--repeat-reference", type=int, default=1, help="MemTracker runs (about 4 min each)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    setup = models.TrainingSetup(**SETUP)
    layout = Layout(**LAYOUT)
    memplan_estimate_s(setup, layout)  # warm the lazy imports of both paths
    ours, theirs, result = [], [], None
    for _ in range(args.repeat):
        seconds, result = memplan_seconds(MODEL, setup, layout)
        ours.append(seconds)
    for _ in range(args.repeat_reference):
        theirs.append(memtracker_seconds(MODEL, setup)[0])
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    rank = result.per_rank[0]
    text = (
        "### Estimate speed: llama-2-70b, seq 4096, full checkpointing, ZeRO-3 over 64 GPUs\n\n"
        "Command: `.venv/bin/python benchmarks/bench_estimate_speed.py`\n\n"
        f"Medians of {args.repeat} memplan and {args.repeat_reference} MemTracker run(s), one process, after imports (x86_64, 2 cores). *memplan*: the whole "
        "`memplan.estimate` call (traces at 3 and 4 blocks, ZeRO-3 rank model, GPU terms, caching-allocator "
        "replay). *MemTracker*: `torch.distributed._tools.mem_tracker.MemTracker` tracking the same fake step "
        "at full depth (80 blocks) on one device (it has no sharding model without a process group). "
        "A fresh `memplan estimate` CLI process adds about 6 s of torch/transformers imports.\n\n"
        "| tool | median (s) | runs (s) |\n|---|---:|---:|\n"
        f"| memplan estimate | {m_ours:.2f} | {', '.join(f'{s:.2f}' for s in ours)} |\n"
        f"| MemTracker | {m_theirs:.2f} | {', '.join(f'{s:.2f}' for s in theirs)} |\n"
        f"| **speed-up** | **{m_theirs / m_ours:.1f}x** | |\n\n"
        f"memplan's answer: peak allocated {rank.peak_allocated_bytes / 2**30:.2f} GiB, peak reserved "
        f"{rank.peak_reserved_bytes / 2**30:.2f} GiB, device used {rank.device_used_bytes / 2**30:.2f} GiB per rank "
        f"(phase {rank.peak_phase}).\n"
    )
    print(text)
    if not args.no_write:
        write_table(text)


def memplan_estimate_s(setup: models.TrainingSetup, layout: Layout) -> None:
    estimate(MODEL, models.TrainingSetup(seq=128, dtype="bf16"), None, gpu="h100-80gb")


if __name__ == "__main__":
    main()
