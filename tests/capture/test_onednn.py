"""oneDNN's CPU matmuls: which ones PyTorch sends there, and the scratch memory they hold.

The rule (`takes_onednn`) is tested with the path given explicitly, so every case runs
on any CPU; the measurement (`matmul_transient_bytes`) on a kernel whose transient is
the same on every CPU: `addmm_impl_cpu_` (aten/src/ATen/native/LinearAlgebra.cpp) copies
an operand that is neither row- nor column-major with `clone(MemoryFormat::Contiguous)`
before the gemm and frees it when it returns.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from memplan.capture import capture
from memplan.capture.onednn import matmul_transient_bytes, onednn_workspaces
from memplan.hardware.onednn import OnednnPath, takes_onednn
from memplan.trace.edit import with_extra_buffers

BF16_CPU = OnednnPath(enabled=True, bf16=True, fp16=False)
NO_BF16 = OnednnPath(enabled=True, bf16=False, fp16=False)


def signature(op, *tensors, alpha=1.0, beta=1.0):
    """`matmul_signature`'s form: [shape, strides, dtype] per tensor (contiguous strides)."""
    rows = []
    for shape, dtype in tensors:
        strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        rows.append([list(shape), strides, dtype])
    return {"op": op, "tensors": rows, "alpha": alpha, "beta": beta}


def test_a_bf16_mm_takes_onednn_where_the_cpu_has_bf16_and_mkldnn_is_on():
    mm = signature("aten::mm", ([64, 256], "bfloat16"), ([256, 64], "bfloat16"))
    assert takes_onednn(mm, BF16_CPU)
    assert not takes_onednn(mm, NO_BF16)
    assert not takes_onednn(mm, OnednnPath(enabled=False, bf16=True, fp16=True))


def test_matmuls_of_at_most_16_cubed_multiply_adds_and_zero_alpha_stay_with_aten():
    # mkldnn_gemm (Matmul.cpp): `m * n * k <= 16 * 16 * 16` or `alpha == 0` returns false
    at_limit = signature("aten::mm", ([16, 16], "bfloat16"), ([16, 16], "bfloat16"))
    above = signature("aten::mm", ([16, 16], "bfloat16"), ([16, 17], "bfloat16"))
    assert not takes_onednn(at_limit, BF16_CPU)
    assert takes_onednn(above, BF16_CPU)
    zero_alpha = signature("aten::addmm", ([64], "bfloat16"), ([64, 64], "bfloat16"), ([64, 64], "bfloat16"),
                           alpha=0.0)
    assert not takes_onednn(zero_alpha, BF16_CPU)
    # bmm (checksize): batch * m * k * n; 2 x 8 x 16 x 16 = 4096 stays, 2 x 8 x 16 x 17 goes
    assert not takes_onednn(signature("aten::bmm", ([2, 8, 16], "bfloat16"), ([2, 16, 16], "bfloat16")), BF16_CPU)
    assert takes_onednn(signature("aten::bmm", ([2, 8, 16], "bfloat16"), ([2, 16, 17], "bfloat16")), BF16_CPU)


def test_linear_folds_its_leading_dimensions_into_the_rows():
    # [2, 32, 64] x [192, 64]^T: m = 64, k = 64, n = 192; [1, 4, 16] x [16, 16]^T: 4 x 16 x 16 = 1024
    big = signature("aten::linear", ([2, 32, 64], "bfloat16"), ([192, 64], "bfloat16"), ([192], "bfloat16"))
    small = signature("aten::linear", ([1, 4, 16], "bfloat16"), ([16, 16], "bfloat16"))
    assert takes_onednn(big, BF16_CPU)
    assert not takes_onednn(small, BF16_CPU)


