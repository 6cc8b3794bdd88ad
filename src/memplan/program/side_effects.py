"""What a program run must not do: report over the network, or write where the program writes.

- **Reporting.** The environment of the run turns the reporting libraries off and the
  Hugging Face libraries offline (`REPORTING_ENV`: wandb's `WANDB_MODE=disabled`,
  `HF_HUB_OFFLINE=1`, ...); `TrainingArguments.report_to` is emptied after the program's own
  arguments are parsed (transformers/training_args.py, `__post_init__`), so `Trainer`
  starts no integration.
- **Checkpoints.** `torch.save` of anything that holds a fake tensor, and the safetensors
  writers (`save_file`, `save`), write nothing: a file of fake tensors is no checkpoint.
  Each skipped write is listed.
- **Processes.** A program that would start its own training processes is refused
  (`ProcessStartRefused`): Lightning's launchers for several devices under a plain `python`
  (`_SubprocessScriptLauncher` runs the script again per local rank, `_MultiProcessingLauncher`
  spawns; lightning/fabric/strategies/launchers/ and lightning/pytorch/strategies/launchers/,
  Lightning 2.6): the ranks memplan runs are those of the launcher it reads (torchrun's, with
  which Lightning starts none: its `TorchElasticEnvironment` creates processes externally).
- **Files.** Every file the program opens for writing (`open` with `w`, `a`, `x` or `+`, its
  name a `str`, a path or `bytes` as tensorboard's event writer gives it;
  `os.makedirs`/`os.mkdir` for its folders) goes under `OUT/files/` at the same path (an
  absolute path `/a/b` becomes `OUT/files/a/b`), and the program's reads of a file it wrote
  read that copy, as do its looks at a path that exists only there (`os.stat`, `os.lstat`,
  `os.listdir`, `os.scandir`, and so `os.path.exists`, `Path.is_dir`: pathlib's
  `mkdir(parents=True, exist_ok=True)` asks `is_dir()` of the folder it was refused to
  make again, torchtune's checkpointer makes its output folder so); the caches
  (`~/.cache`, Inductor's `torchinductor_USER` in the temporary folder, the folders of
  `CACHE_ENV`), `OUT` itself and `/dev` are written where they are (files opened by
  descriptor, as `tempfile`'s, too), as are the folders `tempfile.mkdtemp` makes (and so
  `TemporaryDirectory`) and what is written in them: scratch space, which no earlier file is
  in and which another process may be given (multiprocessing's `pymp-*` folder, whose socket
  a `DataLoader`'s workers send their batches through; a compiler run as a subprocess with it
  as its working directory, Inductor's C++ builds, torch/_inductor/cpp_builder.py,
  `run_compile_cmd`).
"""

from __future__ import annotations

import builtins
import getpass
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from memplan.program.patches import Patches

REPORTING_ENV = {
    "WANDB_MODE": "disabled", "WANDB_DISABLED": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE", "COMET_MODE": "DISABLED",
    "NEPTUNE_MODE": "debug", "CLEARML_OFFLINE_MODE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
}


CACHE_ENV = ("HF_HOME", "XDG_CACHE_HOME", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
             "TORCH_EXTENSIONS_DIR")


class WriteLog:
    """What the program tried to write, and where it went."""

    def __init__(self, out_dir: Path) -> None:
        self.files_dir = out_dir / "files"
        self.out_dir = out_dir
        self.skipped: list[str] = []  # checkpoints of fake tensors, not written
        self.redirected: dict[str, str] = {}  # the program's path -> where it was written
        self.scratch: list[Path] = []  # folders `tempfile.mkdtemp` made, where they are
        self.making_scratch = False  # inside `tempfile.mkdtemp`

    def keep_in_place(self, path: Path) -> bool:
        if self.making_scratch:
            return True
        roots = [Path("/dev"), Path("/proc"), Path("/sys"), Path.home() / ".cache", self.out_dir,
                 Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}", *self.scratch]
        roots += [Path(os.environ[k]) for k in CACHE_ENV if os.environ.get(k)]
        resolved = path.resolve()
        return any(resolved == root.resolve() or root.resolve() in resolved.parents for root in roots)

    def target(self, path: Any) -> Any:
        """Where a write to `path` goes (module docstring); a `bytes` path gives a `bytes` one."""
        if not _is_path(path):
            return path
        absolute = Path(os.path.abspath(os.fsdecode(path)))
        if self.keep_in_place(absolute):
            return path
        redirected = self.files_dir / absolute.relative_to(absolute.anchor)
        self.redirected[str(absolute)] = str(redirected)
        return os.fsencode(redirected) if isinstance(path, bytes) else str(redirected)

    def source(self, path: Any) -> Any:
        """Where a read of `path` reads: the copy the program wrote, if it wrote one; the copy
        under `OUT/files/` of a path that exists only there. A folder that exists where it is
        (`/tmp`, made again by `mkdir(parents=True)`) is read where it is."""
        if not self.redirected or not _is_path(path):
            return path
        absolute = os.path.abspath(os.fsdecode(path))
        copy = self.redirected.get(absolute) or str(self.files_dir / Path(absolute).relative_to(Path(absolute).anchor))
        if not _lexists(copy):
            return path
        if _lexists(absolute) and (absolute not in self.redirected or _is_dir(absolute)):
            return path
        return os.fsencode(copy) if isinstance(path, bytes) else copy


