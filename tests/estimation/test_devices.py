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
    assert profile.platform == "cuda"
    assert profile.cublas_workspace_bytes in (8_519_680, 32 * 2**20)
    assert profile.source


def test_hopper_gets_the_32_mib_cublas_workspace():
    assert device_profile("h100-80gb").cublas_workspace_bytes == 32 * 2**20
    assert device_profile("a100-80gb").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_gpus_without_bf16_fall_back_to_the_fp16_rate():
    v100 = device_profile("v100-32gb")
    assert v100.matmul_flops_per_s("bf16") == v100.matmul_flops_per_s("fp16") == 125e12


def test_unknown_gpu_is_a_user_error_naming_the_closest_profiles():
    with pytest.raises(UserError, match=r"unknown GPU 'h1000': did you mean h100-80gb.*--gpu list") as info:
        device_profile("h1000")
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="did you mean mi300x"):
        device_profile("MI300")
    with pytest.raises(UserError, match="did you mean rtx-a6000"):
        device_profile("a6000")


NEW_GPUS = ["b200", "b300", "gb200", "h20", "h800", "a800-80gb", "l40", "a40", "rtx-a6000", "rtx5090", "rtx4080",
            "mi300x", "mi325x"]
# marketed memory (GB, 10^9 bytes) of each new profile
MARKETED_GB = {"b200": 180, "b300": 288, "gb200": 186, "h20": 96, "h800": 80, "a800-80gb": 80, "l40": 48,
               "a40": 48, "rtx-a6000": 48, "rtx5090": 32, "rtx4080": 16, "mi300x": 192, "mi325x": 256}


def test_every_profile_loads_with_a_source_and_sane_figures():
    for key in list_devices():
        profile = device_profile(key)
        assert profile.source and profile.name and profile.platform in ("cuda", "rocm")
        assert profile.memory_bandwidth_bytes_per_s > 1e11 and profile.interconnect_bytes_per_s > 1e9
        assert profile.matmul_flops_per_s("bf16") >= profile.matmul_flops_per_s("fp32") > 1e12
        # BLAS workspace: cuBLAS's (8,519,680 B, or 32 MiB on Hopper and Blackwell), hipBLASLt's 76 MiB on ROCm
        assert profile.cublas_workspace_bytes in (8_519_680, 32 * 2**20, 76 * 2**20)


@pytest.mark.parametrize("gpu", NEW_GPUS)
def test_new_profile_capacity_is_just_below_its_marketed_memory(gpu):
    profile = device_profile(gpu)
    assert 0.9 * MARKETED_GB[gpu] * 1e9 <= profile.capacity_bytes <= MARKETED_GB[gpu] * 1e9 * 1.075
    assert profile.capacity_source, "each new profile says where its capacity comes from"
    if profile.platform == "cuda":
        assert 0.3e9 <= profile.cuda_context_bytes <= 1.3e9


def test_blackwell_gets_the_32_mib_cublas_workspace_and_the_b200_context():
    # CublasHandlePool.cpp: 32 MiB for compute capability 9.x-12.x; 612 MiB context measured on a B200
    for gpu in ("b200", "b300", "gb200", "rtx5090"):
        assert device_profile(gpu).cublas_workspace_bytes == 32 * 2**20
        assert device_profile(gpu).cuda_context_bytes == 612 * 2**20


def test_rocm_profiles_take_hipblaslt_workspace_and_refuse_what_is_not_modelled():
    mi300x = device_profile("mi300x")
    assert mi300x.platform == "rocm" and mi300x.cublas_workspace_bytes == 76 * 2**20
    assert mi300x.cuda_context_bytes is None
    assert "`attn=eager`" in mi300x.unmodelled(attn="sdpa", world_size=1, context_override=2**30)
    assert "`world_size=1`" in mi300x.unmodelled(attn="eager", world_size=8, context_override=2**30)
    assert "--cuda-context" in mi300x.unmodelled(attn="eager", world_size=1, context_override=None)
    assert mi300x.unmodelled(attn="eager", world_size=1, context_override=2**30) is None
    assert device_profile("h100-80gb").unmodelled(attn="sdpa", world_size=8, context_override=None) is None
    with pytest.raises(UserError, match="HIP context of AMD Instinct MI300X"):
        mi300x.context_bytes()
    assert mi300x.context_bytes(123) == 123


def test_a_device_is_matched_by_its_name_and_total_memory():
    from memplan.hardware.devices import profile_of_device

    # totals as PyTorch reports them (mem_get_info): an H100 SXM's 81,009 MiB, an H200's 143,163 MiB
    assert profile_of_device("NVIDIA H100 80GB HBM3", 81_009 * 2**20).key == "h100-80gb"
    assert profile_of_device("NVIDIA H200", 143_163 * 2**20).key == "h200-141gb"
    assert profile_of_device("NVIDIA H100 PCIe", 81_090 * 2**20).key == "h100-pcie-80gb"


def test_a_device_whose_memory_is_not_its_profiles_has_none():
    from memplan.hardware.devices import profile_of_device

    assert profile_of_device("NVIDIA H100 80GB HBM3", 10 * 2**30) is None  # a MIG slice
    assert profile_of_device("Some Other Accelerator", 80 * 2**30) is None


@pytest.mark.parametrize(("gpu", "gpus"), [
    ("h100-80gb", 8), ("a100-80gb", 8), ("gb200", 72), ("h100-pcie-80gb", 2), ("h100-nvl-94gb", 2),
    ("rtx3090", 2), ("rtx4090", 1), ("rtx4080", 1), ("rtx5090", 1), ("a10g", 1), ("l4", 1), ("l40", 1), ("l40s", 1),
    ("t4", 1),
])
def test_the_nvlink_domain_is_the_vendors_own(gpu, gpus):
    profile = device_profile(gpu)
    assert profile.nvlink_gpus == gpus and profile.nvlink_source


def test_every_profile_says_where_its_nvlink_domain_comes_from():
    assert all(device_profile(gpu).nvlink_source for gpu in list_devices())
