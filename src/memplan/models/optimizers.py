"""The optimizer of a training step: `build_optimizer(model, setup, device)`.

Hyper-parameters are each library's defaults except the learning rate, 1e-4. `device`
is the device the job is meant for (a CUDA job is traced on fake cpu tensors); it picks
PyTorch's default implementation and, below, what is traced for the GPU.

- **torch.optim** (`adamw`, `adam`, `sgd` without momentum, hence no state, `adafactor`):
  `optimizer_impl` None is PyTorch's default (`_default_to_fused_or_foreach`: foreach on
  CUDA, the per-parameter loop elsewhere). Adafactor reads scalars back from tensors
  (`FakeTensorSafeAdafactor`).
- **bitsandbytes** (`adamw8bit`: `bnb.optim.AdamW8bit`, `paged-adamw8bit`:
  `PagedAdamW8bit`, `paged-adamw`: `PagedAdamW`, `lion`: `Lion`, whose states are 32-bit
  by default). 8-bit states (`bitsandbytes/optim/optimizer.py`, `Optimizer2State.init_state`):
  per parameter of at least `min_8bit_size` (4096) elements, `state1`/`state2` uint8
  tensors of its shape and fp32 block maxima `absmax1`/`absmax2` of ceil(n / 256); fp32
  states below that size; the quantisation maps `qmap1`/`qmap2` (256 fp32 each) are
  shared by every parameter of one optimizer. The update is one fused kernel per
  parameter that writes the parameter and its states in place
  (`bitsandbytes/backends/cuda/ops.py`, `_optimizer_update_8bit_blockwise_impl`): no
  tensor is allocated, and bnb's fake kernel allocates none. For a cpu job the update is
  bnb's CPU kernel (`bitsandbytes/backends/cpu/ops.py`), a Python function that
  dequantises the states to fp32 and back; the dispatcher would run it below the
  recorder's dispatch mode, where its tensors are invisible, so `_BnbCpuKernels` calls
  it at Python level, same function, same tensors. bnb builds its quantisation maps
  with `.tolist()` (`functional.create_dynamic_map`), which fake tensors cannot answer:
  under fake tensors they are built with scalar reads answered 1 (their values change
  no size).
  **Paged** optimizers (`Optimizer8bit.get_state_buffer`): on CUDA the states of a
  parameter of at least 1e5 elements are allocated with `cudaMallocManaged`
  (`functional.get_paged`), unified memory outside PyTorch's caching allocator that the
  driver migrates to the GPU on access and evicts to the host under memory pressure;
  memplan reports them as host memory of kind `managed`, not device memory
  (`memplan.models.tracing`). On a CPU bitsandbytes falls back to the non-paged
  optimizer (with a warning), so a paged optimizer in a cpu job is refused.
- **torchao** (`ao-adamw8bit`, `ao-adamw4bit`, `ao-adamw-fp8`: `torchao.optim.AdamW8bit`,
  `AdamW4bit`, `AdamWFp8`). States of parameters of at least 4096 elements divisible by
  the block size are tensor subclasses (`OptimState8bit`: uint8 codes of the parameter's
  shape, fp32 block scales, a 256-entry fp32 qmap; `OptimState4bit`: packed uint8 codes
  of half the elements, scales, a 16-entry qmap; `OptimStateFp8`: float8 codes and
  scales), whose inner storages the recorder sees; smaller parameters get plain
  tensors. torchao compiles the per-parameter update
  (`torch.compile(single_param_adam, fullgraph=True, dynamic=False)`,
  `torchao/optim/adam.py`, `_AdamBase.step`). A compiled kernel cannot run on fake
  tensors (it reads their data pointers), so on fake tensors `single_param_adam` runs
  eagerly: for a CUDA job inside `memplan.models.tracing.fused_kernel()`, because the
  compiled update fuses it into kernels that read the states and write them and the
  parameter in place, keeping the eager program's fp32 intermediates in registers
  (torchao's published A100 figures put its 8-bit AdamW within 0.5% of bitsandbytes',
  whose kernel allocates nothing; BENCHMARKS.md `bench:published_gpu`); for a cpu job the
  eager step is recorded as it runs with `torch.compile` off (what the CPU ground truth
  runs: torch.profiler cannot see the tensors a compiled CPU kernel reads through raw
  pointers).
- **optimizer in backward** (`InBackwardOptimizer`): one optimizer per parameter, stepped
  and zeroed in the parameter's post-accumulate-grad hook, as torchtune's
  `_register_optim_in_bwd_hooks` (`torchtune/training/memory.py`) and PyTorch's tutorial
  "How to save memory by fusing the optimizer step into the backward pass" do.
- **CPU offload**: `optimizer` on one device is torchao's `CPUOffloadOptimizer`
  (`torchao/optim/cpu_offload.py`): a pinned host copy of every parameter of at least
  4096 elements and of its gradient, gradients copied to the host in a post-accumulate
  hook, the base optimizer stepped on the host (AdamW fused, torchao's default), the
  parameters copied back; smaller parameters are stepped on the GPU by a second
  optimizer. It runs only on CUDA/XPU: on a CPU-only machine memplan runs it with the
  stream API of a device whose one stream is synchronous (`_host_streams`) and with
  pinned allocations served by `memplan.models.tracing.host_placement`. `params` is
  FSDP2's `CPUOffloadPolicy` (applied by `memplan.parallel.apply`): the optimizer steps
  the host-resident shards on the host, and the gradients it reads are pinned host
  copies (FSDP2's `foreach_reduce`). Only torch.optim optimizers can be offloaded.
"""

