"""The planned allocator's rules, one per test, on hand-written plans and small tensors.

Sizes are bytes of uint8 tensors, so a request of N bytes is `torch.empty(N, dtype=uint8)`.
"""

import numpy as np
import pytest
import torch

import memplan
from memplan.errors import UserError
from memplan.layout.plan import LONG_LIVED, AddressPlan, DynamicWindow, IterationPlan
from memplan.runtime import FALLBACK_REASONS


def make_plan(groups, arena_bytes, windows=(), alignment_bytes=64):
    return AddressPlan(
        trace_fingerprint="test",
        arena_bytes=arena_bytes,
        alignment_bytes=alignment_bytes,
        iterations=[IterationPlan(it, np.asarray(nb, np.int64), np.asarray(off, np.int64)) for it, nb, off in groups],
        dynamic_space=list(windows),
    )


def request(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8)


def offset_in_arena(pa, tensor):
    assert pa.owns(tensor)
    return tensor.data_ptr() - pa._session.arena_address


def test_nth_request_is_served_at_its_planned_offset(ext):
    plan = make_plan([(0, [100, 200, 100], [0, 128, 0])], 384)
    with memplan.planned_allocator(plan) as pa:
        a = request(100)
        b = request(200)
        del a
        c = request(100)
        assert offset_in_arena(pa, b) == 128
        assert offset_in_arena(pa, c) == 0
        del b, c
    assert pa.stats["served"] == 3
    assert pa.stats["fallbacks"] == 0


def test_size_mismatch_falls_back_and_is_counted(ext):
    plan = make_plan([(0, [100], [0])], 128)
    with memplan.planned_allocator(plan) as pa:
        x = request(101)
        assert not pa.owns(x)
        del x
    assert (pa.stats["size_mismatches"], pa.stats["fallbacks"], pa.stats["fallback_bytes"]) == (1, 1, 101)


def test_requests_beyond_the_plan_fall_back(ext):
    plan = make_plan([(0, [64], [0])], 64)
    with memplan.planned_allocator(plan) as pa:
        a = request(64)
        b = request(64)
        assert pa.owns(a) and not pa.owns(b)
        del a, b
    assert pa.stats["beyond_plan"] == 1
    assert pa.stats["fallbacks"] == 1


def test_planned_bytes_still_in_use_are_not_handed_out_again(ext):
    # The plan thinks request 0 is freed before request 1 reuses offset 0; the run keeps it.
    plan = make_plan([(0, [64, 64], [0, 0])], 64)
    with memplan.planned_allocator(plan) as pa:
        kept = request(64).fill_(7)
        other = request(64).fill_(9)
        assert not pa.owns(other)
    assert int(kept.sum()) == 7 * 64 and int(other.sum()) == 9 * 64
    del kept, other
    assert pa.stats["conflicts"] == 1
    assert pa.stats["fallbacks"] == 1


def test_long_lived_request_goes_to_the_fallback_not_the_dynamic_space(ext):
    plan = make_plan([(0, [64, 64], [LONG_LIVED, -1])], 128, windows=[DynamicWindow(0, 0, 2, [(0, 128)])])
    with memplan.planned_allocator(plan) as pa:
        kept = request(64)
        dynamic = request(64)
        assert not pa.owns(kept) and pa.owns(dynamic)
        del kept, dynamic
    stats = pa.stats
    assert (stats["long_lived"], stats["served_dynamic"], stats["fallbacks"]) == (1, 1, 1)
    assert stats["fallback_reasons"]["outlived_iteration"] == 1


def test_tensor_kept_past_its_planned_lifetime_is_demoted_to_the_fallback(ext):
    # The plan frees request 0 within its iteration; the run keeps it. The next
    # iteration's request 0 finds its bytes held (one conflict); from then on the
    # entry is long-lived and served by the fallback.
    plan = make_plan([(0, [64], [0])], 64)
    kept = []
    with memplan.planned_allocator(plan) as pa:
        for _ in range(4):
            kept.append(request(64))
            pa.next_iteration()
        assert pa.owns(kept[0]) and not any(pa.owns(t) for t in kept[1:])
    stats = pa.stats
    assert (stats["conflicts"], stats["demoted"], stats["fallbacks"]) == (1, 1, 3)
    assert stats["fallback_reasons"] == {**dict.fromkeys(FALLBACK_REASONS, 0), "conflict": 1, "outlived_iteration": 2}
    del kept


