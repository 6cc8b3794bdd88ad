"""The profiler's peak from its allocation events (`events_peak_bytes`) against its memory
timeline (`timeline_peak_bytes`): the same bytes where torch's analysis reads the profile, and
a peak where it refuses one (a block from before the profile freed in it, its address
reused: torch/profiler/_memory_profiler.py `DataFlowNode`, "version mismatch")."""

import os
import subprocess
import sys

import pytest

from memplan import models
from memplan.capture.groundtruth import (
    events_peak_bytes,
    held_peak_bytes,
    memory_profiler,
    timeline_peak_bytes,
)
from memplan.capture.step import build_training_step


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_events_peak_equals_the_timeline_peak_to_the_byte_on_a_training_step(checkpointing):
    setup = models.TrainingSetup(batch=2, seq=32, precision="32-true", checkpointing=checkpointing,
                                 optimizer_impl="foreach")
    step = build_training_step(models.tiny_config("llama-2-7b"), setup, device="cpu")
    step.run()  # the optimizer state exists before the profile: pre-existing storages
    with memory_profiler() as prof:
        step.run()
        step.run()
    assert events_peak_bytes(prof) == timeline_peak_bytes(prof)


REUSE_SCRIPT = """
import torch
from memplan.capture.groundtruth import events_peak_bytes, memory_profiler, timeline_peak_bytes

def profile():
    held = torch.empty(1 << 18)  # 1 MiB allocated before the profile: c10 reports no free of it
    address = held.data_ptr()
    with memory_profiler() as prof:
        held.add_(1)  # seen by the profile, and mutated
        del held
        reused = torch.empty(1 << 18)  # 1 MiB
        reused.mul_(2)
        extra = torch.empty(1024)  # 4,096 B
    return prof if reused.data_ptr() == address else None

# the kernel decides whether the unmapped address is mapped again: try until it is
prof = next(p for p in (profile() for _ in range(20)) if p is not None)
try:
    timeline = timeline_peak_bytes(prof)
except AssertionError as exc:
    timeline = str(exc)[:16]
print(events_peak_bytes(prof), timeline)
"""


def test_the_timeline_refuses_a_profile_in_which_a_block_from_before_it_is_freed_and_its_address_reused():
    # glibc maps each block of 64 KiB or more on its own (a fixed threshold), and unmaps it when freed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", REUSE_SCRIPT], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out == [str(1_048_576 + 4_096), "version", "mismatch"]


FREE_SCRIPT = """
import sys
import torch
from memplan.capture.groundtruth import events_peak_bytes, memory_profiler, report_every_cpu_free, timeline_peak_bytes
if sys.argv[1] == "reported":
    report_every_cpu_free()
held = torch.empty(1 << 18)  # 1 MiB allocated before the profile
with memory_profiler() as prof:
    held.zero_()  # seen by the profile
    del held
    extra = torch.empty(1024)  # 4,096 B
print(events_peak_bytes(prof), timeline_peak_bytes(prof))
"""


@pytest.mark.parametrize(("frees", "peak_bytes"), [("reported", 1_048_576), ("dropped", 1_048_576 + 4_096)])
def test_a_block_from_before_the_profile_leaves_it_where_it_is_freed_once_c10_reports_every_free(frees, peak_bytes):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", FREE_SCRIPT, frees], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out == [str(peak_bytes), str(peak_bytes)]


def test_an_allocation_at_an_address_still_held_replaces_the_block_there():
    # 100 B held from before, its free unseen; 120 B allocated at its address, then 8 B beside
    events = [(1_000, 0xA0, 120), (2_000, 0xB0, 8)]
    assert held_peak_bytes({0xA0: 100}, events) == 120 + 8


def test_a_free_leaves_the_total_and_a_free_of_an_unknown_address_changes_nothing():
    events = [(1_000, 0xB0, 30), (2_000, 0xB0, -30), (3_000, 0xC0, -50), (4_000, 0xD0, 20)]
    assert held_peak_bytes({0xA0: 100}, events) == 100 + 30


def test_allocations_and_frees_in_one_microsecond_count_only_as_they_stand_at_its_end():
    # the timeline coalesces events by microsecond: a block freed in the microsecond it was made is never seen
    events = [(1_000, 0xB0, 30), (1_500, 0xB0, -30), (2_000, 0xC0, 10), (2_999, 0xD0, 5)]
    assert held_peak_bytes({}, events) == 15
