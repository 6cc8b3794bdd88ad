"""A torch.compile'd training step as the dispatch-level `Recorder` sees it.

What torch.compile changes in memory is decided by two parts of PyTorch, and both run
here as they are, on real or on fake tensors:

- AOTAutograd traces forward and backward as one joint graph and splits it with the
  min-cut partitioner (`torch/_functorch/partitioners.py`,
  `min_cut_rematerialization_partition`, Inductor's default for training in
  `torch/_inductor/compile_fx.py`): what the backward graph takes from the forward graph
  is what autograd keeps between them; cheap ops are recomputed in backward instead of
  saved;
- Inductor lowers each graph, fuses ops into kernels (a buffer used only inside one
  kernel is never allocated: `Kernel.remove_kernel_local_buffers` in
  `torch/_inductor/codegen/common.py`), orders the kernels for a lower peak
  (`torch/_inductor/memory.py`, `reorder_for_peak_memory`), and writes a wrapper
  (`torch/_inductor/codegen/wrapper.py`) that allocates every other buffer with
  `empty_strided_*`, re-uses a dead buffer of the same size for a new one
  (`PythonWrapperCodegen.memory_plan_reuse`) and `del`s each after its last use.

Two things stand between that wrapper and the recorder:

1. Dynamo does not compile while a non-infra `TorchDispatchMode` is active: it runs the
   function eagerly instead (`torch/_dynamo/convert_frame.py`, "non-infra torch
   dispatch mode present"), unless the mode's `ignore_compile_internals()` is true, in
   which case modes are off while compiling and on while the compiled code runs
   (`torch/utils/_python_dispatch.py`). The recorder of a compiled step says so
   (`Recorder(compiled_regions=True)`);
2. the wrapper allocates through `torch._C._dynamo.guards._empty_strided_cpu` /
   `_empty_strided_cuda`, C++ fast paths that call the allocator without passing the
   dispatcher, and its kernels are C++ or Triton functions called on raw pointers.
   `inductor_runs()` makes every wrapper module loaded while it is active allocate
   through `torch.empty_strided` instead (the same allocation, seen as an
   `aten.empty_strided` op) and call each kernel next to a `memplan::inductor_kernel` op
   that reads and writes the kernel's tensor arguments (so the trace knows when a
   buffer is used); frees stay what they are, the wrapper's `del`s, seen by the
   recorder's weak references.

On fake tensors the kernels cannot run, and do not need to: they only write into
buffers the wrapper allocated. `inductor_runs(fake=True)` loads each wrapper with no
kernel compiled (no C++ compiler runs), only the `memplan::inductor_kernel` op per call,
and `reinterpret_tensor` as an `as_strided` view through the dispatcher; the wrapper's
allocations, re-uses and frees are exactly those of the real compiled step
(tests/capture/test_compiled.py: fake = real capture, both = torch.profiler on the real
compiled step).

Caches: a fake compile must never serve a real run (its kernels are no-ops) and no
capture may reuse another's compiled code, so `inductor_runs` resets Dynamo's compiled
frames on entry and exit (`torch._dynamo.reset()`) and compiles with
`force_disable_caches` (no FX-graph, AOTAutograd or profile-guided cache; compiled C++
kernels are still found by their source hash, which is the same kernel).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch._inductor.async_compile as inductor_async_compile
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.errors import MemplanBug, UserError

_AsyncCompile = inductor_async_compile.AsyncCompile


class CompiledCaptureBug(MemplanBug):
    """Inductor generated a kind of kernel the compiled capture does not record."""


def refuse_compiled_step(setup: Any, what: str) -> None:
    """`UserError` where a compiled step would be traced by a capture that does not record
    compiled code (parallel ranks, pipeline stages, the reordering graph): Dynamo would run
    it eagerly and the trace would be the eager step's."""
    if getattr(setup, "compile", "none") != "none":
        raise UserError(f"`compile` is traced on one device, not {what}: leave out `compile`")


