"""The device world the program runs in: which tensors are fake, which are on the device.

A program that trains on a GPU builds its model, moves it and its batches to `cuda`, and
runs. memplan runs it unmodified on the CPU with one rule: **what lives on the device and
is computed from the model is fake; what is computed from the program's data alone is
real.** Concretely (`DeviceRedirect`, a `TorchFunctionMode` active for the whole run):

- every parameter and buffer a module registers is a fake tensor (memplan.program.fakes):
  a model built on the CPU takes no memory, at any size;
- `.to("cuda")`, `.cuda()`, `device="cuda"` go to the CPU: a fake tensor's copy stays
  fake, a real tensor's copy (a batch) stays real and is tagged as device memory, so its
  values are the program's own (a token count read with `.item()` is exact);
- factories that make a tensor of a given size with no data (`empty`, `zeros`, `ones`,
  `full`, `rand*`, their `_like` and `new_*` forms) make a fake tensor when they are for
  the device or run inside the model's code (a module's forward, autograd's backward, an
  optimizer's step, where `device=x.device` names the cpu the fake stands on); factories
  of values (`tensor`, `arange`, `linspace`, `eye`) stay real; a training engine's own code
  (DeepSpeed's initialisation, backward and step, memplan.program.deepspeed_engine) counts as
  the model's: the buffers and partitions it makes for `get_accelerator().current_device_name()`
  (the CPU in a cpu run) are device state;
- everything else runs as PyTorch runs it: an op with a fake input gives a fake output
  (FakeTensor's own dispatch), an op on real tensors a real one, tagged as device memory
  when one of its inputs is (a boolean mask too: `&`, `|`, `~` of real device tensors);
  functorch's wrappers (`vmap`'s BatchedTensor) are looked through to the tensor they wrap;
- a real tensor that meets fake tensors is used as its fake copy (`World.fake_copy`): in one
  op, FakeTensor's own dispatch makes that copy (`FakeTensorMode(allow_non_fake_inputs=True)`,
  memoized per real tensor) and the real tensor is unchanged, so a batch stays real; in a
  tensor subclass that holds both (torchao's low-bit optimizer states: fake `codes` and
  `scale` made by size factories in the optimizer's step, a real lookup table `qmap` made by
  `torch.tensor(QMAP, device=...)`, torchao/optim/subclass_8bit.py `OptimState8bit.zeros`),
  the real inner tensors are swapped for the same fake copies the first time an op meets the
  subclass (`fake_mixed_subclasses`): PyTorch refuses a subclass of mixed inner tensors
  (`is_fake`, "got mixed fake and real tensors!", torch/_subclasses/fake_tensor.py). A value
  factory is not made fake when it is created: its values may come from the data (lengths
  read from the batch), and they stay exact until they meet a fake tensor;
- reading a fake tensor's value follows `memplan.program.reads`;
- `data_ptr()` of a fake tensor is an address of its own: a fake storage has none (PyTorch
  gives 0, with a warning), and code keys tensors by it (accelerate's FSDP2 preparation maps
  each original parameter to its sharded one by `data_ptr()`, accelerate/accelerator.py,
  `prepare_model`): each fake storage gets a distinct base, and a view its offset from it.

A CUDA job ("cuda") is traced on fake *cpu* tensors (a CPU-only PyTorch aborts when autograd
runs on fake cuda tensors, docs/capture.md), so `tensor.device` is `cpu` everywhere; device
memory is told apart from host memory by the tags above: a fake tensor is device memory
unless it was made on the host and never moved (a model built on the CPU before `.to`), a
real one only when tagged. A CPU job ("cpu") has one memory: every tensor is in it.

A function mode is off while its own handler runs the function it intercepted; for
`loss.backward()` (`Tensor.backward`, `torch.autograd.backward`, `torch.autograd.grad`) that
is the whole backward, hooks included (FSDP2's all-gathers and reduce-scatters, a
checkpoint's recomputation). `redirect_in_backward` enters the mode again around autograd's
engine (`torch.autograd.graph._engine_run_backward`), whose thread-local state the engine
carries into every node and hook it runs.

Compiled functions (`compiled_outside_mode`) run with the mode off: Dynamo would trace the
mode's handler into their graphs; the code Inductor generates allocates in the world's fake
mode (memplan.capture.compiled), and the world steps aside while PyTorch compiles under a
fake mode of its own (`World.compiling`).

The recorder reads the tags (`on_device`); `in_model_code` is what the factories rule uses.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.nn import Parameter
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TraceableWrapperSubclass, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from memplan.models import tracing
from memplan.program.patches import Patches
from memplan.program.reads import KNOWN_OPS, READS, ReadLog, is_fake_value

Tensor = torch.Tensor

SIZE_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
                            torch.randint, torch.empty_strided, torch.normal})
LIKE_FACTORIES = frozenset({torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
                            torch.rand_like, torch.randn_like, torch.randint_like})
NEW_FACTORIES = frozenset({Tensor.new_empty, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full,
                           Tensor.new_empty_strided})
FAKE_ADDRESS_BASE = 1 << 44  # above any address a real CPU allocation of this process has
_MOVES = frozenset({Tensor.to, Tensor.cuda, Tensor.cpu, Tensor.pin_memory, Tensor.is_pinned})
_PLAIN_TENSOR_TYPES = (Tensor, FakeTensor, Parameter)


def redirect_in_backward(mode: TorchFunctionMode, patches: Patches) -> None:
    """`mode` active in autograd's engine, also when it was entered from its own handler
    (module docstring)."""
    import torch.autograd.graph
    from torch.overrides import _get_current_function_mode_stack

    run = torch.autograd.graph._engine_run_backward

    def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return run(*args, **kwargs)
        with mode:
            return run(*args, **kwargs)

    patches.set(torch.autograd.graph, "_engine_run_backward", engine_run_backward)
    patches.set(torch.autograd, "_engine_run_backward", engine_run_backward)


def redirect_in_saved_tensor_hooks(mode: TorchFunctionMode, patches: Patches) -> None:
    """`mode` active in the pack and unpack hooks of every `saved_tensors_hooks`: autograd
    calls a pack hook while the op that saves the tensor runs, inside `mode`'s own handler of
    that op, where `mode` is off (torchtune's `OffloadActivations` makes its pinned host copy
    there, torchtune/training/_activation_offloading.py, torchtune 0.6.1)."""
    import torch.autograd.graph
    from torch.overrides import _get_current_function_mode_stack

    init = torch.autograd.graph.saved_tensors_hooks.__init__

    def in_mode(hook: Any) -> Any:
        def run(*args: Any) -> Any:
            if any(m is mode for m in _get_current_function_mode_stack()):
                return hook(*args)
            with mode:
                return hook(*args)
        return run

    def hooks_init(self: Any, pack_hook: Any, unpack_hook: Any) -> None:
        init(self, in_mode(pack_hook), in_mode(unpack_hook))

    patches.set(torch.autograd.graph.saved_tensors_hooks, "__init__", hooks_init)


def compiled_outside_mode(mode: DeviceRedirect, patches: Patches) -> None:
    """Every function `torch.compile` makes (`torch.compile(fn)`, the forward of
    `torch.compile(module)` and `module.compile()`, flex attention's own compile) is called
    with `mode` off: Dynamo traces the function modes it finds active into the graph
    (torch/_dynamo/variables/torch_function.py), and the world's handler, which keeps
    Python state of its own, would break the graph at every op. The compiled code's own
    allocations are fake (`memplan.capture.compiled.inductor_runs`' `fake_mode`); a
    compiled backward runs in autograd's engine, with `mode` on (`redirect_in_backward`).

    A function whose compile fails (Dynamo or Inductor raise: flex attention's lowering, a
    `device="cuda"` inside the compiled code, which the world does not redirect there) runs
    its eager ops inside `mode` from then on, and the run says so (`World.compiled_eagerly`).
    Assumed: the compile failed before any of the function's code ran (its first frame; a
    frame after a graph break would have run the code before it)."""
    from torch._dynamo import eval_frame
    from torch._dynamo.exc import TorchDynamoException
    from torch._dynamo.utils import counters

    call = eval_frame.OptimizeContext.__call__
    world = mode.world
    before = dict(counters["graph_break"])  # breaks of earlier runs in this process

    def outside(compiled: Any, fn: Any) -> Any:
        name = _compiled_name(fn)

        @functools.wraps(compiled)
        def outside_mode(*args: Any, **kwargs: Any) -> Any:
            if name not in world.compiled_eagerly:
                # the world's rule for subclasses of fake and real tensors, which its mode,
                # off in here, would apply at the first op (Dynamo refuses them when it wraps)
                world.fake_mixed_subclasses([*args, *kwargs.values()])
                try:
                    with _without_function_mode(mode):
                        return compiled(*args, **kwargs)
                except TorchDynamoException as failed:
                    why = getattr(failed, "inner_exception", None) or failed
                    world.compiled_eagerly[name] = f"{type(why).__name__}: {str(why).splitlines()[0]}"
                finally:  # the code between graphs runs eagerly, outside the world too
                    world.graph_breaks = {str(k): v - before.get(k, 0) for k, v in counters["graph_break"].items()
                                          if v > before.get(k, 0)}
            return fn(*args, **kwargs)

        return outside_mode

    def optimize_call(self: Any, fn: Any) -> Any:
        compiled = call(self, fn)
        if isinstance(compiled, torch.nn.Module) or not callable(compiled):
            return compiled  # an OptimizedModule: its forward was made by this call
        return outside(compiled, fn)

    patches.set(eval_frame.OptimizeContext, "__call__", optimize_call)
    # compiled functions made before the run, module globals of what memplan imported first
    # (torchtune, to read `tune run`'s arguments: its `flex_attention_compiled`)
    for module in list(sys.modules.values()):
        for key, value in list(getattr(module, "__dict__", {}).items()):
            if isinstance(value, types.FunctionType) and value.__dict__.get("_is_torch_compile") is True:
                patches.set(module, key, outside(value, value.__dict__["_torchdynamo_orig_callable"]))


def _compiled_name(fn: Any) -> str:
    """The compiled function's name in the run's report: a module's class for `module.compile()`."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return type(owner).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@contextlib.contextmanager
def _without_function_mode(mode: TorchFunctionMode) -> Iterator[None]:
    """`mode` off the function-mode stack, the modes above it kept, for the block."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    if not any(m is mode for m in _get_current_function_mode_stack()):
        yield
        return
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for m in reversed(above):
        _push_mode(m)
    try:
        yield
    finally:
        for _ in above:
            _pop_mode()
        _push_mode(mode)
        for m in reversed(above):
            _push_mode(m)


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor under functorch's wrappers (`vmap`'s BatchedTensor, `grad`'s wrapper), which
    have no storage of their own: flex attention's `create_block_mask` runs its mask function
    under `vmap` (torch/nn/attention/flex_attention.py, `create_mask`)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def is_cuda(device: Any) -> bool:
    """Whether a `device=` value names a CUDA device (`"cuda"`, `"cuda:1"`, `torch.device`, an index)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _without_copy(to_args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """`Tensor.to`'s arguments after the tensor, less its `copy` flag, and that flag: every
    form of `to` (Tensor.to in torch/_tensor_docs.py: `(dtype, non_blocking, copy)`,
    `(device, dtype, non_blocking, copy)`, `(other, non_blocking, copy)`) takes `copy` as its
    second positional bool or by keyword, and `torch._C._nn._parse_to` refuses it."""
    kwargs = dict(kwargs)
    copy = bool(kwargs.pop("copy", False))
    flags = [i for i, a in enumerate(to_args) if isinstance(a, bool)]
    if len(flags) == 2:
        copy = copy or to_args[flags[1]]
        to_args = to_args[:flags[1]] + to_args[flags[1] + 1:]
    return to_args, kwargs, copy


def _real_tensors(value: Any) -> list[torch.Tensor]:
    if type(value) is Tensor or (isinstance(value, Tensor) and not is_fake(value)):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, Tensor) and not is_fake(t)]
    return []


