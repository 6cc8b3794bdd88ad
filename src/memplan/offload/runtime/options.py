"""The knobs of `memplan.offload.run`, in one frozen value."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """How `run` offloads; only `directory` is required.

    - `directory`: where the per-process offload directory is made (an existing directory,
      e.g. on the NVMe array).
    - `activations`, `optimizer_states`: which of the two kinds move at all.
    - `min_nbytes`: without a plan, the smallest tensor (or saved storage) that moves.
    - `checksum`: a CRC32 of every tensor, verified on reload.
    - `host_fallback`: a failed write keeps the tensor in host memory instead of raising.
    - `direct`: O_DIRECT where the file system allows it.
    - `workers`: I/O threads.
    - `streamed_step`: gradients move too, and the optimizer step streams states chunk by chunk
      (`states.StreamedOptimizer`).
    - `step_in_backward`: each parameter's update runs in backward (`states.StepInBackward`).
    - `chunk_nbytes`: the bytes of states a streamed step works on at once; also the bound on
      saved storages waiting to be written and on those backward reads ahead.
    - `resident_nbytes`: with `step_in_backward` and no plan, states of the largest parameters
      that never leave.
    - `forward_prefetch_nbytes`: with `step_in_backward`, the states read during the forward
      (default `chunk_nbytes`).
    """

    directory: str | os.PathLike
    activations: bool = True
    optimizer_states: bool = True
    min_nbytes: int = 1 << 20
    checksum: bool = False
    host_fallback: bool = True
    direct: bool = True
    workers: int = 2
    streamed_step: bool = False
    step_in_backward: bool = False
    chunk_nbytes: int = 64 << 20
    resident_nbytes: int = 0
    forward_prefetch_nbytes: int | None = None
