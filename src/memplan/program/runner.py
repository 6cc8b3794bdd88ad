"""One rank of the user's program, run in memplan's process and traced.

`run_rank(launch, rank, options)` runs the program as its launcher would start rank `rank`
(`runpy`, `sys.argv` and the launcher's environment; the script's folder first on
`sys.path`; the working directory unchanged), inside the device world
(memplan.program.world) with the CUDA facade for a `cuda` run (memplan.program.cuda_api),
fake weights and checkpoints (memplan.program.fakes), no reporting and no writes outside
`OUT` (memplan.program.side_effects), and, for a distributed launch, the fake process
group (memplan.program.distributed); the program's `torch.compile` is compiled with
Inductor on the fake tensors and its generated code recorded as it runs
(memplan.capture.compiled, `compiled_outside_mode` in memplan.program.world).
`StepWindow` (memplan.program.steps) opens the trace at the program's first top-level
forward and stops the program after `steps + 1` optimizer steps (the first, which makes
the optimizer state, and `steps` more).

What it returns (`RankRun`): the trace of every iteration run (one `.memtrace`), how the
program ended, and what memplan saw it do (memplan.program.seen). Everything it changed is
put back when the rank ends, whatever the program did; the modules of the program's own
folder are unloaded, so the next rank imports them afresh.

A program that raises on its own ends the run with `ProgramFailed` (its exception and the
traceback of its own frames); a read the policy refuses (memplan.program.reads) with
`ProgramRefused` (a `UserError`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memplan.capture import LiveCapture, inductor_runs
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.errors import UserError
from memplan.hardware.devices import DeviceProfile
from memplan.models import tracing
from memplan.program import cuda_api, deepspeed_engine, distributed, fakes, side_effects
from memplan.program.launchers import Launch, run_launched
from memplan.program.patches import Patches
from memplan.program.reads import ReadRefused
from memplan.program.recording import ProgramRecorder
from memplan.program.seen import Seen
from memplan.program.side_effects import ProcessStartRefused
from memplan.program.steps import Call, ProgramStop, ProgramTimeout, StepWindow
from memplan.program.world import (
    DeviceRedirect,
    World,
    compiled_outside_mode,
    redirect_in_backward,
    redirect_in_saved_tensor_hooks,
)
from memplan.trace.model import Trace


class ProgramFailed(Exception):
    """The program raised an exception of its own (not memplan's stop)."""

    def __init__(self, message: str, program_traceback: str) -> None:
        super().__init__(message)
        self.program_traceback = program_traceback


class ProgramRefused(UserError):
    """The program did something memplan cannot run on fake tensors (memplan.program.reads)."""


@dataclass(frozen=True)
class RunOptions:
    """How a program is run: the device it is run for, its profile, the steps, the limits."""

    device: str = "cuda"
    profile: DeviceProfile | None = None
    steps: int = 2  # optimizer steps after the first
    max_seconds: float | None = 600.0
    out_dir: Path = Path("memplan-run")


@dataclass
class RankRun:
    """One rank's run: its trace, how it ended, what was seen."""

    rank: int
    trace: Trace | None
    steps: int  # optimizer steps the program took
    ended: str  # "stopped" (after the steps asked for) or "ended" (the program returned first)
    elapsed_s: float
    seen: Seen
    facts: dict[str, Any]  # `seen.describe()`: what memplan saw, for the report
    reads: dict[str, int] = field(default_factory=dict)
    skipped_writes: list[str] = field(default_factory=list)
    redirected_writes: dict[str, str] = field(default_factory=dict)
    attention: dict[str, Any] | None = None
    process_groups: int = 0  # process groups of more than one rank the program made


class _Trace:
    """The recording of one rank, driven by the step window's events."""

    def __init__(self, world: World, seen: Seen) -> None:
        self.world = world
        self.seen = seen
        self.recorder: ProgramRecorder | None = None
        self.live: LiveCapture | None = None

    def open(self, call: Call) -> None:
        module, args, kwargs = call
        self.recorder = ProgramRecorder(self.world)
        self.live = LiveCapture([module], [], recorder=self.recorder)
        self.live.begin(inputs=(args, kwargs))

    def call(self, call: Call) -> None:
        module, args, kwargs = call
        self.seen.note_call(module, args, kwargs)
        if self.recorder is not None:
            for t in (x for x in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)):
                self.recorder.mark(t, "input")

    def step(self, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
        self.seen.note_step(optimizers, in_backward=self.world.window.step_in_backward)
        if self.recorder is not None:
            self.recorder.iteration = steps
            self.recorder.reset_phase()

    def finish(self, meta: dict[str, Any]) -> Trace | None:
        if self.live is None or not self.live.recording:
            return None
        return self.live.end(meta=meta)

    def abandon(self) -> None:
        if self.live is not None:
            self.live.abandon()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _program_argv(launch: Launch, rank: int) -> Iterator[Path]:
    """`sys.argv` (rank `rank`'s arguments) and `sys.path` as `python SCRIPT ARGS` sets them
    (and the launcher's `path_after`); the program's folder."""
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    before = set(sys.modules)
    if not (launch.module or launch.entry) and not Path(launch.target).is_file():
        raise UserError(f"the program's script {launch.target} does not exist (relative to {Path.cwd()})")
    folder = launch.folder
    sys.argv = [launch.target, *launch.rank_args(rank)]
    if launch.path_entry is not None:
        sys.path.insert(0, launch.path_entry)
    sys.path.extend(launch.path_after)
    try:
        yield folder
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - before:
            path = getattr(sys.modules.get(name), "__file__", None) or ""
            if path.startswith(str(folder)) and "site-packages" not in path:
                sys.modules.pop(name, None)


def _visible_rng_state(world: World, patches: Patches) -> None:
    """`torch.get_rng_state()` (what `torch.utils.checkpoint` saves per checkpointed call)
    made by an op the recorder sees: the CPU generator's state is made in C++, outside the
    dispatcher. It is host memory in a cuda job."""
    get_state = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = get_state()
        with torch._C.DisableTorchFunction():
            out = torch.empty(state.shape, dtype=state.dtype)
        with _disable_current_modes():
            out.copy_(state)
        if world.cuda:
            tracing.mark_host(out, "pageable")
        return out

    patches.set(torch, "get_rng_state", get_rng_state)


def _install(world: World, redirect: DeviceRedirect, patches: Patches, launch: Launch, rank: int,
             options: RunOptions, writes: Any) -> list:
    """Every replacement of the run (module docstring); the hook handles to remove."""
    redirect_in_backward(redirect, patches)
    redirect_in_saved_tensor_hooks(redirect, patches)
    compiled_outside_mode(redirect, patches)
    fakes.patch_checkpoints(world, patches)
    fakes.patch_meta_unpickling(world, patches)
    fakes.patch_params4bit(world, patches)
    fakes.swappable_fakes(patches)
    side_effects.skip_checkpoints(patches, writes)
    side_effects.redirect_writes(patches, writes)
    side_effects.no_reporting(patches)
    side_effects.no_process_starts(patches)
    cuda_api.count_fakes_as_tensors(patches)
    _visible_rng_state(world, patches)
    if world.cuda:
        if options.profile is None:
            raise UserError("a cuda run needs a device profile (--gpu NAME)")
        cuda_api.install(world, patches, options.profile, device_count=cuda_api.visible_device_count(launch.nproc_per_node),
                         local_rank=rank % launch.nproc_per_node)
    if launch.distributed:
        distributed.install(world, patches, rank=rank, world_size=launch.world_size)
    deepspeed_engine.install(world, patches)
    return fakes.module_hooks(world)


def run_rank(launch: Launch, rank: int, options: RunOptions) -> RankRun:
    """Run rank `rank` of the program and trace it (module docstring)."""
    start = time.perf_counter()
    env = {**launch.rank_env(rank), **side_effects.REPORTING_ENV, **fakes.FAKE_ENV}
    with _environment(env), _program_argv(launch, rank) as folder:
        world = World(options.device, folder)
        seen = Seen(world)
        recording = _Trace(world, seen)
        window = StepWindow(options.steps + 1, on_open=recording.open, on_call=recording.call,
                            on_step=recording.step, on_return=seen.note_output, on_first_child=seen.note_autocast,
                            max_seconds=options.max_seconds)
        world.window = window
        writes = side_effects.WriteLog(Path(options.out_dir))
        patches, handles = Patches(), []
        ended = "ended"
        try:
            redirect = DeviceRedirect(world)
            handles = _install(world, redirect, patches, launch, rank, options, writes)
            window.install()
            with kernels_as_on_cuda() if world.cuda else contextlib.nullcontext(), inductor_runs(fake=True, gpu=world.cuda, fake_mode=world.fake_mode), redirect, \
                    _compiler_stance_kept():
                ended = _execute(launch)
            facts = seen.describe()  # while the process group the program made is there
        except BaseException:
            recording.abandon()
            raise
        finally:
            window.remove()
            for handle in handles:
                handle.remove()
            groups = distributed.teardown() if launch.distributed else 0
            patches.restore()
        meta = {**seen.meta(), "rank": rank, "world_size": launch.world_size, "device": options.device,
                "program": " ".join([launch.launcher, launch.target, *launch.args]), "steps": window.steps,
                "torch_version": str(torch.__version__), "fake": True}
        if recording.recorder is not None and recording.recorder.attention is not None:
            meta["attention"] = recording.recorder.attention
        trace = recording.finish(meta)
    return RankRun(rank, trace, window.steps, ended, time.perf_counter() - start, seen, facts, dict(world.reads.answered),
                   list(writes.skipped), dict(writes.redirected),
                   recording.recorder.attention if recording.recorder is not None else None, groups)


@contextlib.contextmanager
def _compiler_stance_kept() -> Iterator[None]:
    """The process's `torch.compiler` stance as it was before the program, after it: a
    program's `torch.compiler.set_stance(...)` (torch/_dynamo/eval_frame.py, `_set_stance`)
    is its own, not the next run's in the same process."""
    from torch._dynamo import eval_frame

    before = eval_frame._stance
    try:
        yield
    finally:
        eval_frame._set_stance(before)


def _execute(launch: Launch) -> str:
    """Run the program; "stopped" when memplan stopped it, "ended" when it returned."""
    try:
        run_launched(launch)
    except BaseException as raised:  # noqa: B036 - sorted below: memplan's own, the program's exit, its error
        exc = _raised_by_memplan(raised)
        if isinstance(exc, ProgramStop):
            return "stopped"
        if isinstance(exc, (ReadRefused, ProgramTimeout, ProcessStartRefused)):
            raise ProgramRefused(str(exc)) from None
        if isinstance(exc, SystemExit):
            if exc.code not in (None, 0):
                raise ProgramFailed(f"the program exited with status {exc.code}", "") from None
            return "ended"
        if isinstance(exc, (UserError, KeyboardInterrupt)) or not isinstance(exc, Exception):
            raise
        raise ProgramFailed(f"the program raised {type(exc).__name__}: {exc}", _program_traceback(exc)) from None
    return "ended"


def _raised_by_memplan(exc: BaseException) -> BaseException:
    """The stop, refusal or timeout memplan raised through the program that `exc` was raised
    while handling, else `exc`: a framework that cleans up on any exception (Lightning's
    `_call_and_handle_interrupt` tears the trainer down, moving the model to the CPU) may fail
    in its cleanup of fake tensors, after the steps were traced."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ProgramStop, ReadRefused, ProgramTimeout, ProcessStartRefused)):
            return seen
        seen = seen.__context__
    return exc


_MEMPLAN_DIR = str(Path(__file__).resolve().parents[1])


def _program_traceback(exc: BaseException) -> str:
    """The traceback of `exc` without memplan's frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_MEMPLAN_DIR)
              and "runpy" not in f.filename]
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(exc), exc))
