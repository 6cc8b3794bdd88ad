"""`MemplanCallback`: `memplan.watch` driven by a Lightning `Trainer` (docs/watch.md)::

    trainer = lightning.Trainer(callbacks=[MemplanCallback(step=3)], ...)

Lightning's training epoch loop (`lightning/pytorch/loops/training_epoch_loop.py`, `advance`)
calls `on_train_batch_start` before a batch's `training_step` and `on_train_batch_end` after
its backward and, at the last batch of an accumulation (`accumulate_grad_batches`), the
optimizer step, both from the same frame: the watch's iteration opens at the first batch
after an optimizer step and closes at the batch end whose `trainer.global_step` has moved on.
The estimate replays the iteration's forward calls of the LightningModule's model as
Lightning's automatic optimization runs them, `optimizer.step(closure)`
(`memplan.watch.fake.standard_step` with `closure=True`), or `step_fn` when given; Lightning's
`gradient_clip_val` becomes the clipping norm.

This module imports lightning: import it only where Lightning is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from memplan.watch import Watch


class MemplanCallback(Callback):
    """Watch optimizer step `step` of a Lightning run (1 = the first); options as `memplan.watch`.
    `module_attr` names the LightningModule's attribute holding the model whose forward the
    training step calls (default: the LightningModule itself)."""

    def __init__(self, step: int = 2, out_dir: str | Path = "memplan-watch", on_oom: bool = True,
                 capacity: int | str | None = None, module_attr: str | None = None, **options: Any) -> None:
        self.step = step
        self.out_dir = out_dir
        self.on_oom = on_oom
        self.capacity = capacity
        self.module_attr = module_attr
        self.options = options
        self.watch: Watch | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        model = getattr(pl_module, self.module_attr) if self.module_attr else pl_module
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        options = {"closure": trainer.lightning_module.automatic_optimization, **self.options}
        if trainer.gradient_clip_val:
            options.setdefault("clip_norm", float(trainer.gradient_clip_val))
        self.watch = Watch(model, optimizer, self.step, self.out_dir, self.on_oom, self.capacity,
                           driver="callbacks", **options)
        self.watch.start()
        self.watch.end_iteration(steps_done=trainer.global_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is not None:
            self.watch.begin_iteration()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is not None and trainer.global_step != self.watch.steps_done:
            self.watch.end_iteration(steps_done=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.watch is not None:
            self.watch.close()

    @property
    def result(self) -> dict[str, Any] | None:
        return self.watch.result if self.watch is not None else None
