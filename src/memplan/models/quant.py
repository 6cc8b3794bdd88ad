"""Quantised base weights: bitsandbytes' layers in place of a model's linear layers (QLoRA).

What `build_model` does for `setup.quant` is what `from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))` followed by peft's
`prepare_model_for_kbit_training` does, with the libraries' own code:

- transformers' bitsandbytes quantizer (`quantizers/quantizer_bnb_4bit.py`,
  `quantizer_bnb_8bit.py`) picks the modules to keep: `get_keys_to_not_convert`
  (`quantizers/base.py`: the output embeddings, tied weights and the last module, i.e. the LM
  head) plus `llm_int8_skip_modules` and the model's `_keep_in_fp32_modules`; its
  `replace_with_bnb_linear` (`integrations/bitsandbytes.py`) swaps every other `nn.Linear`
  (and GPT-2's `Conv1D`) for `bnb.nn.Linear4bit` (`nf4`/`fp4`, with the setup's
  `double_quant`, `quant_storage` and compute dtype) or `bnb.nn.Linear8bitLt` (`int8`,
  `llm_int8_threshold=6.0`, no fp16 weights: transformers' defaults);
- each weight is then quantised as transformers loads it (`Bnb4bitQuantize.convert`:
  `Params4bit(value, ...).to(device)`, which calls `bitsandbytes.functional.quantize_4bit`;
  `Bnb8bitQuantize.convert`: `Int8Params(...).to(device)`, which calls
  `int8_vectorwise_quant`); biases stay in the model's dtype;
- `kbit_prep`: peft's `prepare_model_for_kbit_training` (`peft/utils/other.py`) freezes
  every parameter and casts every fp16/bf16 parameter that is not a `Params4bit` to fp32
  (embeddings, norms, the LM head). It is called without its gradient checkpointing:
  memplan's `checkpointing` applies transformers' non-reentrant checkpointing, with which
  peft adds nothing else (it enables input gradients only for reentrant checkpointing).

On fake tensors no real weight exists, so none is quantised: the model is built with fake
weights, and bitsandbytes' own `quantize_4bit` / `int8_vectorwise_quant` run on them
through their registered fake kernels (`bitsandbytes/_ops.py`), which give the packed
weight and its constants their real shapes: `((n + 1) // (2 * itemsize), 1)` elements of
the storage dtype for n weights, one fp32 absmax per 64-weight block, with double
quantisation one uint8 code per block, an fp32 absmax per 256 of those, a 256-entry fp32
map and an fp32 offset; int8: an int8 [out, in] weight and one fp32 scale per row. A
`Params4bit` cannot wrap a `FakeTensor` (`Tensor._make_subclass` refuses a tensor that
already has a Python object), so on fake tensors the weight is a `FakeTensor` that is also
a `Params4bit` (`Int8Params`) and keeps that class name, which peft dispatches on
(`dequantize_bnb_weight`). A 70B model is quantised in seconds with no memory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.errors import UserError
from memplan.models.dtypes import TORCH_DTYPES
from memplan.models.setup import TrainingSetup

QUANT_STORAGE_DTYPES = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(setup: TrainingSetup) -> str:
    """The dtype 4-bit matmuls dequantise to: the setup's `compute_dtype`, else its autocast
    dtype, else its parameter dtype."""
    if setup.compute_dtype is not None:
        return setup.compute_dtype
    return setup.autocast_dtype if setup.autocast_dtype != "none" else setup.dtype


def bnb_config(setup: TrainingSetup) -> Any:
    """transformers' `BitsAndBytesConfig` for the setup (its defaults for everything the
    setup does not name: `llm_int8_threshold=6.0`, no fp16 weights for int8)."""
    from transformers import BitsAndBytesConfig

    if setup.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=setup.quant,
        bnb_4bit_use_double_quant=setup.double_quant,
        bnb_4bit_compute_dtype=TORCH_DTYPES[compute_dtype(setup)],
        bnb_4bit_quant_storage=QUANT_STORAGE_DTYPES[setup.quant_storage],
    )


def quantise_base(model: nn.Module, setup: TrainingSetup, fake: bool) -> None:
    """Replace `model`'s linear layers with bitsandbytes' quantised layers and quantise
    their weights, as `from_pretrained` with a `BitsAndBytesConfig` does (module docstring).
    `fake`: the model's tensors are fake (no weight is quantised for real)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UserError(f"`quant` quantises a Hugging Face model as transformers loads it; {type(model).__name__} "
                        "is not one: pass a registry name or a config.json")
    quantizer = _quantizer(setup)
    originals = dict(model.named_modules())
    with _outside_fake_mode():  # replace_with_bnb_linear makes the new modules on the meta device
        quantizer.preprocess_model(model, device_map={"": "cpu"})
    replaced = [(name, module) for name, module in model.named_modules() if module is not originals.get(name)
                and _is_bnb_linear(module)]
    if not replaced:
        raise UserError(f"`quant`: {type(model).__name__} has no linear layer to quantise "
                        "(transformers keeps the LM head unquantised)")
    for name, module in replaced:
        _load_weights(model, name, module, originals[name], quantizer, fake)
    quantizer.postprocess_model(model)


