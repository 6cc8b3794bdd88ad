"""`aten._grouped_mm` on fake tensors in every dtype, as CUDA runs it.

Transformers' mixture-of-experts blocks run their experts through `torch._grouped_mm`
(`transformers/integrations/moe.py`, `grouped_mm_experts_forward`, the default experts
implementation). PyTorch's meta kernel for it (`torch/_meta_registrations.py`,
`_meta_grouped_mm_common`) accepts bf16 inputs only, so an fp32 or fp16 MoE step cannot
run on fake tensors. CUDA runs every dtype: `_grouped_mm_cuda`
(`aten/src/ATen/native/cuda/GroupedBlas.cpp`) allocates one output tensor
(`create_grouped_gemm_output_tensor`) and fills it with CUTLASS's bf16 kernel, or, for
any other dtype, with `_grouped_mm_fallback`, a loop of `mm_out` calls into slices of that
same output. So the allocation is the output alone, in every dtype.

`register()` adds, once per process, a fake-tensor rule for `aten._grouped_mm.default`
(`torch._subclasses.fake_impls.register_op_impl`, consulted before the meta kernel) that
answers non-bf16 calls with that one output, sized by PyTorch's own
`_create_grouped_mm_output_tensor`; bf16 calls fall through to PyTorch's meta kernel.
"""

from __future__ import annotations

from typing import Any

import torch

_registered = False


def _is_grouped_mm(func: Any) -> bool:
    return func is torch.ops.aten._grouped_mm.default


def _grouped_mm_any_dtype(fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
                          offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> Any:
    """The output of one non-bf16 `_grouped_mm` on fake tensors (module docstring)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    bf16 = torch.bfloat16
    if mat_a.dtype == bf16 and mat_b.dtype == bf16 and out_dtype in (None, bf16):
        return NotImplemented  # PyTorch's meta kernel
    torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm of {mat_a.dtype} and {mat_b.dtype}")
    contracted_a = mat_a.size(-1)
    contracted_b = mat_b.size(-2)
    torch._check(contracted_a == contracted_b,
                 lambda: f"grouped_mm contracts {contracted_a} with {contracted_b}")
    with in_kernel_invocation_manager(fake_mode):
        out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
    return FakeTensor(fake_mode, out, mat_a.device)


def register() -> None:
    """Install the fake-tensor rule of the module docstring (idempotent)."""
    global _registered
    if _registered:
        return
    from torch._subclasses.fake_impls import register_op_impl

    register_op_impl(_is_grouped_mm)(_grouped_mm_any_dtype)
    _registered = True
