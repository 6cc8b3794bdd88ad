"""`make gpu-check`: memplan's CUDA paths and its estimates against real training steps on one GPU.

Everything memplan says about a GPU is modelled on a machine without one; this script is the
ground truth, in one command, on a machine with one NVIDIA GPU and nothing but the working
tree (no network, no virtual environment: the machine's own `python3`, memplan from `src/`):

1. the versions it runs with (Python, torch, CUDA, the driver, transformers, peft, the GPU and
   its memory), and the device profile of that GPU (`memplan.hardware.devices.profile_of_device`:
   h100-80gb, h200-141gb, ...; another GPU is refused unless `--gpu NAME` names the profile to
   estimate it with, its capacity then the measured total);
2. `pytest tests/cuda` (the watch, the planned allocator, the offload runtime's device moves,
   calibrate, the training step built on CUDA; they skip without a GPU);
3. the training steps of `CASES` below, each built by memplan's own step builder
   (`memplan.capture.step.build_training_step(model, setup, device="cuda")`) from a shipped
   config with random weights, in a fresh process (a clean CUDA context and allocator): one
   warm-up step, then the measured one, between `torch.cuda.reset_peak_memory_stats()` and
   `torch.cuda.memory_stats()` (peak allocated, peak reserved) and device used at the peak as
   `memplan.watch` takes it (`torch.cuda.mem_get_info`: the memory outside PyTorch's reserved
   plus the peak reserved). Each is set against `memplan.estimate` of the same model and setup
   for the device's profile, run on the same host's CPU (fake tensors, the GPU hidden) in
   parallel processes while the GPU works; a case whose estimate does not fit the device is
   skipped, and said so;
3b. the `generate()` calls of `GENERATION_CASES` the same way, in a table of their own: the
   model built by `memplan generate`'s own builder (`memplan.inference.gen_capture`), a
   warm-up call, then the measured one, each with `min_new_tokens = max_new_tokens` (the
   fixed-shape rule `memplan.estimate_generation` traces), set against that estimate;
4. `memplan.watch` on one of those steps and `memplan calibrate` on the step it measured: the
   fitted CUDA context and cuBLAS workspace beside the shipped profile's;
5. one JSON and one Markdown table under `GPU_CHECK_OUT` (default memplan-out/gpu-check),
   rewritten after every stage, so a run cut short still leaves what it measured; on a GPU
   the table is also BENCHMARKS.md's "GPU ground truth" section.

Every stage runs under its own timeout and the whole run under a budget (within 8 minutes; 3
with `--quick`, which runs the cases marked quick and the tests last, with what time is left):
what no longer fits is skipped and listed.
Goals, printed beside each case: peak allocated within 1% and peak reserved within 3% of the
measured figure on dense models, and a median of at most 2% over them.

    make gpu-check                # on the GPU machine (python3, PYTHONPATH=src)
    make gpu-check QUICK=1        # the quick subset
    make gpu-check DRY_RUN=1      # anywhere: the cases and their estimates, no GPU
    python3 benchmarks/gpu_check.py --render memplan-out/gpu-check/gpu_check.json
                                  # BENCHMARKS.md's section from a run's JSON
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(Path(__file__).resolve().parent)]

FORMAT = "memplan-gpu-check"
COMMAND = "make gpu-check"
SECTION = "gpu_check"
DEFAULT_OUT = "memplan-out/gpu-check"
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")
GOALS = {"peak_allocated_bytes": 0.01, "peak_reserved_bytes": 0.03}  # |error| per dense case
MEDIAN_GOAL = 0.02  # median |error| of each figure with a goal, over the dense cases
BUDGET_S = {"full": 450, "quick": 165}  # within 8 and 3 minutes on an H100, start-up included
PYTEST_TIMEOUT_S = {"full": 180, "quick": 90}
PYTEST_WORKERS = 4  # pytest-xdist workers where it is installed
PYTEST_TEST_TIMEOUT_S = 150  # per test, where pytest-timeout is installed
ESTIMATE_TIMEOUT_S = 300
WATCH_TIMEOUT_S = 150
CALIBRATE_TIMEOUT_S = 60
RESERVE_S = 10  # kept back from the budget for the last writes
MIN_STAGE_S = 20  # a stage is not started with less time than this left
# memory_stats() kept beside the figures: the requested bytes (before the allocator's 512-byte
# rounding), the active and segment peaks, retries and cudaMalloc calls
DIAGNOSTIC_STATS = ("requested_bytes.all.peak", "active_bytes.all.peak", "segment.all.peak", "num_alloc_retries",
                    "num_device_alloc", "num_ooms")
OPTIONAL_PACKAGES = ("bitsandbytes", "torchao", "litgpt", "peft", "accelerate", "triton")


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured training step: a shipped model under a setup (`TrainingSetup` fields)."""

    name: str
    model: str
    setup: dict[str, Any]
    dense: bool = True  # the goals apply (a mixture of experts is reported beside them)
    quick: bool = False  # in the `--quick` subset
    timeout_s: int = 120
    fit_check: bool = False  # measured only if its estimate fits the device (waited for)
    # a generate() call (`GenerationSetup` fields; `setup` then holds the model's fields only)
    generation: dict[str, Any] | None = None
    estimate_timeout_s: int = ESTIMATE_TIMEOUT_S

    def training_setup(self) -> Any:
        from memplan.models.setup import TrainingSetup

        return TrainingSetup.from_dict(self.setup)

    def generation_setup(self) -> Any:
        from memplan.inference.gen_capture import GenerationSetup

        return GenerationSetup(**(self.generation or {}))

    def model_fields(self) -> dict[str, Any]:
        """The model's fields of a generation case, as `memplan generate` passes them."""
        return {**self.setup, "seq": self.generation_setup().total_len}


