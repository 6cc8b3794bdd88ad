"""DeepSpeed's ZeRO optimizers (`--engine deepspeed`), modelled on the single-device trace.

DeepSpeed wraps the model and optimizer in its own engine (`deepspeed.initialize`); its
ZeRO optimizers allocate their buffers themselves, outside the model's step. The rules
below are read from DeepSpeed 0.19.8's source (`deepspeed/runtime/zero/stage_1_and_2.py`,
`stage3.py`, `partition_parameters.py`, `config.py`) and applied to the buffers of the
single-device trace. T is the number of trainable parameters, d the data-parallel
degree, e the model's element size (`precision`: DeepSpeed's `bf16`/`fp16` modes keep
the model in that dtype; fp32 otherwise); gradients accumulate in the model dtype
(`engine.get_data_types`: `grad_accum_dtype` defaults to the model dtype).

Stages 1 and 2 (`DeepSpeedZeroOptimizer`):

- the model's parameters stay whole on every rank (`bit16_groups_flat`: the parameters
  become views of one flat buffer);
- fp32 master weights, the rank's partition: ceil(T / d) x 4 B, persistent
  (`__init__`: `single_partition_of_fp32_groups`, a `.clone()` made fp32, also when the
  model is fp32);
- the optimizer's states and its step's temporaries are over that fp32 partition: the
  traced ones times 4 / e / d;
- the fp32 gradient partition the optimizer steps with, ceil(T / d) x 4 B, during the
  optimizer step (`step`: `single_grad_partition`, flattened and cast to fp32);
- with `contiguous_gradients` (DeepSpeed's default), the reduce bucket,
  `reduce_bucket_size` elements of the model dtype, two with `overlap_comm`, from the
  first gradient's hook (`process_gradients` -> `setup_buckets`) to the end of the
  backward (`independent_gradient_partition_epilogue` -> `_release_ipg_buffers`);
- the rank's partition of every gradient, ceil(T / d) x e B
  (`copy_grads_in_partition`: `grads_in_partition`), from the first bucket reduced to the
  step (to its end for an fp32 model, where it is the fp32 gradient itself); stage 2
  reduces a bucket whenever the gradients made so far fill one and frees each gradient as
  it is copied into the bucket; stage 1 keeps the whole gradients until the end of the
  backward and reduces them there.

Stage 3 (`DeepSpeedZeroOptimizer_Stage3`):

- every parameter with more than `stage3_param_persistence_threshold` elements is
  partitioned, ceil(n / d) x e B (`partition_parameters.py`, `_partition_param`); smaller
  ones stay whole on every rank (`persistent_parameters`);
- partitioned parameters are gathered per module for its forward and again for its
  backward and released after it; per transformer block, the next block's parameters
  are prefetched while one runs when the two fit `stage3_prefetch_bucket_size` and
  `stage3_max_live_parameters` (`PartitionedParameterCoordinator.fetch_sub_module`); the
  parameters outside the blocks (embeddings, head, final norm) are counted gathered for
  the whole step, as in the FSDP rule;
- fp32 master weights, ceil(T / d) x 4 B, unless the model is fp32 (then the partition
  itself is the master: `_create_fp32_partitions`);
- the fp32 gradient buffer the optimizer steps with, ceil(T / d) x 4 B
  (`initialize_optimizer_states`: `gradient_buffer`), the flat gradient partition,
  ceil(T / d) x e B (`_setup_for_real_optimizer`: `grad_partitions_flat_buffer`), and the
  reduce bucket, `reduce_bucket_size` elements of the model dtype (same function, the
  `ipg_buckets`' buffer), all persistent;
- a block's gradients live from its backward until the next block's is done (they are
  copied into the reduce bucket and freed, `__add_grad_to_ipg_bucket`).

Config knobs and DeepSpeed's defaults (`zero/config.py`): `reduce_bucket_size` 5e8,
`stage3_prefetch_bucket_size` 5e7, `stage3_param_persistence_threshold` 1e5,
`stage3_max_live_parameters` 1e9, `overlap_comm` False for stages 1-2 (stage 3 keeps
one bucket either way). Not modelled: CPU/NVMe offload, `sub_group_size` splitting
(one sub-group below 1e9 elements), DeepSpeed's own fused optimizers (the setup's
torch optimizer runs, as with `torch_adam`).
"""

from __future__ import annotations

import math

import numpy as np

from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import DeepSpeedConfig
from memplan.trace.edit import ExtraBuffer
from memplan.trace.model import CATEGORY, PHASE, Trace

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32_BYTES = 4


def element_bytes(setup: TrainingSetup) -> int:
    """Bytes per element of the model (and of its gradients) under DeepSpeed."""
    return ELEMENT_BYTES[setup.dtype]


def trainable_elements(trace: Trace, setup: TrainingSetup, grad_bytes: int) -> int:
    """T: the trainable parameters' elements (the capture's `trainable_bytes`, else the
    traced gradients' bytes)."""
    return int(trace.meta.get("trainable_bytes", grad_bytes)) // element_bytes(setup)


def optimizer_span(trace: Trace) -> tuple[int, int]:
    """First event of the optimizer step and one past its last (the trace's end)."""
    ops = np.flatnonzero(trace.ops["phase"] == PHASE["optimizer"]) if trace.num_ops else np.zeros(0, np.int64)
    if ops.size == 0:
        return trace.num_events, trace.num_events
    return int(trace.ops["first_event"][ops[0]]), trace.num_events


