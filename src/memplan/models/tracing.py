"""What a training step's own code tells memplan's recorder that no op can show.

A CUDA job is traced on fake *cpu* tensors (docs/capture.md), so the host and the GPU
are the same device in the trace. Code that keeps tensors on the host (torchao's
`CPUOffloadOptimizer`, FSDP2's `CPUOffloadPolicy`, bitsandbytes' paged optimizers)
marks them here, and the recorder (`memplan.capture.recorder`) labels their buffers
`host:pinned`, `host:pageable` or `host:managed` instead of the job's device:

- `host_placement()`: a dispatch mode for the step and for the code that builds it.
  It serves `pin_memory=True` and `Tensor.pin_memory()` (`aten._pin_memory`) with an
  ordinary host allocation of the same size, marked `pinned`, and answers
  `is_pinned()` from the marks: a CPU-only PyTorch has no pinned-memory allocator
  (`pin_memory=True` raises there), and fake tensors have no `_pin_memory` kernel.
  Everything made inside `host_compute()` (an optimizer step that runs on the host's
  CPU: its states, temporaries and `step` counters) is on the host, `pageable`.
  Nothing else is inferred: a copy between host and GPU (`.to("cuda")`) is no op at
  all when both are the fake cpu, so placement cannot follow data flow;
- `mark_host(tensor, kind)`: a placement the dispatcher cannot see (bitsandbytes'
  paged state buffers live in CUDA managed memory, made by `cudaMallocManaged`).

The marks are keyed by storage and die with it. `host_kind(storage)` reads them;
`add_listener` tells the recorder of a mark made after it first saw the storage.

`fused_kernel()`: the ops run inside this block are one compiled kernel on the target
device (torchao's `torch.compile`d optimizer step, run eagerly on fake tensors because a
compiled kernel cannot run on them): the recorder lets them run without recording, so
the eager program's intermediate tensors, which the compiled kernel keeps in registers,
are not in the trace. Such a block may only change existing storages in place.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

HOST_KINDS = ("pinned", "pageable", "managed")

_marks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # untyped storage -> host kind
_listeners: list[Callable[[Any, str], None]] = []
_local = threading.local()


def _storage(tensor: torch.Tensor) -> Any:
    return tensor.untyped_storage()


def mark_host(tensor: torch.Tensor, kind: str) -> None:
    """Record that `tensor`'s storage lives in host memory of `kind` (`HOST_KINDS`)."""
    if kind not in HOST_KINDS:
        raise ValueError(f"host kind must be one of {', '.join(HOST_KINDS)}, not {kind!r}")
    storage = _storage(tensor)
    if _marks.get(storage) == kind:
        return
    _marks[storage] = kind
    for listener in list(_listeners):
        listener(storage, kind)


def host_kind(storage: Any) -> str | None:
    """The host kind of an untyped storage, or None when it lives on the job's device."""
    return _marks.get(storage)


def is_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage is marked as host memory."""
    return host_kind(_storage(tensor)) is not None


@contextlib.contextmanager
def add_listener(listener: Callable[[Any, str], None]) -> Iterator[None]:
    """Call `listener(storage, kind)` on every mark made inside the block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@contextlib.contextmanager
def host_compute() -> Iterator[None]:
    """Everything made inside the block lives on the host (`pageable` unless pinned)."""
    depth = getattr(_local, "host_depth", 0)
    _local.host_depth = depth + 1
    try:
        yield
    finally:
        _local.host_depth = depth


def in_host_compute() -> bool:
    return getattr(_local, "host_depth", 0) > 0


@contextlib.contextmanager
def fused_kernel() -> Iterator[None]:
    """The block runs as one fused kernel of the target device (module docstring)."""
    depth = getattr(_local, "fused_depth", 0)
    _local.fused_depth = depth + 1
    try:
        yield
    finally:
        _local.fused_depth = depth


def in_fused_kernel() -> bool:
    return getattr(_local, "fused_depth", 0) > 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _HostPlacement(TorchDispatchMode):
    """The dispatch mode of `host_placement` (module docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor or a quantised state: its inner ops come back here
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten.is_pinned.default:
            return host_kind(_storage(args[0])) == "pinned"
        if func is torch.ops.aten._pin_memory.default:
            out = args[0].clone()
            mark_host(out, "pinned")
            return out
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs["pin_memory"] = False
        kind = "pinned" if pinned else "pageable" if in_host_compute() else None
        # the inputs' storages, held so that their ids stay theirs while compared
        seen = {id(s): s for s in map(_storage, _tensors((args, kwargs)))} if kind is not None else {}
        out = func(*args, **kwargs)
        if kind is not None:
            for t in _tensors(out):
                if id(_storage(t)) not in seen and not is_host(t):
                    mark_host(t, kind)
        return out


def host_placement() -> contextlib.AbstractContextManager:
    """The dispatch mode that follows host memory through the step (module docstring)."""
    return _HostPlacement()