def _quantizer(setup: TrainingSetup) -> Any:
    if setup.quant == "int8":
        from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer

        return Bnb8BitHfQuantizer(bnb_config(setup), pre_quantized=False)
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    return Bnb4BitHfQuantizer(bnb_config(setup), pre_quantized=False)


def _is_bnb_linear(module: nn.Module) -> bool:
    import bitsandbytes as bnb

    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def _outside_fake_mode() -> Any:
    """Outside any `FakeTensorMode`: modules made on the meta device are then real meta
    tensors, which `Params4bit` and `Int8Params` can wrap, and tensors made are real."""
    return unset_fake_temporarily()


def _load_weights(model: nn.Module, name: str, module: nn.Module, original: nn.Module, quantizer: Any,
                  fake: bool) -> None:
    """Quantise `original`'s weight into `module` (the bnb layer that replaced it) and give
    `module` the original bias."""
    value = original.weight.detach()
    if fake:
        _load_fake(module, value, original)
    else:
        ops = quantizer.get_quantize_ops()
        result = ops.convert({f"{name}.weight": value}, full_layer_name=f"{name}.weight", model=model)
        module._parameters["weight"] = result[f"{name}.weight"]
    if original.bias is not None:
        module.bias = original.bias


def _load_fake(module: nn.Module, value: torch.Tensor, original: nn.Module) -> None:
    """The quantised weight of `module` from the fake `value`, through bitsandbytes' own
    quantisation functions on fake tensors (module docstring)."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    if isinstance(original, Conv1D):  # Bnb*Quantize.convert: Conv1D weights are stored [in, out]
        value = value.T
    weight = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        with _fake_dynamic_map(value.fake_mode):
            packed, state = bnb.functional.quantize_4bit(
                value.contiguous(), blocksize=weight.blocksize, compress_statistics=weight.compress_statistics,
                quant_type=weight.quant_type, quant_storage=weight.quant_storage)
        param = fake_parameter(packed, fake_params4bit_class())
        param.__dict__.update({**weight.__dict__, "quant_state": state, "bnb_quantized": True, "module": module})
        module.quant_state = state
    else:
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(value.contiguous().to(torch.float16))
        param = fake_parameter(cb, fake_int8_params_class())
        # Int8Params._quantize: the parameter's data is CB, which it also keeps as `CB`
        param.__dict__.update({"CB": param.detach(), "SCB": scb, "has_fp16_weights": weight.has_fp16_weights})
    module._parameters["weight"] = param


@contextlib.contextmanager
def _fake_dynamic_map(fake_mode: Any) -> Iterator[None]:
    """bitsandbytes' 8-bit dynamic map (`functional.name2qmap["dynamic"]`, the code of double
    quantisation) as a fake tensor of `fake_mode` while the block runs. `quantize_blockwise`
    builds the map on first use with `.tolist()` (`create_dynamic_map`), which no fake tensor
    can answer, so it is made for real here, then converted; the real cache is restored."""
    import bitsandbytes as bnb

    cache = bnb.functional.name2qmap
    before = cache.get("dynamic")
    with _outside_fake_mode():
        real = before if before is not None else bnb.functional.create_dynamic_map()
    cache["dynamic"] = fake_mode.from_tensor(real)
    try:
        yield
    finally:
        if before is None:
            cache.pop("dynamic", None)
        else:
            cache["dynamic"] = before


def fake_parameter(like: torch.Tensor, cls: type) -> torch.Tensor:
    """A frozen fake parameter of class `cls` (a `FakeTensor` subclass) with the shape,
    dtype, strides and device of the fake tensor `like`."""
    with _outside_fake_mode():
        elem = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    return cls.__new__(cls, like.fake_mode, elem, like.device, requires_grad=False, _is_param=True)


class _FakeQuantisedParameter:
    """What the fake counterparts of bitsandbytes' parameters change: copies and moves make a
    new fake parameter of the same size and attributes (the real ones rewrap their data with
    `Tensor._make_subclass`, which a fake tensor refuses)."""

    device: Any  # the tensor's, on the bitsandbytes parameter class this is mixed into

    def __deepcopy__(self, memo: dict) -> Any:
        new = fake_parameter(self, type(self))
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k not in _FAKE_TENSOR_FIELDS})
        for key in ("quant_state", "SCB"):
            if getattr(self, key, None) is not None:
                setattr(new, key, copy.deepcopy(getattr(self, key), memo))
        if getattr(self, "CB", None) is not None:
            new.CB = new.detach()
        return new

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if (device is None or device == self.device) and dtype is None:
            return self
        raise UserError(f"a fake quantised weight on {self.device} cannot be moved to {device or dtype}")


# attributes FakeTensor.__new__ sets on every fake tensor; a copy gets its own
_FAKE_TENSOR_FIELDS = frozenset({
    "fake_device", "_fake_device", "fake_mode", "constant", "pytype", "dispatch_keys", "real_tensor",
    "nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo", "_is_param",
})


@functools.cache
def fake_params4bit_class() -> type:
    """`FakeTensor` + `bitsandbytes.nn.Params4bit`, named `Params4bit` (module docstring)."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensor

    return type("Params4bit", (_FakeQuantisedParameter, FakeTensor, bnb.nn.Params4bit),
                {"__module__": __name__, "__doc__": "A fake-tensor Params4bit (memplan.models.quant)."})


