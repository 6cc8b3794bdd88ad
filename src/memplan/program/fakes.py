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
- **Checkpoints of shapes only.** A tensor saved from the `meta` device is pickled with no
  data, as `torch._utils._rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad)`
  (torch/_tensor.py, `Tensor._reduce_ex_internal`). For the run that function gives a fake
  tensor (host memory) of a floating-point dtype, so a `state_dict` of a model built on
  `meta` and `torch.save`d is a checkpoint of the model's shapes whichever unpickler reads
  it: `torch.load`, or Lightning's lazy loader (`lightning.fabric.utilities.load._lazy_load`,
  which LitGPT's `load_checkpoint` uses) that takes other classes from `torch._utils` by name.
- **bitsandbytes' `Params4bit`.** Its constructor wraps its data with
  `Tensor._make_subclass`, which a fake tensor refuses; for the run a `Params4bit` of fake
  data is a fake tensor of that class (`memplan.models.quant`, `fake_params4bit_class`) with
  the attributes the constructor sets. Its `.to(device)` quantises an unquantised weight as
  bitsandbytes' `Params4bit.to` does (`_quantize`: `functional.quantize_4bit`, whose fake
  kernels give the packed weight and its constants their shapes), else it is the weight
  moved (bitsandbytes/nn/modules.py, bitsandbytes 0.50.0). Lightning Fabric's
  `BitsandbytesPrecision` builds, quantises and loads its layers through these.
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


def patch_meta_unpickling(world: World, patches: Patches) -> None:
    """A floating-point tensor unpickled from the `meta` device is a fake one for the run
    (module docstring, "Checkpoints of shapes only")."""
    import functools

    import torch._utils

    original = torch._utils._rebuild_meta_tensor_no_storage

    @functools.wraps(original)  # torch.load's weights-only allowlist names it by module and qualname
    def rebuild(dtype: torch.dtype, size: Any, stride: Any, requires_grad: bool) -> torch.Tensor:
        t = original(dtype, size, stride, requires_grad)
        if not (t.is_floating_point() or t.is_complex()):
            return t
        fake = world.tag_host(world.fake_like(t))
        return fake.requires_grad_(requires_grad) if requires_grad else fake

    patches.set(torch._utils, "_rebuild_meta_tensor_no_storage", rebuild)
    # torch.load's weights-only allowlist is computed once (an lru_cache): not with this in it
    # beyond the run
    allowed = torch._weights_only_unpickler._get_allowed_globals
    allowed.cache_clear()
    patches.on_restore(allowed.cache_clear)


def patch_params4bit(world: World, patches: Patches) -> None:
    """bitsandbytes' `Params4bit` of fake data is a fake `Params4bit` (module docstring), from
    when the program imports bitsandbytes."""

    def apply(module: Any) -> None:
        if module.__name__ == "bitsandbytes.nn.modules":
            _fake_params4bit(world, patches, module.Params4bit)

    patches.on_import("bitsandbytes", apply)
    patches.on_import("lightning.fabric.plugins.precision.bitsandbytes",
                      lambda module: _fabric_quantises_on_the_device(world, patches, module))


def _fabric_quantises_on_the_device(world: World, patches: Patches, module: Any) -> None:
    """Lightning Fabric's 4-bit layer quantises its weight in its constructor where it is made
    on the GPU, which it asks as `torch.tensor(0, device=device).device.type == "cuda"`
    (lightning/fabric/plugins/precision/bitsandbytes.py, `_Linear4bit.__init__`, lightning
    2.6.6); in the run every tensor is on the cpu, so the question is asked of the world: is
    that tensor device memory. Its classes are made by `_import_bitsandbytes`."""
    if not hasattr(module, "_import_bitsandbytes"):
        return
    original_import = module._import_bitsandbytes

    def import_bitsandbytes() -> Any:
        bnb = original_import()
        linear = module.__dict__.get("_Linear4bit")
        if linear is not None and not getattr(linear.__init__, "_memplan", False):
            original_init = linear.__init__

            def init(self: Any, *args: Any, device: Any = None, **kwargs: Any) -> None:
                original_init(self, *args, device=device, **kwargs)
                if not self.weight.bnb_quantized and world.on_device(torch.tensor(0, device=device)):
                    self.quantize_()

            init._memplan = True  # type: ignore[attr-defined]
            patches.set(linear, "__init__", init)
        return bnb

    patches.set(module, "_import_bitsandbytes", import_bitsandbytes)


