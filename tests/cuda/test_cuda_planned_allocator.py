"""The planned allocator behind `torch.cuda.memory.CUDAPluggableAllocator`, on a GPU.

PyTorch lets a process change its CUDA allocator only before CUDA is initialised, so
each case runs in a fresh interpreter.
"""

import json

import pytest
import torch
from fresh_python import last_json_line, run_python

from memplan.native import missing_build_tools

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or bool(missing_build_tools()), reason="needs a CUDA device and a C++ compiler"
)


def test_installing_after_the_first_cuda_tensor_is_refused_in_one_line():
    done = run_python("""
        import torch
        from memplan.errors import UserError
        from memplan.runtime.cuda import install_cuda_allocator
        torch.zeros(1, device="cuda")
        try:
            install_cuda_allocator()
        except UserError as exc:
            print(str(exc))
    """)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "before the first CUDA allocation" in lines[0]


def test_a_plan_serves_cuda_allocations_at_its_offsets():
    done = run_python("""
        import json
        import numpy as np
        import torch
        from memplan.layout.plan import LONG_LIVED, AddressPlan, IterationPlan
        from memplan.runtime.cuda import CudaPlannedAllocator, install_cuda_allocator

        install_cuda_allocator()
        install_cuda_allocator()  # a second call is a no-op
        plan = AddressPlan("test", 1024, 512, [IterationPlan(0, np.array([512, 512, 512], np.int64),
                                                             np.array([0, 512, LONG_LIVED], np.int64))])
        with CudaPlannedAllocator(plan) as pa:
            a = torch.empty(512, dtype=torch.uint8, device="cuda").fill_(1)
            b = torch.empty(512, dtype=torch.uint8, device="cuda").fill_(2)
            kept = torch.empty(512, dtype=torch.uint8, device="cuda").fill_(3)
            stats = pa.stats  # before the sums below make requests beyond the plan
            offsets = [a.data_ptr() - a.data_ptr(), b.data_ptr() - a.data_ptr()]
            sums = [int(a.sum()), int(b.sum()), int(kept.sum())]
            del a, b
        print(json.dumps({"offsets": offsets, "sums": sums, "stats": stats}))
    """)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["offsets"] == [0, 512]
    assert out["sums"] == [512, 1024, 1536]
    stats = out["stats"]
    assert (stats["served_planned"], stats["fallbacks"], stats["long_lived"]) == (2, 1, 1)
    assert stats["fallback_reasons"]["outlived_iteration"] == 1


def test_a_training_step_runs_under_the_plan_of_its_traced_capture():
    """A real step of a tiny Llama on CUDA, served from the STWeaver plan of its own capture
    (traced on fake tensors for cuda): some requests at their planned offsets, whatever the
    trace did not foresee from the fallback, and the parameters bit-identical to the same step
    without the plan."""
    out = last_json_line(run_python("""
        import json
        import torch
        from memplan import models, plan_addresses
        from memplan.capture.step import build_training_step, capture_model
        from memplan.runtime.cuda import CudaPlannedAllocator, install_cuda_allocator

        install_cuda_allocator()
        config, setup = models.tiny_config("llama-3.2-1b"), models.TrainingSetup(batch=2, seq=32)
        plan = plan_addresses(capture_model(config, setup, device="cuda"))
        reference = build_training_step(config, setup, device="cuda")
        reference.run()
        reference.run()
        planned = build_training_step(config, setup, device="cuda")
        planned.run()
        with CudaPlannedAllocator(plan, first_iteration=0) as pa:  # after the warm-up: the periodic step
            planned.run()
            torch.cuda.synchronize()
            stats = pa.stats
        same = [torch.equal(a, b) for a, b in zip(reference.model.parameters(), planned.model.parameters())]
        print(json.dumps({"stats": stats, "same": all(same)}))
    """))
    stats = out["stats"]
    assert out["same"]
    assert stats["served_planned"] > 0, stats
    assert stats["served"] + stats["fallbacks"] == stats["requests"], stats
