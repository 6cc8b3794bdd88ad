"""Keep a fake-tensor step the same program as the real one inside transformers.

transformers treats a FakeTensor as "tracing" and then never skips the causal mask:
it cannot read whether the position ids describe packed sequences, so it assumes they
may, and materialises a [B, 1, S, S] boolean mask that SDPA turns into a float one —
where a real step passes `is_causal=True` and no mask at all (and so, on a GPU, reaches
the flash kernel). That changes the memory of the step (1% of a tiny LoRA step's peak).

memplan's batches are never packed (positions 0..S-1 in every row), so while a step is
captured, fake position ids count as "not packed", and the causal-skip test (which reads
no tensor values when there is no padding mask) does not count fake tensors as tracing.
Real tensors are untouched. The real-vs-fake capture tests hold the two programs equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def masks_as_on_real_tensors() -> Iterator[None]:
    """Let transformers build attention masks for fake tensors as it does for real ones."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # an older transformers without the shared masking code
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    is_tracing = masking.is_tracing
    find_packed = masking.find_packed_sequence_indices
    ignore_causal = masking._ignore_causal_mask_sdpa

    def not_packed(position_ids: torch.Tensor) -> Any:
        return None if isinstance(position_ids, FakeTensor) else find_packed(position_ids)

    def ignore_causal_mask(*args: Any, **kwargs: Any) -> bool:
        masking.is_tracing = lambda t=None: is_tracing(None if isinstance(t, FakeTensor) else t)
        try:
            return ignore_causal(*args, **kwargs)
        finally:
            masking.is_tracing = is_tracing

    masking.find_packed_sequence_indices = not_packed
    masking._ignore_causal_mask_sdpa = ignore_causal_mask
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find_packed
        masking._ignore_causal_mask_sdpa = ignore_causal
