"""Device profiles: every documented --gpu name ships, with sane, sourced figures."""

import pytest

from memplan.errors import UserError
from memplan.hardware.devices import device_profile, list_devices

ISSUE_GPUS = ["h100-80gb", "h100-pcie-80gb", "h100-nvl-94gb", "h200-141gb", "a100-40gb", "a100-80gb",
              "a10g", "l4", "l40s", "rtx3090", "rtx4090", "v100-16gb", "v100-32gb", "t4"]


def test_every_gpu_the_issue_names_has_a_profile():
    assert set(ISSUE_GPUS) <= set(list_devices())


@pytest.mark.parametrize("gpu", ISSUE_GPUS)
def test_profile_capacity_is_within_its_marketed_size_and_context_in_the_documented_range(gpu):
    profile = device_profile(gpu)
    marketed_gb = int(gpu.split("-")[-1].removesuffix("gb")) if gpu.split("-")[-1].endswith("gb") else None
    if marketed_gb:
        assert 0.9 * marketed_gb * 1e9 <= profile.capacity_bytes <= marketed_gb * 2**30
    assert 0.3e9 <= profile.cuda_context_bytes <= 1.3e9  # docs/sources.md §7
    assert profile.cublas_workspace_bytes in (8_519_680, 32 * 2**20)
    assert profile.source


def test_hopper_gets_the_32_mib_cublas_workspace():
    assert device_profile("h100-80gb").cublas_workspace_bytes == 32 * 2**20
    assert device_profile("a100-80gb").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_gpus_without_bf16_fall_back_to_the_fp16_rate():
    v100 = device_profile("v100-32gb")
    assert v100.matmul_flops_per_s("bf16") == v100.matmul_flops_per_s("fp16") == 125e12


def test_unknown_gpu_is_a_user_error_listing_the_known_ones():
    with pytest.raises(UserError, match="h100-80gb.*t4"):
        device_profile("h1000")
