"""Run autocast with CUDA's op lists while a CUDA job is traced on fake cpu tensors.

A CUDA job is traced on fake *cpu* tensors (`memplan.capture.step.capture_model`), so
`torch.autocast` dispatches through the `AutocastCPU` key, whose op lists are not
CUDA's. The difference changes memory: under CUDA's autocast, `softmax`,
`log_softmax`, `layer_norm`, `pow`, `exp`, `rsqrt`, `sum`, `cumsum` and the other ops
of its fp32 lists run in fp32 (an eager attention's [B, H, S, S] probabilities, GPT-2's
`gelu_new` built on `pow`, BERT's layer norms), where the CPU lists leave them in
fp16/bf16.

`autocast_as_on_cuda()` registers, for as long as it is active, a Python kernel on the
`AutocastCPU` key of every op in CUDA's lists other than the lower-precision one
(`aten/src/ATen/autocast_mode.h`: `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`,
`AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE`) with CUDA's policy
for it, the way `autocast_mode.cpp` wraps them:

- `fp32`: floating-point tensor arguments below fp32 (fp16, bf16) are cast to fp32;
- `fp32_set_opt_dtype` (softmax, log_softmax, sum, cumsum, prod, ...): an unset
  `dtype` argument becomes fp32 when the first argument is floating point;
- `fp32_append_dtype` (`norm` without a dtype): redispatched to the overload that takes
  one, with fp32;
- `promote`: every floating-point tensor argument is cast to the widest of them.

The lower-precision lists of both devices hold the same matmul, linear, convolution
and attention ops, so those keep the CPU kernels (and their weight-cast cache). An
eligible tensor is any floating-point tensor except float64: the traced tensors stand
for CUDA tensors. Casts are made above autograd, as CUDA's autocast makes them, so
they are recorded and saved for backward the same way.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "tensordot",
           "scatter_add")
_KEY = torch._C.DispatchKey.AutocastCPU


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)) and any(_eligible(v) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _no_autocast() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY))


def _fp32_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            return op(*(_cast(a, torch.float32) for a in args),
                      **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
    return kernel


def _set_opt_dtype_kernel(op: Any) -> Any:
    position = [a.name for a in op._schema.arguments].index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            if _eligible(args[0]):
                if position < len(args):
                    if args[position] is None:
                        args = (*args[:position], torch.float32, *args[position + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _append_dtype_kernel(target: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*args, **kwargs, dtype=dtype)
    return kernel


def _promote_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            tensors = [t for a in (*args, *kwargs.values())
                       for t in (a if isinstance(a, (list, tuple)) else (a,)) if _eligible(t)]
            if not tensors:
                return op(*args, **kwargs)
            widest = torch.float32 if any(t.dtype == torch.float32 for t in tensors) else tensors[0].dtype
            return op(*(_cast(a, widest) for a in args), **{k: _cast(v, widest) for k, v in kwargs.items()})
    return kernel


@contextlib.contextmanager
def autocast_as_on_cuda() -> Iterator[None]:
    """While active, `torch.autocast("cpu", ...)` follows CUDA's policy for every op of
    CUDA's fp32, fp32-dtype and promote lists (module docstring)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel" (CPU's own lists)
            warnings.simplefilter("ignore")
            for name in FP32:
                library.impl(name, _fp32_kernel(_overload(name)), "AutocastCPU")
            for name in FP32_SET_OPT_DTYPE:
                library.impl(name, _set_opt_dtype_kernel(_overload(name)), "AutocastCPU")
            for name, target in FP32_APPEND_DTYPE.items():
                library.impl(name, _append_dtype_kernel(_overload(target)), "AutocastCPU")
            for name in PROMOTE:
                library.impl(name, _promote_kernel(_overload(name)), "AutocastCPU")
        yield
    finally:
        library._destroy()
