"""Which bytes of a tensor this process holds and moves: a DTensor's local shard (FSDP2)."""

from __future__ import annotations

from typing import Any

import torch


def local_shard(t: Any) -> Any:
    """A DTensor's local shard (FSDP2's sharded parameters, their gradients and optimizer
    states: the bytes this rank holds and moves); any other value as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard)."""
    t = local_shard(t)
    return t.numel() * t.element_size()
