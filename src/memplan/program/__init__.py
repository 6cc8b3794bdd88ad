"""`memplan run -- COMMAND`: the memory of the user's own training program, traced as it runs.

`run_program(["torchrun", "--nproc-per-node", "8", "train.py", ...], device="cuda",
gpu="h100-80gb")` runs the program unmodified in this process (`runpy`), one rank after
another on PyTorch's fake process group, with fake weights and real data, traces its
optimizer steps with memplan's recorder and gives, per traced rank, the same figures as
`memplan estimate` (allocator replay, CUDA context, NCCL), with what memplan saw the program
do. docs/run.md explains the method and its policies:

- `launchers`: the command as its launcher reads it (python, torchrun);
- `world`, `fakes`, `reads`: which tensors are fake, which are device memory, and what a
  read of a fake value gives;
- `cuda_api`: `torch.cuda` answered from a device profile and memplan's counters;
- `distributed`: the fake process group, and the ranks whose memory differs;
- `steps`: where the program's steps begin and end, and its stop;
- `side_effects`: no reporting, no checkpoint of fake tensors, the program's writes under OUT;
- `recording`, `runner`, `seen`, `estimate`, `api`: one rank traced, what was seen, the figures;
- `groundtruth`: the same command run for real on the CPU under torch.profiler.

The names below are imported on first use, so that a ground-truth process that needs only
`steps` does not import the recorder and the estimate.
"""

import importlib

_LAZY_NAMES = {
    "ProgramRun": "memplan.program.api", "run_program": "memplan.program.api",
    "measure_program": "memplan.program.groundtruth",
    "LAUNCHERS": "memplan.program.launchers", "Launch": "memplan.program.launchers",
    "parse_command": "memplan.program.launchers",
    "ProgramFailed": "memplan.program.runner", "ProgramRefused": "memplan.program.runner",
}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - the type depends on the name
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.program' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
