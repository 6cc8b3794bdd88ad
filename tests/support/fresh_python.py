"""Run code in a fresh interpreter: for CUDA tests that need a clean CUDA context and allocator
(PyTorch lets a process change its CUDA allocator only before CUDA is initialised, and a
measured peak must not include what earlier tests left in the caching allocator)."""

import os
import subprocess
import sys
import textwrap


def run_python(code: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`code` (dedented) in a new `sys.executable` with this process's import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout_s, check=False)


def last_json_line(done: subprocess.CompletedProcess) -> dict:
    """The JSON object the code printed last (it prints one line of JSON at its end)."""
    import json

    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
