"""The KV caches of transformers' `generate()` while it is traced: which buffers are the cache,
and the three caches whose device behaviour a fake cpu trace cannot run by itself.

- **Which buffers are the cache.** `cache_buffers(recorder)` wraps `Cache.update`
  (transformers 5.23, `cache_utils.py` L1540-1590): after each layer's update, every storage
  the layer holds (`keys`, `values`, a quantised layer's `_quantized_keys` /
  `_quantized_values` and their scales) is noted as KV cache, so the breakdown can put the
  cache apart from the other activations. Nothing about the cache's own code changes.
- **Offloaded cache** (`cache_implementation="offloaded"`: `DynamicCache(offloading=True)`,
  `Cache.update` L1565-1588, `CacheLayerMixin.offload` / `prefetch` L70-80). Before a layer's
  update, the next offloaded layer is prefetched to the GPU (circling back to the first one
  after the last); after it, the layer's keys and values are moved to the host with
  `.to("cpu", non_blocking=True)`, which from CUDA lands in pinned memory
  (`_to_copy` pins a non-blocking copy to the CPU). On fake cpu tensors the host and the GPU
  are one device and CUDA streams do not exist, so `offloaded_as_on_cuda()` runs the same
  order with the copies made explicitly: the host copy is a new buffer marked pinned host
  memory (`memplan.models.tracing.mark_host`), the prefetch a new device buffer; the stream
  synchronisation, which allocates nothing, is left out.
- **HQQ's quantised cache** (`HQQQuantizedLayer`, L909-963, backend of `quantized:int8`: the
  quanto backend has 2 and 4 bits only). HQQ's `Quantizer.quantize` (hqq 0.2.8,
  `hqq/core/quantize.py`) reads its optimiser's error with `.item()` to stop early, which no
  fake tensor can answer, so `ModelledHQQLayer` keeps transformers' `QuantizedLayer.update`
  (the residual window of `residual_length` tokens, the flush that re-quantises the whole
  cache) and models HQQ's two functions by what they keep: `quantize` makes the fp32 copy
  `W = tensor.float()` and returns the packed codes (8 bits: one uint8 per value) with a scale
  and a zero per group of `q_group_size` values in the cache's dtype; `dequantize` returns
  the values in the cache's dtype. HQQ's optimiser's own temporaries (fp32 copies of the
  group matrix over up to 20 iterations) are not modelled.
- **quanto's quantised cache** (`QuantoQuantizedLayer`, L854-906, backend of `quantized:int4`)
  runs as is, but one check of quanto's cannot see through a fake tensor:
  `WeightQBitsTensor.__init__` (optimum-quanto 0.2.7 `tensor/weights/qbits.py` L133-136) packs
  the 4-bit codes two to a byte (`PackedTensor.pack`) only when `type(data) is torch.Tensor`,
  which a `FakeTensor` is not; unpacked, the cache would hold twice its codes.
  `quanto_packs_fake_codes()` packs them there as a real tensor's are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memplan.capture.recorder import Recorder, inner_tensors
from memplan.models import tracing


def _held_tensors(layer: Any) -> list[torch.Tensor]:
    """Every plain tensor a cache layer holds: keys, values and quantised states."""
    held = []
    for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
        value = getattr(layer, name, None)
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, dict):
                item = [v for v in item.values() if isinstance(v, torch.Tensor)]
            for t in item if isinstance(item, list) else (item,):
                if isinstance(t, torch.Tensor):
                    held.extend(inner_tensors(t))
    return held


@contextlib.contextmanager
def cache_buffers(rec: Recorder, found: set[int]) -> Iterator[None]:
    """While active, the buffer of every storage a cache layer holds after an update is added
    to `found` (module docstring)."""
    from transformers.cache_utils import Cache

    update = Cache.update

    def noted_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                     *args: Any, **kwargs: Any) -> Any:
        out = update(self, key_states, value_states, layer_idx, *args, **kwargs)
        for t in _held_tensors(self.layers[layer_idx]):
            if t.numel():
                found.add(rec.buffer_of(t))
        return out

    Cache.update = noted_update
    try:
        yield
    finally:
        Cache.update = update


def _on_host(t: torch.Tensor) -> bool:
    return tracing.host_kind(t.untyped_storage()) is not None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t.to("cpu", non_blocking=True)` from a GPU: a pinned host copy."""
    out = torch.empty_like(t)
    tracing.mark_host(out, "pinned")
    return out.copy_(t)


def _device_copy(t: torch.Tensor) -> torch.Tensor:
    """`t.to(device, non_blocking=True)` from the host: a device copy."""
    return torch.empty_like(t).copy_(t)


