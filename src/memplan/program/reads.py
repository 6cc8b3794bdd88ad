"""Reading a value out of a fake tensor: the policy, and the refusal.

The program runs with the model's tensors fake (no values), so a Python read of one —
`loss.item()`, `float(x)`, `x.tolist()`, `if x:`, `f"{loss:.3f}"` — has nothing to read.
Tensors computed from the program's data alone are real (memplan.program.world) and read
as they would be. For fake ones the policy is:

- a floating-point read (`item`, `float`, `tolist`, `numpy`, formatting) reads 0.0 for
  every element: what a training loop does with it is log it (`loss.item()`), add it up,
  or compare it with a threshold; 0.0 is also the "nothing found" value of the reads
  PyTorch itself makes, `GradScaler`'s `found_inf.item()` (torch/amp/grad_scaler.py,
  `_maybe_opt_step`), so a scaled step is taken;
- the values of the model's tensors are taken to be finite: `isnan` / `isinf` of a fake
  tensor are all False and `isfinite` all True, carried through `any`, `all`, `~`, `|`, `&`
  (the checks of `Trainer`'s `logging_nan_inf_filter` and of `clip_grad_norm_`'s
  `error_if_nonfinite`), and a boolean read of such a result gives that value; so does
  `x < 0` of a one-element floating-point fake tensor (False): a norm is below zero only as
  the sentinel of a non-finite one (DeepSpeed's group-norm helpers report inf/NaN as -1 and
  `is_invalid_grad_norm` tests `~isfinite(norm) | (norm < 0)`, deepspeed/runtime/utils.py,
  DeepSpeed 0.19.8);
- a count of non-finite checks is zero: a one-element tensor of `zeros` to which only such
  checks known False are added (`count += check`) is known to be 0, carried through dtype
  and device conversions (`.bool()`, `.byte()`, `.to(...)`, `.clone()`) and indexing, and an
  integer or boolean read of it gives 0 / False. This is DeepSpeed's bf16 and fp16 ZeRO-1/2
  overflow check (`has_overflow_partitioned_grads_serial` sums `has_inf_or_nan` of every
  gradient partition into `torch.zeros([1])`, and `has_overflow` reads
  `overflow.byte()`'s `overflow_gpu[0].item()` after an all-reduce MAX over the ranks,
  deepspeed/runtime/zero/stage_1_and_2.py:3229-3249, `has_inf_or_nan`
  deepspeed/runtime/utils.py:205-228, DeepSpeed 0.19.8). The all-reduce is no torch function
  and leaves the rank's value as it is: under the assumption every rank's count is 0, and the
  MAX (or SUM) of zeros is 0. Only the value 0 is carried (a sum with a check known True is
  not), and any other op that writes the tensor (an in-place op, `out=`, `__setitem__`, `.data =`)
  forgets it, so a counter the program changes otherwise is refused;
- a boolean read inside PyTorch's own initialisation functions (`torch.nn.init`) is False:
  `trunc_normal_` draws samples until none is rejected, asking `mask.any()` or
  `pending.any()` after each draw (`_no_grad_trunc_normal_`, torch/nn/init.py:86-160,
  PyTorch 2.13.0; torchtune's and torchtitan's model builders initialise with it); fake
  weights have no samples to reject, and the loop ends after its first draw, whose ops ran;
- any other read (an integer or boolean computed from the weights: a Python branch on a
  tensor, a size) is refused: `ReadRefused`, naming the op and the program's file:line.

A DTensor whose local shard is fake (FSDP2's and TP's parameters in a distributed run) is
read as that shard is.

Every read the policy answered is counted by site (`ReadLog`), so the run can say which
values it made up and where.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

Tensor = torch.Tensor

# the Python reads of a tensor's value (each goes through __torch_function__)
READS = frozenset({Tensor.item, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.__index__,
                   Tensor.__complex__, Tensor.tolist, Tensor.numpy, Tensor.__format__, Tensor.__array__})
_FINITE_CHECKS = {torch.isnan: False, Tensor.isnan: False, torch.isinf: False, Tensor.isinf: False,
                  torch.isposinf: False, Tensor.isposinf: False, torch.isneginf: False, Tensor.isneginf: False,
                  torch.isfinite: True, Tensor.isfinite: True}
_REDUCE = frozenset({torch.any, Tensor.any, torch.all, Tensor.all})
_NOT = frozenset({torch.logical_not, Tensor.logical_not, Tensor.__invert__, torch.bitwise_not, Tensor.bitwise_not})
_OR = frozenset({torch.logical_or, Tensor.logical_or, Tensor.__or__, Tensor.__ror__, torch.bitwise_or})
_AND = frozenset({torch.logical_and, Tensor.logical_and, Tensor.__and__, Tensor.__rand__, torch.bitwise_and})
_BELOW = frozenset({torch.lt, Tensor.lt, Tensor.__lt__, torch.less, Tensor.less})
_ZEROS = frozenset({torch.zeros, torch.zeros_like, Tensor.new_zeros})
_ADD = frozenset({torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__})
_SAME_VALUE = frozenset({Tensor.bool, Tensor.byte, Tensor.int, Tensor.long, Tensor.float, Tensor.to, Tensor.clone,
                         torch.clone, Tensor.__getitem__})
KNOWN_OPS = frozenset({*_FINITE_CHECKS, *_REDUCE, *_NOT, *_OR, *_AND, *_BELOW, *_ZEROS, *_ADD, *_SAME_VALUE})
_VALUE_READS = frozenset({Tensor.__bool__, Tensor.item, Tensor.__int__, Tensor.__index__, Tensor.__float__})

_LIBRARY_PARTS = ("site-packages", "dist-packages", f"{Path(sys.prefix).name}/lib", "<frozen")


class ReadRefused(BaseException):  # noqa: N818 - raised through the program: its `except Exception` must not catch it
    """A read of a fake tensor's value that the policy does not answer (module docstring)."""


