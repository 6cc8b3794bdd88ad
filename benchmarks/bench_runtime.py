"""Per-allocation cost of memplan's planned CPU allocator against PyTorch's default.

Each case times one `torch.empty(nbytes, dtype=uint8)` + its free, 2,000 times per
repeat, median of 15 repeats, the variants taken in turn; "planned" runs under `memplan.planned_allocator` with a
plan recorded from the same loop (every request served from the arena), "fallback"
under a plan with no entries (every request goes through the core to c10::alloc_cpu),
"recording" under the recorder `from_step` uses. The times include `torch.empty`'s own
dispatch, so the difference between rows is the allocator's. A last row times a tiny
GPT-2 training step (batch 2 x 32 tokens) under each.

    .venv/bin/python benchmarks/bench_runtime.py
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memplan  # noqa: E402
from benchmarks_md import write_section  # noqa: E402
from memplan.layout.plan import AddressPlan  # noqa: E402
from memplan.runtime.build import cpu_extension  # noqa: E402

COUNT = 2000
REPEATS = 15
SIZES = (64, 4096, 1 << 20)


def alloc_loop(nbytes: int) -> None:
    for _ in range(COUNT):
        t = torch.empty(nbytes, dtype=torch.uint8)
        del t


def medians_s(variants: list, fn, repeats: int = REPEATS) -> list[float]:
    """Median seconds of `fn` under each context manager factory (None: the default
    allocator), taken round-robin so that load from other processes on this shared
    machine falls on all of them alike. Entering and leaving are not timed."""
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for make, out in zip(variants, times, strict=True):
            manager = make() if make is not None else contextlib.nullcontext()
            with manager as pa:
                start = time.perf_counter()
                fn()
                if pa is not None and hasattr(pa, "next_iteration"):
                    pa.next_iteration()
                out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


class Recording:
    """The recorder `from_step` runs, as a context manager."""

    def __enter__(self) -> None:
        self.session = cpu_extension().new_recorder()
        self.session.install()

    def __exit__(self, *exc: object) -> None:
        self.session.uninstall()


def allocation_rows() -> list[list[str]]:
    rows = []
    empty_plan = AddressPlan("none", 0, 64, [])
    for nbytes in SIZES:
        def loop(nbytes=nbytes):
            alloc_loop(nbytes)

        pa = memplan.planned_allocator.from_step(loop, warmup=2)
        default, planned, fallback, recording = medians_s(
            [None, lambda pa=pa: pa, lambda: memplan.planned_allocator(empty_plan), Recording], loop
        )
        assert pa.stats["fallbacks"] == 0 and pa.stats["served"] == COUNT, pa.stats
        ns = [t / COUNT * 1e9 for t in (default, planned, fallback, recording)]
        rows.append([f"{nbytes:,} B", *(f"{v:.0f}" for v in ns), f"{ns[1] - ns[0]:+.0f}"])
    return rows


def training_row() -> list[str]:
    from memplan import models
    from memplan.capture.step import build_training_step

    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    step = build_training_step(models.tiny_config("gpt2"), setup, device="cpu")
    for _ in range(2):
        step.run()
    pa = memplan.planned_allocator.from_step(step.run, warmup=2)
    default, planned = medians_s([None, lambda: pa], step.run)
    assert pa.stats["fallbacks"] == 0, pa.stats
    requests = pa.stats["requests"]
    return [
        f"tiny GPT-2 step ({requests} requests)",
        f"{default * 1e3:.2f} ms",
        f"{planned * 1e3:.2f} ms",
        f"arena {pa.plan.arena_bytes:,} B",
    ]


def main() -> None:
    cpu_extension()  # compile outside the timings
    rows = allocation_rows()
    train = training_row()
    lines = [
        "## Planned allocator: per-allocation cost on CPU",
        "",
        "`torch.empty(nbytes, dtype=uint8)` + free, ns per pair (median of 15 x 2,000, variants in turn); "
        "`planned`: served from the arena by the plan; `fallback`: through the core to "
        "c10::alloc_cpu; `recording`: what `from_step` runs. Torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores while measured (shared machine).",
        "",
        "```",
        ".venv/bin/python benchmarks/bench_runtime.py",
        "```",
        "",
        "| request | default ns | planned ns | fallback ns | recording ns | planned - default |",
        "|---|---:|---:|---:|---:|---:|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "| workload | default | planned | |",
        "|---|---:|---:|---|",
        "| " + " | ".join(train) + " |",
    ]
    section = "\n".join(lines)
    print(section)
    write_section("runtime", section)


if __name__ == "__main__":
    main()
