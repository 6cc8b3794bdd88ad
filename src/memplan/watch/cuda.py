"""The watch's CUDA side: imported only where the watched model is on a CUDA device.

Measuring (`CudaMeasurement`). The measured iteration runs under memplan's dispatch-level
recorder, as on cpu (categories, phases, ops of the real tensors), and under PyTorch's own
record: `torch.cuda.memory._record_memory_history` (the allocator's history, for
pytorch.org/memory_viz) and `torch.cuda.memory_stats()` after `reset_peak_memory_stats()`
(PyTorch docs, "Understanding CUDA Memory Usage"). The trace keeps the stats memplan compares
(`STAT_KEYS`: allocated, reserved, active, `num_alloc_retries`, `num_ooms`); the snapshot
written is PyTorch's `torch.cuda.memory._snapshot()`.

Device used at the peak (`device_used_peak_bytes`): `torch.cuda.mem_get_info()` gives the
device's used memory now (cudaMemGetInfo: every process on the device); what is not
PyTorch's reserved memory now (the CUDA context, kernel images, NCCL's buffers, other
processes) is taken as constant over the step, so the peak is that plus the peak reserved.
The same difference at the watch's start is the measured context (`context_bytes`) the
estimate uses instead of the device profile's.

Out of memory (`CudaGuard`): PyTorch calls the observers attached with
`torch._C._cuda_attach_out_of_memory_observer(fn)` as `fn(device, alloc_bytes,
device_allocated_bytes, device_free_bytes)` from `CUDACachingAllocator.cpp` (after releasing
the allocator's lock, before raising `torch.OutOfMemoryError`); the history is on for the
whole watch so the snapshot taken there shows what led to the error. Observers cannot be
detached: a removed guard stops answering.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import UserError
from memplan.hardware.devices import DeviceProfile, device_profile, profile_of_name
from memplan.trace import load_snapshot
from memplan.watch import oom
from memplan.watch.measure import Measurement, StepFiles, step_meta, write_step

STAT_KEYS = ("allocated_bytes.all.peak", "allocated_bytes.all.current", "reserved_bytes.all.peak",
             "reserved_bytes.all.current", "active_bytes.all.peak", "num_alloc_retries", "num_ooms")
HISTORY_ENTRIES = 100_000  # allocator events kept (PyTorch's own default for _record_memory_history)


def history_on() -> None:
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)


def history_off() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def outside_reserved_bytes() -> int:
    """Device memory in use that is not PyTorch's reserved memory (module docstring)."""
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def device_used_peak_bytes(outside_bytes: int, stats: dict[str, Any]) -> int:
    """Device used at the step's peak: the memory outside PyTorch's plus its peak reserved."""
    return int(outside_bytes) + int(stats["reserved_bytes.all.peak"])


class CudaMeasurement(Measurement):
    """One recorded iteration on cuda (module docstring)."""

    def __init__(self, watch: Any, inputs: Any, measured: bool) -> None:
        self._own_history = False
        if measured:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if not getattr(watch._oom_guard, "history", False):
                history_on()
                self._own_history = True
        super().__init__(watch, inputs, measured)

    def start_profiler(self, watch: Any) -> None:
        self.profiler = None  # PyTorch's own history and stats are the measurement on cuda

    def finish(self, watch: Any) -> StepFiles | None:
        if not self.measured or self.oom_trace is not None:
            self.abandon()
            return None
        trace = self.live.end(meta=step_meta(watch))
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        trace.meta["cuda_memory_stats"] = {k: int(stats.get(k, 0)) for k in STAT_KEYS}
        trace.meta["device_used_peak_bytes"] = device_used_peak_bytes(outside_reserved_bytes(), stats)
        trace.meta["gpu_name"] = torch.cuda.get_device_name()
        trace.meta["device_total_bytes"] = int(torch.cuda.mem_get_info()[1])
        trace.meta["context_bytes"] = watch.context_bytes  # outside PyTorch's reserved at the watch's start
        trace.meta["outside_reserved_end_bytes"] = outside_reserved_bytes()
        dist = torch.distributed
        trace.meta["world_size"] = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        snapshot = torch.cuda.memory._snapshot()
        self._stop_history()
        return write_step(watch, trace, raw_snapshot=snapshot)

    def abandon(self) -> None:
        self._stop_history()
        super().abandon()

    def _stop_history(self) -> None:
        if self._own_history:
            history_off()
            self._own_history = False


class CudaGuard:
    """PyTorch's out-of-memory observer, answering for the watch (module docstring)."""

    history = True

    def __init__(self, watch: Any) -> None:
        self.watch = watch
        self.active = True
        history_on()
        torch._C._cuda_attach_out_of_memory_observer(self._on_oom)

    def _on_oom(self, device: int, alloc_bytes: int, device_allocated_bytes: int, device_free_bytes: int) -> None:
        if not self.active:
            return
        watch = self.watch
        message = (f"memplan.watch: CUDA out of memory on device {device}: {alloc_bytes} bytes asked, "
                   f"{device_allocated_bytes} allocated, {device_free_bytes} free")
        snapshot = torch.cuda.memory._snapshot()
        trace = load_snapshot(snapshot)
        trace.meta.update({"device": "cuda", "torch_version": str(torch.__version__),
                           "watched_model": watch.identity, "oom": message})
        if watch._open is not None:
            watch._open.oom_trace = trace
        oom.handle_oom(watch, message, trace, raw_snapshot=snapshot)

    def remove(self) -> None:
        self.active = False
        history_off()


def watched_profile(watch: Any) -> DeviceProfile | None:
    if watch.gpu is not None:
        return device_profile(watch.gpu)
    return profile_of_name(torch.cuda.get_device_name())


def device_terms(watch: Any) -> tuple[DeviceProfile | None, int | None]:
    """The profile (gpu= or the one named like the device) and the context measured at the start."""
    return watched_profile(watch), getattr(watch, "context_bytes", None)


def target_gpu(watch: Any) -> str:
    """The profile name memplan fit searches for this device."""
    profile = watched_profile(watch)
    if profile is None:
        raise UserError(f"no device profile is named like {torch.cuda.get_device_name()}: pass gpu= to memplan.watch "
                        "(see `memplan estimate --gpu list`, or make one with `memplan calibrate`)")
    return profile.key