def _empty_strided(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    """`empty_strided_cpu` / `empty_strided_cuda` of Inductor's wrapper, through the dispatcher.

    A CUDA job is traced on (fake) cpu tensors, so the CUDA helper allocates there too."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _empty_strided_in(fake_mode: FakeTensorMode) -> Any:
    """`_empty_strided` under `fake_mode`: the wrapper's buffers are fake tensors of that
    mode, also where no fake mode is active (a program run: `memplan.program`)."""
    def empty_strided(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        with fake_mode:
            return _empty_strided(size, stride, dtype)

    return empty_strided


def _reinterpret_tensor(tensor: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    """The wrapper's `reinterpret_tensor` (a view of the same storage, `offset` elements on),
    through the dispatcher so that it also works on fake tensors."""
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)


# One op per call of a compiled kernel, so that the trace knows which buffers each kernel
# reads and writes (what offload's lifetimes and the roofline's bytes take from op
# arguments). It does nothing: the kernel itself runs next to it (or not, on fake tensors).
_LIBRARY = torch.library.Library("memplan", "DEF")
_LIBRARY.define("inductor_kernel(Tensor[] reads, Tensor[] writes) -> ()")
_LIBRARY.impl("inductor_kernel", lambda reads, writes: None, "CompositeExplicitAutograd")


class _RecordedKernel:
    """A compiled C++ kernel whose calls are also `memplan::inductor_kernel` ops: its
    `const T*` arguments are reads, its other pointer arguments writes (the argument types
    Inductor passes to `AsyncCompile.cpp_pybinding`). `kernel` None: a fake run, nothing
    to call."""

    def __init__(self, kernel: Any, argtypes: list[str]) -> None:
        self.kernel = kernel
        self.argtypes = argtypes

    def __call__(self, *args: Any) -> Any:
        reads = [a for a, t in zip(args, self.argtypes) if isinstance(a, torch.Tensor) and t.startswith("const")]
        writes = [a for a, t in zip(args, self.argtypes) if isinstance(a, torch.Tensor) and not t.startswith("const")]
        torch.ops.memplan.inductor_kernel(reads, writes)
        return None if self.kernel is None else self.kernel(*args)


class _VisibleAllocations(_AsyncCompile):
    """Inductor's `AsyncCompile` for real runs: the kernels compile as usual; once they are
    loaded (`wait(globals())`, the wrapper module's last top-level step before `call`), each
    is wrapped as a `_RecordedKernel` and the module's allocation and view helpers are
    swapped for ones that pass the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.argtypes: dict[int, list[str]] = {}  # id of what cpp_pybinding returned -> its argument types

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Any:
        loaded = super().cpp_pybinding(argtypes, source_code)  # a kernel, or a future of one
        self.argtypes[id(loaded)] = argtypes
        return loaded

    def wait(self, scope: dict[str, Any]) -> None:
        kernels = {key: self.argtypes[id(value)] for key, value in scope.items() if id(value) in self.argtypes}
        super().wait(scope)
        for key, types in kernels.items():
            scope[key] = _RecordedKernel(scope[key], types)
        scope["empty_strided_cpu"] = _empty_strided
        scope["empty_strided_cuda"] = _empty_strided
        scope["reinterpret_tensor"] = _reinterpret_tensor  # as on fake tensors: the same ops in both traces


class _NoKernels(_AsyncCompile):
    """Inductor's `AsyncCompile` for fake runs: no kernel is compiled (no C++ compiler runs),
    each is a `_RecordedKernel` with nothing to call, and the wrapper's allocation and view
    helpers pass the dispatcher (`empty_strided`: `_empty_strided`, or one under a given fake
    mode, `inductor_runs`)."""

    empty_strided = staticmethod(_empty_strided)

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> _RecordedKernel:
        return _RecordedKernel(None, argtypes)

    def cpp(self, source_code: str) -> Any:
        raise CompiledCaptureBug("Inductor asked for a C++ kernel without Python bindings (cpp_wrapper): "
                         "memplan.capture.compiled records the Python wrapper only")

    def wait(self, scope: dict[str, Any]) -> None:
        super().wait(scope)
        scope["empty_strided_cpu"] = self.empty_strided
        scope["empty_strided_cuda"] = self.empty_strided
        scope["reinterpret_tensor"] = _reinterpret_tensor
        scope["assert_alignment"] = lambda *args, **kwargs: None  # reads data pointers


@contextlib.contextmanager
def inductor_runs(*, fake: bool, gpu: bool = False, fake_mode: FakeTensorMode | None = None) -> Iterator[None]:
    """Within this block, torch.compile compiles afresh and the code it generates allocates
    where the `Recorder` sees it; with `fake`, its kernels are no-ops (module docstring).

    `fake_mode` (with `fake`): the mode the generated code allocates its buffers in, for a
    step whose fake tensors run with no fake mode active (a program run, `memplan.program`);
    without it, the mode active when the code runs.

    `gpu`: the step stands for a GPU job traced on (fake) cpu tensors: Inductor pads buffer
    strides as it does for GPU graphs (`comprehensive_padding`, which
    `maybe_disable_comprehensive_padding` in `torch/_inductor/compile_fx.py` turns off for
    graphs without a GPU input: `disable_padding_cpu`)."""
    torch._dynamo.reset()
    no_kernels = _NoKernels if fake_mode is None else type(
        "_NoKernelsIn", (_NoKernels,), {"empty_strided": staticmethod(_empty_strided_in(fake_mode))})
    inductor_async_compile.AsyncCompile = no_kernels if fake else _VisibleAllocations
    options = {"force_disable_caches": True, **({"disable_padding_cpu": False} if gpu else {})}
    try:
        with inductor_config.patch(options), warnings.catch_warnings():
            # torch.compile(block) warns that global module hooks (the recorder's) fire once
            # more, for the OptimizedModule: that call is the block's, as the recorder wants
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            warnings.filterwarnings("ignore", message=r"dynamo_pgo force disabled")
            yield
    finally:
        inductor_async_compile.AsyncCompile = _AsyncCompile
        torch._dynamo.reset()
