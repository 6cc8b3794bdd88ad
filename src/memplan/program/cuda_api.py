"""`torch.cuda` as a program run for a GPU profile sees it, on a machine with no GPU.

For a `cuda` run, `install(world, patches, profile, ...)` answers PyTorch's device queries
from the device profile (memplan.hardware.devices) and from memplan's own counters, so that
the program takes the path it takes on that GPU and its own memory logging prints memplan's
figures:

- availability and identity: `is_available` (True), `device_count` (the GPUs
  `CUDA_VISIBLE_DEVICES` names where the program's environment sets it, else the launcher's
  processes per node: `visible_device_count`), `current_device` / `set_device` / `device(...)` (the rank's local
  device), `get_device_name`, `get_device_capability` (from the profile's generation),
  `get_device_properties` (name, `total_memory`, capability), `is_bf16_supported`, and the
  same in `torch.accelerator`; NCCL, which PyTorch's CUDA builds ship:
  `torch.distributed.is_nccl_available` (True) and `torch.cuda.nccl.version` (`NCCL_VERSION`),
  which torchtune asks before it trains in bf16 (torchtune/training/precision.py,
  `verify_bf16_support`, torchtune 0.6.1: a CPU build has no NCCL and the check fails);
- memory: `memory_allocated` / `max_memory_allocated` are the live and peak bytes of the
  device tensors memplan's recorder sees (each rounded to the caching allocator's 512-byte
  blocks, memplan.alloc.conf); `memory_reserved` / `max_memory_reserved` answer the same
  figures (the caching allocator's reserved memory is known only after the run, from the
  allocator replay of the estimate); `mem_get_info` is (capacity - CUDA context - reserved,
  capacity); `memory_stats` / `memory_summary` hold these; `reset_peak_memory_stats` resets
  the peak;
- streams: `Stream`, `current_stream`, `default_stream`, `stream(...)`, `set_stream` and
  `with stream:` (and the same of `torch.cpu`, the device FSDP2's mesh has in a cuda run)
  keep which stream the program's work is on, and each device buffer is
  traced on the stream it was allocated on (`World.stream`): the caching allocator keeps a
  pool per stream (c10/cuda/CUDACachingAllocator.cpp, blocks are reused only by the
  stream they were allocated on), and FSDP2 allocates its all-gather outputs and its
  sharded gradients on streams of their own (torch/distributed/fsdp/_fully_shard/
  _fsdp_collectives.py, `foreach_all_gather`, `foreach_reduce`, torch 2.13); waits and
  events are no-ops (memory is traced in program order);
- no-ops: `synchronize`, `empty_cache`, `ipc_collect`, `manual_seed*`, `nvtx` ranges; `get_rng_state` gives a 16-byte host tensor (a
  Philox seed and offset, as `CUDAGeneratorImpl::get_state`);
- `torch.autocast("cuda", ...)` (and `torch.cuda.amp.autocast`) runs CPU autocast with
  CUDA's default dtype (fp16) and CUDA's op lists (`memplan.capture.cuda_kernels
  .kernels_as_on_cuda`, with SDPA's fused CUDA kernels), as memplan traces every CUDA job;
- a device map's GPU indices (`from_pretrained(device_map="auto")`: accelerate's
  `infer_auto_device_map` numbers the GPUs; `device_map={"": 0}`) are `cuda:N`
  (transformers/integrations/accelerate.py, `_get_device_map`, transformers 5.23): on a
  CPU build `torch.device(0)` raises, there being no accelerator to number;
- optimizers default to the implementation they take on CUDA (foreach: torch/optim/
  optimizer.py, `_default_to_fused_or_foreach`, which on a CPU build would choose the
  per-parameter loop for the fake cpu parameters).

In every run (cuda or cpu) fake tensors count as the plain tensors they stand for where
PyTorch checks a tensor's type before its foreach paths (`_foreach_supported_types`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.hardware.devices import DeviceProfile
from memplan.program.patches import Patches
from memplan.program.world import World

NCCL_VERSION = (2, 27, 3)  # an NCCL 2.2x of the nvidia-nccl-cu12 wheels; programs check a floor (torchtune: 2.10)
CAPABILITY = {"volta": (7, 0), "turing": (7, 5), "ampere": (8, 0), "ada": (8, 9), "hopper": (9, 0),
              "blackwell": (10, 0)}


class _Stream:
    """A CUDA stream or event standing in for the real one: every wait is already satisfied.
    Each has a number of its own, in the order the run makes them (0: the default stream);
    `with stream:` makes it the stream new device buffers are allocated on (`CudaState.switch`),
    as `torch.cuda.stream(stream)` and `set_stream` do."""

    state: CudaState | None = None  # the run's, on the class `CudaState` makes for it

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.number = self.state.new_stream_number() if self.state is not None else 0

    def wait_stream(self, *_args: Any) -> None: ...
    def wait_event(self, *_args: Any) -> None: ...
    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else type(self)()
    def record(self, *_args: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True
    def is_capturing(self) -> bool:
        return False
    def elapsed_time(self, _other: Any) -> float:
        return 0.0
    def __enter__(self) -> _Stream:
        if self.state is not None:
            self.state.outer_streams.append(self.state.switch(self))
        return self
    def __exit__(self, *exc: Any) -> None:
        if self.state is not None:
            self.state.switch(self.state.outer_streams.pop())


@contextlib.contextmanager
def _nothing(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


class CudaState:
    """The facade's answers (module docstring): the profile and the rank's device."""

    def __init__(self, world: World, profile: DeviceProfile, device_count: int, local_rank: int) -> None:
        self.world = world
        self.profile = profile
        self.count = max(1, device_count)
        self.current = local_rank % self.count
        self._streams_made = 0
        self.stream_class = type("Stream", (_Stream,), {"state": self})
        self.default_stream = self.stream_class()
        self.current_stream = self.default_stream
        self.outer_streams: list[_Stream] = []  # of the `with stream:` blocks the program is in

    def new_stream_number(self) -> int:
        self._streams_made += 1
        return self._streams_made - 1

    def switch(self, stream: Any) -> _Stream:
        """Make `stream` (the default stream for anything else) the one new device buffers are
        allocated on (`World.stream`); the stream that was."""
        previous = self.current_stream
        self.current_stream = stream if isinstance(stream, _Stream) else self.default_stream
        self.world.stream = self.current_stream.number
        return previous

    @contextlib.contextmanager
    def stream_context(self, stream: Any = None) -> Iterator[None]:
        """`torch.cuda.stream(stream)`: `None` changes nothing."""
        if stream is None:
            yield
            return
        previous = self.switch(stream)
        try:
            yield
        finally:
            self.switch(previous)

    def set_device(self, device: Any) -> None:
        index = device.index if isinstance(device, torch.device) else (
            int(str(device).split(":")[1]) if isinstance(device, str) and ":" in device else device)
        if isinstance(index, int):
            self.current = index

    def properties(self, _device: Any = None) -> Any:
        major, minor = CAPABILITY.get(self.profile.generation, (8, 0))
        return SimpleNamespace(name=self.profile.name, total_memory=self.profile.capacity_bytes, major=major,
                               minor=minor, multi_processor_count=0, is_integrated=False,
                               is_multi_gpu_board=False, uuid="memplan", L2_cache_size=0, gcnArchName="")

    def stats(self, _device: Any = None) -> dict[str, int]:
        w = self.world
        return {"allocated_bytes.all.current": w.allocated_bytes, "allocated_bytes.all.peak": w.peak_allocated_bytes,
                "reserved_bytes.all.current": w.allocated_bytes, "reserved_bytes.all.peak": w.peak_allocated_bytes,
                "active_bytes.all.current": w.allocated_bytes, "active_bytes.all.peak": w.peak_allocated_bytes,
                "num_alloc_retries": 0, "num_ooms": 0}

    def summary(self, _device: Any = None, abbreviated: bool = False) -> str:
        w = self.world
        return (f"memplan run ({self.profile.name}): allocated {w.allocated_bytes} B, "
                f"peak {w.peak_allocated_bytes} B (device tensors traced so far)")

    def mem_get_info(self, _device: Any = None) -> tuple[int, int]:
        total = self.profile.capacity_bytes
        context = self.profile.cuda_context_bytes or 0
        return max(0, total - context - self.world.allocated_bytes), total

    def reset_peak(self, _device: Any = None) -> None:
        self.world.peak_allocated_bytes = self.world.allocated_bytes


def _functions(state: CudaState) -> dict[str, Any]:
    """The `torch.cuda` functions the facade replaces, by name (module docstring)."""
    w = state.world
    rng = lambda *_a, **_k: torch.zeros(16, dtype=torch.uint8)  # noqa: E731 - Philox seed + offset
    return {
        "is_available": lambda: True, "device_count": lambda: state.count, "is_initialized": lambda: True,
        "init": lambda: None, "_lazy_init": lambda: None, "current_device": lambda: state.current,
        "set_device": state.set_device, "get_device_name": lambda *_a: state.profile.name,
        "get_device_capability": lambda *_a: CAPABILITY.get(state.profile.generation, (8, 0)),
        "get_device_properties": state.properties, "is_bf16_supported": lambda *_a, **_k:
            CAPABILITY.get(state.profile.generation, (8, 0)) >= (8, 0),
        "mem_get_info": state.mem_get_info, "memory_allocated": lambda *_a: w.allocated_bytes,
        "max_memory_allocated": lambda *_a: w.peak_allocated_bytes, "memory_reserved": lambda *_a: w.allocated_bytes,
        "max_memory_reserved": lambda *_a: w.peak_allocated_bytes, "memory_stats": state.stats,
        "memory_summary": state.summary, "reset_peak_memory_stats": state.reset_peak,
        "reset_max_memory_allocated": state.reset_peak, "reset_accumulated_memory_stats": lambda *_a: None,
        "synchronize": lambda *_a: None, "empty_cache": lambda: None, "ipc_collect": lambda: None,
        "manual_seed": lambda *_a: None, "manual_seed_all": lambda *_a: None, "seed": lambda: None,
        "seed_all": lambda: None, "initial_seed": lambda: 0, "get_rng_state": rng,
        "get_rng_state_all": lambda: [rng() for _ in range(state.count)], "set_rng_state": lambda *_a, **_k: None,
        "set_rng_state_all": lambda *_a: None, "Stream": state.stream_class, "Event": state.stream_class,
        "ExternalStream": state.stream_class, "current_stream": lambda *_a, **_k: state.current_stream,
        "default_stream": lambda *_a, **_k: state.default_stream, "set_stream": state.switch,
        "stream": state.stream_context, "device": _nothing, "device_of": _nothing,
    }


def install(world: World, patches: Patches, profile: DeviceProfile, *, device_count: int, local_rank: int) -> None:
    """Answer `torch.cuda`, `torch.accelerator` and autocast as the GPU of `profile` (module docstring)."""
    state = CudaState(world, profile, device_count, local_rank)
    functions = _functions(state)
    for name, value in functions.items():
        patches.set(torch.cuda, name, value)
    # FSDP2 takes the stream API of its mesh's device type (`_get_device_handle`,
    # torch/distributed/device_mesh.py), which is `cpu` in a cuda run (memplan.program.distributed)
    for name in ("Stream", "Event", "current_stream", "stream"):
        patches.set(torch.cpu, name, functions[name])
    for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
        patches.set(torch.cuda.nvtx, name, lambda *_a, **_k: None)
    patches.set(torch.cuda.nvtx, "range", _nothing)
    patches.set(torch.cuda.nccl, "version", lambda: NCCL_VERSION)
    patches.set(torch.distributed, "is_nccl_available", lambda: True)
    # functions of their own, not torch.cuda's: TorchDynamo keys its handlers by function
    # (torch/_dynamo/variables/torch.py, `_get_handlers`: `torch.accelerator.current_stream`
    # and `torch.cuda.current_stream` in one `register`), and refuses one function twice
    accelerator = {"is_available": lambda *_a, **_k: True, "device_count": lambda *_a, **_k: state.count,
                   "current_accelerator": lambda *_a, **_k: torch.device("cuda"),
                   "current_device_index": lambda *_a, **_k: state.current,
                   "set_device_index": lambda device, *_a: state.set_device(device), "synchronize": lambda *_a: None,
                   "current_stream": lambda *_a, **_k: state.current_stream,
                   "set_stream": lambda stream, *_a: state.switch(stream)}
    for name, value in accelerator.items():
        patches.set(torch.accelerator, name, value)
    _redirect_autocast(patches)
    _cuda_optimizer_defaults(patches)
    _device_map_indices_as_cuda(patches)
    _flex_attention_as_on_cuda(patches)
    from torch.utils.data._utils import pin_memory

    patches.set(pin_memory, "pin_memory", lambda data, *_a, **_k: data)  # host copies: not device memory


def visible_device_count(nproc_per_node: int) -> int:
    """The GPUs each process of the node sees: as many as `CUDA_VISIBLE_DEVICES` names where the
    environment sets it (the user's, or a launcher's: accelerate's `--gpu_ids`), else one per
    process the launcher starts on the node."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return nproc_per_node
    return len([d for d in visible.split(",") if d.strip()])


@contextlib.contextmanager
def answering(profile: DeviceProfile) -> Iterator[None]:
    """`torch.cuda` answered as one GPU of `profile` outside a program's run: while a
    launcher's own CLI reads the command (TRL's `TrainingArguments.__post_init__` checks that
    the GPU it would train on supports bf16)."""
    patches = Patches()
    install(World("cuda", None), patches, profile, device_count=1, local_rank=0)
    try:
        yield
    finally:
        patches.restore()


def _redirect_autocast(patches: Patches) -> None:
    """`torch.autocast("cuda")` as CPU autocast with CUDA's default dtype; its queries likewise."""
    from torch.amp import autocast_mode

    init = autocast_mode.autocast.__init__

    def autocast_init(self: Any, device_type: str, dtype: Any = None, enabled: bool = True,
                      cache_enabled: Any = None) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    patches.set(autocast_mode.autocast, "__init__", autocast_init)
    enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    patches.set(torch, "is_autocast_enabled",
                lambda device_type="cuda": enabled("cpu" if device_type == "cuda" else device_type))
    patches.set(torch, "get_autocast_dtype",
                lambda device_type: get_dtype("cpu" if device_type == "cuda" else device_type))


def _device_map_indices_as_cuda(patches: Patches) -> None:
    """A `from_pretrained` device map's GPU indices as `cuda:N` (module docstring)."""
    try:
        from transformers.integrations import accelerate as hf_accelerate
    except ImportError:
        return
    get_device_map = hf_accelerate._get_device_map

    def device_map_on_cuda(*args: Any, **kwargs: Any) -> Any:
        device_map = get_device_map(*args, **kwargs)
        if isinstance(device_map, dict):
            return {k: f"cuda:{v}" if isinstance(v, int) and not isinstance(v, bool) else v
                    for k, v in device_map.items()}
        return device_map

    patches.everywhere(get_device_map, device_map_on_cuda, ("transformers",))


def _flex_attention_as_on_cuda(patches: Patches) -> None:
    """`flex_attention` of fake tensors takes its backward as on CUDA: PyTorch refuses a
    backward for cpu inputs before dispatch (torch/nn/attention/flex_attention.py,
    `_validate_device`); on fake inputs its operators give their FakeTensor outputs (the
    output and the fp32 log-sum-exp the CUDA kernel saves; its backward's gradients)."""
    from torch.nn.attention import flex_attention

    validate = flex_attention._validate_device

    def validate_device(query: Any, key: Any, value: Any) -> None:
        if not (isinstance(query, FakeTensor) and query.device.type == "cpu"):
            validate(query, key, value)

    patches.set(flex_attention, "_validate_device", validate_device)


def _cuda_optimizer_defaults(patches: Patches) -> None:
    """Optimizers choose CUDA's default implementation for the fake cpu parameters."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    devices = _foreach_utils._get_foreach_kernels_supported_devices
    fused = _foreach_utils._get_fused_kernels_supported_devices
    patches.set(optimizer, "_get_foreach_kernels_supported_devices", lambda: [*devices(), "cpu"])
    patches.set(optimizer, "_get_fused_kernels_supported_devices", lambda: [*fused(), "cpu"])


def count_fakes_as_tensors(patches: Patches) -> None:
    """Fake tensors pass PyTorch's foreach type checks as the tensors they stand for (module docstring)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for owner in (optimizer, _foreach_utils):
        types = getattr(owner, "_foreach_supported_types", None)
        if isinstance(types, list) and FakeTensor not in types:
            patches.set(owner, "_foreach_supported_types", [*types, FakeTensor])
