"""`memplan.watch` for an Accelerate loop (docs/watch.md)::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with memplan.integrations.accelerate.watch(accelerator, model, optimizer, step=3) as w:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()

Under `accelerator.accumulate`, the prepared optimizer (`accelerate/optimizer.py`,
`AcceleratedOptimizer.step`) steps the wrapped `torch.optim` optimizer only when
`gradient_state.sync_gradients` is set, at the last micro-batch of each accumulation: the
watch's post-hook sits on that inner optimizer, so its iteration is one optimizer step with
all its micro-batches. The watch hooks the unwrapped model (`accelerator.unwrap_model`),
whose forward a DDP or FSDP wrapper calls.

This module imports accelerate: import it only where accelerate is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator

from memplan.errors import UserError
from memplan.watch import Watch


def watch(accelerator: Accelerator, model: Any, optimizer: Any, step: int = 2,
          out_dir: str | Path = "memplan-watch", **options: Any) -> Watch:
    """`memplan.watch` on an Accelerate job's prepared model and optimizer (module docstring)."""
    if not isinstance(accelerator, Accelerator):
        raise UserError(f"memplan.integrations.accelerate.watch takes the Accelerator first, not "
                        f"{type(accelerator).__name__}")
    return Watch(accelerator.unwrap_model(model), optimizer, step, out_dir, **options)
