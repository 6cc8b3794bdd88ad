"""The step time `memplan fit` ranks candidates by: the estimate's roofline, the pipeline
bubble and the collectives.

Compute is `Estimate.roofline_s` (rank 0's ops, each max(FLOPs / peak FLOP/s, bytes / HBM
bandwidth), `memplan.hardware.roofline`), which PyTorch's
`torch.distributed._tools.runtime_estimator.RuntimeEstimator` computes the same way in its
roofline mode. What that figure covers depends on what the estimate traced
(`Estimate.parallel`):

- a single-device trace (`single device`, `modelled`): every micro-batch of the step
  (`grad_accum` of them) on the whole model; the modelled TP rule splits it over the TP
  degree; with PP it is one stage's blocks for one micro-batch (the stage setup has one
  micro-batch per trace), so it is multiplied by the step's micro-batches;
- the rank's own traced step (`traced`, `traced + modelled`): the rank's local ops, TP
  shards included; with PP, the stage's 1F1B step over every micro-batch.

With PP, a 1F1B step of m micro-batches on p stages lasts (m + p - 1) stage micro-steps
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters",
§2.2.1: bubble fraction (p - 1) / m; (p - 1) / (m v) with v model chunks per rank for the
interleaved schedule).

Communication is the bytes each rank sends over the device profile's interconnect link,
ring collectives (Patarasuk and Yuan 2009; NCCL's ring algorithm): data parallel, per step,
an all-reduce of the gradients, 2 (n - 1) / n x their bytes (DDP, ZeRO-1/2), or for ZeRO-3
two all-gathers of the parameters (forward and backward) and a reduce-scatter of the
gradients, 3 (n - 1) / n x the bytes; tensor parallel, per block and micro-batch, two
all-reduces of the [B, S, H] activations forward and two backward (torchtitan's Llama plan:
after the attention output and the MLP's down projection), 8 (t - 1) / t x B S H x the
activation element size. LoRA's gradient all-reduce (the adapters, well under 1% of the
weights) is counted as zero. Data-parallel communication overlaps the backward (DDP's
buckets, FSDP2's prefetch): step = compute + max(0, dp - compute) + tp. Nothing here is
validated against measured step times; it orders candidates, it does not promise seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memplan.estimation.pipeline import Estimate
from memplan.hardware.devices import DeviceProfile
from memplan.hardware.roofline import matmul_dtype
from memplan.models.build import sequence_length
from memplan.models.depth import num_layers
from memplan.models.setup import TrainingSetup
from memplan.parallel.layout import INTERLEAVED_CHUNKS, Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SINGLE_DEVICE_TRACES = ("single device", "modelled")  # `Estimate.parallel` of a single-device trace


@dataclass
class StepTime:
    """One step's roofline time (seconds) and the tokens it trains."""

    step_s: float
    compute_s: float
    dp_comm_s: float
    tp_comm_s: float
    tokens_per_step: int

    @property
    def s_per_token(self) -> float:
        return self.step_s / self.tokens_per_step

    def to_json(self) -> dict[str, Any]:
        return {**{k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()},
                "s_per_token": self.s_per_token}


def micro_batches_per_step(setup: TrainingSetup, layout: Layout) -> int:
    """Micro-batches one optimizer step runs on each data-parallel rank."""
    return layout.microbatches if layout.pp > 1 else setup.grad_accum


def tokens_per_step(setup: TrainingSetup, layout: Layout, config: PretrainedConfig) -> int:
    """Tokens one optimizer step trains over every data-parallel rank (the global batch)."""
    return setup.batch * sequence_length(setup, config) * micro_batches_per_step(setup, layout) * layout.dp


def compute_seconds(result: Estimate, layout: Layout) -> float:
    """Rank 0's compute time for the whole step (module docstring)."""
    compute = result.roofline_s
    if layout.pp == 1:
        return compute / layout.tp if result.parallel in SINGLE_DEVICE_TRACES else compute
    m = layout.microbatches
    if result.parallel in SINGLE_DEVICE_TRACES:
        compute = compute / layout.tp * m  # one micro-batch traced: the step runs m of them
    chunks = INTERLEAVED_CHUNKS if layout.schedule == "interleaved" else 1
    return compute * (1 + (layout.pp - 1) / (m * chunks))


def step_time(result: Estimate, setup: TrainingSetup, layout: Layout, config: PretrainedConfig,
              profile: DeviceProfile) -> StepTime:
    """The step time of `result`, an estimate of `setup` under `layout` (module docstring)."""
    compute_s = compute_seconds(result, layout)
    link = profile.interconnect_bytes_per_s
    param_bytes = ELEMENT_BYTES[setup.dtype] * result.parameters / (layout.tp * layout.pp)
    grad_bytes = 0.0 if setup.lora_rank > 0 else param_bytes
    n = layout.dp
    if n > 1 and layout.zero == 3:
        dp_bytes = (n - 1) / n * (2 * param_bytes + grad_bytes)
    else:
        dp_bytes = 2 * (n - 1) / n * grad_bytes
    tp_bytes = 0.0
    if layout.tp > 1:
        hidden = getattr(config, "hidden_size", 0) or 0
        blocks = (num_layers(config) or 1) / layout.pp
        element = ELEMENT_BYTES[matmul_dtype(setup)]
        t = layout.tp
        tp_bytes = (8 * (t - 1) / t * setup.batch * sequence_length(setup, config) * hidden * element * blocks
                    * micro_batches_per_step(setup, layout))
    dp_s, tp_s = dp_bytes / link, tp_bytes / link
    total_s = compute_s + max(0.0, dp_s - compute_s) + tp_s
    return StepTime(total_s, compute_s, dp_s, tp_s, tokens_per_step(setup, layout, config))
