"""Weights without memory: the program's parameters, buffers and checkpoints as fake tensors.

- **Modules.** PyTorch's global registration hooks
  (`torch.nn.modules.module.register_module_parameter_registration_hook` and its buffer
  twin, torch/nn/modules/module.py) may return a replacement for each parameter and buffer a
  module registers: here a fake copy (`FakeTensorMode.from_tensor`: shape, dtype, strides,
  `requires_grad`, no memory), so `Model(config)` builds a model of any size. The real tensor
  a module made first (`nn.Linear`'s `torch.empty`) is never written: initialisation runs on
  the fake one, and an untouched `empty` takes no resident memory. Parameters made on the
  `meta` device (`init_empty_weights`, `torch.device("meta")`) are left as they are.
- **safetensors.** `safe_open`, `load_file` and `load` read the file's header only (8 bytes
  of length, then the JSON table of names, dtypes and shapes: the format of
  huggingface/safetensors, docs "Format") and give fake tensors of those shapes and dtypes;
  the data is never read. This is what `from_pretrained` loads through
  (transformers/modeling_utils.py, `_load_pretrained_model`: `safe_open(...).get_slice(k)`,
  materialised by `tensor[...]` in core_model_loading.py), one tensor after the other
  (`FAKE_ENV`: FakeTensorMode is one state for all threads, and transformers materialises
  weights on a thread pool unless `HF_DEACTIVATE_ASYNC_LOAD` is set).
- **`.to()` of a fake module.** `Module._apply` swaps a fake parameter with its converted
  copy (`torch.utils.swap_tensors`), which refuses a tensor something holds a weak reference
  to; FakeTensorMode's converter memoizes the fake outputs of ops it computes afresh
  (`FakeTensorConverter.from_meta_and_device`) in a weak-value table, and so does every other
  fake mode that meets them (DTensor's sharding propagation makes its own). For the run, a
  swap of fake tensors first drops them from every such table (`swappable_fakes`). A
  `weakref.finalize` on a fake tensor (DeepSpeed's parameter-name map, deepspeed/utils/debug.py
  `WeakIdNameMap`) is detached before the swap and registered again on the same object after
  it: the swap keeps each object's identity, which is what a finalizer is about.
- **torch.load.** The file is memory-mapped where its format allows (`mmap=True`) and every
  floating-point tensor in it is replaced by a fake copy (weights, optimizer states); integer
  and boolean tensors (token ids, masks: data) stay real, so data files load as they are.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from memplan.program.patches import Patches
from memplan.program.world import World

FAKE_ENV = {"HF_DEACTIVATE_ASYNC_LOAD": "1"}
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def fake_parameter(world: World, param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A fake copy of `param` with its Python attributes (transformers' `_is_hf_initialized`)."""
    fake = torch.nn.Parameter(world.fake_like(param), requires_grad=param.requires_grad)
    for key, value in getattr(param, "__dict__", {}).items():
        setattr(fake, key, value)
    return world.tag_host(fake)


def _needs_fake(t: torch.Tensor | None) -> bool:
    return t is not None and not is_fake(t) and t.device.type != "meta"


def module_hooks(world: World) -> list[Any]:
    """Register the fake-parameter and fake-buffer hooks (module docstring); their handles."""
    from torch.nn.modules import module as module_mod

    def on_parameter(_module: torch.nn.Module, _name: str, param: Any) -> Any:
        return fake_parameter(world, param) if _needs_fake(param) else None

    def on_buffer(_module: torch.nn.Module, _name: str, buffer: Any) -> Any:
        return world.tag_host(world.fake_like(buffer)) if _needs_fake(buffer) else None

    return [module_mod.register_module_parameter_registration_hook(on_parameter),
            module_mod.register_module_buffer_registration_hook(on_buffer)]


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}, and `__metadata__`."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


