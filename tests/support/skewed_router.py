"""A mixture-of-experts step whose own router prefers expert 0, and the token counts it
routed: `bias_first_expert` is a `measure_rank_peaks(..., prepare=...)` for gpt-oss, whose
router has a learned bias (`GptOssTopKRouter.bias`); it adds `BIAS` to expert 0's, so
every token picks expert 0 first and its other expert by the router's weights, and it
records, per rank, the tokens each expert was given in the last forward of each MoE block
(in the directory `COUNTS_ENV` names, one JSON file per rank)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from memplan.models.moe import expert_modules

BIAS = 4.0
COUNTS_ENV = "MEMPLAN_TEST_ROUTER_COUNTS"


def bias_first_expert(step) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    for name, module in step.model.named_modules():
        if name.endswith("mlp.router"):
            local = module.bias.to_local() if isinstance(module.bias, DTensor) else module.bias
            first = _first_global_index(module.bias)
            if first == 0 and local.numel() > 0:
                with torch.no_grad():
                    local[0] += BIAS
    counts: dict[str, list[int]] = {}
    directory = Path(os.environ[COUNTS_ENV])
    for name, module in expert_modules(step.model):
        experts = module.memplan_num_experts

        def record(_module, args, name=name, experts=experts):
            with torch.no_grad():
                counts[name] = torch.bincount(args[1].reshape(-1), minlength=experts).tolist()
            (directory / f"rank{rank}.json").write_text(json.dumps(counts))

        module.register_forward_pre_hook(record)


def _first_global_index(param) -> int:
    """The global index of the first element of this rank's shard of a 1-D parameter."""
    if not isinstance(param, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0])