from __future__ import annotations

import contextlib
import functools
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import UserError
from memplan.models import tracing
from memplan.models.build import is_fake_mode_active
from memplan.models.packages import require
from memplan.models.setup import TORCH_OPTIMIZERS, TrainingSetup

LR = 1e-4
BNB_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged-adamw8bit": "PagedAdamW8bit", "paged-adamw": "PagedAdamW",
                  "lion": "Lion"}
AO_OPTIMIZERS = {"ao-adamw8bit": "AdamW8bit", "ao-adamw4bit": "AdamW4bit", "ao-adamw-fp8": "AdamWFp8"}
PAGED_OPTIMIZERS = ("paged-adamw8bit", "paged-adamw")
PAGED_MIN_ELEMENTS = 100_000  # Optimizer8bit.get_state_buffer pages tensors of at least 1e5 elements


def build_optimizer(model: nn.Module, setup: TrainingSetup, device: str | None = None) -> torch.optim.Optimizer:
    """The setup's optimizer over the model's trainable parameters (module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters")
    target = torch.device(device or params[0].device.type).type
    check_target(setup, target)
    if setup.optimizer in BNB_OPTIMIZERS:
        require("bitsandbytes", f"--optimizer {setup.optimizer}")
    if setup.optimizer in AO_OPTIMIZERS:
        require("torchao", f"--optimizer {setup.optimizer}")
    if setup.cpu_offload == "optimizer":
        require("torchao", "--cpu-offload optimizer")
    if setup.optimizer_in_backward:
        return InBackwardOptimizer(params, lambda group: base_optimizer(group, setup, target),
                                   set_to_none=setup.zero_grad == "none")
    if setup.cpu_offload == "optimizer":
        return offloaded_optimizer(params, setup, target)
    return base_optimizer(params, setup, target)


def check_target(setup: TrainingSetup, device: str) -> None:
    """`UserError` for an optimizer the job's device cannot run as asked: a paged
    optimizer on a CPU (bitsandbytes runs it unpaged there; module docstring)."""
    if setup.optimizer in PAGED_OPTIMIZERS and device != "cuda":
        raise UserError(f"`optimizer={setup.optimizer}` pages its state through CUDA unified memory; on a CPU "
                        "bitsandbytes runs it unpaged: use "
                        f"`optimizer={'adamw8bit' if setup.optimizer.endswith('8bit') else 'adamw'}` with --device cpu")


def base_optimizer(params: list[nn.Parameter], setup: TrainingSetup, target: str) -> torch.optim.Optimizer:
    """The setup's optimizer over `params`, with no placement technique around it."""
    if setup.optimizer in TORCH_OPTIMIZERS:
        cls = _torch_class(setup.optimizer)
        if setup.cpu_offload == "params":  # FSDP2's CPUOffloadPolicy: the step runs on the host
            cls, target = host_aware(cls), "cpu"  # PyTorch's default for host tensors: the loop
        return cls(params, lr=LR, **_impl_kwargs(setup.resolved_optimizer_impl(target)))
    if setup.optimizer in BNB_OPTIMIZERS:
        return _bnb_optimizer(params, setup.optimizer, target)
    return _ao_optimizer(params, setup.optimizer, target)


def step_context(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """What the whole training step (backward hooks included) must run inside for
    `optimizer`: the host's stream API and pinned memory for an offloaded optimizer."""
    context = getattr(optimizer, "step_context", None)
    return context() if callable(context) else contextlib.nullcontext()


def _impl_kwargs(impl: str) -> dict[str, Any]:
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def _torch_class(name: str) -> type[torch.optim.Optimizer]:
    return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
            "adafactor": FakeTensorSafeAdafactor}[name]