class FakeSlice:
    """What `safe_open(...).get_slice(name)` returns, over a fake tensor: shape, dtype, indexing."""

    def __init__(self, world: World, dtype_name: str, shape: list[int]) -> None:
        self.world = world
        self.dtype_name = dtype_name
        self.shape = list(shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_name

    def fake(self) -> torch.Tensor:
        dtype = SAFETENSORS_DTYPES.get(self.dtype_name)
        if dtype is None:
            raise ValueError(f"safetensors dtype {self.dtype_name} is not one memplan can fake")
        return self.world.tag_host(self.world.fake(torch.empty, self.shape, dtype=dtype))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.world.tag_host(self.world.fake(lambda: self.fake()[index].clone()))


class FakeSafeOpen:
    """`safetensors.safe_open` reading the header only (module docstring)."""

    def __init__(self, world: World, filename: str | Path, framework: str = "pt", device: Any = "cpu",
                 **_kwargs: Any) -> None:
        self.world = world
        header = safetensors_header(filename)
        self._metadata = header.pop("__metadata__", None)
        self._entries = header

    def __enter__(self) -> FakeSafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._entries)

    def offset_keys(self) -> list[str]:
        return sorted(self._entries, key=lambda k: self._entries[k]["data_offsets"][0])

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def get_slice(self, name: str) -> FakeSlice:
        entry = self._entries[name]
        return FakeSlice(self.world, entry["dtype"], entry["shape"])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name).fake()

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {k: self.get_tensor(k) for k in self._entries}


def _drop_from_weak_table(ref: Any) -> None:
    """Remove the entry a `weakref.WeakValueDictionary` keeps through `ref` (a `KeyedRef`,
    whose callback takes a weak reference to its table as a default argument, CPython's
    Lib/weakref.py): a converter's memo, a cache."""
    import weakref

    if not isinstance(ref, weakref.KeyedRef) or ref.__callback__ is None:
        return
    for owner in getattr(ref.__callback__, "__defaults__", None) or ():
        table = owner() if isinstance(owner, weakref.ref) else None
        if isinstance(table, weakref.WeakValueDictionary):
            table.pop(ref.key, None)


def swappable_fakes(patches: Patches) -> None:
    """`torch.utils.swap_tensors` of fake tensors (module docstring)."""
    import weakref

    import torch.utils
    from torch._subclasses.fake_tensor import FakeTensor

    swap = torch.utils.swap_tensors

    def forget(t: torch.Tensor) -> list[tuple]:
        """Drop `t` from weak-value tables; detach its finalizers, returned to register again."""
        detached = []
        if isinstance(t, FakeTensor):
            for ref in weakref.getweakrefs(t):
                if isinstance(ref.__callback__, weakref.finalize):
                    detached.append(ref.__callback__.detach())
                else:
                    _drop_from_weak_table(ref)
        return [d for d in detached if d is not None]

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        finalizers = forget(t1) + forget(t2)  # a function of its own: its weak references die with it
        swap(t1, t2)
        for obj, func, args, kwargs in finalizers:
            weakref.finalize(obj, func, *args, **kwargs)

    patches.set(torch.utils, "swap_tensors", swap_tensors)


def _fake_floating(world: World, value: Any) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not is_fake(x) and (x.is_floating_point() or x.is_complex()):
            return world.tag_host(world.fake_like(x))
        return x
    return tree_map(one, value)


def patch_checkpoints(world: World, patches: Patches) -> None:
    """safetensors and torch.load give fake weights for the run (module docstring)."""
    import safetensors
    import safetensors.torch

    original_safe_open, original_load_file, original_load = (safetensors.safe_open, safetensors.torch.load_file,
                                                               torch.load)

    def safe_open(filename: str | Path, framework: str = "pt", device: Any = "cpu", **kwargs: Any) -> FakeSafeOpen:
        return FakeSafeOpen(world, filename, framework, device, **kwargs)

    def load_file(filename: str | Path, device: Any = "cpu") -> dict[str, torch.Tensor]:
        return FakeSafeOpen(world, filename).get_tensors()

    def load(data: bytes) -> dict[str, torch.Tensor]:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        header.pop("__metadata__", None)
        return {k: FakeSlice(world, v["dtype"], v["shape"]).fake() for k, v in header.items()}

    def torch_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, Path)) and "mmap" not in kwargs:
            try:
                return _fake_floating(world, original_load(f, *args, mmap=True, **kwargs))
            except RuntimeError:  # the legacy format cannot be mapped
                pass
        return _fake_floating(world, original_load(f, *args, **kwargs))

    prefixes = ("safetensors", "transformers", "accelerate", "peft", "__main__")
    patches.everywhere(original_safe_open, safe_open, prefixes)
    patches.everywhere(original_load_file, load_file, prefixes)
    patches.set(safetensors.torch, "load", load)
    patches.set(torch, "load", torch_load)