# The cases, in the order they run (the quick ones first). bf16-mixed is fp32 weights under
# bf16 autocast (dtype fp32, autocast bf16); pure bf16 is dtype bf16.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CASES = (
    Case("gpt2", "gpt2", {"batch": 8, "seq": 1024}, quick=True),
    Case("llama-3.2-1b-bf16-mixed", "llama-3.2-1b", {"batch": 4, "seq": 1024, "dtype": "fp32", "autocast": "bf16"},
         quick=True),
    Case("llama-3.2-1b-bf16", "llama-3.2-1b", {"batch": 4, "seq": 1024, "dtype": "bf16"}, quick=True),
    Case("llama-3.2-1b-chunked-loss", "llama-3.2-1b", {"batch": 4, "seq": 2048, "dtype": "bf16", "loss": "chunked"}),
    Case("qwen2.5-1.5b-checkpointed", "qwen2.5-1.5b",
         {"batch": 8, "seq": 2048, "dtype": "bf16", "checkpointing": "full"}),
    Case("llama-3.1-8b-lora", "llama-3.1-8b", {"batch": 2, "seq": 1024, "dtype": "bf16", "lora_rank": 16}),
    Case("gpt2-compiled", "gpt2", {"batch": 8, "seq": 1024, "compile": "model"}, timeout_s=240),
    Case("olmoe-1b-7b-lora", "olmoe-1b-7b",
         {"batch": 2, "seq": 1024, "dtype": "bf16", "lora_rank": 16, "lora_targets": ATTENTION}, dense=False),
    Case("qwen3-30b-a3b-lora", "qwen3-30b-a3b",
         {"batch": 1, "seq": 1024, "dtype": "bf16", "lora_rank": 16, "lora_targets": ATTENTION}, dense=False,
         timeout_s=180, fit_check=True),
)
# Generation (`memplan generate`: a KV cache, no optimizer), measured the same way (a fresh
# process, a warm-up call, then the measured one) and set against its estimate, in a table of
# their own; after the training steps. Tracing 256 decode steps takes minutes on one core,
# hence the longer estimate timeout.
GENERATION_CALL = {"batch": 8, "input_len": 512, "new_tokens": 256}
GENERATION_CASES: tuple[Case, ...] = (
    Case("llama-3.2-1b-gen-dynamic", "llama-3.2-1b", {"dtype": "bf16"},
         generation={**GENERATION_CALL, "cache": "dynamic"}, estimate_timeout_s=420),
    Case("llama-3.2-1b-gen-static", "llama-3.2-1b", {"dtype": "bf16"},
         generation={**GENERATION_CALL, "cache": "static"}, estimate_timeout_s=420),
)
WATCH_CASE = "llama-3.2-1b-bf16"  # the step memplan.watch measures and calibrate fits


def case_by_name(name: str) -> Case:
    for case in CASES + GENERATION_CASES:
        if case.name == name:
            return case
    raise SystemExit(f"gpu_check: no case {name!r}: {', '.join(c.name for c in CASES + GENERATION_CASES)}")


def setup_label(case: Case) -> str:
    """One short line: precision, batch x sequence (or the generate() call), and the techniques on."""
    s = case.setup
    if case.generation is not None:
        g = case.generation_setup()
        return f"{s.get('dtype', 'fp32')}, b{g.batch}, {g.input_len} + {g.new_tokens} tokens, {g.cache} cache"
    precision = {("fp32", "none"): "fp32", ("fp32", "bf16"): "bf16-mixed", ("bf16", "none"): "bf16"}.get(
        (s.get("dtype", "fp32"), s.get("autocast", "none")), f"{s.get('dtype', 'fp32')}+{s.get('autocast')}")
    parts = [precision, f"b{s['batch']} x s{s['seq']}"]
    if s.get("lora_rank"):
        parts.append(f"LoRA r{s['lora_rank']}" + (" (attention)" if s.get("lora_targets") == ATTENTION else ""))
    for flag, label in (("checkpointing", "{} AC"), ("loss", "{} loss"), ("compile", "compile {}")):
        if s.get(flag, "none") not in ("none", "full") or (flag == "checkpointing" and s.get(flag) == "full"):
            parts.append(label.format(s[flag]))
    return ", ".join(parts)


# --- the children: each runs in its own process and writes one JSON object ---------------


def device_info() -> dict[str, Any]:
    """The versions and the device (child `--device-info`; the parent never touches CUDA)."""
    import torch

    info: dict[str, Any] = environment()
    info["cuda_available"] = torch.cuda.is_available()
    if not info["cuda_available"]:
        return info
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    info.update(gpu_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                total_bytes=int(total), free_bytes_at_start=int(free),
                compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                driver=nvidia_smi_field("driver_version"))
    return info


def environment() -> dict[str, Any]:
    """Python, torch, CUDA, transformers and the optional packages, as this process sees them."""
    import torch
    import transformers

    packages = {}
    for name in OPTIONAL_PACKAGES:  # read from their metadata: importing litgpt alone takes seconds
        try:
            packages[name] = importlib.metadata.version(name) if importlib.util.find_spec(name) else None
        except importlib.metadata.PackageNotFoundError:
            packages[name] = "importable, no metadata"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "packages": packages, "memplan_commit": git_commit(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "cpus": os.cpu_count()}


def nvidia_smi_field(field: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True)
        return done.stdout.strip().splitlines()[0]
    return None