def _is_path(path: Any) -> bool:
    """A file name (`str`, `bytes` or path-like; tensorboard's writer opens `bytes` names), not a
    descriptor."""
    return isinstance(path, (str, bytes, os.PathLike))


_LSTAT = os.lstat  # the original: `redirect_writes` replaces `os.lstat` by one that calls `WriteLog.source`


def _lexists(path: Any) -> bool:
    try:
        _LSTAT(path)
    except (OSError, ValueError):
        return False
    return True


def _is_dir(path: str) -> bool:
    return stat.S_ISDIR(_LSTAT(path).st_mode)


def _writes(mode: str) -> bool:
    return any(c in mode for c in "wax+")


def redirect_writes(patches: Patches, log: WriteLog) -> None:
    """The program's file writes go under `OUT/files/` (module docstring)."""
    original_open, makedirs, mkdir, mkdtemp = builtins.open, os.makedirs, os.mkdir, tempfile.mkdtemp

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if _writes(mode):
            file = log.target(file)
            if isinstance(file, (str, bytes)):
                makedirs(os.path.dirname(file) or ".", exist_ok=True)
        else:
            file = log.source(file)
        return original_open(file, mode, *args, **kwargs)

    def makedirs_(name: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        makedirs(log.target(name), mode, exist_ok)

    def mkdir_(path: Any, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
        target = log.target(path)
        if target is not path and os.path.isdir(os.path.dirname(os.path.abspath(os.fspath(path)))):
            makedirs(os.path.dirname(target), exist_ok=True)  # the copy's folders of the folders that exist
        mkdir(target, mode, *args, **kwargs)

    def mkdtemp_(*args: Any, **kwargs: Any) -> Any:
        log.making_scratch = True
        try:
            folder = mkdtemp(*args, **kwargs)
        finally:
            log.making_scratch = False
        log.scratch.append(Path(os.fspath(folder)).resolve())
        return folder

    patches.set(tempfile, "mkdtemp", mkdtemp_)
    patches.set(builtins, "open", open_)
    patches.set(io, "open", open_)
    patches.set(os, "makedirs", makedirs_)
    patches.set(os, "mkdir", mkdir_)
    for name in ("stat", "lstat", "listdir", "scandir"):
        patches.set(os, name, _reading_copies(getattr(os, name), log))


def _reading_copies(look: Any, log: WriteLog) -> Any:
    """`look` (`os.stat`, ...) of the copy the program wrote, where it wrote one (`WriteLog.source`)."""

    def look_(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
        return look(log.source(path), *args, **kwargs)

    return look_


def skip_checkpoints(patches: Patches, log: WriteLog) -> None:
    """No file of fake tensors is written (module docstring)."""
    import safetensors.torch

    save = torch.save

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if any(isinstance(t, torch.Tensor) and is_fake(t) for t in tree_flatten(obj)[0]) or _holds_fake(obj):
            log.skipped.append(f"torch.save -> {f if isinstance(f, (str, os.PathLike)) else type(f).__name__}")
            return None
        return save(obj, f, *args, **kwargs)

    def save_file(_tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
        log.skipped.append(f"safetensors.save_file -> {filename}")

    def save_bytes(_tensors: Any, *args: Any, **kwargs: Any) -> bytes:
        log.skipped.append("safetensors.save")
        return b""

    patches.set(torch, "save", torch_save)
    patches.everywhere(safetensors.torch.save_file, save_file, ("safetensors", "transformers", "accelerate",
                                                                 "peft", "huggingface_hub"))
    patches.set(safetensors.torch, "save", save_bytes)


def _holds_fake(obj: Any) -> bool:
    """A module or optimizer (what `torch.save(model)` takes) with a fake tensor."""
    if isinstance(obj, torch.nn.Module):
        return any(is_fake(t) for t in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(is_fake(p) for group in obj.param_groups for p in group["params"])
    return False


class ProcessStartRefused(BaseException):  # noqa: N818 - raised through the program, like memplan's stop
    """The program would start its own training processes (module docstring)."""


def no_process_starts(patches: Patches) -> None:
    """Lightning's own process launchers refuse to start (module docstring)."""
    def refuse(launcher: Any, *_args: Any, **_kwargs: Any) -> None:
        strategy = getattr(launcher, "_strategy", None)  # the Fabric launcher's count is its strategy's
        n = getattr(launcher, "num_processes", None) or getattr(strategy, "num_processes", None)
        raise ProcessStartRefused(
            f"Lightning would start its {n or 'several'} processes itself ({type(launcher).__name__}): memplan "
            f"runs the ranks of the launcher on its command line; run it as `torchrun --nproc-per-node {n or 'N'} "
            "SCRIPT ...` (Lightning then starts none)")

    for package in ("lightning.fabric", "lightning.pytorch"):
        for module_name, cls, method in (("subprocess_script", "_SubprocessScriptLauncher", "_call_children_scripts"),
                                          ("multiprocessing", "_MultiProcessingLauncher", "launch")):
            patches.on_import(f"{package}.strategies.launchers.{module_name}",
                              lambda module, cls=cls, method=method: patches.set(getattr(module, cls), method, refuse))


def no_reporting(patches: Patches) -> None:
    """`TrainingArguments.report_to` emptied after the program's arguments are parsed."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return
    post_init = TrainingArguments.__post_init__

    def post_init_without_reporting(self: Any) -> None:
        post_init(self)
        self.report_to = []

    patches.set(TrainingArguments, "__post_init__", post_init_without_reporting)
