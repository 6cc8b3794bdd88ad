"""Files for offloaded tensors: one preallocated file per key, O_DIRECT where allowed, aligned buffers.

Files are preallocated (`posix_fallocate`), written and read with `os.pwrite`/`os.preadv` at
4 KiB-aligned offsets through O_DIRECT where the file system allows it (open(2), O_DIRECT:
page-aligned buffers, offsets and lengths), and buffered I/O where it refuses (tmpfs, some
overlays). Everything lives in one directory per process, `memplan-offload-<pid>`, removed
on exit; directories left by a process that died are removed at the next start.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import threading
from pathlib import Path

import torch

from memplan.errors import UserError

ALIGN = 4096
DIR_PREFIX = "memplan-offload-"


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
        if not entry.name.startswith(DIR_PREFIX):
            continue
        try:
            pid = int(entry.name[len(DIR_PREFIX) :])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def aligned_nbytes(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of pages (`ALIGN`)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class FileStore:
    """One preallocated file per tensor key, O_DIRECT where allowed, in a per-process directory.

    O_DIRECT needs page-aligned memory and lengths. A buffer that has both (the states the
    streamed optimizers refill with `refill_page_aligned`) moves directly; the others
    (tensors are only 64-byte aligned) go through a bounce buffer of `bounce_nbytes` per I/O
    thread, allocated once and reused, a tensor moving in pieces of that size (a fresh
    `mmap` per transfer would fault in every page; docs/offload.md has the measured costs).
    """

    def __init__(self, directory: str | os.PathLike, *, direct: bool = True, bounce_nbytes: int = 8 << 20) -> None:
        root = Path(directory)
        if not root.is_dir():
            raise UserError(f"offload directory {root} does not exist")
        self.stale_removed = clean_stale(root)
        self.path = root / f"{DIR_PREFIX}{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.direct_refused = False
        self.bounce_nbytes = max(ALIGN, aligned_nbytes(bounce_nbytes))
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
        size = aligned_nbytes(nbytes)
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
                        written = os.pwrite(fd, view[: aligned_nbytes(piece)], offset)
                        if written != aligned_nbytes(piece):
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
                        got = os.preadv(fd, [view[: aligned_nbytes(piece)]], offset)
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


def fresh_bytes(nbytes: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(raw uint8 storage, byte offset) for `nbytes` read back from a file, allocated on the
    calling (training) thread. On CPU the data starts on a page and the storage has room for a
    page-multiple read (up to 2 pages more than `nbytes`): O_DIRECT then moves it with no copy
    through a bounce buffer (the CPU allocator aligns to 64 bytes only). It comes from the same
    allocator, so the profiler and the budget see every byte. On CUDA: plain device storage."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), 0
    raw = torch.empty(aligned_nbytes(nbytes) + ALIGN, dtype=torch.uint8)
    return raw, (-raw.data_ptr()) % ALIGN  # a multiple of 64: whole elements of any dtype


def refill_page_aligned(t: torch.Tensor, nbytes: int) -> None:
    """Give `t`, whose storage was released, fresh storage of `nbytes` (`fresh_bytes`)."""
    raw, offset_bytes = fresh_bytes(nbytes, t.device)
    t.set_(raw.untyped_storage(), offset_bytes // t.element_size(), t.shape, t.stride())


def _page_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use this buffer as it is: page-aligned start and length."""
    if view.nbytes == 0 or view.nbytes % ALIGN or view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without going through numpy (which would pin the storage's size)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