def git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True)
        return done.stdout.split()[0]
    return None


def measure(case: Case) -> dict[str, Any]:
    """The case's warm-up step, then its measured step, on the GPU (child `--measure`)."""
    import torch

    from memplan.capture.step import build_training_step
    from memplan.watch.cuda import outside_reserved_bytes

    if case.generation is not None:
        return measure_generation(case)
    start = time.perf_counter()
    torch.cuda.init()
    context = outside_reserved_bytes()  # the CUDA context before any kernel is loaded
    step = build_training_step(case.model, case.training_setup(), device="cuda")
    torch.cuda.synchronize()
    built = time.perf_counter()
    step.run()
    torch.cuda.synchronize()
    warm = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    step.run()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {**measured_figures(context), "parameters": step.meta["parameters"],
            "trainable_parameters": step.meta["trainable_parameters"], "build_s": round(built - start, 2),
            "warmup_s": round(warm - built, 2), "step_s": round(done - warm, 3)}


def measured_figures(context_bytes: int) -> dict[str, Any]:
    """The figures of what ran since `torch.cuda.reset_peak_memory_stats()`: peak allocated and
    reserved, device used at the peak, the diagnostic statistics and the GPU's processes."""
    import torch

    from memplan.watch.cuda import device_used_peak_bytes, outside_reserved_bytes

    stats = torch.cuda.memory_stats()
    outside = outside_reserved_bytes()
    return {
        "peak_allocated_bytes": int(stats["allocated_bytes.all.peak"]),
        "peak_reserved_bytes": int(stats["reserved_bytes.all.peak"]),
        "device_used_bytes": device_used_peak_bytes(outside, stats),
        "outside_reserved_bytes": outside, "context_at_start_bytes": context_bytes,
        "stats": {key: int(stats.get(key, 0)) for key in DIAGNOSTIC_STATS}, "gpu_processes": nvidia_smi_processes(),
    }


def measure_generation(case: Case) -> dict[str, Any]:
    """A generation case's warm-up `generate()` call, then its measured one, on the GPU: the
    model `memplan generate` builds (random weights), B prompts of L random token ids, exactly
    N new tokens (min_new_tokens = max_new_tokens); the output's length is checked. Decoding is
    eager, as memplan traces it: transformers would compile a static cache's decoding forward
    on CUDA (its auto-compile, `generation_config.disable_compile` set here)."""
    import torch

    from memplan.inference.gen_capture import (
        build_generation_model,
        generation_inputs,
        model_setup,
        run_generate,
    )
    from memplan.models.quant import weight_count
    from memplan.models.registry import load_config
    from memplan.watch.cuda import outside_reserved_bytes

    start = time.perf_counter()
    torch.cuda.init()
    context = outside_reserved_bytes()
    config, generation = load_config(case.model), case.generation_setup()
    model = build_generation_model(config, model_setup(case.model_fields()), device="cuda")
    model.generation_config.disable_compile = True
    inputs = generation_inputs(config, generation, device="cuda")
    torch.cuda.synchronize()
    built = time.perf_counter()
    length = int(run_generate(model, inputs, generation).shape[-1])  # the warm-up's output is dropped
    if length != generation.total_len:
        raise RuntimeError(f"generate() returned {length} tokens per sequence, not {generation.total_len}")
    torch.cuda.synchronize()
    warm = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    out = run_generate(model, inputs, generation)
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {**measured_figures(context), "parameters": int(sum(weight_count(p) for p in model.parameters())),
            "output_shape": list(out.shape), "build_s": round(built - start, 2), "warmup_s": round(warm - built, 2),
            "step_s": round(done - warm, 3)}


def nvidia_smi_processes() -> list[dict[str, Any]] | None:
    """The processes nvidia-smi sees on the GPU (pid, MiB): another one would count in device used."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True)
        rows = [line.split(",") for line in done.stdout.strip().splitlines() if line.strip()]
        return [{"pid": int(pid), "used_mib": int(mib)} for pid, mib in rows if mib.strip().isdigit()]
    return None


def estimate_case(case: Case, gpu: str, capacity_bytes: int) -> dict[str, Any]:
    """`memplan.estimate` (a generation case: `memplan.estimate_generation`) of the case for the
    device's profile (child `--estimate`, or in-process)."""
    from memplan.estimation import estimate

    if case.generation is not None:
        return estimate_generation_case(case, gpu, capacity_bytes)
    result = estimate(case.model, case.training_setup(), device="cuda", gpu=gpu, capacity=capacity_bytes,
                      alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None)
    out = {key: getattr(result, key) for key in (*FIGURES, "capacity_bytes", "fits", "method", "parameters")}
    out.update(elapsed_s=round(result.elapsed_s, 1), breakdown=result.per_rank[0].breakdown,
               peak_phase=result.per_rank[0].peak_phase, routing=result.routing)
    return out


def estimate_generation_case(case: Case, gpu: str, capacity_bytes: int) -> dict[str, Any]:
    """`memplan.estimate_generation` of a generation case for the device's profile."""
    from memplan.inference.generate import estimate_generation

    result = estimate_generation(case.model, case.generation_setup(), case.model_fields(), device="cuda", gpu=gpu,
                                 capacity=capacity_bytes, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None)
    out = {key: getattr(result, key) for key in (*FIGURES, "capacity_bytes", "fits", "method", "parameters")}
    out.update(elapsed_s=round(result.elapsed_s, 1), breakdown=result.breakdown, peak_phase=result.peak_phase)
    return out


