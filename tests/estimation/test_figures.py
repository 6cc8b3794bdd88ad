"""A trace's figures (`memplan.estimation.figures.rank_estimate`): the allocator replayed
within the usable memory, as PyTorch's caching allocator frees its cache and retries;
the margin every verdict uses. Hand-computed cases on hand-made traces."""

import numpy as np
import pytest

from memplan import models
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.estimation.figures import check_margin, rank_estimate
from memplan.trace import ALLOC, FREE, from_events

MiB = 1 << 20


def _trace(steps, sizes):
    kinds = np.array([ALLOC if kind == "a" else FREE for kind, _ in steps])
    return from_events(kinds, np.array(sizes), np.array([b for _, b in steps]))


# 20 MiB, freed (its segment stays cached), then 30 MiB: the cached segment is too small
CACHED_THEN_LARGER = _trace([("a", 0), ("f", 0), ("a", 1)], [20 * MiB, 30 * MiB])


def test_without_a_limit_the_cached_segment_stays_reserved():
    rank = rank_estimate(CACHED_THEN_LARGER, rank=0, allocator="caching", alloc_conf=None, overhead_bytes=0,
                         usable_bytes=None)
    assert (rank.peak_allocated_bytes, rank.peak_reserved_bytes, rank.oom) == (30 * MiB, 50 * MiB, None)


def test_at_the_usable_limit_the_cache_is_freed_and_reserved_stays_within_it():
    # 40 MiB usable with 4 MiB outside the allocator (context): the cudaMalloc of 30 MiB fails
    # at 36 MiB, the 20 MiB cached segment is released, the retry succeeds
    rank = rank_estimate(CACHED_THEN_LARGER, rank=0, allocator="caching", alloc_conf=None, overhead_bytes=4 * MiB,
                         usable_bytes=40 * MiB)
    assert (rank.peak_allocated_bytes, rank.peak_reserved_bytes, rank.device_used_bytes) == \
        (30 * MiB, 30 * MiB, 34 * MiB)
    assert rank.oom is None


def test_a_demand_that_does_not_fit_even_after_freeing_the_cache_is_out_of_memory_with_the_demand():
    rank = rank_estimate(CACHED_THEN_LARGER, rank=0, allocator="caching", alloc_conf=None, overhead_bytes=4 * MiB,
                         usable_bytes=30 * MiB)
    assert rank.oom is not None and rank.oom["alloc_bytes"] == 30 * MiB
    assert (rank.peak_reserved_bytes, rank.device_used_bytes) == (50 * MiB, 54 * MiB)


def test_expandable_segments_unmap_their_cached_pages_at_the_limit_too():
    rank = rank_estimate(CACHED_THEN_LARGER, rank=0, allocator="expandable", alloc_conf=None, overhead_bytes=0,
                         usable_bytes=40 * MiB)
    assert rank.oom is None and rank.peak_reserved_bytes <= 40 * MiB


def test_phase_peaks_hold_the_peak_of_each_phase():
    rank = rank_estimate(CACHED_THEN_LARGER, rank=0, allocator="none", alloc_conf=None, overhead_bytes=0,
                         usable_bytes=None)
    assert rank.phase_peaks == {"other": 30 * MiB}


@pytest.fixture(scope="module")
def tiny_gpt2_on_t4():
    return estimate(models.tiny_config("gpt2"), models.TrainingSetup(seq=32), gpu="t4")


def test_an_estimate_fits_only_within_capacity_times_one_minus_the_margin():
    setup = models.TrainingSetup(seq=32)
    used = estimate(models.tiny_config("gpt2"), setup, gpu="t4").device_used_bytes
    capacity = int(used / 0.97)  # used is 97% of the capacity: above the 5% margin's 95%, below 100%
    result = estimate(models.tiny_config("gpt2"), setup, gpu="t4", capacity=capacity)
    assert result.usable_bytes == int(capacity * 0.95) and not result.fits
    assert estimate(models.tiny_config("gpt2"), setup, gpu="t4", capacity=capacity, margin=0.02).fits


def test_the_estimate_json_carries_the_margin_and_the_usable_bytes(tiny_gpt2_on_t4):
    doc = tiny_gpt2_on_t4.to_json()
    assert doc["margin"] == 0.05 and doc["usable_bytes"] == int(doc["capacity_bytes"] * 0.95)
    assert doc["fits"] == (doc["device_used_bytes"] <= doc["usable_bytes"])


@pytest.mark.parametrize("margin", [-0.1, 1.0, "5%", True])
def test_a_margin_outside_zero_to_one_is_refused(margin):
    with pytest.raises(UserError, match="margin"):
        check_margin(margin)
