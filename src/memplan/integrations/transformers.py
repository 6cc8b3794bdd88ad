"""`MemplanCallback`: `memplan.watch` driven by the Hugging Face `Trainer` (docs/watch.md).

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MemplanCallback(step=3, out_dir="memplan-watch")])
    trainer.train()

The `Trainer`'s loop (`transformers/trainer.py`, `_inner_training_loop`) calls `on_step_begin`
before the first micro-batch of an optimizer step and `on_step_end` after `optimizer.step()`
and `model.zero_grad()`, both from the same frame of the loop: the watch's iteration is the
span between them (`Watch.begin_iteration` / `end_iteration`, counted by `state.global_step`).
The estimate replays the same step: each micro-batch's forward and `loss.backward()`, then
`Trainer._clip_grad_norm` (`clip_grad_norm_` to `args.max_grad_norm`, or to infinity for the
norm `_get_grad_norm` logs when it is 0), `optimizer.step()` and `zero_grad`.

This module imports transformers: import it only where transformers is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from memplan.watch import Watch


class MemplanCallback(TrainerCallback):
    """Watch optimizer step `step` of a `Trainer` run (1 = the first); options as `memplan.watch`."""

    def __init__(self, step: int = 2, out_dir: str | Path = "memplan-watch", on_oom: bool = True,
                 capacity: int | str | None = None, **options: Any) -> None:
        self.step = step
        self.out_dir = out_dir
        self.on_oom = on_oom
        self.capacity = capacity
        self.options = options
        self.watch: Watch | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else float("inf")
        options = {"clip_norm": clip, **self.options}
        self.watch = Watch(model, optimizer, self.step, self.out_dir, self.on_oom, self.capacity,
                           driver="callbacks", **options)
        self.watch.start()
        self.watch.end_iteration(steps_done=state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.begin_iteration()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.end_iteration(steps_done=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.close()

    @property
    def result(self) -> dict[str, Any] | None:
        """The watch's result (`Watch.result`) once training has ended."""
        return self.watch.result if self.watch is not None else None