def watch(case: Case, gpu: str, out_dir: Path) -> dict[str, Any]:
    """`memplan.watch` around three steps of the case, measuring the second (child `--watch`)."""
    import memplan
    from memplan.capture.step import build_training_step

    setup = case.training_setup()
    step = build_training_step(case.model, setup, device="cuda")
    start = time.perf_counter()
    with memplan.watch(step.model, step.optimizer, step=2, out_dir=out_dir, gpu=gpu, setup=setup):
        for _ in range(3):
            step.run()
    compared = json.loads((out_dir / "compare.json").read_text())
    return {"out_dir": str(out_dir), "measured_file": str(out_dir / "step2.memtrace"),
            "figures": compared["figures"], "elapsed_s": round(time.perf_counter() - start, 1)}


CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "device_info": lambda a: device_info(),
    "measure": lambda a: measure(case_by_name(a.measure)),
    "estimate": lambda a: estimate_case(case_by_name(a.estimate), a.gpu, int(a.capacity)),
    "watch": lambda a: watch(case_by_name(a.watch), a.gpu, Path(a.watch_dir)),
}


def run_as_child(args: argparse.Namespace, mode: str) -> int:
    """Run one child mode and write its JSON (or the error that stopped it) to `--result`."""
    try:
        result: dict[str, Any] = {"ok": True, **CHILDREN[mode](args)}
    except Exception as exc:  # noqa: BLE001 - the parent reports whatever stopped the child
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"}
    write_json(Path(args.result), result)
    return 0 if result["ok"] else 1


# --- the parent: stages, each in its own process under a timeout ----------------------------


@dataclasses.dataclass
class Child:
    """What a child process left: its JSON (None when it wrote none), exit code, time, output tail."""

    result: dict[str, Any] | None
    rc: int | None
    timed_out: bool
    elapsed_s: float
    tail: str


def child_env(hide_gpu: bool = False) -> dict[str, str]:
    """The environment of a child: memplan from this tree; the GPU hidden from CPU-only work, so
    that no CUDA context of an estimate counts in a measured step's device used."""
    paths = [str(ROOT / "src"), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


_LIVE_GROUPS: set[int] = set()  # the process groups of the children running now


def kill_children(signum: int, _frame: Any) -> None:
    """On SIGTERM or SIGINT: end every child's process group, then this process."""
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def children_end_with_this_process() -> Any:
    """SIGTERM and SIGINT end the children too (`kill_children`) for the block."""
    previous = {signum: signal.signal(signum, kill_children) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_child(command: list[str], timeout_s: float, log: Path, *, env: dict[str, str],
              result: Path | None = None) -> Child:
    """Run `command` in a process group of its own with output to `log`; past `timeout_s` the
    whole group is killed (a compiled step's compile workers too). The group stays in this
    process's session, so whatever ends the session's processes ends it too."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if result is not None:
        result.unlink(missing_ok=True)
    start = time.perf_counter()
    timed_out = False
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, **group)
        _LIVE_GROUPS.add(proc.pid)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            _LIVE_GROUPS.discard(proc.pid)
    tail = log.read_text(errors="replace")[-2000:]
    data = json.loads(result.read_text()) if result is not None and result.exists() else None
    return Child(data, rc, timed_out, round(time.perf_counter() - start, 1), tail)


def run_mode(mode_args: list[str], timeout_s: float, log: Path, result: Path, hide_gpu: bool = False) -> Child:
    """This script as a child in one mode (`--measure NAME`, ...)."""
    command = [sys.executable, str(Path(__file__).resolve()), *mode_args, "--result", str(result)]
    return run_child(command, timeout_s, log, env=child_env(hide_gpu), result=result)


def child_outcome(child: Child) -> dict[str, Any]:
    """A child's JSON, or why there is none (timeout, crash), with its last output lines."""
    if child.timed_out:
        return {"ok": False, "error": f"timed out after {child.elapsed_s:.0f} s", "log_tail": child.tail[-600:]}
    if child.result is None:
        return {"ok": False, "error": f"exited {child.rc} without a result", "log_tail": child.tail[-600:]}
    out = dict(child.result)
    if not out.get("ok"):
        out["log_tail"] = child.tail[-600:]
    return out


class Budget:
    """The run's deadline, and each stage's share of what is left."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def left_s(self) -> float:
        return self.total_s - (time.monotonic() - self.start) - RESERVE_S

    def allows(self, stage_timeout_s: float) -> float | None:
        """The timeout a stage gets (its own, cut to what is left), or None when too little is left."""
        left = self.left_s()
        return min(stage_timeout_s, left) if left >= MIN_STAGE_S else None


# --- goals, tables, files --------------------------------------------------------------------


def errors_of(measured: dict[str, Any] | None, estimated: dict[str, Any] | None) -> dict[str, float | None]:
    """(estimate - measured) / measured for each figure, None where a side lacks it."""
    out: dict[str, float | None] = {}
    for key in FIGURES:
        m = (measured or {}).get(key)
        e = (estimated or {}).get(key)
        out[key] = (e - m) / m if isinstance(m, int) and isinstance(e, int) and m > 0 else None
    return out


def within_goals(case: Case, errors: dict[str, float | None]) -> bool | None:
    """Whether a dense case meets the per-case goals (None: no goal, or not measured)."""
    if not case.dense or any(errors.get(key) is None for key in GOALS):
        return None
    return all(abs(errors[key]) <= limit for key, limit in GOALS.items())


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error| of each figure over the dense cases measured, and how many met the goals."""
    dense = [r for r in rows if r.get("dense") and r.get("errors") and r["errors"].get("peak_allocated_bytes") is not None]
    out: dict[str, Any] = {"dense_measured": len(dense), "within_goals": sum(1 for r in dense if r.get("within_goals"))}
    for key in FIGURES:
        values = [abs(r["errors"][key]) for r in dense if r["errors"].get(key) is not None]
        out[f"median_abs_error_{key.removesuffix('_bytes')}"] = statistics.median(values) if values else None
    out["median_goal_met"] = all(out[f"median_abs_error_{k.removesuffix('_bytes')}"] is not None and
                                 out[f"median_abs_error_{k.removesuffix('_bytes')}"] <= MEDIAN_GOAL
                                 for k in GOALS) if dense else None
    return out


def gib(value: Any) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, int) else "—"


def pct(value: Any, sign: str = "+") -> str:
    return f"{value * 100:{sign}.2f}%" if isinstance(value, float) else "—"


def goal_text(row: dict[str, Any]) -> str:
    if row.get("status") != "measured":
        return row.get("status", "—")
    if not row.get("dense"):
        return "reported (MoE)"
    verdict = row.get("within_goals")
    return "—" if verdict is None else ("met" if verdict else "missed")


def case_rows_markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| case | setup | measured GiB alloc / reserved / used | memplan GiB alloc / reserved / used | "
             "error alloc / reserved / used | goal |", "|---|---|---|---|---|---|"]
    for row in rows:
        m, e, err = row.get("measured") or {}, row.get("estimate") or {}, row.get("errors") or {}
        lines.append(f"| {row['name']} | {row['setup_label']} | "
                     + " / ".join(gib(m.get(k)) for k in FIGURES) + " | "
                     + " / ".join(gib(e.get(k)) for k in FIGURES) + " | "
                     + " / ".join(pct(err.get(k)) for k in FIGURES) + f" | {goal_text(row)} |")
    return lines


