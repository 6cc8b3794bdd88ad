"""The offload runtime: applies offloading to a real PyTorch training loop, with NVMe files.

`run(model, optimizer, plan=None, directory=...)` is a context manager around the
training loop. Inside it:

- saved activations go through `torch.autograd.graph.saved_tensors_hooks`: the storage
  of a saved tensor (at least `min_nbytes`, not a parameter's, a view of one, or a
  buffer's) is written out once when autograd first saves it and read back, ahead of
  need, in backward (`_ActivationOffloader`);
- optimizer states leave after each optimizer step (`register_step_post_hook`) and are
  prefetched, asynchronously, as soon as backward produces the first gradient
  (`register_post_accumulate_grad_hook`); the step waits for them (`register_step_pre_hook`).

The engine follows TERAIO's (arXiv 2506.06472, §4): a tensor location table (key ->
device / host / ssd) and a worker pool doing the I/O. Files are preallocated, written
and read with `os.pwrite`/`os.preadv` at 4 KiB-aligned offsets through O_DIRECT where
the file system allows it, and buffered I/O where it refuses (tmpfs, some overlays).
Everything lives in one directory per process, `memplan-offload-<pid>`, removed on
exit; directories left by a process that died are removed at the next start. An I/O
error or a full disk degrades the tensor to host memory when `host_fallback` allows
it, else raises `OffloadError`; with `checksum=True` a CRC32 of every tensor is
verified on reload, so a corrupted file is an error, never silent.

Assumptions: gradients and states that move are dense, contiguous and not views (the
others stay where they are); on CPU, "device memory" is the process's tensor memory and
a tensor's storage is released with `untyped_storage().resize_(0)`. Under FSDP2 the
sharded parameters, gradients and states are DTensors: their local shards move. CUDA
tensors move through `cuda_io` (imported only when one does): kvikio (GPUDirect Storage)
when it is installed and no checksum is asked for, else a pinned host buffer per I/O thread
and a side CUDA stream; that path has not run here (no GPU on this machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import threading
import weakref
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memplan.errors import UserError
from memplan.units import format_bytes

ALIGN = 4096
_DIR_PREFIX = "memplan-offload-"


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(directory: str | os.PathLike) -> list[str]:
    """Remove offload directories of processes that are no longer running; return what went."""
    removed = []
    root = Path(directory)
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        try:
            pid = int(entry.name[len(_DIR_PREFIX) :])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class FileStore:
    """One preallocated file per tensor key, O_DIRECT where allowed, in a per-process directory.

    O_DIRECT needs page-aligned memory and lengths. A buffer that has both (the states the
    streamed optimizers refill with `_refill_page_aligned`) moves directly; the others
    (tensors are only 64-byte aligned) go through a bounce buffer of `bounce_nbytes` per I/O
    thread, allocated once and reused, a tensor moving in pieces of that size. (A fresh
    `mmap` per transfer costs a page fault per 4 KiB: it held the first version of this store
    to under 0.6 GB/s. The bounce copy itself is ~1 s of CPU per 4 GB moved, taken from
    the compute on a 2-core machine.)
    """

    def __init__(self, directory: str | os.PathLike, *, direct: bool = True, bounce_nbytes: int = 8 << 20) -> None:
        root = Path(directory)
        if not root.is_dir():
            raise UserError(f"offload directory {root} does not exist")
        self.stale_removed = clean_stale(root)
        self.path = root / f"{_DIR_PREFIX}{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.direct_refused = False
        self.bounce_nbytes = max(ALIGN, _aligned(bounce_nbytes))
        self._local = threading.local()

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = mmap.mmap(-1, self.bounce_nbytes)  # page-aligned, as O_DIRECT requires
            self._local.bounce = buf
        return buf

    def _open(self, path: Path, write: bool) -> tuple[int, bool]:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        if self.direct and not self.direct_refused:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError:
                self.direct_refused = True  # this file system refuses O_DIRECT: buffered from now on
        return os.open(path, flags, 0o600), False

    def path_for(self, key: str) -> str:
        return str(self.path / f"{key}.bin")

    def write(self, key: str, data: memoryview) -> str:
        path = Path(self.path_for(key))
        nbytes = data.nbytes
        size = _aligned(nbytes)
        fd, direct = self._open(path, write=True)
        try:
            os.posix_fallocate(fd, 0, size)  # preallocate: a full disk fails here, before any data moves
            if not direct or _page_aligned(data):  # buffered, or O_DIRECT with no bounce copy
                written = os.pwrite(fd, data, 0)
                if written != nbytes:
                    raise OSError(f"short write to {path}: {written} of {nbytes} bytes")
            else:
                buf = self._bounce()
                view = memoryview(buf)
                try:
                    for offset in range(0, nbytes, self.bounce_nbytes):
                        piece = min(self.bounce_nbytes, nbytes - offset)
                        view[:piece] = data[offset : offset + piece]
                        written = os.pwrite(fd, view[: _aligned(piece)], offset)
                        if written != _aligned(piece):
                            raise OSError(f"short write to {path}: {offset + written} of {size} bytes")
                finally:
                    view.release()
        finally:
            os.close(fd)
        return str(path)

    def read(self, path: str, out: memoryview) -> None:
        nbytes = out.nbytes
        fd, direct = self._open(Path(path), write=False)
        try:
            if not direct or _page_aligned(out):  # buffered, or O_DIRECT with no bounce copy
                got = os.preadv(fd, [out], 0)
                if got < nbytes:
                    raise OSError(f"short read from {path}: {got} of {nbytes} bytes")
            else:
                buf = self._bounce()
                view = memoryview(buf)
                try:
                    for offset in range(0, nbytes, self.bounce_nbytes):
                        piece = min(self.bounce_nbytes, nbytes - offset)
                        got = os.preadv(fd, [view[: _aligned(piece)]], offset)
                        if got < piece:
                            raise OSError(f"short read from {path}: {offset + got} of {nbytes} bytes")
                        out[offset : offset + piece] = view[:piece]
                finally:
                    view.release()
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _fresh_bytes(nbytes: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(raw uint8 storage, byte offset) for `nbytes` read back from a file, allocated on the
    calling (training) thread. On CPU the data starts on a page and the storage has room for a
    page-multiple read (up to 2 pages more than `nbytes`): O_DIRECT then moves it with no copy
    through a bounce buffer (the CPU allocator aligns to 64 bytes only). It comes from the same
    allocator, so the profiler and the budget see every byte. On CUDA: plain device storage."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), 0
    raw = torch.empty(_aligned(nbytes) + ALIGN, dtype=torch.uint8)
    return raw, (-raw.data_ptr()) % ALIGN  # a multiple of 64: whole elements of any dtype


def _refill_page_aligned(t: torch.Tensor, nbytes: int) -> None:
    """Give `t`, whose storage was released, fresh storage of `nbytes` (`_fresh_bytes`)."""
    raw, offset_bytes = _fresh_bytes(nbytes, t.device)
    t.set_(raw.untyped_storage(), offset_bytes // t.element_size(), t.shape, t.stride())


def _page_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use this buffer as it is: page-aligned start and length."""
    if view.nbytes == 0 or view.nbytes % ALIGN or view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def _local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2's sharded parameters, their gradients and optimizer
    states: the bytes this rank holds and moves); any other value as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard)."""
    t = _local(t)
    return t.numel() * t.element_size()


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


def _parameter_of(key: str) -> str:
    """The parameter name in a runtime key: `grad.<name>` or `state.<name>.<state key>`."""
    if key.startswith("grad."):
        return key[len("grad."):]
    return key[len("state."):].rpartition(".")[0] if key.startswith("state.") else key


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without going through numpy (which would pin the storage's size)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class OffloadEngine:
    """Asynchronous offload/prefetch of tensors by key, with a location table."""

    def __init__(
        self,
        store: FileStore,
        *,
        workers: int = 2,
        checksum: bool = False,
        host_fallback: bool = True,
        fault: Any = None,
    ) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memplan-offload")
        self.checksum = checksum
        self.host_fallback = host_fallback
        self.fault = fault  # test hook: called as fault(op, key) inside the worker before the I/O
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
        from memplan.offload import cuda_io

        if self._cuda_mover is None:
            self._cuda_mover = cuda_io.CudaMover()
        return self._cuda_mover

    def _write_cuda(self, key: str, t: torch.Tensor, ready: Any) -> Location:
        """A device tensor out: kvikio straight from device memory, or through a pinned buffer."""
        from memplan.offload import cuda_io

        nbytes = t.numel() * t.element_size()
        crc = None
        try:
            if self.fault is not None:
                self.fault("write", key)
            if cuda_io.kvikio_available() and not self.checksum:
                path = self.store.path_for(key)
                cuda_io.CudaMover.write_direct(path, t, ready)
            else:
                data = _bytes_of(self._cuda().to_host(t, ready))
                crc = zlib.crc32(data) if self.checksum else None
                path = self.store.write(key, data)
        except (OSError, RuntimeError) as exc:  # kvikio reports I/O errors as RuntimeError
            if not self.host_fallback:
                raise OffloadError(f"offloading tensor '{key}' to {self.store.path} failed: {exc}") from None
            staged = self._cuda().to_host(t, ready)
            with self.lock:
                self.degraded.append(f"{key}: {exc}")
            return Location("host", nbytes, host_copy=cuda_io.host_copy(staged),
                            crc32=zlib.crc32(_bytes_of(staged)) if self.checksum else None)
        with self.lock:
            self.bytes_written += nbytes
        return Location("ssd", nbytes, path=path, crc32=crc)

    def _load_cuda(self, key: str, loc: Location, out: torch.Tensor, ready: Any) -> None:
        """A device tensor back: kvikio straight into device memory, or through a pinned buffer."""
        from memplan.offload import cuda_io

        host = loc.host_copy if loc.tier == "host" else None
        if loc.tier != "host":
            try:
                if self.fault is not None:
                    self.fault("read", key)
                if loc.crc32 is None and cuda_io.kvikio_available():
                    cuda_io.CudaMover.read_direct(loc.path, out, loc.nbytes, ready)
                else:
                    host = self._cuda().staging_for(loc.nbytes)
                    self.store.read(loc.path, _bytes_of(host))
            except (OSError, RuntimeError) as exc:
                raise OffloadError(f"reading tensor '{key}' back from {loc.path} failed: {exc}") from None
            with self.lock:
                self.bytes_read += loc.nbytes
        if host is not None:
            if loc.crc32 is not None and zlib.crc32(_bytes_of(host)) != loc.crc32:
                raise OffloadError(f"tensor '{key}' read back from {loc.path} is corrupted (CRC32 mismatch)")
            self._cuda().to_device(host, out, ready)

    def _write(self, key: str, t: torch.Tensor, ready: Any = None) -> Location:
        if t.is_cuda:
            return self._write_cuda(key, t, ready)
        data = _bytes_of(t)
        crc = zlib.crc32(data) if self.checksum else None
        try:
            if self.fault is not None:
                self.fault("write", key)
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
            from memplan.offload import cuda_io

            ready = cuda_io.ready_event()
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
        view = _bytes_of(out)
        if loc.tier == "host":
            view[: loc.nbytes] = _bytes_of(loc.host_copy)
        else:
            try:
                if self.fault is not None:
                    self.fault("read", key)
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
            from memplan.offload import cuda_io

            ready = cuda_io.ready_event()
        return self.pool.submit(self.load_into, key, out, ready)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.table.clear()
        self.store.close()


class _StateOffloader:
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
                t = _local(t)
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


class _StreamedOptimizer:
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
        return _moves(key, _local(t), self.moved, self.min_nbytes)

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
            self._send(key, _local(p.grad))

    def _tensors_of(self, p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = self.names.get(id(p), id(p))
        out = [(f"grad.{name}", p.grad)] if p.grad is not None else []
        out += [(f"state.{name}.{k}", t) for k, t in self.optimizer.state.get(p, {}).items()]
        return [(k, _local(t)) for k, t in out if self._big(k, t)]

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
                    _refill_page_aligned(t, nbytes)
                    futures.append(self.engine.prefetch_into(key, t))
        return futures

    def _chunks(self) -> list[tuple[int, list[torch.Tensor]]]:
        chunks: list[tuple[int, list[torch.Tensor]]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            current: list[torch.Tensor] = []
            nbytes = 0
            for p in group["params"]:
                current.append(p)
                nbytes += 3 * _nbytes(p)  # gradient + two moments
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


class _StepInBackward(_StreamedOptimizer):
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
        for p in sorted(self.order, key=lambda q: -_nbytes(q)):  # stable: backward's order on ties
            state_nbytes = 2 * _nbytes(p)
            if kept_nbytes + state_nbytes <= resident_nbytes:
                self.kept.add(id(p))
                kept_nbytes += state_nbytes
        self.updated: set[int] = set()
        self.fetching: dict[int, tuple[torch.Tensor, list[Future]]] = {}
        self.cursor = 0

    def _prefetch_ahead(self, limit_nbytes: int | None = None) -> None:
        limit_nbytes = self.chunk_nbytes if limit_nbytes is None else limit_nbytes
        ahead = sum(2 * _nbytes(p) for p, _ in self.fetching.values())
        while self.cursor < len(self.order) and ahead < limit_nbytes:
            p = self.order[self.cursor]
            self.cursor += 1
            if id(p) in self.updated:
                continue
            futures = self._fetch([p])
            if futures:
                self.fetching[id(p)] = (p, futures)
                ahead += 2 * _nbytes(p)

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


class _ActivationOffloader:
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
        self.kept = {_local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
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
        entry.raw, entry.offset = _fresh_bytes(entry.nbytes, entry.device)
        size = entry.nbytes if entry.device.type == "cuda" else _aligned(entry.nbytes)  # a page-multiple read
        return self.engine.prefetch_into(entry.key, entry.raw[entry.offset : entry.offset + size]) if size else None

    def _read_ahead(self) -> None:
        loaded = sum(self.ahead.values())
        while self.cursor >= 0 and loaded < self.prefetch_nbytes:
            entry = self.stack[self.cursor]
            self.cursor -= 1
            if entry.raw is None and entry.refs > 0:
                entry.future = self._read(entry)
                self.ahead[entry.key] = _aligned(entry.nbytes)
                loaded += _aligned(entry.nbytes)

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


@contextlib.contextmanager
def run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Any = None,
    *,
    directory: str | os.PathLike,
    activations: bool = True,
    optimizer_states: bool = True,
    min_nbytes: int = 1 << 20,
    checksum: bool = False,
    host_fallback: bool = True,
    direct: bool = True,
    workers: int = 2,
    fault: Any = None,
    streamed_step: bool = False,
    step_in_backward: bool = False,
    chunk_nbytes: int = 64 << 20,
    resident_nbytes: int = 0,
    forward_prefetch_nbytes: int | None = None,
) -> Iterator[OffloadEngine]:
    """Offload activations and optimizer states of `model`'s training to files under `directory`.

    `plan` (an `OffloadPlan` of a trace `memplan.capture` recorded of this very step) decides
    what moves: the optimizer states (and, with `streamed_step`, gradients) it offloads, by
    name, read back in the plan's order, and the saved storages it offloads, by their order
    in the forward (`memplan.offload.schedule`); the rest stays. A plan that moves what this
    mode does not (parameters; gradients without `streamed_step`) is refused: plan with
    `categories=runtime_categories(streamed_step=...)`. The runtime's own timing
    applies: out after last use, back ahead of next use. With None, every activation and
    optimizer state of at least `min_nbytes` moves. With `streamed_step`, gradients
    move too and the optimizer step streams states chunk by chunk (`_StreamedOptimizer`):
    the device then never holds every gradient and state at once. With `step_in_backward`,
    each parameter's update runs in backward as soon as its gradient is ready
    (`_StepInBackward`): gradients never leave and the update overlaps backward; it needs one
    backward per optimizer step; `resident_nbytes` of states then stay, and
    `forward_prefetch_nbytes` of states are read during the forward (see `_StepInBackward`).
    Yields the engine (its
    location table, bytes moved and degraded tensors are there to inspect).
    """
    moved: dict[str, int] | None = None
    saved: tuple[list[int], list[bool]] | None = None
    if plan is not None:
        schedule = plan.tensors
        if schedule.empty and plan.transfers:
            raise OffloadError("this plan names no tensors of a live model (it was made from a modelled trace, or one "
                               "captured without names): capture the training step with memplan.capture and plan "
                               "that trace")
        if resident_nbytes:
            raise OffloadError("a plan decides which optimizer states stay: give either plan or resident_nbytes")
        if schedule.unnamed:
            what = ", ".join(f"{format_bytes(n)} of {c}s" for c, n in sorted(schedule.unnamed.items()))
            raise OffloadError(f"the plan moves tensors the runtime does not move ({what}): plan with "
                               f"categories=memplan.offload.runtime_categories(streamed_step={streamed_step})")
        if not streamed_step and any(k.startswith("grad.") for k in schedule.moved):
            raise OffloadError("the plan moves gradients, which only streamed_step=True moves: run with it, or plan "
                               "with categories=memplan.offload.runtime_categories()")
        moved = schedule.moved
        params = {name for name, _ in model.named_parameters()}
        unknown = [k for k in moved if _parameter_of(k) not in params]
        if unknown:
            raise OffloadError(f"the plan moves {len(unknown)} tensor(s) of parameters this model does not have "
                               f"(e.g. {unknown[0]}): it was made for another model; capture and plan this very step")
        saved = (schedule.saved_nbytes, schedule.saved_moved)
        activations = activations and any(schedule.saved_moved)
        optimizer_states = optimizer_states and bool(moved)
    engine = OffloadEngine(FileStore(directory, direct=direct), workers=workers, checksum=checksum,
                           host_fallback=host_fallback, fault=fault)
    states: Any = None
    if optimizer_states and step_in_backward:
        states = _StepInBackward(engine, model, optimizer, min_nbytes, chunk_nbytes, resident_nbytes,
                                 forward_prefetch_nbytes, moved)
    elif optimizer_states and streamed_step:
        states = _StreamedOptimizer(engine, model, optimizer, min_nbytes, chunk_nbytes, moved)
    elif optimizer_states:
        states = _StateOffloader(engine, model, optimizer, min_nbytes, False, moved)
    acts = (_ActivationOffloader(engine, model, min_nbytes, chunk_nbytes, chunk_nbytes, saved)
            if activations else None)
    try:
        with acts.hooks if acts is not None else contextlib.nullcontext():
            engine.saved_tensors_hooks = acts.hooks if acts is not None else None
            yield engine
    finally:
        engine.saved_tensors_hooks = None
        try:
            if states is not None:
                states.restore()
                states.remove()
        finally:
            engine.close()
