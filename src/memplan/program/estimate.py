"""The figures of a traced program rank: `memplan estimate`'s later stages on the program's trace.

The trace is the program's own run, so no capture, layout rule or extrapolation is
involved; what remains is what the device adds that the CPU trace cannot see
(`memplan.estimation.pipeline`, the same functions as `memplan estimate`):

- **cuda**: the CUDA attention kernels' workspaces (`memplan.trace.edit
  .attention_kernel_buffers`, sized from the first SDPA op the recorder saw) and the cuBLAS
  workspace of the profile; the caching allocator replayed under the program's
  `PYTORCH_CUDA_ALLOC_CONF` (`replay_counters`) for peak allocated and peak reserved; device
  used = reserved + the profile's CUDA context + NCCL's buffers for each process group of
  more than one rank the program made (`DeviceProfile.nccl_bytes`);
- **cpu**: the tensors' live bytes (what torch.profiler's memory timeline shows), plus, for
  several ranks, gloo's staging buffers of each all-gather and reduce-scatter
  (`memplan.parallel.traced.gloo_staging_buffers`). The CPU RNG states saved by
  checkpointing are in the trace itself (memplan.program.runner makes them visible).

Each figure carries the phase and breakdown at the allocated peak (`figures_full`).
"""

from __future__ import annotations

import os

from memplan.estimation.figures import DEFAULT_MARGIN, RankEstimate, usable_bytes_of
from memplan.estimation.figures import rank_estimate as figures_rank_estimate
from memplan.hardware.devices import DeviceProfile
from memplan.parallel.traced import gloo_staging_buffers
from memplan.trace import edit as trace_edit
from memplan.trace.model import Trace


def device_trace(trace: Trace, device: str, profile: DeviceProfile | None, *, world_size: int) -> Trace:
    """The program's trace with what the device adds (module docstring)."""
    if device == "cpu":
        return trace_edit.with_extra_buffers(trace, gloo_staging_buffers(trace)) if world_size > 1 else trace
    attention = trace.meta.get("attention")
    extras = []
    if attention is not None:
        extras += trace_edit.attention_kernel_buffers(trace, dtype=attention["dtype"], attn="sdpa",
                                                      seq=attention["seq"], head_dim=attention["head_dim"])
    if profile is not None:
        extras += trace_edit.workspace_buffer(trace, profile.cublas_workspace_bytes)
    return trace_edit.with_extra_buffers(trace, extras)


def rank_estimate(trace: Trace, rank: int, same_as: list[int], device: str, profile: DeviceProfile | None, *,
                  world_size: int, process_groups: int, margin: float = DEFAULT_MARGIN) -> RankEstimate:
    """The figures of one traced rank (module docstring), by the one function every
    trace's figures come from (`memplan.estimation.figures.rank_estimate`)."""
    view = device_trace(trace, device, profile, world_size=world_size)
    if device == "cpu":
        return figures_rank_estimate(view, rank=rank, allocator="none", alloc_conf=None, overhead_bytes=0,
                                     usable_bytes=None, same_as=same_as)
    overhead = 0
    if profile is not None:
        overhead = profile.context_bytes() + profile.nccl_bytes(process_groups if world_size > 1 else 0)
    return figures_rank_estimate(view, rank=rank, allocator="caching",
                                 alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
                                 overhead_bytes=overhead, same_as=same_as,
                                 usable_bytes=usable_bytes_of(profile.capacity_bytes if profile else None, margin))
