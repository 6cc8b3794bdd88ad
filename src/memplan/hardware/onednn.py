"""Which CPU matmuls PyTorch runs with oneDNN on this host.

On x86, PyTorch 2.13 runs a CPU `mm` / `addmm` in bf16 (or fp16) through oneDNN's
matmul primitive wherever `mkldnn_bf16_device_check()` holds: `addmm_impl_cpu_`
(`aten/src/ATen/native/LinearAlgebra.cpp`) calls `cpublas::gemm`, whose bf16 overload
(`aten/src/ATen/native/CPUBlas.cpp`) tries `mkldnn_bf16_gemm` before ATen's own gemm;
`mkldnn_gemm` (`aten/src/ATen/native/mkldnn/Matmul.cpp`) takes it when MKLDNN is
enabled, the device check holds, m * n * k > 16^3 and alpha != 0. `bmm` / `baddbmm`
(`bmm_out_or_baddbmm_`, LinearAlgebra.cpp) go to `mkldnn_matmul` under
`use_mkldnn_matmul` (Matmul.cpp: the same checks, batch * m * k * n > 16^3). fp32
matmuls join them when `torch.backends.mkldnn.matmul.fp32_precision` is "bf16"
(`use_mkldnn_bf32_matmul`) or "tf32" (`use_mkldnn_tf32_matmul`). Where PyTorch also
checks a cpuinfo flag Python cannot read (AMX-FP16 for tf32; AVX512-BF16 for the bf16
matrix-vector bypass in `cpublas::gemm`), the matmul counts as taken, and
`memplan.capture.onednn` measures what the kernel that actually runs allocates.

The device check is ideep's `has_bf16_type_support()` (`mkldnn_bf16_device_check`,
`aten/src/ATen/native/mkldnn/Utils.h`), that is oneDNN's
`has_data_type_support(bf16)`: `mayiuse(avx512_core) || mayiuse(avx2_vnni_2)` (oneDNN
v3.12, the version PyTorch 2.13 builds, `src/cpu/platform.cpp` lines 111-117): any
AVX-512 CPU, native BF16 instructions or not, and never one capped below by
`ONEDNN_MAX_CPU_ISA`. `torch.ops.mkldnn._is_mkldnn_bf16_supported()` returns that same
check (`RegisterMkldnnOpContextClass.cpp`), and `host_onednn_path` reads it there, so
it decides as PyTorch does, the cap included.

What such a matmul allocates beside its output is measured by `memplan.capture.onednn`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# The ops whose CPU kernel reaches `addmm_impl_cpu_` or `bmm_out_or_baddbmm_`; `linear` is
# `addmm` or `mm` below its own kernel (`at::native::linear`), and the dispatch-level
# recorder sees it whole where it runs inside a library's composite kernel.
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear"})
MATRIX_ARGUMENTS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                    "aten::linear": (0, 1)}  # which tensor arguments are the two matrices
GEMM_MIN_SIZE = 16 * 16 * 16  # `mkldnn_gemm` and `checksize` (Matmul.cpp) leave smaller products to ATen


@dataclass(frozen=True)
class OnednnPath:
    """What PyTorch reads to send a CPU matmul to oneDNN: MKLDNN enabled
    (`torch.backends.mkldnn.enabled`), the bf16 and fp16 device checks, and the
    precision of fp32 matmuls on MKLDNN ("none", "ieee", "bf16" or "tf32")."""

    enabled: bool
    bf16: bool
    fp16: bool
    fp32_precision: str = "none"


def host_onednn_path() -> OnednnPath:
    """`OnednnPath` of this process, from the checks PyTorch's matmuls make."""
    available = torch.backends.mkldnn.is_available()
    return OnednnPath(
        enabled=available and bool(torch.backends.mkldnn.enabled),
        bf16=available and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        fp16=available and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        fp32_precision=str(torch.backends.mkldnn.matmul.fp32_precision),
    )


def takes_onednn(signature: dict[str, Any], path: OnednnPath) -> bool:
    """Whether PyTorch runs the matmul of `signature` with oneDNN under `path`.

    `signature`: {"op": a `MATMUL_OPS` name, "tensors": [shape, strides, dtype] of each
    tensor argument in order, "alpha", "beta"} (`memplan.capture.onednn.matmul_signature`)."""
    first, second = MATRIX_ARGUMENTS[signature["op"]]
    (a_shape, _, dtype), (b_shape, _, b_dtype) = signature["tensors"][first], signature["tensors"][second]
    if not path.enabled or dtype != b_dtype or signature["alpha"] == 0 or not _dtype_goes(dtype, path):
        return False
    return int(np.prod(batch_m_k_n(signature["op"], a_shape, b_shape))) > GEMM_MIN_SIZE


def batch_m_k_n(op: str, a_shape: list[int], b_shape: list[int]) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of `op` multiplying `a_shape` by `b_shape` (`linear`: input
    [..., k] by weight [n, k], the leading dimensions folded into m as
    `at::native::linear` folds them)."""
    if op == "aten::linear":
        return 1, int(np.prod(a_shape[:-1])), a_shape[-1], b_shape[0]
    if len(a_shape) == 2:
        return 1, a_shape[0], a_shape[1], b_shape[1]
    return a_shape[0], a_shape[1], a_shape[2], b_shape[2]


def _dtype_goes(dtype: str, path: OnednnPath) -> bool:
    """Whether matmuls in `dtype` go to oneDNN under `path` (module docstring)."""
    if dtype == "bfloat16":
        return path.bf16
    if dtype == "float16":
        return path.fp16
    if dtype == "float32":
        return path.fp32_precision == "tf32" or (path.fp32_precision == "bf16" and path.bf16)
    return False