def backward_start(trace: Trace) -> int:
    """The first event of the first backward (the trace's end when there is none)."""
    phase = trace.ops["phase"] if trace.num_ops else np.zeros(0, np.int64)
    ops = np.flatnonzero(np.isin(phase, [PHASE["backward"], PHASE["recompute"]]))
    return int(trace.ops["first_event"][ops[0]]) if ops.size else trace.num_events


def partitioned_bytes(nbytes: np.ndarray, element: int, d: int, threshold: int | None = None) -> np.ndarray:
    """Each parameter's bytes on one rank: ceil(n / d) elements, or whole where `threshold`
    is given and n <= threshold (stage 3's persistent parameters)."""
    numel = nbytes // element
    out = -(-numel // d) * element
    if threshold is not None:
        out = np.where(numel <= threshold, nbytes, out)
    return out.astype(np.int64)


def optimizer_factor(setup: TrainingSetup, d: int) -> float:
    """What the traced optimizer states and temporaries are multiplied by: fp32 over the
    rank's partition."""
    return FP32_BYTES / element_bytes(setup) / d


def stage12_buffers(trace: Trace, setup: TrainingSetup, stage: int, d: int, grad_bytes: int,
                    config: DeepSpeedConfig, device: int) -> list[ExtraBuffer]:
    """Stages 1-2: master partition, the reduce bucket(s) of the backward, the gradient
    partition from the first bucket reduced (stage 2: when the gradients made so far
    first fill a bucket; stage 1: at the end of the backward) to the step, and the fp32
    copy of it the step takes when the model is not fp32 (module docstring)."""
    element, partition = element_bytes(setup), math.ceil(trainable_elements(trace, setup, grad_bytes) / d)
    step_start, _ = optimizer_span(trace)
    last_backward = backward_end(trace)
    bucket_bytes = config.reduce_bucket_size * element
    flushed = first_flush(trace, bucket_bytes) if stage == 2 else last_backward
    fp32 = element == FP32_BYTES  # the partition is then the fp32 gradient itself (`.to` returns it)
    extras = [ExtraBuffer(partition * FP32_BYTES, 0, -1, "optimizer_state", device=device),
              ExtraBuffer(0 if fp32 else partition * FP32_BYTES, step_start, -1, "gradient", "optimizer",
                          device=device),
              ExtraBuffer(partition * element, flushed, -1 if fp32 else step_start, "gradient", "backward",
                          device=device)]
    # allocated by the first gradient's hook (`process_gradients` -> `setup_buckets`)
    first_hook = first_flush(trace, 1)
    extras += [ExtraBuffer(bucket_bytes, first_hook, last_backward, "other", "backward", device=device)
               for _ in range(2 if config.overlap_comm else 1)]
    return [x for x in extras if x.nbytes > 0 and x.alloc_before < trace.num_events]


def first_flush(trace: Trace, bucket_bytes: int) -> int:
    """The event where the gradients the backward has made first fill a reduce bucket of
    `bucket_bytes` (the end of the backward when they never do)."""
    grads = np.flatnonzero(trace.buffers["category"] == CATEGORY["gradient"])
    events = trace.buffers["alloc_event"][grads] if grads.size else np.zeros(0, np.int64)
    made = events >= backward_start(trace)
    order = np.argsort(events[made], kind="stable")
    filled = np.cumsum(trace.buffers["nbytes"][grads][made][order]) >= bucket_bytes
    return int(events[made][order][np.argmax(filled)]) if filled.any() else backward_end(trace)


def backward_end(trace: Trace) -> int:
    """One past the last event of the last backward op."""
    phase = trace.ops["phase"] if trace.num_ops else np.zeros(0, np.int64)
    ops = np.flatnonzero(np.isin(phase, [PHASE["backward"], PHASE["recompute"]]))
    if ops.size == 0:
        return trace.num_events
    last = int(ops[-1])
    return int(trace.ops["first_event"][last + 1]) if last + 1 < trace.num_ops else trace.num_events


def stage3_buffers(trace: Trace, setup: TrainingSetup, d: int, grad_bytes: int, config: DeepSpeedConfig,
                   device: int) -> list[ExtraBuffer]:
    """Stage 3's persistent optimizer-side buffers (module docstring)."""
    element, partition = element_bytes(setup), math.ceil(trainable_elements(trace, setup, grad_bytes) / d)
    master = 0 if element == FP32_BYTES else partition * FP32_BYTES
    extras = [ExtraBuffer(master, 0, -1, "optimizer_state", device=device),
              ExtraBuffer(partition * FP32_BYTES, 0, -1, "gradient", device=device),
              ExtraBuffer(partition * element, 0, -1, "gradient", device=device),
              ExtraBuffer(config.reduce_bucket_size * element, 0, -1, "other", device=device)]
    return [x for x in extras if x.nbytes > 0]


def stage3_prefetches(block_param_bytes: dict[int, int], setup: TrainingSetup, config: DeepSpeedConfig) -> bool:
    """Whether stage 3 gathers the next block while one runs: two blocks' parameters fit
    both the prefetch bucket and the live-parameter limit (elements)."""
    largest = max(block_param_bytes.values(), default=0) // element_bytes(setup)
    return largest <= config.prefetch_bucket_size and 2 * largest <= config.max_live_parameters
