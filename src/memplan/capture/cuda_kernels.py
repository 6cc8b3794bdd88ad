"""Run a CUDA job's attention through CUDA's SDPA kernels while it is traced on fake cpu.

A CUDA job is traced on fake *cpu* tensors (see `memplan.capture.step.capture_model`).
For most ops the CPU and CUDA programs allocate the same tensors, but not for
`scaled_dot_product_attention`: with dropout (GPT-2, BERT, OPT train with
`attn_pdrop=0.1`), or with fp32, the CPU dispatcher falls back to the *math* path,
which materialises the [B, H, S, S] attention matrix, its softmax and a dropout mask,
where a GPU runs a fused kernel that keeps only the output and a logsumexp (flash
attention draws its dropout from a Philox seed; no mask is stored).

`sdpa_as_on_cuda()` sends each SDPA call to the kernel
PyTorch's CUDA dispatcher would pick (`sdp_utils.cpp`, `select_sdp_backend`): flash
attention for fp16/bf16 without an explicit mask, with one head dim for query, key and
value (DeepSeek's latent attention has a narrower value) ≤ 256 and a multiple of 8, the
memory-efficient kernel otherwise (fp32, or an attention mask, as an additive bias). Both ATen ops have meta kernels and autograd formulas, so they run on fake
tensors of any device and their backward ops (`_scaled_dot_product_flash_attention_backward`,
`_scaled_dot_product_efficient_attention_backward`) appear in the trace with their real
output sizes (the efficient kernel's logsumexp is padded to a multiple of 32, as on GPU).
Grouped-query attention is expanded to the query heads first (`repeat_interleave`),
which is what PyTorch does before its fused kernels when `enable_gqa` is set.

Dropout differs too. ATen's `dropout` (aten/src/ATen/native/Dropout.cpp, PyTorch 2.x: lines
43-45 `is_fused_kernel_acceptable`, 132-145 `dropout`) takes the fused `native_dropout`
kernel on CUDA when training with 0 < p < 1 on a non-empty input: it keeps a *bool* mask
(1 byte an element) for backward. On the CPU the same call multiplies the input by a noise
tensor of the input's dtype (`_dropout_impl`: `empty_like(input).bernoulli_(1 - p)`), which
autograd keeps: 2 bytes an element in bf16, 4 in fp32. `dropout_as_on_cuda()` sends
`torch.nn.functional.dropout` (what `nn.Dropout` and the model libraries call) to
`torch.native_dropout` under the same conditions; its CPU kernel makes the same bool mask
and output (Dropout.cpp lines 104-125, `native_dropout_cpu`), and autograd keeps the mask.
In-place dropout (`dropout_`) takes the noise path on CUDA too, and is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from memplan.capture.cuda_autocast import autocast_as_on_cuda

_SDPA = torch.nn.functional.scaled_dot_product_attention
_DROPOUT = torch.nn.functional.dropout
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _as_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:  # PyTorch converts boolean masks to -inf biases the same way
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention` through the CUDA kernel PyTorch would choose."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    head_dim = query.shape[-1]
    same_head_dims = key.shape[-1] == head_dim and value.shape[-1] == head_dim  # flash's check_head_dim_size_flash
    if query.dim() == 4 and attn_mask is None and query.dtype in _FLASH_DTYPES and same_head_dims and \
            head_dim <= 256 and head_dim % 8 == 0:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if query.dim() == 4:
        needs_lse = query.requires_grad or key.requires_grad or value.requires_grad
        bias = None if attn_mask is None else _as_bias(attn_mask, query.dtype)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_lse, dropout_p, is_causal, scale=scale
        )
        return out[0]
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                 scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def sdpa_as_on_cuda() -> Iterator[None]:
    """Within this block, SDPA calls run CUDA's fused kernels (see the module docstring).

    The function itself is swapped, not intercepted by a TorchFunctionMode: activation
    checkpointing recomputes the forward from inside autograd's engine, where a mode
    entered around the step is not active, and the recomputation must run the same
    kernels as the forward (it checks that both saved the same tensors).
    """
    functional = torch.nn.functional
    functional.scaled_dot_product_attention = cuda_sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = _SDPA


def cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,  # noqa: A002 (F.dropout's names)
                 inplace: bool = False) -> torch.Tensor:
    """`torch.nn.functional.dropout` through the kernel CUDA takes (module docstring)."""
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return _DROPOUT(input, p, training, inplace)


@contextlib.contextmanager
def dropout_as_on_cuda() -> Iterator[None]:
    """Within this block, `torch.nn.functional.dropout` keeps a bool mask as CUDA's fused
    kernel does (module docstring); swapped like SDPA, for the same reason."""
    functional = torch.nn.functional
    functional.dropout = cuda_dropout
    try:
        yield
    finally:
        functional.dropout = _DROPOUT


@contextlib.contextmanager
def kernels_as_on_cuda() -> Iterator[None]:
    """What a CUDA job runs differently from the cpu it is traced on: SDPA's fused
    kernels (`sdpa_as_on_cuda`), dropout's fused kernel (`dropout_as_on_cuda`) and
    autocast's CUDA op lists (`memplan.capture.cuda_autocast.autocast_as_on_cuda`)."""
    with sdpa_as_on_cuda(), dropout_as_on_cuda(), autocast_as_on_cuda():
        yield