class _ScalarReadsAsOne(TorchDispatchMode):
    """Answer `tensor.item()` with 1 where the value cannot exist (fake tensors)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        return func(*args, **(kwargs or {}))


def scalar_reads_as_one_if_fake() -> contextlib.AbstractContextManager:
    """`_ScalarReadsAsOne` under fake tensors, nothing on real ones."""
    return _ScalarReadsAsOne() if is_fake_mode_active() else contextlib.nullcontext()


class FakeTensorSafeAdafactor(torch.optim.Adafactor):
    """`torch.optim.Adafactor` that also steps under `FakeTensorMode`.

    Adafactor reads scalars back from tensors (`step.item()`, `param.norm().item()`) to
    scale its update; fake tensors have no values, so under fake tensors those reads
    return 1. They only set the update's magnitude, never a shape or an allocation, so the
    step allocates exactly what the real one does. On real tensors it is plain Adafactor.
    """

    def step(self, closure: Any = None) -> Any:
        with scalar_reads_as_one_if_fake():
            return super().step(closure)


@functools.cache
def host_aware(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`cls` whose step, when its parameters live on the host, runs on the host
    (`memplan.models.tracing.host_compute`: its states and temporaries are host memory)
    and reads gradients the offloading code copied to pinned host memory."""

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        if not any(tracing.is_host(_local(p)) for p in params):
            return cls.step(self, *args, **kwargs)
        for p in params:
            if p.grad is not None and not tracing.is_host(_local(p.grad)):
                tracing.mark_host(_local(p.grad), "pinned")
        with tracing.host_compute():
            return cls.step(self, *args, **kwargs)

    def step_context(self: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return tracing.host_placement()

    return type(f"HostAware{cls.__name__}", (cls,), {"step": step, "step_context": step_context})


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's rank-local tensor (FSDP2's shards), or `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped and zeroed in the parameter's post-accumulate-grad
    hook (module docstring); `step()` and `zero_grad()` have nothing left to do."""

    def __init__(self, params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 *, set_to_none: bool = True) -> None:
        # torchtune's OptimizerInBackwardWrapper does not call Optimizer.__init__ either:
        # the per-parameter optimizers hold the state
        self.defaults: dict[str, Any] = {}
        self.optimizers = {p: make([p]) for p in params}
        self.set_to_none = set_to_none
        self.hooks = [p.register_post_accumulate_grad_hook(self._step_one) for p in params]

    def _step_one(self, p: torch.Tensor) -> None:
        optimizer = self.optimizers[p]
        optimizer.step()
        optimizer.zero_grad(set_to_none=self.set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    @property
    def state(self) -> ChainMap:  # type: ignore[override]
        return ChainMap(*(optimizer.state for optimizer in self.optimizers.values()))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def step_context(self) -> contextlib.AbstractContextManager:
        return step_context(next(iter(self.optimizers.values())))


# --- bitsandbytes ---------------------------------------------------------------------


@functools.cache
def _bnb_cpu_kernels() -> dict[Any, Callable[..., Any]]:
    """bitsandbytes' CPU kernels of its optimizer-update ops (Python functions)."""
    from bitsandbytes.backends.cpu import ops

    return {torch.ops.bitsandbytes.optimizer_update_8bit_blockwise.default: ops._optimizer_update_8bit_blockwise_cpu,
            torch.ops.bitsandbytes.optimizer_update_32bit.default: ops._optimizer_update_32bit_cpu}


class _BnbCpuKernels(TorchDispatchMode):
    """Run bitsandbytes' optimizer updates through their CPU kernels at Python level, so
    that a dispatch mode below this one (the recorder) sees the tensors they make."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kernel = _bnb_cpu_kernels().get(func)
        return (kernel or func)(*args, **(kwargs or {}))


class _BnbTraced:
    """What memplan adds to a bitsandbytes optimizer class (module docstring): the CPU
    kernels visible for a cpu job, and paged states marked as managed host memory."""

    memplan_target = "cuda"

    def step(self, closure: Any = None) -> Any:
        kernels = _BnbCpuKernels() if self.memplan_target == "cpu" else contextlib.nullcontext()
        with kernels:
            return super().step(closure)  # type: ignore[misc]

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.is_paged or p.device.type == "cuda":  # type: ignore[attr-defined]
            buffer = super().get_state_buffer(p, dtype=dtype)  # type: ignore[misc]
        else:  # a CUDA job traced on cpu tensors (paging is refused for cpu jobs): bnb's bytes
            buffer = torch.zeros_like(p, dtype=dtype)
        if self.is_paged and p.numel() >= PAGED_MIN_ELEMENTS:  # type: ignore[attr-defined]
            tracing.mark_host(buffer, "managed")
        return buffer


@functools.cache
def _bnb_class(name: str) -> type[torch.optim.Optimizer]:
    import bitsandbytes as bnb

    cls = getattr(bnb.optim, name)
    return type(f"Traced{name}", (_BnbTraced, cls), {})


def _bnb_optimizer(params: list[nn.Parameter], name: str, target: str) -> torch.optim.Optimizer:
    with scalar_reads_as_one_if_fake():
        optimizer = _bnb_class(BNB_OPTIMIZERS[name])(params, lr=LR)
    optimizer.memplan_target = target
    return optimizer


# --- torchao ---------------------------------------------------------------------------


@contextlib.contextmanager
def eager_compile(fused: bool = False) -> Iterator[None]:
    """Inside the block `torch.compile(fn, ...)` returns `fn` itself, run inside
    `tracing.fused_kernel()` when `fused`: how a fake step runs torchao's update (module
    docstring: a compiled kernel cannot run on fake tensors), and how a real CPU step
    runs it for torch.profiler, which cannot see what a compiled CPU kernel reads and
    writes through raw pointers."""

    def compile_eagerly(fn: Callable[..., Any], **_options: Any) -> Callable[..., Any]:
        if not fused:
            return fn

        def run(*args: Any, **kwargs: Any) -> Any:
            with tracing.fused_kernel():
                return fn(*args, **kwargs)

        return run

    compile_ = torch.compile
    torch.compile = compile_eagerly  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = compile_


class _AoTraced:
    """What memplan adds to a torchao low-bit optimizer class: on fake tensors the
    compiled update runs eagerly (module docstring)."""

    memplan_target = "cuda"

    def step(self, closure: Any = None) -> Any:
        if not is_fake_mode_active():
            return super().step(closure)  # type: ignore[misc]
        with eager_compile(fused=self.memplan_target == "cuda"):
            return super().step(closure)  # type: ignore[misc]


@functools.cache
def _ao_class(name: str) -> type[torch.optim.Optimizer]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchao import optim as ao
    from torchao.optim import subclass_4bit, subclass_8bit

    with unset_fake_temporarily():
        # the quantisation maps are built once, with `.tolist()` (lru-cached constants):
        # build them on real tensors before a fake step asks for them
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()
    return type(f"Traced{name}", (_AoTraced, getattr(ao, name)), {})


def _ao_optimizer(params: list[nn.Parameter], name: str, target: str) -> torch.optim.Optimizer:
    optimizer = _ao_class(AO_OPTIMIZERS[name])(params, lr=LR)
    optimizer.memplan_target = target
    return optimizer


# --- torchao's CPUOffloadOptimizer on a host without an accelerator ------------------


class _HostStream:
    """The part of a CUDA stream's API `CPUOffloadOptimizer` calls, for a device whose
    one stream runs every copy synchronously: waiting and events have nothing to wait for."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def _host_streams() -> Iterator[None]:
    """torchao's `CPUOffloadOptimizer` runs with `torch.cuda`'s stream API answered by
    `_HostStream` and the accelerator it asks for named cuda (it asserts one exists)."""
    from torchao.optim import cpu_offload

    stream = _HostStream()
    saved = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, cpu_offload.get_available_devices)
    torch.cuda.Stream = lambda *_a, **_k: stream  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda *_a, **_k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()  # type: ignore[assignment]
    cpu_offload.get_available_devices = lambda: ["cpu", "cuda"]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, cpu_offload.get_available_devices = saved


def offloaded_optimizer(params: list[nn.Parameter], setup: TrainingSetup, target: str) -> torch.optim.Optimizer:
    """torchao's `CPUOffloadOptimizer` over the setup's torch.optim optimizer (module
    docstring): AdamW fused on the host unless `optimizer_impl` says otherwise."""
    from torchao.optim import CPUOffloadOptimizer

    impl = setup.optimizer_impl or ("fused" if setup.optimizer == "adamw" else "loop")
    cls = _offload_class(CPUOffloadOptimizer)
    return cls(params, host_aware(_torch_class(setup.optimizer)), lr=LR, **_impl_kwargs(impl))


@functools.cache
def _offload_class(base: Any) -> type:
    on_cuda = torch.cuda.is_available()

    def context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(tracing.host_placement())
        if not on_cuda:
            stack.enter_context(_host_streams())
        return stack

    def __init__(self: Any, params: Any, optimizer_class: type, **kwargs: Any) -> None:
        with context():
            base.__init__(self, params, optimizer_class, **kwargs)
        # the global optimizer-step hooks (memplan's capture) see the whole step: the
        # host optimizers' steps and the copies back to the device between them
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()

    def step(self: Any, closure: Any = None) -> Any:
        return base.step(self, closure)

    def state(self: Any) -> ChainMap:
        inner = [*self.optim_dict.values(), *([self.d_opt] if self.d_opt is not None else [])]
        return ChainMap(*(optimizer.state for optimizer in inner))

    return type("TracedCPUOffloadOptimizer", (base,), {
        "__init__": __init__, "step": torch.optim.Optimizer.profile_hook_step(step),
        "state": property(state), "step_context": lambda self: context()})