def test_each_fallback_is_counted_under_its_reason(ext):
    plan = make_plan([(0, [64, 64], [0, 0])], 64)
    with memplan.planned_allocator(plan) as pa:
        a = request(64)
        b = request(64)  # conflict: a still holds offset 0
        c = request(32)  # beyond the plan
        del a, b, c
        pa.next_iteration()
        d = request(65)  # unplanned size
        del d
    reasons = pa.stats["fallback_reasons"]
    assert (reasons["conflict"], reasons["beyond_plan"], reasons["unplanned_size"]) == (1, 1, 1)
    assert sum(reasons.values()) == pa.stats["fallbacks"] == 3


def test_unplanned_request_goes_best_fit_into_the_dynamic_space(ext):
    # Request 1 is dynamic (offset -1); its window offers [0, 256) and [320, 448):
    # with [0, 64) taken by request 0, the gaps are [64, 256) (192 B) and [320, 448)
    # (128 B); best fit for 100 B is the smaller, at 320.
    window = DynamicWindow(0, 1, 2, [(0, 256), (320, 448)])
    plan = make_plan([(0, [64, 100], [0, -1])], 448, windows=[window])
    with memplan.planned_allocator(plan) as pa:
        a = request(64)
        b = request(100)
        assert offset_in_arena(pa, b) == 320
        del a, b
    assert (pa.stats["unplanned"], pa.stats["served_dynamic"], pa.stats["fallbacks"]) == (1, 1, 0)


def test_dynamic_space_placement_is_aligned(ext):
    window = DynamicWindow(0, 0, 2, [(0, 512)])
    plan = make_plan([(0, [10, 10], [-1, -1])], 512, windows=[window])
    with memplan.planned_allocator(plan) as pa:
        a = request(10)
        b = request(10)
        assert offset_in_arena(pa, a) % 64 == 0 and offset_in_arena(pa, b) % 64 == 0
        assert offset_in_arena(pa, a) != offset_in_arena(pa, b)
        del a, b


def test_iterations_beyond_the_last_planned_replay_it(ext):
    plan = make_plan([(0, [64], [0]), (1, [128], [64])], 192)
    with memplan.planned_allocator(plan) as pa:
        for _ in range(4):
            x = request(64 if pa.stats["iteration"] == 0 else 128)
            del x
            pa.next_iteration()
    per = {e["iteration"]: e for e in pa.stats["iterations"]}
    assert [per[i]["served_planned"] for i in range(4)] == [1, 1, 1, 1]


def test_next_iteration_restarts_request_numbering(ext):
    plan = make_plan([(0, [64, 128], [0, 64])], 192)
    with memplan.planned_allocator(plan) as pa:
        for _ in range(3):
            a, b = request(64), request(128)
            del a, b
            pa.next_iteration()
    assert pa.stats["served"] == 6


def test_prologue_is_the_default_first_iteration(ext):
    plan = make_plan([(-1, [64], [0]), (0, [128], [64])], 192)
    with memplan.planned_allocator(plan) as pa:
        weights = request(64)
        pa.next_iteration()
        x = request(128)
        assert offset_in_arena(pa, weights) == 0 and offset_in_arena(pa, x) == 64
        del x
        pa.next_iteration()
        del weights
    assert pa.stats["served"] == 2


def test_zero_byte_tensors_are_not_requests(ext):
    plan = make_plan([(0, [64], [0])], 64)
    with memplan.planned_allocator(plan) as pa:
        empty = request(0)
        x = request(64)
        assert pa.owns(x)
        del empty, x
    assert pa.stats["requests"] == 1