def _subclasses(values: Iterable[Any]) -> list[TraceableWrapperSubclass]:
    """The tensor subclasses with inner tensors among `values` and the lists in them."""
    found: list[TraceableWrapperSubclass] = []
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Tensor) and type(t) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(t):
                found.append(t)
    return found


def _inner_tensors(t: TraceableWrapperSubclass) -> list[tuple[str, Tensor]]:
    names, _ = t.__tensor_flatten__()
    return [(name, value) for name in names if isinstance(value := getattr(t, name), Tensor)]


class World:
    """One program run's device world (module docstring): the fake mode, the tags, the
    model-code regions and the reads."""

    def __init__(self, device: str, program_dir: Path | None) -> None:
        self.device = device
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.reads = ReadLog(program_dir)
        self._device_storages: WeakIdKeyDictionary = WeakIdKeyDictionary()  # real storages on the device
        self._host_fakes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake storages on the host
        self._fake_addresses: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake storage -> its address
        self._next_address = FAKE_ADDRESS_BASE
        self.window: Any = None  # the step window (memplan.program.steps): module and optimizer depth
        self.engine_depth = 0  # calls into a training engine's own device code (memplan.program.deepspeed_engine)
        self.allocated_bytes = 0  # live device tensors the recorder sees (512-byte blocks)
        self.peak_allocated_bytes = 0
        self.stream = 0  # the CUDA stream the program's work is on (memplan.program.cuda_api)
        # told each real tensor a subclass now holds as its fake copy (the recorder: the same buffer)
        self.on_fake_copy: Callable[[Tensor, Tensor], None] | None = None
        self.compiled_eagerly: dict[str, str] = {}  # compiled function -> why its compile failed
        self.graph_breaks: dict[str, int] = {}  # Dynamo's graph breaks in compiled functions, by reason

    # --- tags ------------------------------------------------------------------------
    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage is device memory (a cpu job: always)."""
        if not self.cuda:
            return True
        t = _unwrapped(t)
        storage = t.untyped_storage()
        if is_fake(t):
            return storage not in self._host_fakes
        return storage in self._device_storages

    def storage_on_device(self, storage: Any, fake: bool) -> bool:
        if not self.cuda:
            return True
        return storage not in self._host_fakes if fake else storage in self._device_storages

    def tag_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.cuda and isinstance(t, Tensor):
            storage = _unwrapped(t).untyped_storage()
            if is_fake(t):
                self._host_fakes.pop(storage, None)
            else:
                self._device_storages[storage] = True
        return t

    def tag_host(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor made on the host (a parameter of a model built on the CPU)."""
        if self.cuda and is_fake(t):
            self._host_fakes[t.untyped_storage()] = True
        return t

    def fake_address(self, t: torch.Tensor) -> int:
        """`t.data_ptr()` of a fake tensor (module docstring)."""
        storage = t.untyped_storage()
        base = self._fake_addresses.get(storage)
        if base is None:
            base = self._fake_addresses[storage] = self._next_address
            self._next_address += (storage.nbytes() // 4096 + 2) * 4096
        return base + t.storage_offset() * t.element_size()

    def in_model_code(self) -> bool:
        """Inside a module's forward, autograd's backward, an optimizer's step or a training
        engine's code that builds or updates device state (`engine_depth`)."""
        window = self.window
        if self.engine_depth > 0 or window is not None and (window.depth > 0 or window.optimizer_depth > 0):
            return True
        return torch._C._current_graph_task_id() != -1

    def compiling(self) -> bool:
        """Whether torch.compile is compiling (AOTAutograd and Inductor trace and lower the
        graph under a fake mode of their own, also when the backward is compiled lazily inside
        autograd's engine): its tensors are PyTorch's, not the program's."""
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        return mode is not None and mode is not self.fake_mode

    def fake(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """`func(*args, **kwargs)` under the run's fake mode."""
        with self.fake_mode:
            return func(*args, **kwargs)

    def fake_copy(self, real: Tensor) -> Tensor:
        """The fake copy of a real tensor that meets fake ones: FakeTensorMode's memoized
        conversion, the copy FakeTensor's dispatch uses for a real input of an op."""
        fake = self.fake_mode.from_tensor(real)
        if not self.on_device(real):
            self.tag_host(fake)
        if self.on_fake_copy is not None:
            self.on_fake_copy(real, fake)
        return fake

    def fake_mixed_subclasses(self, values: Iterable[Any]) -> None:
        """Each tensor subclass among `values` (and the lists in them) that holds fake and real
        inner tensors holds the real ones' fake copies instead (module docstring)."""
        for t in _subclasses(values):
            self._fake_inner_reals(t)

    def _fake_inner_reals(self, t: Tensor) -> None:
        inner = _inner_tensors(t)
        for _, value in inner:
            if type(value) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(value):
                self._fake_inner_reals(value)
        fake = [is_fake(value) for _, value in inner]
        if any(fake) and not all(fake):
            for (name, value), is_fake_value in zip(inner, fake):
                if not is_fake_value:
                    setattr(t, name, self.fake_copy(value))

    def fake_like(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor of `t`'s shape, strides and dtype, made by a factory: a fake made by
        `FakeTensorMode.from_tensor` is weakly referenced by the mode's converter, and
        `Module._apply` (`.to()`) swaps fake parameters with `torch.utils.swap_tensors`,
        which refuses a tensor with a weak reference."""
        with self.fake_mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


class DeviceRedirect(TorchFunctionMode):
    """The function mode of `World` (module docstring)."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.world.compiling():
            return func(*args, **kwargs)
        self.world.fake_mixed_subclasses(args)
        if func in READS:
            if args and is_fake_value(args[0]):
                return self.world.reads.read(func, args, kwargs)
            return func(*args, **kwargs)
        result = self._call(func, args, kwargs)
        reads = self.world.reads
        if func in KNOWN_OPS or reads.known:  # a value the reads policy knows, carried on or forgotten
            reads.note_known(func, args, kwargs, result)
        return result

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` of `args`, as the world runs it (module docstring)."""
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func is Tensor.data_ptr and args and isinstance(args[0], FakeTensor):
            return self.world.fake_address(args[0])
        if func in SIZE_FACTORIES or func in LIKE_FACTORIES or func in NEW_FACTORIES:
            return self._factory(func, args, kwargs)
        device = kwargs.get("device")
        if device is not None and is_cuda(device) and self.world.cuda:
            kwargs = {**kwargs, "device": "cpu"}
            kwargs.pop("pin_memory", None)
            return self._tagged(func(*args, **kwargs))
        result = func(*args, **kwargs)
        if self.world.cuda and _real_tensors(result) and any(
                self.world.on_device(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)):
            self._tagged(result)
        return result

    def _tagged(self, result: Any) -> Any:
        for t in tree_flatten(result)[0]:
            if isinstance(t, Tensor):
                self.world.tag_device(t)
        return result

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A tensor of a given size with no data (module docstring)."""
        world = self.world
        kwargs = dict(kwargs)
        for_device = is_cuda(kwargs.get("device")) and world.cuda
        if for_device:
            kwargs = {**kwargs, "device": "cpu"}
        if world.cuda and kwargs.pop("pin_memory", False):
            return self._pinned(func(*args, **kwargs) if not world.in_model_code() and not any(
                is_fake(a) for a in args if isinstance(a, Tensor)) else world.fake(func, *args, **kwargs))
        source = args[0] if func in NEW_FACTORIES or func in LIKE_FACTORIES else None
        if source is not None and is_fake(source):
            out = func(*args, **kwargs)
            return world.tag_device(out) if for_device or world.on_device(source) else out
        if for_device or world.in_model_code():
            return world.fake(func, *args, **kwargs)
        out = func(*args, **kwargs)
        if source is not None and world.cuda and world.on_device(source):
            world.tag_device(out)
        return out

    def _pinned(self, out: Tensor) -> Tensor:
        """A factory's `pin_memory=True` tensor: page-locked host memory, never the device's
        (torchtune's activation offloading makes its host copies so, inside the model's forward)."""
        self.world.tag_host(out)
        tracing.mark_host(out, "pinned")
        return out

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`.to`, `.cuda`, `.cpu`, `.pin_memory`, `.is_pinned` (module docstring)."""
        world = self.world
        t = args[0]
        if not world.cuda:
            if func is Tensor.pin_memory:
                return t
            if func is Tensor.is_pinned:
                return False
            return func(*args, **kwargs)
        if func is Tensor.is_pinned:
            return tracing.host_kind(t.untyped_storage()) == "pinned"
        if func is Tensor.pin_memory:
            out = t.clone()
            tracing.mark_host(out, "pinned")
            return out
        if func is Tensor.cuda:
            return self._to_device(t, None, kwargs.get("non_blocking", False), copy=False)
        if func is Tensor.cpu:
            return self._to_host(t, None) if world.on_device(t) else t
        to_args, to_kwargs, copy = _without_copy(args[1:], kwargs)
        if to_args and isinstance(to_args[0], Tensor):
            target_device = "cuda" if world.on_device(to_args[0]) else "cpu"
            dtype = to_args[0].dtype
        else:
            device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*to_args, **to_kwargs)
            target_device = "cuda" if device is not None and device.type == "cuda" else (
                "cpu" if device is not None else None)
        if target_device == "cuda":
            return self._to_device(t, dtype, False, copy=copy)
        if target_device == "cpu" and world.on_device(t):
            return self._to_host(t, dtype)
        return func(*args, **kwargs)

    def _to_device(self, t: torch.Tensor, dtype: torch.dtype | None, non_blocking: bool, *, copy: bool) -> torch.Tensor:
        if self.world.on_device(t) and not copy:
            return t if dtype is None or dtype == t.dtype else t.to(dtype)
        out = t.to("cpu", dtype=dtype or t.dtype, copy=True, non_blocking=non_blocking)
        return self.world.tag_device(out)

    def _to_host(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        out = t.to("cpu", dtype=dtype or t.dtype, copy=True)
        if is_fake(out):
            self.world.tag_host(out)
        return out
