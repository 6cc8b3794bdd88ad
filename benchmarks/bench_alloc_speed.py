"""Replay speed of the caching allocator model on a 1,000,000-event synthetic trace.

The trace mimics training steps: long-lived parameters, then per iteration a forward
pass that keeps activations (freed LIFO in the backward pass) and makes short-lived
temporaries, with sizes mixing small (< 1 MiB), medium (1-10 MiB) and large blocks.
Writes the `alloc_speed` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_alloc_speed.py [--events 1000000] [--repeats 3] [--no-write]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np

from benchmarks_md import write_section
from memplan.alloc import AllocConf, CachingAllocator, record_replay, replay
from memplan.trace import from_events

BENCH = "alloc_speed"


def training_like_trace(num_events: int, seed: int = 0):
    """A trace of roughly `num_events` events shaped like repeated training steps."""
    rng = np.random.default_rng(seed)
    small = rng.integers(1, 2048, 4096) * 512  # up to 1 MiB
    medium = rng.integers(2, 20, 512) * (1 << 19)  # 1-10 MiB
    large = rng.integers(10, 200, 256) * (1 << 20)  # 10-200 MiB

    def draw() -> int:
        r = rng.random()
        if r < 0.6:
            return int(small[rng.integers(small.shape[0])])
        if r < 0.9:
            return int(medium[rng.integers(medium.shape[0])])
        return int(large[rng.integers(large.shape[0])])

    sizes: list[int] = []
    kinds: list[int] = []
    buffers: list[int] = []

    def alloc(nbytes: int) -> int:
        sizes.append(nbytes)
        kinds.append(0)
        buffers.append(len(sizes) - 1)
        return len(sizes) - 1

    def free(buffer: int) -> None:
        kinds.append(1)
        buffers.append(buffer)

    for _ in range(200):
        alloc(draw())  # parameters: live to the end
    layers = 24
    while len(kinds) < num_events:
        saved: list[list[int]] = []
        for _layer in range(layers):
            keep = []
            for _op in range(8):
                temps = [alloc(draw()) for _ in range(2)]
                keep.append(alloc(draw()))
                for t in temps:
                    free(t)
            saved.append(keep)
        for keep in reversed(saved):
            for buffer in reversed(keep):
                grad = alloc(draw())
                free(buffer)
                free(grad)
    # Buffers are numbered in allocation order, so those allocated in the kept events are a prefix.
    event_buffers = np.asarray(buffers[:num_events])
    nbytes = np.asarray(sizes[: int(event_buffers.max()) + 1])
    return from_events(np.asarray(kinds[:num_events]), nbytes, event_buffers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    trace = training_like_trace(args.events)
    rows = []
    for label, conf in (("caching", AllocConf()), ("expandable", AllocConf(expandable_segments=True))):
        record_s, replay_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            record_replay(trace, CachingAllocator(conf))
            record_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = replay(trace, label)
            replay_s.append(time.perf_counter() - start)
        rows.append((label, statistics.median(record_s), statistics.median(replay_s), result))
        print(f"{label}: record {statistics.median(record_s):.2f} s, replay {statistics.median(replay_s):.2f} s "
              f"(peak reserved {result.peak_reserved_bytes / 2**30:.2f} GiB)", file=sys.stderr)
    lines = [
        f"<!-- bench:{BENCH} -->",
        "### Allocator replay speed",
        "",
        "Command: `.venv/bin/python benchmarks/bench_alloc_speed.py`",
        "",
        f"Synthetic training-like trace, {trace.num_events:,} events ({trace.num_buffers:,} buffers); "
        f"median of {args.repeats} runs on {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}. *record*: the event loop alone (`memplan.alloc.record_replay`); "
        "*replay*: `memplan.replay` (the event loop, series, segment map at the peak rebuilt from the log, "
        "independent check). Target: <= 10 s.",
        "",
        "| allocator | events | record (s) | replay (s) | peak reserved (GiB) | fragmentation |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, record_median, replay_median, result in rows:
        lines.append(
            f"| {label} | {trace.num_events:,} | {record_median:.2f} | {replay_median:.2f} | "
            f"{result.peak_reserved_bytes / 2**30:.2f} | {result.fragmentation:.1%} |"
        )
    lines.append(f"<!-- /bench:{BENCH} -->")
    if not args.no_write:
        write_section(BENCH, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