def test_cpu_allocator_is_installed_inside_and_restored_after(ext):
    before = ext.cpu_allocator_address()
    with memplan.planned_allocator(make_plan([], 0)):
        assert ext.cpu_allocator_address() == ext.planned_allocator_address()
    assert ext.cpu_allocator_address() == before


def test_cpu_allocator_is_restored_when_the_step_raises(ext):
    before = ext.cpu_allocator_address()
    plan = make_plan([(0, [64], [0])], 64)
    with pytest.raises(ZeroDivisionError), memplan.planned_allocator(plan) as pa:
        x = request(64)
        del x
        1 / 0  # noqa: B018
    assert ext.cpu_allocator_address() == before
    assert pa.arena_released


def test_arena_is_released_at_exit(ext):
    plan = make_plan([(0, [64], [0])], 64)
    with memplan.planned_allocator(plan) as pa:
        x = request(64)
        del x
        assert not pa.arena_released
    assert pa.arena_released
    assert pa.stats["arena_releases"] == 1


def test_arena_outlives_the_context_until_its_last_tensor_is_freed(ext):
    plan = make_plan([(0, [64, 64], [0, 64])], 128)
    with memplan.planned_allocator(plan) as pa:
        a = request(64).fill_(3)
        b = request(64).fill_(5)
    assert not pa.arena_released
    assert int(a.sum()) == 3 * 64  # still valid memory after exit
    del a
    assert not pa.arena_released
    c = request(64)  # the default allocator again: not in the arena
    assert not pa.owns(c)
    del b
    assert pa.arena_released
    del c


def test_tensors_from_before_the_context_are_freed_by_their_own_allocator(ext):
    before = torch.ones(1000)
    plan = make_plan([(0, [64], [0])], 64)
    with memplan.planned_allocator(plan) as pa:
        del before  # freed inside: goes to the allocator that made it
        x = request(64)
        del x
    assert (pa.stats["requests"], pa.stats["served"], pa.stats["fallbacks"]) == (1, 1, 0)


def test_fallback_tensors_freed_after_exit_are_released(ext):
    plan = make_plan([], 0)
    with memplan.planned_allocator(plan) as pa:
        x = request(1000).fill_(1)
    assert pa.stats["fallback_live_bytes"] == 1000
    assert int(x.sum()) == 1000
    del x
    assert pa.stats["fallback_live_bytes"] == 0


def test_peak_bytes_counts_the_arena_and_fallbacks_live_together(ext):
    plan = make_plan([(0, [64], [0])], 64)
    with memplan.planned_allocator(plan) as pa:
        a = request(64)
        b = request(1000)  # beyond the plan: fallback
        del b
        c = request(500)
        del a, c
    assert pa.stats["peak_bytes"] == 64 + 1000
    assert pa.stats["peak_live_bytes"] == 64 + 1000


def test_plan_offsets_below_cpu_alignment_are_refused(ext):
    with pytest.raises(UserError, match="64"):
        memplan.planned_allocator(make_plan([(0, [8, 8], [0, 8])], 16, alignment_bytes=8))


def test_a_second_planned_allocator_cannot_be_installed_inside_the_first(ext):
    plan = make_plan([], 0)
    with memplan.planned_allocator(plan), pytest.raises(UserError, match="already installed"):
        with memplan.planned_allocator(plan):
            pass


def test_profiler_sees_planned_allocations(ext):
    plan = make_plan([(0, [4096], [0])], 4096)
    with memplan.planned_allocator(plan) as pa:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            x = request(4096)
            x.fill_(1)
            del x
        assert pa.stats["served"] == 1
    usage = [(e.name, e.cpu_memory_usage) for e in prof.events()]
    assert ("aten::empty", 4096) in usage  # the allocation, charged to the op that made it
    assert ("[memory]", -4096) in usage  # the free


def test_cuda_glue_is_neither_imported_nor_compiled_without_cuda():
    import subprocess
    import sys

    code = (
        "import sys, memplan, memplan.runtime; memplan.planned_allocator; "
        "print('memplan.runtime.cuda' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    if not torch.cuda.is_available():
        from memplan.runtime.build import cuda_extension

        with pytest.raises(UserError, match="CUDA device"):
            cuda_extension()
