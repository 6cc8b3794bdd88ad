"""`memplan calibrate` on a step `memplan.watch` measured on this GPU, in a fresh process (a
clean CUDA context and allocator): the context, capacity and cuBLAS workspace it fits, and the
profile it writes, used by an estimate. Skipped without a GPU."""

import pytest
import torch
from fresh_python import last_json_line, run_python

from memplan import models
from memplan.estimation import estimate
from memplan.estimation.calibrate import calibrate
from memplan.hardware.devices import profile_of_device
from memplan.trace import load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SETUP = {"batch": 2, "seq": 64}


def watched_step(out_dir):
    """Three steps of a tiny Llama under the watch, the second measured; the device's name and total."""
    return last_json_line(run_python(f"""
        import json
        import torch
        import memplan
        from memplan import models
        from memplan.capture.step import build_training_step

        setup = models.TrainingSetup(**{SETUP!r})
        step = build_training_step(models.tiny_config("llama-3.2-1b"), setup, device="cuda")
        with memplan.watch(step.model, step.optimizer, step=2, out_dir={str(out_dir)!r}, setup=setup,
                           gpu="h100-80gb"):
            for _ in range(3):
                step.run()
        print(json.dumps({{"name": torch.cuda.get_device_name(), "total": torch.cuda.mem_get_info()[1]}}))
    """))


def test_calibrate_fits_the_context_capacity_and_workspace_of_a_real_step(tmp_path):
    device = watched_step(tmp_path)
    measured = tmp_path / "step2.memtrace"
    meta = load(measured).meta
    result = calibrate(measured, "this-gpu", base="h100-80gb")
    fitted = result["measured"]
    assert fitted["capacity_bytes"] == device["total"]
    assert fitted["cuda_context_bytes"] == meta["context_bytes"] > 0
    assert "cublas_workspace_bytes" in fitted, result["kept"]
    shipped = profile_of_device(device["name"], device["total"])
    if shipped is not None:  # the shipped profile's workspace is what this device allocates
        assert fitted["cublas_workspace_bytes"] == shipped.cublas_workspace_bytes, (fitted, shipped.key)


def test_the_calibrated_profile_is_an_estimate_s_gpu(tmp_path):
    watched_step(tmp_path)
    fitted = calibrate(tmp_path / "step2.memtrace", "this-gpu", base="h100-80gb")["measured"]
    est = estimate(models.tiny_config("llama-3.2-1b"), models.TrainingSetup(**SETUP), gpu="this-gpu")
    assert est.capacity_bytes == fitted["capacity_bytes"]
    assert est.device_used_bytes - est.peak_reserved_bytes == fitted["cuda_context_bytes"]