def device_line(report: dict[str, Any]) -> str:
    env = report.get("environment") or {}
    if report.get("dry_run"):
        return (f"Dry run (no GPU): estimates for the `{report.get('gpu')}` profile; torch {env.get('torch')}, "
                f"transformers {env.get('transformers')}, Python {env.get('python')}.")
    return (f"{env.get('gpu_name')} ({gib(env.get('total_bytes'))} GiB, profile `{report.get('gpu')}`), driver "
            f"{env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}, peft {(env.get('packages') or {}).get('peft')}, Python {env.get('python')}, "
            f"memplan {env.get('memplan_commit')}.")


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for key, what in (("summary", "Dense cases"), ("generation_summary", "Generation cases")):
        s = report.get(key) or {}
        if s.get("dense_measured"):
            lines.append(f"{what} measured: {s['dense_measured']}, within the per-case goals (allocated ±1%, "
                         f"reserved ±3%): {s['within_goals']}. Median |error|: allocated "
                         f"{pct(s.get('median_abs_error_peak_allocated'), '')}, reserved "
                         f"{pct(s.get('median_abs_error_peak_reserved'), '')}, device used "
                         f"{pct(s.get('median_abs_error_device_used'), '')} (goal ≤ 2%: "
                         f"{'met' if s.get('median_goal_met') else 'missed'}).")
    tests = report.get("pytest")
    if tests:
        lines.append(f"`pytest tests/cuda`: {tests.get('summary') or tests.get('error')}.")
    calibration = report.get("calibration")
    if calibration:
        lines.append(calibration_line(calibration))
    skipped = [r["name"] for r in report.get("cases", []) if r.get("status", "").startswith("skipped")]
    if skipped:
        lines.append(f"Skipped: {', '.join(skipped)} (see the JSON for why).")
    return lines


def calibration_line(c: dict[str, Any]) -> str:
    if not c.get("ok"):
        return f"watch + calibrate on `{c.get('case')}`: {c.get('error')}."
    fitted, shipped = c.get("measured") or {}, c.get("shipped") or {}

    def mib(value: Any) -> str:
        return f"{value / 2**20:.0f} MiB" if isinstance(value, int) else "—"

    return (f"`memplan calibrate` on the step `memplan.watch` measured (`{c['case']}`): CUDA context "
            f"{mib(fitted.get('cuda_context_bytes'))} (profile {mib(shipped.get('cuda_context_bytes'))}), cuBLAS "
            f"workspace {mib(fitted.get('cublas_workspace_bytes'))} (profile "
            f"{mib(shipped.get('cublas_workspace_bytes'))}), capacity {gib(fitted.get('capacity_bytes'))} GiB "
            f"(profile {gib(shipped.get('capacity_bytes'))} GiB); the watch's own estimate against its measurement: "
            f"allocated {pct(c.get('watch_error_allocated'))}.")


def render_markdown(report: dict[str, Any]) -> str:
    """The run as Markdown: the device line, the tables (training steps, then generate() calls),
    the summary."""
    lines = ["## GPU ground truth", "", device_line(report), "", *case_tables_markdown(report.get("cases", []))]
    lines += [line + "\n" for line in summary_lines(report)]
    return "\n".join(lines).rstrip() + "\n"