_PARAMS4BIT_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
                      "bnb_quantized", "module")


def _fake_params4bit(world: World, patches: Patches, params4bit: type) -> None:
    """Replace `Params4bit.__new__` so that fake data makes a fake `Params4bit` whose `to`
    quantises or moves it as bitsandbytes' does (module docstring)."""
    from memplan.models.quant import fake_parameter as fake_quantised_parameter
    from memplan.models.quant import fake_params4bit_class

    original_new = params4bit.__new__
    fake: list[type] = []  # made at the first fake weight: bitsandbytes is still importing now

    def make(data: torch.Tensor, requires_grad: bool, fields: dict[str, Any]) -> Any:
        if not fake:
            fake.append(type("Params4bit", (fake_params4bit_class(),), {
                "__module__": __name__, "__doc__": "A fake Params4bit of the run (memplan.program.fakes).",
                "to": to, "cuda": lambda self, device=None, non_blocking=False: self.to(device or "cuda"),
                "cpu": lambda self: self.to("cpu"), "_quantize": quantize, "detach": detach}))
        param = fake_quantised_parameter(data, fake[0])
        param.__dict__.update(fields)
        if requires_grad:
            param.requires_grad_(True)
        if not world.on_device(data):
            world.tag_host(param)
        return param

    def new(cls: type, data: Any = None, requires_grad: bool = False, quant_state: Any = None,
            blocksize: int | None = None, compress_statistics: bool = True, quant_type: str = "fp4",
            quant_storage: torch.dtype = torch.uint8, module: Any = None, bnb_quantized: bool = False,
            **kwargs: Any) -> Any:
        if not is_fake(data):
            return original_new(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                                quant_storage, module, bnb_quantized, **kwargs)
        return make(data, requires_grad, {
            "blocksize": 64 if blocksize is None else blocksize, "compress_statistics": compress_statistics,
            "quant_type": quant_type, "quant_state": quant_state, "quant_storage": quant_storage,
            "bnb_quantized": bnb_quantized, "module": module})

    def where_it_is(self: Any) -> torch.Tensor:
        """A plain fake tensor like `self`, in the same memory (device or host)."""
        like = world.fake_like(self)
        return like if world.on_device(self) else world.tag_host(like)

    def detach(self: Any) -> Any:
        """A fake `Params4bit` like `self` (`nn.Parameter(p)`, which `Module._apply` makes of
        each moved fake parameter, asks `detach()` for one of `p`'s own class)."""
        return make(where_it_is(self), False, {k: self.__dict__.get(k) for k in _PARAMS4BIT_FIELDS})

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device, _dtype, _non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type != "meta" and not self.bnb_quantized:
            return quantize(self, device)
        plain = torch.Tensor.to(where_it_is(self), *args, **kwargs)
        if plain.dtype == self.dtype and world.on_device(plain) == world.on_device(self):
            return self
        return make(plain, self.requires_grad, {k: self.__dict__.get(k) for k in _PARAMS4BIT_FIELDS})

    def quantize(self: Any, device: torch.device) -> Any:
        import bitsandbytes as bnb

        weight = torch.Tensor.to(where_it_is(self), device)
        packed, state = bnb.functional.quantize_4bit(
            weight, blocksize=self.blocksize, compress_statistics=self.compress_statistics,
            quant_type=self.quant_type, quant_storage=self.quant_storage)
        fields = {k: self.__dict__.get(k) for k in _PARAMS4BIT_FIELDS}
        quantised = make(packed, self.requires_grad, {**fields, "quant_state": state, "bnb_quantized": True})
        if self.module is not None:
            self.module.quant_state = state
        return quantised

    patches.set(params4bit, "__new__", new)