def test_fp32_and_fp16_matmuls_take_onednn_only_where_pytorch_sends_them():
    fp32 = signature("aten::mm", ([64, 64], "float32"), ([64, 64], "float32"))
    fp16 = signature("aten::mm", ([64, 64], "float16"), ([64, 64], "float16"))
    assert not takes_onednn(fp32, BF16_CPU)
    assert takes_onednn(fp32, OnednnPath(enabled=True, bf16=True, fp16=False, fp32_precision="bf16"))
    assert not takes_onednn(fp32, OnednnPath(enabled=True, bf16=False, fp16=False, fp32_precision="bf16"))
    assert takes_onednn(fp32, OnednnPath(enabled=True, bf16=False, fp16=False, fp32_precision="tf32"))
    assert not takes_onednn(fp16, BF16_CPU)
    assert takes_onednn(fp16, OnednnPath(enabled=True, bf16=False, fp16=True))


def strided_addmm():
    """addmm(bias [16], mat1 [64, 32] every other column of a [64, 64], mat2 [32, 16]),
    fp32: its kernel clones mat1 (64 x 32 x 4 = 8,192 B) for the length of the call."""
    sig = signature("aten::addmm", ([16], "float32"), ([64, 32], "float32"), ([32, 16], "float32"))
    sig["tensors"][1][1] = [64, 2]
    return sig


def test_the_measured_transient_is_what_the_kernel_holds_beyond_its_output():
    assert matmul_transient_bytes(strided_addmm()) == 64 * 32 * 4
    contiguous = signature("aten::addmm", ([16], "float32"), ([64, 32], "float32"), ([32, 16], "float32"))
    assert matmul_transient_bytes(contiguous) == 0


def test_the_recorder_keeps_each_matmul_s_arguments():
    bias, m1, m2 = torch.zeros(16), torch.zeros(64, 64)[:, ::2], torch.zeros(32, 16)
    trace = capture(lambda: torch.addmm(bias, m1, m2).relu())
    [[op, sig]] = trace.meta["matmul_args"]
    assert trace.op_name(op) == "aten.addmm.default"
    assert sig == strided_addmm()


def test_the_workspace_is_live_with_the_output_of_its_op():
    """Pre-existing bias 64 B, mat1's [64, 64] storage 16,384 B, mat2 2,048 B; the
    output 64 x 16 x 4 = 4,096 B; the clone 8,192 B beside it: 30,784 B at the peak.
    fp32 under `fp32_precision="bf16"` counts as oneDNN's here, so that the measured
    kernel is the same on every CPU."""
    bias, m1, m2 = torch.zeros(16), torch.zeros(64, 64)[:, ::2], torch.zeros(32, 16)
    trace = capture(lambda: torch.addmm(bias, m1, m2))
    assert int(trace.live_bytes().max()) == 64 + 16384 + 2048 + 4096
    bf32 = OnednnPath(enabled=True, bf16=True, fp16=False, fp32_precision="bf16")
    extras = onednn_workspaces(trace, bf32)
    assert [x.nbytes for x in extras] == [8192]
    assert int(with_extra_buffers(trace, extras).live_bytes().max()) == 64 + 16384 + 2048 + 4096 + 8192


def test_no_matmul_is_measured_where_pytorch_keeps_its_own_kernels():
    bias, m1, m2 = torch.zeros(16), torch.zeros(64, 64)[:, ::2], torch.zeros(32, 16)
    trace = capture(lambda: torch.addmm(bias, m1, m2))

    def measure(_signature):
        raise AssertionError("measured a matmul that does not take oneDNN's kernel")

    assert onednn_workspaces(trace, OnednnPath(enabled=True, bf16=True, fp16=True), measure) == []


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_onednn_max_cpu_isa_avx2_turns_the_bf16_path_off():
    """oneDNN's bf16 support needs AVX-512 (or AVX2-VNNI-2), above the AVX2 cap: under
    the cap the path reads off on every CPU, as PyTorch's own check does (on a CPU
    without AVX-512 it is off either way)."""
    code = "from memplan.hardware.onednn import host_onednn_path; print(host_onednn_path().bf16)"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
