"""The torch dtype each of `TrainingSetup`'s dtype names stands for."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
