"""The offload engine of TERAIO (arXiv 2506.06472, §4): a tensor location table and a worker pool.

Tensors go out and come back by key (`grad.<parameter>`, `state.<parameter>.<state key>`,
`act.<n>`) on a pool of I/O threads; the table says where each is ("ssd": a file of the
`FileStore`; "host": a CPU copy). An I/O error or a full disk degrades the tensor to host
memory when `host_fallback` allows it, else raises `OffloadError`; with `checksum` a CRC32 of
every tensor is verified on reload, so a corrupted file is an error, never silent. CUDA
tensors move through `cuda_io`, imported only when one does (it imports kvikio, optional).
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import UserError
from memplan.offload.runtime.store import FileStore, bytes_of


class OffloadError(UserError):
    """An offload or reload that failed and could not fall back."""


@dataclass
class Location:
    """Where one offloaded tensor is: "ssd" (file, offset) or "host" (a CPU copy)."""

    tier: str
    nbytes: int
    path: str | None = None
    host_copy: torch.Tensor | None = None
    crc32: int | None = None


# Called as _fault_hook(op, key), op "write" or "read", in the I/O thread before each file
# transfer; None outside tests, which set it to inject I/O errors and corruption.
_fault_hook: Callable[[str, str], None] | None = None


def _cuda_io() -> Any:
    """The `cuda_io` module, imported on the first CUDA tensor: it imports kvikio (optional),
    and a process that moves only CPU tensors never loads it."""
    from memplan.offload.runtime import cuda_io

    return cuda_io


def _before_io(op: str, key: str) -> None:
    if _fault_hook is not None:
        _fault_hook(op, key)


class OffloadEngine:
    """Asynchronous offload/prefetch of tensors by key, with a location table."""

    def __init__(
        self,
        store: FileStore,
        *,
        workers: int = 2,
        checksum: bool = False,
        host_fallback: bool = True,
    ) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memplan-offload")
        self.checksum = checksum
        self.host_fallback = host_fallback
        self.table: dict[str, Location] = {}
        self.pending: dict[str, Future] = {}
        self.holding: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.degraded: list[str] = []
        self.bytes_written = 0
        self.bytes_read = 0
        self.keys_written: set[str] = set()  # gradients and states written out since the engine started
        self.storages_written = 0  # saved storages written out (a fresh key each, so counted, not kept)
        self.saved_tensors_hooks: Any = None  # set by `run` while activations are offloaded
        self._cuda_mover: Any = None  # cuda_io.CudaMover, made when the first CUDA tensor moves

    def _cuda(self) -> Any:
        if self._cuda_mover is None:
            self._cuda_mover = _cuda_io().CudaMover()
        return self._cuda_mover

    def _write_cuda(self, key: str, t: torch.Tensor, ready: Any) -> Location:
        """A device tensor out: kvikio straight from device memory, or through a pinned buffer."""
        cuda_io = _cuda_io()
        nbytes = t.numel() * t.element_size()
        crc = None
        try:
            _before_io("write", key)
            if cuda_io.kvikio_available() and not self.checksum:
                path = self.store.path_for(key)
                cuda_io.CudaMover.write_direct(path, t, ready)
            else:
                data = bytes_of(self._cuda().to_host(t, ready))
                crc = zlib.crc32(data) if self.checksum else None
                path = self.store.write(key, data)
        except (OSError, RuntimeError) as exc:  # kvikio reports I/O errors as RuntimeError
            if not self.host_fallback:
                raise OffloadError(f"offloading tensor '{key}' to {self.store.path} failed: {exc}") from None
            staged = self._cuda().to_host(t, ready)
            with self.lock:
                self.degraded.append(f"{key}: {exc}")
            return Location("host", nbytes, host_copy=cuda_io.host_copy(staged),
                            crc32=zlib.crc32(bytes_of(staged)) if self.checksum else None)
        with self.lock:
            self.bytes_written += nbytes
        return Location("ssd", nbytes, path=path, crc32=crc)

    def _load_cuda(self, key: str, loc: Location, out: torch.Tensor, ready: Any) -> None:
        """A device tensor back: kvikio straight into device memory, or through a pinned buffer."""
        cuda_io = _cuda_io()
        host = loc.host_copy if loc.tier == "host" else None
        if loc.tier != "host":
            try:
                _before_io("read", key)
                if loc.crc32 is None and cuda_io.kvikio_available():
                    cuda_io.CudaMover.read_direct(loc.path, out, loc.nbytes, ready)
                else:
                    host = self._cuda().staging_for(loc.nbytes)
                    self.store.read(loc.path, bytes_of(host))
            except (OSError, RuntimeError) as exc:
                raise OffloadError(f"reading tensor '{key}' back from {loc.path} failed: {exc}") from None
            with self.lock:
                self.bytes_read += loc.nbytes
        if host is not None:
            if loc.crc32 is not None and zlib.crc32(bytes_of(host)) != loc.crc32:
                raise OffloadError(f"tensor '{key}' read back from {loc.path} is corrupted (CRC32 mismatch)")
            self._cuda().to_device(host, out, ready)

    def _write(self, key: str, t: torch.Tensor, ready: Any = None) -> Location:
        if t.is_cuda:
            return self._write_cuda(key, t, ready)
        data = bytes_of(t)
        crc = zlib.crc32(data) if self.checksum else None
        try:
            _before_io("write", key)
            path = self.store.write(key, data)
        except OSError as exc:
            if not self.host_fallback:
                raise OffloadError(f"offloading tensor '{key}' to {self.store.path} failed: {exc}") from None
            with self.lock:
                self.degraded.append(f"{key}: {exc}")
            return Location("host", data.nbytes, host_copy=t.detach().clone(), crc32=crc)
        with self.lock:
            self.bytes_written += data.nbytes
        return Location("ssd", data.nbytes, path=path, crc32=crc)

    def offload(self, key: str, t: torch.Tensor) -> Future:
        """Write `t` out in the background; the caller may drop its storage once the future is done.

        The engine holds `t` until the caller's thread calls `reap` or `wait`, so that the
        tensor is freed on that thread, never on a worker: allocations and frees then stay
        on the training thread, where `torch.profiler` records them."""
        self.wait(key)
        ready = None
        if t.is_cuda:  # the copy waits for the kernel that made `t`, on the training thread's stream
            ready = _cuda_io().ready_event()
        future = self.pool.submit(self._write, key, t, ready)
        if key.startswith("act."):
            self.storages_written += 1
        else:
            self.keys_written.add(key)
        self.pending[key] = future
        self.holding[key] = t
        return future

    def reap(self) -> None:
        """Drop the engine's hold on tensors whose writes have completed (on the calling thread)."""
        for key in [k for k, f in self.pending.items() if f.done()]:
            self.wait(key)

    def wait(self, key: str) -> Location | None:
        future = self.pending.pop(key, None)
        if future is not None:
            self.table[key] = future.result()
        self.holding.pop(key, None)
        return self.table.get(key)

    def load_into(self, key: str, out: torch.Tensor, ready: Any = None) -> None:
        """Read tensor `key` back into `out` (at least as many bytes), verifying its checksum."""
        loc = self.wait(key)
        if loc is None:
            raise OffloadError(f"tensor '{key}' was never offloaded")
        out_nbytes = out.numel() * out.element_size()  # may exceed the tensor's: a page-multiple read
        if out_nbytes < loc.nbytes:
            raise OffloadError(f"tensor '{key}' has {loc.nbytes} bytes, more than its destination's {out_nbytes}")
        if out.is_cuda:
            self._load_cuda(key, loc, out, ready)
            return
        view = bytes_of(out)
        if loc.tier == "host":
            view[: loc.nbytes] = bytes_of(loc.host_copy)
        else:
            try:
                _before_io("read", key)
                self.store.read(loc.path, view)
            except OSError as exc:
                raise OffloadError(f"reading tensor '{key}' back from {loc.path} failed: {exc}") from None
            with self.lock:
                self.bytes_read += loc.nbytes
        if loc.crc32 is not None and zlib.crc32(view[: loc.nbytes]) != loc.crc32:
            raise OffloadError(f"tensor '{key}' read back from {loc.path} is corrupted (CRC32 mismatch)")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Autograd on this thread saves tensors as usual inside this block (e.g. for another
        model's step, or evaluation); the activation hooks are back after it. The hooks are a
        thread-local stack: no other `saved_tensors_hooks` may be entered and left open inside."""
        hooks = self.saved_tensors_hooks
        if hooks is None:
            yield
            return
        hooks.__exit__(None, None, None)
        try:
            yield
        finally:
            hooks.__enter__()

    def prefetch_into(self, key: str, out: torch.Tensor) -> Future:
        ready = None
        if out.is_cuda:  # `out`'s block may still be in use by the training stream's earlier kernels
            ready = _cuda_io().ready_event()
        return self.pool.submit(self.load_into, key, out, ready)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.table.clear()
        self.store.close()