@functools.cache
def fake_int8_params_class() -> type:
    """`FakeTensor` + `bitsandbytes.nn.Int8Params`, named `Int8Params` (module docstring)."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensor

    return type("Int8Params", (_FakeQuantisedParameter, FakeTensor, bnb.nn.Int8Params),
                {"__module__": __name__, "__doc__": "A fake-tensor Int8Params (memplan.models.quant)."})


def prepare_for_kbit_training(model: nn.Module) -> None:
    """peft's `prepare_model_for_kbit_training` (module docstring), without its gradient
    checkpointing (memplan's `checkpointing` applies it)."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def train_unquantised(model: nn.Module) -> None:
    """`frozen_base` without LoRA: every parameter that is not quantised trains."""
    for param in model.parameters():
        param.requires_grad_(not is_quantised(param))


def is_quantised(param: torch.Tensor) -> bool:
    """Whether `param` is a bitsandbytes quantised weight (`Params4bit`, `Int8Params`)."""
    return type(param).__name__ in ("Params4bit", "Int8Params")


def weight_count(param: torch.Tensor) -> int:
    """The number of weights `param` holds: a `Params4bit` packs several per element of its
    storage, and its `quant_state.shape` is the weight's own."""
    state = getattr(param, "quant_state", None)
    return math.prod(state.shape) if state is not None else param.numel()


def quantisation_constants(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name, tensor) of every quantisation constant of `model`'s bitsandbytes layers
    that is not a parameter or buffer: 4-bit absmax, code, and with double quantisation the
    nested absmax, code and offset (`QuantState`); int8 row scales (`SCB`, kept on the weight
    until the first forward, then on the layer's `MatmulLtState`)."""
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None or not is_quantised(weight):
            continue
        state = getattr(weight, "quant_state", None)
        states = [state, getattr(state, "state2", None)] if state is not None else []
        for qs in states:
            if qs is not None:
                for key in ("absmax", "code", "offset"):
                    if isinstance(getattr(qs, key, None), torch.Tensor):
                        yield name, getattr(qs, key)
        for holder in (weight, getattr(module, "state", None)):
            scb = getattr(holder, "SCB", None)
            if isinstance(scb, torch.Tensor):
                yield name, scb
