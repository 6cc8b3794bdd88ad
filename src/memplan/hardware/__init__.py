"""What memplan knows of the machines a job runs on: GPU profiles, host links and NVMe
arrays (shipped as JSON beside the modules, each figure with its public source), and
the one roofline that turns a trace's ops into seconds on a GPU."""

from memplan.hardware.devices import DeviceProfile, all_profiles, device_profile, list_devices
from memplan.hardware.links import Hardware, NvmeArray, make_hardware, parse_nvme_spec
from memplan.hardware.roofline import matmul_dtype, op_seconds, step_seconds

__all__ = [
    "DeviceProfile",
    "all_profiles",
    "Hardware",
    "NvmeArray",
    "device_profile",
    "list_devices",
    "make_hardware",
    "matmul_dtype",
    "op_seconds",
    "parse_nvme_spec",
    "step_seconds",
]