def case_tables_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The training steps' table, then the generate() calls' (where there are any), each followed by a blank line."""
    training, generation = split_rows(rows)
    lines = [*case_rows_markdown(training), ""] if training else []
    if generation:
        lines += ["`generate()` calls (peak allocated, reserved and device used over the measured call, "
                  "against `memplan.estimate_generation`):", "", *case_rows_markdown(generation), ""]
    return lines


def render_section(report: dict[str, Any] | None) -> str:
    """BENCHMARKS.md's "GPU ground truth" section: the run's table, or that none has run yet."""
    intro = ("Real training steps on one GPU against `memplan estimate` for that GPU's profile, and "
             "transformers `generate()` calls (min_new_tokens = max_new_tokens) against `memplan generate`: "
             "`torch.cuda.max_memory_allocated` / `max_memory_reserved` of the step after a warm-up step, and "
             "device used (`mem_get_info`) at its peak, each step in a fresh process; built by memplan's own "
             "step builder from the shipped configs with random weights. Error = (memplan - measured) / "
             "measured. Goals: allocated within 1% and reserved within 3% on dense models, median ≤ 2%. "
             "Reproduce on a machine with one NVIDIA GPU (its own python3, no network, nothing but the "
             "working tree):")
    head = f"<!-- bench:{SECTION} -->\n## GPU ground truth\n\n{intro}\n\n```\n{COMMAND}\n```\n"
    if report is None or report.get("dry_run") or not report.get("cases"):
        estimated = {row["name"]: row.get("estimate") for row in (report or {}).get("cases", [])}
        rows = [{**planned_row(case), "estimate": estimated.get(case.name)} for case in CASES + GENERATION_CASES]
        gpu = f" memplan's columns are its estimates for `{report['gpu']}` (`make gpu-check DRY_RUN=1`)." \
            if report and any(estimated.values()) else ""
        body = (f"\nThis check has not run on a GPU yet: the measured columns fill when it does.{gpu}\n\n"
                + "\n".join(case_tables_markdown(rows)).rstrip() + "\n")
    else:
        body = "\n" + render_markdown(report).split("\n", 2)[2]
    return head + body + f"<!-- /bench:{SECTION} -->"


def planned_row(case: Case) -> dict[str, Any]:
    return {"name": case.name, "setup_label": setup_label(case), "dense": case.dense, "status": "not run",
            "generation": case.generation}


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training steps, generate() calls): each has a table and a summary of its own."""
    return [r for r in rows if not r.get("generation")], [r for r in rows if r.get("generation")]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    """The JSON and the Markdown table, rewritten whole (each replaced in one rename)."""
    training, generation = split_rows(report.get("cases", []))
    report["summary"] = summary(training)
    report["generation_summary"] = summary(generation)
    report["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(out_dir / "gpu_check.json", report)
    tmp = out_dir / "gpu_check.md.tmp"
    tmp.write_text(render_markdown(report))
    tmp.replace(out_dir / "gpu_check.md")


# --- the stages -------------------------------------------------------------------------------


def pick_profile(info: dict[str, Any], gpu: str | None) -> tuple[str, int]:
    """The profile to estimate with and the capacity: the measured device's shipped profile, or
    `--gpu`'s with the measured total. `UserError` on another GPU without `--gpu`."""
    from memplan.errors import UserError
    from memplan.hardware.devices import device_profile, profile_of_device

    total = int(info["total_bytes"])
    if gpu is not None:
        device_profile(gpu)  # an unknown name is a UserError naming the closest
        return gpu, total
    profile = profile_of_device(info["gpu_name"], total)
    if profile is None:
        raise UserError(f"no shipped device profile is {info['gpu_name']!r} with {total / 2**30:.1f} GiB: pass "
                        "--gpu NAME (a profile of `memplan estimate --gpu list`) to estimate with it and the "
                        "measured total as its capacity")
    return profile.key, total


def start_estimates(cases: list[Case], gpu: str, capacity: int, out_dir: Path,
                    pool: concurrent.futures.Executor) -> dict[str, concurrent.futures.Future]:
    """Each case's estimate in its own CPU process (the GPU hidden), in parallel."""
    def one(case: Case) -> dict[str, Any]:
        child = run_mode(["--estimate", case.name, "--gpu", gpu, "--capacity", str(capacity)], case.estimate_timeout_s,
                         case_file(out_dir, case, "estimate.log"), case_file(out_dir, case, "estimate.json"),
                         hide_gpu=True)
        return child_outcome(child)

    # the generation cases' estimates take longest and are measured last: they start first
    return {case.name: pool.submit(one, case) for case in sorted(cases, key=lambda c: c.generation is None)}


def run_pytest(out_dir: Path, budget: Budget, timeout_s: float) -> dict[str, Any]:
    """`pytest tests/cuda` in its own process, its counts read from its last line."""
    allowed = budget.allows(timeout_s)
    if allowed is None:
        return {"error": "skipped: the budget was spent"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cuda"]
    if importlib.util.find_spec("xdist"):  # the tests' fresh processes and compiles run side by side
        command += ["-n", str(PYTEST_WORKERS)]
    if importlib.util.find_spec("pytest_timeout"):  # one hung test fails alone
        command += [f"--timeout={PYTEST_TEST_TIMEOUT_S}"]
    child = run_child(command, allowed, out_dir / "pytest.log", env=child_env())
    words = ("passed", "failed", "skipped", "error", "no tests ran")
    last = next((line for line in reversed(child.tail.splitlines())
                 if " in " in line and any(word in line for word in words)), "")
    outcome = {"rc": child.rc, "elapsed_s": child.elapsed_s, "summary": last.strip("= ") or None,
               "tail": child.tail[-1500:]}
    if child.timed_out:
        outcome["error"] = f"timed out after {child.elapsed_s:.0f} s"
    return outcome


def case_file(out_dir: Path, case: Case, what: str) -> Path:
    """A case's file under `out_dir/cases` (`what`: measure.json, estimate.log, ...)."""
    return out_dir / "cases" / f"{case.name}.{what}"


def measured_row(case: Case, out_dir: Path, budget: Budget,
                 estimate: concurrent.futures.Future | None) -> dict[str, Any]:
    """One case measured, then set against its estimate (waited for after the step). An
    estimate that does not fit the device skips the case: a `fit_check` case waits for it
    first, the others use it if it has finished."""
    row: dict[str, Any] = {**planned_row(case), "model": case.model, "setup": case.setup}
    row.pop("status")
    est = {}
    if estimate is not None and (case.fit_check or estimate.done()):
        with contextlib.suppress(concurrent.futures.TimeoutError):
            est = estimate.result(timeout=max(1.0, budget.left_s()))
    if est.get("ok") and est.get("fits") is False:
        row["estimate"] = est
        row["status"] = (f"skipped: estimated {gib(est['device_used_bytes'])} GiB used, more than the "
                         f"{gib(est['capacity_bytes'])} GiB device")
        return row
    allowed = budget.allows(case.timeout_s)
    if allowed is None:
        row["status"] = "skipped: budget"
        return row
    child = run_mode(["--measure", case.name], allowed, case_file(out_dir, case, "measure.log"),
                     case_file(out_dir, case, "measure.json"))
    row["measured"] = child_outcome(child)
    row["status"] = "measured" if row["measured"].get("ok") else f"failed: {row['measured'].get('error')}"
    if estimate is not None:
        try:
            row["estimate"] = estimate.result(timeout=max(1.0, budget.left_s()))
        except concurrent.futures.TimeoutError:
            row["estimate"] = {"ok": False, "error": "not finished within the budget"}
    est = row.get("estimate") or {}
    if row["status"] == "measured" and est.get("ok"):
        row["errors"] = errors_of(row["measured"], est)
        row["within_goals"] = within_goals(case, row["errors"])
    return row


def watch_and_calibrate(case: Case, gpu: str, out_dir: Path, budget: Budget) -> dict[str, Any]:
    """`memplan.watch` on the case's step, then `memplan calibrate` on what it measured."""
    from memplan.hardware.devices import device_profile

    outcome: dict[str, Any] = {"case": case.name}
    allowed = budget.allows(WATCH_TIMEOUT_S)
    if allowed is None:
        return {**outcome, "ok": False, "error": "skipped: the budget was spent"}
    watch_dir = out_dir / "watch"
    child = run_mode(["--watch", case.name, "--gpu", gpu, "--watch-dir", str(watch_dir)], allowed,
                     out_dir / "watch.log", out_dir / "watch.json")
    watched = child_outcome(child)
    if not watched.get("ok"):
        return {**outcome, **watched}
    allocated = watched["figures"]["peak_allocated_bytes"]
    outcome["watch_error_allocated"] = errors_of({"peak_allocated_bytes": allocated["measured"]},
                                                 {"peak_allocated_bytes": allocated["estimated"]})[FIGURES[0]]
    command = [sys.executable, "-m", "memplan", "calibrate", watched["measured_file"], "--name", "gpu-check",
               "--base", gpu, "--json"]
    env = {**child_env(hide_gpu=True), "MEMPLAN_CACHE": str(out_dir / "cache")}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                              timeout=min(CALIBRATE_TIMEOUT_S, max(1.0, budget.left_s())))
    except subprocess.TimeoutExpired:
        return {**outcome, "ok": False, "error": "memplan calibrate timed out"}
    try:
        fitted = json.loads(done.stdout)
    except ValueError:
        return {**outcome, "ok": False, "error": f"memplan calibrate exited {done.returncode} without JSON",
                "log_tail": done.stderr[-600:]}
    shipped = device_profile(gpu)
    return {**outcome, "ok": True, "measured": fitted["measured"], "kept": sorted(fitted["kept"]),
            "shipped": {"cuda_context_bytes": shipped.cuda_context_bytes, "capacity_bytes": shipped.capacity_bytes,
                        "cublas_workspace_bytes": shipped.cublas_workspace_bytes}}


def selected_cases(args: argparse.Namespace) -> list[Case]:
    """The cases of `--case`, else every training step (the quick ones with `--quick`) and,
    on a full run, the generation cases after them."""
    if args.case:
        return [case_by_name(name) for name in args.case]
    return [case for case in CASES + GENERATION_CASES if case.quick or not args.quick]


def dry_run(args: argparse.Namespace, out_dir: Path) -> int:
    """The cases and their estimates for `--gpu`'s profile (default h100-80gb), in this process."""
    from memplan.hardware.devices import device_profile

    gpu = args.gpu or "h100-80gb"
    capacity = device_profile(gpu).capacity_bytes
    report: dict[str, Any] = {"format": FORMAT, "dry_run": True, "quick": args.quick, "gpu": gpu,
                              "environment": environment(), "cases": []}
    print(f"gpu_check --dry-run: {len(selected_cases(args))} cases, estimated for {gpu}", flush=True)
    for case in selected_cases(args):
        row = {**planned_row(case), "model": case.model, "setup": case.setup}
        try:
            row["estimate"] = {"ok": True, **estimate_case(case, gpu, capacity)}
            row["status"] = "estimated" if row["estimate"]["fits"] else "would be skipped: does not fit"
        except Exception as exc:  # noqa: BLE001 - a case that cannot be estimated is reported, the rest go on
            row["estimate"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            row["status"] = "estimate failed"
        report["cases"].append(row)
        e = row["estimate"]
        print(f"  {case.name:28} {setup_label(case):42} " + (
            " / ".join(gib(e.get(k)) for k in FIGURES) + f" GiB ({e.get('method')}, {e.get('elapsed_s')} s)"
            if e.get("ok") else e["error"]), flush=True)
        write_report(out_dir, report)
    failed = [r["name"] for r in report["cases"] if not r["estimate"].get("ok")]
    return 1 if failed else 0


def gpu_run(args: argparse.Namespace, out_dir: Path) -> int:
    """The whole check on the GPU (module docstring)."""
    mode = "quick" if args.quick else "full"
    budget = Budget(args.budget_s or BUDGET_S[mode])
    info = child_outcome(run_mode(["--device-info"], 120, out_dir / "device_info.log", out_dir / "device_info.json"))
    if not info.get("ok"):
        print(f"gpu_check: could not read the device: {info.get('error')}", file=sys.stderr)
        return 2
    if not info.get("cuda_available"):
        print("gpu_check: no CUDA device is visible: run it on a machine with one NVIDIA GPU, or with --dry-run",
              file=sys.stderr)
        return 2
    from memplan.errors import UserError

    try:
        gpu, capacity = pick_profile(info, args.gpu)
    except UserError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    cases = selected_cases(args)
    report: dict[str, Any] = {"format": FORMAT, "dry_run": False, "quick": args.quick, "gpu": gpu,
                              "capacity_bytes": capacity, "environment": info, "command": shlex.join(sys.argv),
                              "cases": [planned_row(case) for case in cases]}
    print(device_line(report), flush=True)
    print("error (memplan - measured) / measured, allocated / reserved / used; goals on dense models: allocated "
          "within 1%, reserved within 3%, median <= 2%", flush=True)
    write_report(out_dir, report)
    jobs = args.jobs or max(1, min(len(cases), (os.cpu_count() or 2) // 2))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        estimates = start_estimates(cases, gpu, capacity, out_dir, pool)
        # the full run tests first, while the estimates run; the quick one measures first
        if not args.no_pytest and not args.quick:
            pytest_stage(report, out_dir, budget, args.pytest_timeout_s or PYTEST_TIMEOUT_S[mode])
        run_cases(args, cases, report, out_dir, budget, estimates, gpu)
        if not args.no_pytest and args.quick:
            pytest_stage(report, out_dir, budget, args.pytest_timeout_s or PYTEST_TIMEOUT_S[mode])
        for future in estimates.values():
            future.cancel()
    if not args.dry_run and not args.case and not args.quick:
        from benchmarks_md import write_section

        write_section(SECTION, render_section(report))
    print(render_markdown(report), flush=True)
    return 0


def pytest_stage(report: dict[str, Any], out_dir: Path, budget: Budget, timeout_s: float) -> None:
    report["pytest"] = run_pytest(out_dir, budget, timeout_s)
    print(f"pytest tests/cuda: {report['pytest'].get('summary') or report['pytest'].get('error')}", flush=True)
    write_report(out_dir, report)


def run_cases(args: argparse.Namespace, cases: list[Case], report: dict[str, Any], out_dir: Path, budget: Budget,
              estimates: dict[str, concurrent.futures.Future], gpu: str) -> None:
    """Each case in turn, the table rewritten after each; the watch after the quick ones."""
    watch_case = case_by_name(WATCH_CASE)
    watched = args.no_watch
    for index, case in enumerate(cases):
        if not watched and not case.quick:
            report["calibration"] = watch_and_calibrate(watch_case, gpu, out_dir, budget)
            watched = True
            print(calibration_line(report["calibration"]), flush=True)
            write_report(out_dir, report)
        row = measured_row(case, out_dir, budget, estimates.get(case.name))
        report["cases"][index] = row
        err = row.get("errors") or {}
        print(f"  {case.name:28} " + " / ".join(pct(err.get(k)) for k in FIGURES) + f"  goal: {goal_text(row)}",
              flush=True)
        write_report(out_dir, report)
    if not watched:
        report["calibration"] = watch_and_calibrate(watch_case, gpu, out_dir, budget)
        print(calibration_line(report["calibration"]), flush=True)
        write_report(out_dir, report)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU: print the cases and their estimates")
    p.add_argument("--quick", action="store_true", help="the quick subset (within 3 minutes on an H100)")
    p.add_argument("--case", action="append", metavar="NAME", help="only this case (repeatable)")
    p.add_argument("--gpu", default=None, help="the device profile to estimate with (default: the device's own)")
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or DEFAULT_OUT, help="where the results go")
    p.add_argument("--budget-s", type=float, default=None, help="the whole run's budget (default 480, quick 180)")
    p.add_argument("--pytest-timeout-s", type=float, default=None)
    p.add_argument("--jobs", type=int, default=None, help="estimates run at once (default: half the cores)")
    p.add_argument("--no-pytest", action="store_true", help="leave out `pytest tests/cuda`")
    p.add_argument("--no-watch", action="store_true", help="leave out the watch and calibrate")
    p.add_argument("--render", metavar="JSON", help="write BENCHMARKS.md's section from a run's JSON, and stop")
    for child in ("--measure", "--estimate", "--watch"):
        p.add_argument(child, metavar="CASE", help=argparse.SUPPRESS)
    p.add_argument("--device-info", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--capacity", help=argparse.SUPPRESS)
    p.add_argument("--watch-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for mode in ("device_info", "measure", "estimate", "watch"):
        if getattr(args, mode):
            return run_as_child(args, mode)
    if args.render:
        from benchmarks_md import write_section

        write_section(SECTION, render_section(json.loads(Path(args.render).read_text())))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        return dry_run(args, out_dir)
    with children_end_with_this_process():
        return gpu_run(args, out_dir)


if __name__ == "__main__":
    sys.exit(main())
