"""Optimizer states and gradients through the engine: three ways to keep them off the device.

- `StateOffloader`: states leave after each optimizer step (`register_step_post_hook`) and are
  prefetched, asynchronously, as soon as backward produces the first gradient
  (`register_post_accumulate_grad_hook`); the step waits for them (`register_step_pre_hook`).
- `StreamedOptimizer`: gradients leave as backward produces them, and the optimizer step
  streams states chunk by chunk.
- `StepInBackward`: each parameter's update runs in backward as soon as its gradient is
  accumulated; states stream around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from memplan.offload.runtime.engine import OffloadEngine, OffloadError
from memplan.offload.runtime.store import refill_page_aligned
from memplan.offload.runtime.tensors import local_nbytes, local_shard


def _movable(t: Any, min_nbytes: int) -> bool:
    """Whether a gradient or state can leave by releasing its storage: a contiguous tensor of
    at least `min_nbytes` that is not a view of another. (FSDP2's sharded gradients are views
    of one reduce-scatter buffer: releasing one's storage would free them all. They stay.)"""
    return (
        isinstance(t, torch.Tensor)
        and t._base is None
        and t.is_contiguous()
        and t.numel() * t.element_size() >= min_nbytes
    )


def _moves(key: str, t: Any, moved: dict[str, int] | None, min_nbytes: int) -> bool:
    """Whether the gradient or state `t` (runtime key `key`) leaves: the plan's choice where
    there is one (`moved`), else every one of at least `min_nbytes`; only if it can (`_movable`)."""
    if moved is None:
        return _movable(t, min_nbytes)
    if key not in moved:
        return False
    if not _movable(t, 0):
        raise OffloadError(f"the plan moves {key}, which cannot leave by itself (a view of another tensor, or not "
                           "contiguous; FSDP2's sharded gradients are views of one reduce-scatter buffer): plan "
                           "without it, e.g. with categories=memplan.offload.runtime_categories()")
    return True


def parameter_of(key: str) -> str:
    """The parameter name in a runtime key: `grad.<name>` or `state.<name>.<state key>`."""
    if key.startswith("grad."):
        return key[len("grad."):]
    return key[len("state."):].rpartition(".")[0] if key.startswith("state.") else key


class StateOffloader:
    """Optimizer states: out after each step, back (in the background) once backward starts."""

    def __init__(self, engine: OffloadEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 min_nbytes: int, offload_grads: bool, moved: dict[str, int] | None = None) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.min_nbytes = min_nbytes
        self.offload_grads = offload_grads
        self.moved = moved  # a plan's keys -> first return op; None: every large state moves
        self.away: dict[str, torch.Tensor] = {}  # key -> tensor whose storage was released
        self.sizes: dict[str, int] = {}
        self.prefetches: list[Future] = []
        self.handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        self.names = {id(p): name for name, p in model.named_parameters()}
        for p in model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for p, state in self.optimizer.state.items():
            for name, t in state.items():
                t = local_shard(t)
                key = f"state.{self.names.get(id(p), id(p))}.{name}"
                if _moves(key, t, self.moved, self.min_nbytes):
                    yield key, t

    def _after_step(self, *_: Any) -> None:
        futures = []
        for key, t in self._tensors():
            futures.append((key, t, self.engine.offload(key, t)))
        for key, t, future in futures:
            future.result()
            self.engine.wait(key)
            self.sizes[key] = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
            self.away[key] = t

    def _on_grad(self, _p: torch.Tensor) -> None:
        if self.away and not self.prefetches:
            order = sorted(self.away, key=lambda k: self.moved.get(k, 0)) if self.moved else list(self.away)
            for key in order:  # the plan's order of return, where there is a plan
                t = self.away[key]
                t.untyped_storage().resize_(self.sizes[key])
                self.prefetches.append(self.engine.prefetch_into(key, t))

    def _before_step(self, *_: Any) -> None:
        self._on_grad(None)  # no gradient hook ran (e.g. no backward): fetch now
        for f in self.prefetches:
            f.result()
        self.prefetches.clear()
        self.away.clear()

    def restore(self) -> None:
        """Bring every state back (at exit, so the optimizer is whole again)."""
        self._before_step()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class StreamedOptimizer:
    """Gradients and optimizer states streamed through the files, one chunk of parameters at a time.

    Each gradient is written out as soon as backward has accumulated it and its storage is
    released when the write completes. `optimizer.step` is replaced, for the life of the
    context, by a loop over chunks of about `chunk_nbytes` of state: the next chunk's
    gradients and states are read back while the optimizer updates this chunk (the original
    `step`, called with the group's parameter list cut down to the chunk), and this chunk's
    states go out again right after. Per-parameter optimizers (AdamW with `foreach=False`)
    compute exactly what one whole step would. Gradients are dropped after their chunk's
    update, as `zero_grad(set_to_none=True)` would.

    This is how a step fits a budget below params + gradients + states: TERAIO's plan makes
    the optimizer phase stream its states in and out (see `planner.py`).
    """

    def __init__(self, engine: OffloadEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 min_nbytes: int, chunk_nbytes: int, moved: dict[str, int] | None = None) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.min_nbytes = min_nbytes
        self.chunk_nbytes = chunk_nbytes
        self.moved = moved  # a plan's keys -> first return op; None: every large gradient and state moves
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.away: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (tensor, storage bytes)
        self.sending: dict[str, torch.Tensor] = {}  # written out (or being written), not yet released
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in model.parameters() if p.requires_grad]
        self.original_step = optimizer.step
        optimizer.step = self.step  # type: ignore[method-assign]

    def _big(self, key: str, t: Any) -> bool:
        return _moves(key, local_shard(t), self.moved, self.min_nbytes)

    def _send(self, key: str, t: torch.Tensor) -> None:
        """Write `t` out; `_reap` releases its storage, on the training thread, once written.

        Back-pressure: while more than `chunk_nbytes` wait to be written, the oldest is waited
        for and released, so the device memory the writes hold does not depend on disk speed."""
        self.engine.offload(key, t)
        self.sending[key] = t
        while len(self.sending) > 1 and sum(x.untyped_storage().nbytes() for x in self.sending.values()) > self.chunk_nbytes:
            oldest = next(iter(self.sending))
            self.engine.wait(oldest)
            self._reap()

    def _reap(self) -> None:
        for key in [k for k in self.sending if self.engine.pending.get(k) is None or self.engine.pending[k].done()]:
            t = self.sending.pop(key)
            self.engine.wait(key)
            self.away[key] = (t, t.numel() * t.element_size())
            t.untyped_storage().resize_(0)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._reap()
        key = f"grad.{self.names.get(id(p), id(p))}"
        if p.grad is not None and self._big(key, p.grad):
            self._send(key, local_shard(p.grad))

    def _tensors_of(self, p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = self.names.get(id(p), id(p))
        out = [(f"grad.{name}", p.grad)] if p.grad is not None else []
        out += [(f"state.{name}.{k}", t) for k, t in self.optimizer.state.get(p, {}).items()]
        return [(k, local_shard(t)) for k, t in out if self._big(k, t)]

    def _fetch(self, params: list[torch.Tensor]) -> list[Future]:
        futures = []
        for p in params:
            for key, _t in self._tensors_of(p):
                if self.sending.pop(key, None) is not None:
                    self.engine.wait(key)  # written but never released: it is still here
                    continue
                entry = self.away.pop(key, None)
                if entry is not None:
                    t, nbytes = entry
                    refill_page_aligned(t, nbytes)
                    futures.append(self.engine.prefetch_into(key, t))
        return futures

    def _chunks(self) -> list[tuple[int, list[torch.Tensor]]]:
        chunks: list[tuple[int, list[torch.Tensor]]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            current: list[torch.Tensor] = []
            nbytes = 0
            for p in group["params"]:
                current.append(p)
                nbytes += 3 * local_nbytes(p)  # gradient + two moments
                if nbytes >= self.chunk_nbytes:
                    chunks.append((gi, current))
                    current, nbytes = [], 0
            if current:
                chunks.append((gi, current))
        return chunks

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise OffloadError("the streamed optimizer step does not take a closure")
        chunks = self._chunks()
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        pending = self._fetch(chunks[0][1]) if chunks else []
        try:
            for i, (gi, params) in enumerate(chunks):
                for f in pending:
                    f.result()
                self._reap()
                pending = self._fetch(chunks[i + 1][1]) if i + 1 < len(chunks) else []
                for g in groups:
                    g["params"] = []
                groups[gi]["params"] = params
                self.original_step()
                for p in params:
                    p.grad = None
                    for key, t in self._tensors_of(p):
                        self._send(key, t)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
            for f in pending:
                f.result()
        return None

    def restore(self) -> None:
        """Bring every state back and put the optimizer's own step back (at exit)."""
        for p in [p for g in self.optimizer.param_groups for p in g["params"]]:
            for f in self._fetch([p]):
                f.result()
        self.optimizer.step = self.original_step  # type: ignore[method-assign]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class StepInBackward(StreamedOptimizer):
    """The optimizer update of each parameter runs in backward, as soon as its gradient is accumulated.

    Gradients then never leave (each is consumed and dropped right away, as torchtune's
    "optimizer in backward" does), and the update overlaps the rest of backward instead of
    running as a phase of its own. Optimizer states are prefetched in reverse parameter order
    (the order backward produces gradients), at most `chunk_nbytes` ahead, and written out
    again after their update. Per-parameter optimizers (AdamW with `foreach=False`) compute
    exactly what one whole step would. Requires one backward per optimizer step (no gradient
    accumulation, no clipping over all gradients): a second gradient for a parameter already
    updated in this step is an error. `optimizer.step()` updates whatever backward did not
    reach and waits for the writes.

    `resident_nbytes`: the states of the largest parameters (ties: backward's order), up to
    about that many bytes (two moments per parameter assumed), never leave: where the budget
    has room, every byte kept is a byte neither written nor read back each step. Largest first
    because the update of the largest parameter is where such a step peaks (its gradient, both
    its states and the optimizer's temporaries coexist; for GPT-2 the tied embedding, at the
    very end of backward): states that must be in memory at the peak anyway cost nothing there
    when kept, and their reads and writes, the longest of the step, would stall the end of
    backward.

    `forward_prefetch_nbytes`: how far ahead states are read after the optimizer step, i.e.
    during the next forward, where the disk is otherwise idle and memory is below backward's
    peak (default `chunk_nbytes`). Backward then consumes them first, and refills to
    `chunk_nbytes` ahead only once fewer than that are in flight, so the extra bytes are held
    only from the forward to the first updates of backward.
    """

    def __init__(self, engine: OffloadEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 min_nbytes: int, chunk_nbytes: int, resident_nbytes: int = 0,
                 forward_prefetch_nbytes: int | None = None, moved: dict[str, int] | None = None) -> None:
        super().__init__(engine, model, optimizer, min_nbytes, chunk_nbytes, moved)
        groups = optimizer.param_groups
        self.group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self.order = [p for g in reversed(groups) for p in reversed(g["params"])]
        self.forward_prefetch_nbytes = chunk_nbytes if forward_prefetch_nbytes is None else forward_prefetch_nbytes
        self.kept: set[int] = set()
        kept_nbytes = 0
        for p in sorted(self.order, key=lambda q: -local_nbytes(q)):  # stable: backward's order on ties
            state_nbytes = 2 * local_nbytes(p)
            if kept_nbytes + state_nbytes <= resident_nbytes:
                self.kept.add(id(p))
                kept_nbytes += state_nbytes
        self.updated: set[int] = set()
        self.fetching: dict[int, tuple[torch.Tensor, list[Future]]] = {}
        self.cursor = 0

    def _prefetch_ahead(self, limit_nbytes: int | None = None) -> None:
        limit_nbytes = self.chunk_nbytes if limit_nbytes is None else limit_nbytes
        ahead = sum(2 * local_nbytes(p) for p, _ in self.fetching.values())
        while self.cursor < len(self.order) and ahead < limit_nbytes:
            p = self.order[self.cursor]
            self.cursor += 1
            if id(p) in self.updated:
                continue
            futures = self._fetch([p])
            if futures:
                self.fetching[id(p)] = (p, futures)
                ahead += 2 * local_nbytes(p)

    def _update(self, p: torch.Tensor) -> None:
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            groups[self.group_of[id(p)]]["params"] = [p]
            self.original_step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def _on_grad(self, p: torch.Tensor) -> None:
        self._reap()
        if id(p) in self.updated:
            raise OffloadError(
                "a second gradient for a parameter already updated in this step: step_in_backward needs one "
                "backward per optimizer step (no gradient accumulation)"
            )
        _, futures = self.fetching.pop(id(p), (p, []))
        for f in futures + self._fetch([p]):  # not prefetched (backward out of order): fetch it now
            f.result()
        self._update(p)
        p.grad = None
        self.updated.add(id(p))
        if id(p) not in self.kept:
            for key, t in self._tensors_of(p):
                self._send(key, t)
        self._prefetch_ahead()

    def _settle(self) -> None:
        """Wait for every write, release what was written, and for every prefetch still in flight."""
        for key in list(self.sending):
            self.engine.wait(key)
        self._reap()
        for p, futures in self.fetching.values():
            for f in futures:
                f.result()
            for key, t in self._tensors_of(p):  # fetched for a parameter that got no gradient
                self._send(key, t)
        self.fetching.clear()
        for key in list(self.sending):
            self.engine.wait(key)
        self._reap()

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise OffloadError("the streamed optimizer step does not take a closure")
        for p in self.order:
            if p.grad is not None and id(p) not in self.updated:
                self._on_grad(p)
        self._settle()
        self.updated.clear()
        self.cursor = 0
        self._prefetch_ahead(self.forward_prefetch_nbytes)  # read during the next forward
        return None

    def restore(self) -> None:
        self._settle()
        super().restore()
