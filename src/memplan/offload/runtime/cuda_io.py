"""CUDA tensors in the offload engine: pinned host staging on a side stream, or kvikio.

Imported by `engine.py` only when a CUDA tensor reaches the engine, so a process that moves
only CPU tensors never loads it (nor kvikio). Two ways to move a device tensor's bytes:

- **kvikio** (GPUDirect Storage through cuFile, `pip install kvikio-cu12`; without GDS
  kvikio itself falls back to POSIX I/O, its "compatibility mode", `KVIKIO_COMPAT_MODE` in
  kvikio's runtime settings): the file is read into and written
  from device memory directly. Used when kvikio imports and no checksum is asked for (a
  CRC32 needs the bytes on the host).
- **Pinned staging**: each I/O thread owns one pinned host buffer (grown to the largest
  tensor it moved, reused after); the device-to-host copy runs on a side CUDA stream after
  an event recorded on the training thread's stream when the tensor was handed over (its
  producer has finished), and the thread waits for the copy before the file write. Reads
  go the other way: file -> pinned buffer -> side-stream copy into the destination, waited
  for before the future completes, so the training thread may use the tensor as soon as it
  has the result.

The training thread allocates and frees every device tensor; the I/O threads only copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

try:  # GPUDirect Storage; optional
    import kvikio  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    kvikio = None


def kvikio_available() -> bool:
    return kvikio is not None


def ready_event() -> torch.cuda.Event:
    """An event on the calling (training) thread's current stream: the tensor's producer is done when it fires."""
    event = torch.cuda.Event()
    event.record()
    return event


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (contiguous tensors only)."""
    return t.detach().reshape(-1).view(torch.uint8)


class CudaMover:
    """A side stream and per-thread pinned buffers for one process's device transfers."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "pinned", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._local.pinned = buf
        return buf[:nbytes]

    def to_host(self, t: torch.Tensor, ready: torch.cuda.Event | None) -> torch.Tensor:
        """`t`'s bytes in this thread's pinned buffer (valid until this thread's next transfer)."""
        src = _flat_bytes(t)
        host = self._staging(src.numel())
        stream = self._stream(t.device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            host.copy_(src, non_blocking=True)
        stream.synchronize()
        return host

    def staging_for(self, nbytes: int) -> torch.Tensor:
        """This thread's pinned buffer, `nbytes` long, for a read from a file."""
        return self._staging(nbytes)

    def to_device(self, host: torch.Tensor, out: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Copy `host`'s bytes into `out` (a device tensor) and wait for the copy. `ready`: recorded
        when `out` was allocated on the training thread (its block's previous tenant is done)."""
        stream = self._stream(out.device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            _flat_bytes(out)[: host.numel()].copy_(host, non_blocking=True)
        stream.synchronize()

    @staticmethod
    def write_direct(path: str, t: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """GPUDirect Storage: device memory straight to the file (kvikio)."""
        if ready is not None:
            ready.synchronize()
        with kvikio.CuFile(path, "w") as f:
            f.pwrite(_flat_bytes(t)).get()

    @staticmethod
    def read_direct(path: str, out: torch.Tensor, nbytes: int, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()
        with kvikio.CuFile(path, "r") as f:
            got = f.pread(_flat_bytes(out)[:nbytes]).get()
        if got != nbytes:
            raise OSError(f"short read from {path}: {got} of {nbytes} bytes")


def host_copy(t: Any) -> torch.Tensor:
    """A pageable host copy of staged bytes (the host-memory fallback keeps it)."""
    return t.detach().to("cpu", copy=True)
