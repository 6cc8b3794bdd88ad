"""Saved activations through the engine: `torch.autograd.graph.saved_tensors_hooks` that move storages.

A saved storage is written out once when autograd first saves it and read back, ahead of need,
in backward, as `torch.autograd.graph.save_on_cpu` (torch/autograd/graph.py) moves saved tensors
to host memory.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any

import torch

from memplan.offload.runtime.engine import OffloadEngine, OffloadError
from memplan.offload.runtime.store import aligned_nbytes, fresh_bytes
from memplan.offload.runtime.tensors import local_shard


class _Saved:
    """One offloaded storage: written once however many saved tensors view it, read back once."""

    __slots__ = ("key", "nbytes", "refs", "version", "tensors", "raw", "offset", "future", "device", "moved")

    def __init__(self, key: str, nbytes: int, version: int, moved: bool = True) -> None:
        self.key = key
        self.nbytes = nbytes
        self.moved = moved  # False: a saved storage a plan keeps (tracked only to count storages)
        self.refs = 0  # packed handles not yet unpacked
        self.version = version
        self.tensors: list[weakref.ref] = []  # the packed tensors, while they live (deduplication)
        self.raw: torch.Tensor | None = None  # the storage read back (page-aligned), until the last unpack
        self.offset = 0  # byte offset of the data in `raw`
        self.future: Future | None = None  # the prefetch in flight
        self.device = torch.device("cpu")

    def remember(self, t: torch.Tensor) -> None:
        """Keep weak references by which a later save of the same storage finds this entry: the
        tensor and, for a view, its base. A view saved by one op dies as the op returns (Llama's
        q, k and v projections each save their own 2-D view of one input), while its base lives
        as long as any view of it: with the base, the three saves are one storage, as in the trace."""
        self.tensors.append(weakref.ref(t))
        if t._base is not None:
            self.tensors.append(weakref.ref(t._base))


class ActivationOffloader:
    """saved_tensors_hooks: the storages of large saved tensors go out at pack and come back in backward.

    The unit is the *storage*, as autograd's own saved variables keep storages alive: the views
    of one storage that several ops save (GPT-2's q, k and v are views of one `c_attn` output;
    a layer's input is saved by more than one op) are written once and read once, and a view
    saved as non-contiguous moves like any other. Tensors that require grad (the activations
    themselves) move too, as `torch.autograd.graph.save_on_cpu` moves them. Parameters (FSDP2's
    unsharded ones included), their views (a weight's transpose) and module buffers stay: they
    live on anyway.

    Backward reads ahead: when it unpacks a storage, the storages packed before it (the order
    backward needs them) are read in the background, up to `prefetch_nbytes` loaded and not
    yet used, into page-aligned storage (O_DIRECT needs no bounce copy). A storage is dropped,
    and its file removed, at the last unpack of a tensor that views it.

    With a plan (`saved`: the sizes of the storages the traced forward saved, in the order it
    first saved them, and whether the plan moves each), the k-th storage this forward saves
    moves if the plan moves the traced forward's k-th, whatever its size; a storage whose size
    differs from the traced one, or a forward that saves more storages, is an error: the plan
    was made for another step."""

    def __init__(self, engine: OffloadEngine, model: torch.nn.Module, min_nbytes: int,
                 max_inflight_nbytes: int = 64 << 20, prefetch_nbytes: int = 64 << 20,
                 saved: tuple[list[int], list[bool]] | None = None) -> None:
        self.engine = engine
        self.min_nbytes = min_nbytes
        self.saved = saved
        self.max_inflight_nbytes = max_inflight_nbytes
        self.prefetch_nbytes = prefetch_nbytes
        self.kept = {local_shard(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.count = 0
        self.live: dict[int, _Saved] = {}  # storage data_ptr -> its entry, this forward
        self.stack: list[_Saved] = []  # this forward's entries, in pack order
        self.cursor = -1  # the next entry (downwards) backward's read-ahead looks at
        self.ahead: dict[str, int] = {}  # key -> bytes, read ahead and not yet unpacked
        self.unpacked = False  # an unpack happened since the last pack: the next pack starts a new forward
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _entry_for(self, t: torch.Tensor, ptr: int) -> _Saved | None:
        entry = self.live.get(ptr)
        if entry is None:
            return None
        for ref in entry.tensors:
            other = ref()
            if other is not None and other.untyped_storage().data_ptr() == ptr:
                return entry if other._version == entry.version and t._version == entry.version else None
        return None

    def pack(self, t: torch.Tensor) -> Any:
        self.engine.reap()
        if (
            type(t) is not torch.Tensor  # parameters (FSDP2's unsharded ones too), tensor subclasses
            or isinstance(t._base, torch.nn.Parameter)  # a view of one (a weight's transpose)
            or t.device.type not in ("cpu", "cuda")
            or t.layout != torch.strided
            or (self.saved is None and t.untyped_storage().nbytes() < self.min_nbytes)
            or t.untyped_storage().data_ptr() in self.kept
        ):
            return t
        if self.unpacked:  # a new forward
            self.live.clear()
            self.stack = []
            self.unpacked = False
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        entry = self._entry_for(t, ptr)
        if entry is None:
            self.count += 1
            entry = _Saved(f"act.{self.count}", storage.nbytes(), t._version, self._planned(len(self.stack), storage))
            self.live[ptr] = entry
            self.stack.append(entry)
            entry.device = t.device
            if not entry.moved:
                entry.remember(t)
                return t
            self.cursor = len(self.stack) - 1
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # held until written
            self.engine.offload(entry.key, whole)
            # back-pressure: the storages waiting to be written stay within `max_inflight_nbytes`
            while len(self.engine.holding) > 1 and sum(
                x.numel() * x.element_size() for x in self.engine.holding.values()
            ) > self.max_inflight_nbytes:
                self.engine.wait(next(iter(self.engine.holding)))
        if not entry.moved:
            return t
        entry.remember(t)
        entry.refs += 1
        return (entry, t.dtype, t.shape, t.stride(), t.storage_offset())

    def _planned(self, k: int, storage: Any) -> bool:
        """Whether the k-th storage of this forward moves: always without a plan; with one,
        as the plan moves the traced forward's k-th (checked to be the same size)."""
        if self.saved is None:
            return True
        sizes, moved = self.saved
        if k >= len(sizes):
            raise OffloadError(f"this forward saves more storages for backward than the planned one ({len(sizes)}): "
                               "the plan was made for another step; capture and plan this very step")
        if storage.nbytes() != sizes[k]:
            raise OffloadError(f"storage {k + 1} this forward saves for backward has {storage.nbytes()} bytes, the "
                               f"planned step's has {sizes[k]}: the plan was made for another step; capture and plan "
                               "this very step")
        return moved[k]

    def _read(self, entry: _Saved) -> Future | None:
        """Start reading `entry` back into fresh page-aligned storage (on this thread: the
        allocation is the training thread's); None where it is held in host memory."""
        self.engine.wait(entry.key)  # its write is complete, and released on this thread
        entry.raw, entry.offset = fresh_bytes(entry.nbytes, entry.device)
        size = entry.nbytes if entry.device.type == "cuda" else aligned_nbytes(entry.nbytes)  # a page-multiple read
        return self.engine.prefetch_into(entry.key, entry.raw[entry.offset : entry.offset + size]) if size else None

    def _read_ahead(self) -> None:
        loaded = sum(self.ahead.values())
        while self.cursor >= 0 and loaded < self.prefetch_nbytes:
            entry = self.stack[self.cursor]
            self.cursor -= 1
            if entry.raw is None and entry.refs > 0:
                entry.future = self._read(entry)
                self.ahead[entry.key] = aligned_nbytes(entry.nbytes)
                loaded += aligned_nbytes(entry.nbytes)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not self.unpacked and self.saved is not None and len(self.stack) < len(self.saved[0]):
            raise OffloadError(f"this forward saved {len(self.stack)} storages for backward, the planned one "
                               f"{len(self.saved[0])}: the plan was made for another step; capture and plan this very step")
        self.unpacked = True
        if isinstance(packed, torch.Tensor):
            return packed
        self.engine.reap()
        entry, dtype, shape, stride, offset = packed
        if entry.refs <= 0:
            raise OffloadError(f"saved tensor '{entry.key}' was unpacked twice (retain_graph is not supported "
                               "with activation offloading)")
        if entry.raw is None:
            entry.future = self._read(entry)
        if entry.future is not None:
            entry.future.result()
            entry.future = None
        self.ahead.pop(entry.key, None)
        out = torch.empty(0, dtype=dtype, device=entry.raw.device).set_(
            entry.raw.untyped_storage(), (entry.offset // dtype.itemsize) + offset, shape, stride)
        entry.refs -= 1
        if entry.refs == 0:
            entry.raw = None
            entry.tensors.clear()
            loc = self.engine.table.pop(entry.key, None)
            if loc is not None and loc.path:
                self.engine.store.remove(loc.path)
        self._read_ahead()
        return out