def is_fake_value(t: Any) -> bool:
    """Whether `t` is a fake tensor with no value memplan could read (a fake made from a
    Python scalar keeps it as a constant, and reads as that), or a DTensor over one."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return isinstance(t, FakeTensor) and t.constant is None


_TORCH_INIT = str(Path(torch.nn.init.__file__))


def _in_torch_init() -> bool:
    """Whether the read is made by `torch.nn.init`'s own code (the frames above it up to the
    first one outside PyTorch and memplan)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name == _TORCH_INIT:
            return True
        if "/torch/" not in name and "/memplan/" not in name:
            return False
        frame = frame.f_back
    return False


def program_site(program_dir: Path | None) -> str:
    """`file:line` of the innermost frame of the program's own code (under `program_dir`,
    else outside every installed library and memplan)."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if program_dir is not None and name.startswith(str(program_dir)):
            return f"{_short(name)}:{frame.f_lineno}"
        if fallback is None and not any(part in name for part in _LIBRARY_PARTS) and "/memplan/" not in name:
            fallback = f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "(the program)"


def _short(path: str) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _one_fake_float(t: Any) -> bool:
    return isinstance(t, FakeTensor) and t.is_floating_point() and t.numel() == 1


_IN_PLACE_OPERATOR = re.compile(r"__i(add|sub|mul|truediv|floordiv|div|mod|pow|and|or|xor|lshift|rshift|matmul)__")


def _writes(func: Any) -> bool:
    """Whether `func` writes its tensor arguments in place (`add_`, `_foreach_mul_`, `__iadd__`,
    `__setitem__`, a property's setter: `x.data = y`)."""
    name = getattr(func, "__name__", "")
    return ((name.endswith("_") and not name.endswith("__")) or name in ("__setitem__", "__set__")
            or _IN_PLACE_OPERATOR.fullmatch(name) is not None)


def _typed(value: float | bool, t: torch.Tensor) -> float | bool:
    """`value` as a Python scalar of `t`'s dtype."""
    if t.dtype == torch.bool:
        return bool(value)
    return float(value) if t.is_floating_point() else int(value)


class ReadLog:
    """The reads the policy answered, and the values the policy knows of the model's tensors."""

    def __init__(self, program_dir: Path | None) -> None:
        self.program_dir = program_dir
        self.answered: dict[str, int] = {}  # "file:line: what" -> count
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake tensor -> the value of each element

    def note_known(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """Carry the finiteness assumption through `func` (module docstring); forget the value of
        every tensor `func` writes otherwise."""
        if func not in KNOWN_OPS:
            if self.known:
                self._forget(func, args, kwargs, result)
            return
        if not isinstance(result, FakeTensor):
            return
        value = self._value_after(func, args, kwargs, result)
        if value is not None:
            self.known[result] = value
        elif result in self.known:  # written in place (`count += x`) with a value not known
            del self.known[result]

    def _forget(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        written = [result, *tree_flatten(kwargs.get("out"))[0]]
        if _writes(func):
            written += tree_flatten(args)[0]
        for t in written:
            if isinstance(t, Tensor) and t in self.known:
                del self.known[t]

    def _value_after(self, func: Any, args: tuple, kwargs: dict, result: FakeTensor) -> float | bool | None:
        """The value of every element of `result`, where the policy knows it (module docstring)."""
        if func in _FINITE_CHECKS:
            return _FINITE_CHECKS[func] if args and isinstance(args[0], FakeTensor) else None
        if func in _BELOW:
            below_zero = _one_fake_float(args[0]) and len(args) > 1 and not isinstance(args[1], Tensor)
            return False if below_zero and args[1] == 0 else None
        if func in _ZEROS:
            return 0 if result.numel() == 1 else None
        values = [self.known.get(a) if isinstance(a, Tensor) else None for a in args[:2]]
        if func in _SAME_VALUE or func in _REDUCE:
            return None if not values or values[0] is None else _typed(values[0], result)
        if func in _ADD:  # a count of non-finite checks: zero plus checks known False
            zero = len(values) == 2 and not kwargs and all(v is not None and not v for v in values)
            return _typed(0, result) if zero else None
        if result.dtype != torch.bool or None in values:  # bitwise ops of integers are not logical ones
            return None
        if func in _NOT:
            return not values[0]
        if func in _OR and len(values) == 2:
            return values[0] or values[1]
        if func in _AND and len(values) == 2:
            return values[0] and values[1]
        return None

    def read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The value of a read of the fake tensor `args[0]` (module docstring), or `ReadRefused`."""
        t = args[0]
        if func in _VALUE_READS and t in self.known:
            return self._answer(func, t, _typed(self.known[t], t))
        if (t.is_floating_point() or t.is_complex()) and func is not Tensor.__bool__:
            return self._answer(func, t, 0.0, args, kwargs)
        if func is Tensor.__bool__ and _in_torch_init():
            return self._answer(func, t, False)
        what = {Tensor.__bool__: "a Python branch on (bool of)", Tensor.__int__: "int() of",
                Tensor.__index__: "an index or size from"}.get(func, f"{func.__name__}() of")
        raise ReadRefused(
            f"{program_site(self.program_dir)}: {what} a {str(t.dtype).removeprefix('torch.')} tensor computed "
            f"from the model's weights (aten._local_scalar_dense): memplan runs the model on fake tensors, which "
            "have no values, and reads only floating-point values (as 0.0, for logging) and the finiteness checks "
            "isnan/isinf/isfinite; compute it from the data, or make it a floating-point value the program logs")

    def _answer(self, func: Any, t: torch.Tensor, value: float | bool, args: tuple = (), kwargs: dict | None = None) -> Any:
        site = f"{program_site(self.program_dir)}: {func.__name__}"
        self.answered[site] = self.answered.get(site, 0) + 1
        if func is Tensor.tolist:
            return torch.zeros(t.shape, dtype=torch.float64).tolist() if t.dim() else float(value)
        if func in (Tensor.numpy, Tensor.__array__):
            import numpy as np

            return np.zeros(tuple(t.shape), dtype=np.float64)
        if func is Tensor.__format__:
            return format(float(value), args[1] if len(args) > 1 else "")
        if func in (Tensor.__int__, Tensor.__index__):
            return int(value)
        if func is Tensor.__complex__:
            return complex(value)
        if t.numel() != 1:
            raise ReadRefused(f"{program_site(self.program_dir)}: {func.__name__}() of a tensor of "
                              f"{t.numel()} elements (only one-element tensors convert to Python scalars)")
        if func is Tensor.__bool__:
            return bool(value)
        return float(value) if func is Tensor.__float__ else value
