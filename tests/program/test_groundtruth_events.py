"""`measure_program`'s ground truth, the peak of the profiler's allocation events
(`memplan.capture.groundtruth.events_peak_bytes`), against the peak of torch's memory timeline
of the same profile, which it replaces: to the byte on every rank the timeline's analysis reads
(on a 2-rank FSDP2 run it refuses some ranks, its own warnings saying an address was freed with
another size than it was allocated with: gloo's thread frees blocks the profiler does not see;
those ranks are not compared)."""

import sys

import pytest

from memplan.program.groundtruth import measure_program_ranks

from .conftest import PROGRAMS


def _equal_where_the_timeline_reads(ranks):
    """The ranks compared; each compared rank's two peaks are equal."""
    read = [r for r in ranks if r.timeline_error is None]
    assert [(r.rank, r.peak_bytes) for r in read] == [(r.rank, r.timeline_peak_bytes) for r in read]
    return {r.rank for r in read}


@pytest.mark.slow
def test_the_plain_loops_events_peak_is_its_timeline_peak_to_the_byte(text_file):
    ranks = measure_program_ranks([sys.executable, str(PROGRAMS / "plain_loop.py"), "--data", str(text_file)],
                                  with_timeline=True)
    assert _equal_where_the_timeline_reads(ranks) == {0}


@pytest.mark.gloo
@pytest.mark.slow
def test_every_rank_of_fsdp2_has_its_timeline_peak_to_the_byte_where_the_timeline_reads(text_file):
    command = ["torchrun", "--nproc-per-node", "2", str(PROGRAMS / "fsdp2_loop.py"), "--data", str(text_file),
               "--param-dtype", "fp64"]
    compared: set[int] = set()
    for _ in range(2):  # fresh runs until the timeline has read each rank once
        compared |= _equal_where_the_timeline_reads(measure_program_ranks(command, steps=1, with_timeline=True))
        if compared == {0, 1}:
            return
    pytest.skip(f"the timeline's analysis read only ranks {sorted(compared)} in 2 runs")
