"""The recorder of a program run: memplan's dispatch-level recorder with the world's devices.

`ProgramRecorder` is `memplan.parallel.traced.DistributedRecorder` (the recorder that sees
through DTensors and FSDP's in-place storage frees; docs/capture.md), with what a program
run adds:

- **devices.** Each buffer is labelled with where the program's tensor lives
  (memplan.program.world): `cuda:0` for device memory, `host:pageable` for a real tensor
  the program keeps on the host in a CUDA job (its data, its CPU metrics), `cpu` for every
  tensor of a CPU job. A real tensor made inside the model's code, or from device tensors,
  is device memory (`x.device` is the fake cpu there, so the program's `device=x.device`
  cannot say so).
- **counters.** The live and peak bytes of device buffers (each rounded to the caching
  allocator's 512-byte blocks) as the program runs: what `torch.cuda.memory_allocated()`
  answers (memplan.program.cuda_api).
- **a real tensor written with fake values.** An in-place op on a real tensor with a fake
  input (`buffer.copy_(fake)`) runs on the fake copy FakeTensorMode makes of it (memoized:
  every later use of the real tensor is that fake copy). The copy is the same memory as the
  real tensor: its storage is recorded as another name of the real tensor's buffer, not as
  a new allocation. So is the fake copy a tensor subclass holds in place of a real inner
  tensor (`World.fake_mixed_subclasses`: torchao's low-bit optimizer states).
- **attention shapes.** The first SDPA kernel's sequence length, head size and dtype, which
  the GPU-only attention workspace terms need (`memplan.trace.edit.attention_kernel_buffers`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from memplan.alloc.conf import round_size_plain
from memplan.capture.recorder import _tensors
from memplan.parallel.traced import DistributedRecorder
from memplan.program.world import World

SDPA_OPS = frozenset({"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                      "aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten::_scaled_dot_product_cudnn_attention"})
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class ProgramRecorder(DistributedRecorder):
    """The recorder of a program run (module docstring)."""

    def __init__(self, world: World) -> None:
        super().__init__(record_flops=True, compiled_regions=True)
        # a higher-order operator the program calls eagerly (flex attention's, whose fake
        # implementation gives the output and log-sum-exp the CUDA kernel allocates) is
        # one op, recorded with what it returns (memplan.capture.recorder)
        self.supports_higher_order_operators = True
        self.world = world
        self.device_label = "cuda:0" if world.cuda else "cpu"
        self.attention: dict[str, Any] | None = None
        self._op_on_device = False
        self._charged: dict[int, int] = {}  # device buffer -> its 512-byte-rounded bytes
        world.on_fake_copy = self.alias_fake_copy

    def _new_buffer(self, storage: Any, device: torch.device, *, preexisting: bool, op: int) -> int:
        fake = storage.device.type == "meta"
        world = self.world
        on_device = world.storage_on_device(storage, fake)
        if not on_device and not fake and not preexisting and self._op_on_device and world.cuda:
            world._device_storages[storage] = True
            on_device = True
        label = self.device_label if on_device else "host:pageable"
        self.stream = world.stream if on_device else 0
        idx = super()._new_buffer(storage, label, preexisting=preexisting, op=op)
        if on_device:
            charged = round_size_plain(int(storage.nbytes())) if storage.nbytes() else 0
            self._charged[idx] = charged
            world.allocated_bytes += charged
            world.peak_allocated_bytes = max(world.peak_allocated_bytes, world.allocated_bytes)
        return idx

    def _make_free_callback(self, idx: int) -> Any:
        free = super()._make_free_callback(idx)

        def on_free(ref: weakref.ref) -> None:
            events = len(self._ev_kind)
            free(ref)
            if len(self._ev_kind) > events or not self.active:
                self._uncharge(idx)

        return on_free

    def _uncharge(self, idx: int) -> None:
        self.world.allocated_bytes -= self._charged.pop(idx, 0)

    def storage_freed(self, tensor: torch.Tensor) -> None:
        idx = self._ids.get(tensor.untyped_storage())
        super().storage_freed(tensor)
        if idx is not None:
            self._uncharge(idx)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.active:
            return func(*args, **(kwargs or {}))
        tensors = _tensors((args, kwargs))
        self.world.fake_mixed_subclasses(tensors)  # an op from C++ the world's function mode did not see
        fakes = [t for t in tensors if is_fake(t)]
        if fakes and len(fakes) < len(tensors):
            self._alias_written_reals(func, args)
        world = self.world
        self._op_on_device = world.cuda and (world.in_model_code() or any(world.on_device(t) for t in tensors))
        if self.attention is None and getattr(getattr(func, "_schema", None), "name", "") in SDPA_OPS:
            self._note_attention(args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _alias_written_reals(self, func: Any, args: Any) -> None:
        """A real tensor an op writes with fake inputs: its fake copy is the same buffer (module docstring)."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return
        for argument, value in zip(schema.arguments, args):
            info = argument.alias_info
            if info is None or not info.is_write or not isinstance(value, torch.Tensor) or is_fake(value):
                continue
            self.alias_fake_copy(value, self.world.fake_mode.from_tensor(value))

    def alias_fake_copy(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """`fake`, the fake copy of `real`, is recorded as the same buffer (module docstring)."""
        if not self.active:
            return
        idx = self.buffer_of(real)
        fake_storage = fake.untyped_storage()
        if self._ids.get(fake_storage) is None:
            self._ids[fake_storage] = idx
            self._alias_count[idx] = self._alias_count.get(idx, 0) + 1
            self._alias_refs.append(weakref.ref(fake_storage, self._make_free_callback(idx)))

    def _note_attention(self, args: Any) -> None:
        query = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if query is not None and query.dim() == 4:
            self.attention = {"seq": int(query.shape[-2]), "head_dim": int(query.shape[-1]),
                              "dtype": DTYPE_NAMES.get(query.dtype, "fp32")}