def _offload(layer: Any) -> None:
    if layer.is_initialized and not _on_host(layer.keys):
        layer.keys, layer.values = _host_copy(layer.keys), _host_copy(layer.values)


def _prefetch(layer: Any) -> None:
    if layer.is_initialized and _on_host(layer.keys):
        layer.keys, layer.values = _device_copy(layer.keys), _device_copy(layer.values)


@contextlib.contextmanager
def offloaded_as_on_cuda() -> Iterator[None]:
    """The offloaded cache's moves between GPU and host, as on CUDA, on fake cpu tensors
    (module docstring): `Cache.__init__` keeps `offloading` without making a CUDA stream, and
    `Cache.update` prefetches and offloads with explicit copies."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    init, update = Cache.__init__, Cache.update
    layer_offload, layer_prefetch = CacheLayerMixin.offload, CacheLayerMixin.prefetch

    def init_without_stream(self: Any, *args: Any, offloading: bool = False, **kwargs: Any) -> None:
        init(self, *args, offloading=False, **kwargs)
        self.offloading = offloading
        self.only_non_sliding = kwargs.get("offload_only_non_sliding", True) if offloading else False
        self.prefetch_stream = contextlib.nullcontext()  # `Cache.prefetch` copies under it: no stream here

    def offloading_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                          *args: Any, **kwargs: Any) -> Any:
        if not self.offloading:
            return update(self, key_states, value_states, layer_idx, *args, **kwargs)
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        out = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        self.offload(layer_idx, self.only_non_sliding)
        return out

    Cache.__init__, Cache.update = init_without_stream, offloading_update
    CacheLayerMixin.offload, CacheLayerMixin.prefetch = _offload, _prefetch
    try:
        yield
    finally:
        Cache.__init__, Cache.update = init, update
        CacheLayerMixin.offload, CacheLayerMixin.prefetch = layer_offload, layer_prefetch


def modelled_hqq_layer() -> type:
    """`ModelledHQQLayer`: transformers' `QuantizedLayer` with HQQ's storage (module docstring)."""
    from transformers.cache_utils import QuantizedLayer

    class ModelledHQQLayer(QuantizedLayer):
        def _quantize(self, tensor: torch.Tensor, axis: int) -> tuple[torch.Tensor, dict[str, Any]]:
            work = tensor.float()  # hqq's first step: W = tensor.float()
            groups = tensor.numel() // self.q_group_size
            codes = torch.empty(tensor.numel() * self.nbits // 8, dtype=torch.uint8, device=tensor.device)
            scale = torch.empty((1, groups), dtype=tensor.dtype, device=tensor.device)
            zero = torch.empty((1, groups), dtype=tensor.dtype, device=tensor.device)
            del work
            return codes, {"scale": scale, "zero": zero, "shape": tensor.shape, "dtype": tensor.dtype}

        def _dequantize(self, qtensor: tuple[torch.Tensor, dict[str, Any]]) -> torch.Tensor:
            codes, meta = qtensor
            return codes.to(meta["dtype"]).reshape(meta["shape"]) if self.nbits == 8 else \
                torch.empty(meta["shape"], dtype=meta["dtype"], device=codes.device)

    return ModelledHQQLayer


@contextlib.contextmanager
def quanto_packs_fake_codes() -> Iterator[None]:
    """quanto packs the 4-bit codes of a fake tensor as of a real one (module docstring)."""
    from optimum.quanto.tensor.packed import PackedTensor
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor
    from torch._subclasses.fake_tensor import FakeTensor

    init = WeightQBitsTensor.__init__

    def packing_init(self: Any, qtype: Any, axis: int, group_size: int, size: Any, stride: Any, data: Any,
                     *args: Any, **kwargs: Any) -> None:
        if type(data) is FakeTensor:
            data = PackedTensor.pack(data, qtype.bits)
        init(self, qtype, axis, group_size, size, stride, data, *args, **kwargs)

    WeightQBitsTensor.__init__ = packing_init
    try:
        yield
    finally:
        WeightQBitsTensor.__init__ = init


@contextlib.contextmanager
def hqq_modelled() -> Iterator[None]:
    """`QuantizedCache(backend="hqq")` builds `ModelledHQQLayer`s (module docstring)."""
    import transformers.cache_utils as cache_utils

    real = cache_utils.HQQQuantizedLayer
    cache_utils.HQQQuantizedLayer = modelled_hqq_layer()
    try:
        yield
    finally:
        cache_utils.HQQQuantizedLayer = real
