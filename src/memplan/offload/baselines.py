"""The baselines of TERAIO's evaluation (arXiv 2506.06472, §5), run through the same simulator.

Each baseline turns the trace's lifetimes into op times, device bytes and `Move`s:

- `ideal`: no offloading, unlimited device memory (the roofline step time).
- `zero_offload`: ZeRO-Offload (USENIX ATC'21): optimizer states live on the CPU;
  each gradient goes to host memory right after backward produces it; the optimizer
  step runs on the CPU (CPU-Adam); updated fp32 parameters come back over PCIe before
  the next forward. Host memory needed: 16 B per parameter (fp32 params, grads, m, v).
- `zero_infinity`: ZeRO-Infinity (SC'21) with NVMe offload: parameters, gradients and
  optimizer states leave the GPU; parameters are fetched from NVMe *per layer* with
  fixed timing (issued when the previous layer starts, released when the layer ends),
  in forward and again in backward (with its recomputation); the optimizer step streams
  the states from NVMe through CPU-Adam and writes them back. Host memory needed
  (assumption): 8 B per parameter (fp32 gradients and parameter staging buffers) plus the
  offloaded activations.

Activations, for both ZeRO baselines: DeepSpeed's only activation offload is
`cpu_checkpointing` (the JSON config's `activation_checkpointing` section; DeepSpeed's
`deepspeed/runtime/activation_checkpointing/checkpointing.py`, `checkpoint_in_cpu`), which
moves the *checkpoints* of its activation checkpointing to host memory: without activation
checkpointing every activation stays on the GPU. So each ZeRO baseline runs two ways and
reports the faster feasible one: on the step's own trace (no checkpointing, activations on
the GPU), and, when the caller gives the same step captured with full activation
checkpointing (`checkpointed`), on that trace (each layer's forward recomputed in backward)
with the checkpoints going to host memory at layer granularity (docs/offload.md).
- `torchtune_activations`: torchtune's `OffloadActivations`, at layer granularity: a
  layer's activations go to host memory when its forward ends and come back when the
  backward of the layer after it starts; everything else stays on the GPU.

With `gpus` > 1, ZeRO partitions the optimizer work: each GPU's share of states and
parameters is 1/gpus; the CPU-Adam rate is node-wide. A baseline is feasible when its
simulated device peak fits the budget and its host need fits the host limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.hardware.links import Hardware, cpu_adam_params_per_s
from memplan.offload.lifetimes import Lifetimes
from memplan.offload.simulate import Move, OffloadSim, simulate_offload
from memplan.trace.model import CATEGORY, PHASE, Trace

_LAYER = re.compile(r"^(.*?\.layers\.\d+)(\.|$)")


@dataclass
class BaselineResult:
    name: str
    sim: OffloadSim
    host_bytes_needed: float
    feasible: bool
    note: str = ""

    def to_json(self, ideal_step_s: float) -> dict[str, Any]:
        return {
            "step_s": self.sim.step_s,
            "throughput_vs_ideal": ideal_step_s / self.sim.step_s if self.sim.step_s > 0 else 0.0,
            "feasible": self.feasible,
            "stall_s": self.sim.stall_s,
            "peak_device_bytes": self.sim.peak_device_bytes,
            "host_bytes_needed": self.host_bytes_needed,
            "note": self.note,
        }


def layer_of(module: str) -> str:
    """`model.layers.3.mlp.up_proj` -> `model.layers.3`; modules outside the layer stack are their own group."""
    match = _LAYER.match(module)
    return match.group(1) if match else module


def _live_bytes_of(trace: Trace, lt: Lifetimes, mask: np.ndarray) -> np.ndarray:
    """Bytes of the masked buffers live during each op."""
    n = lt.num_ops
    diff = np.zeros(n + 1)
    first = np.clip(lt.live_first_op[mask], 0, n)
    last = np.clip(lt.live_last_op[mask], -1, n - 1)
    nbytes = trace.buffers["nbytes"][mask].astype(np.float64)
    np.add.at(diff, first, nbytes)
    np.add.at(diff, last + 1, -nbytes)
    return np.cumsum(diff)[:n]


def _uses(lt: Lifetimes, b: int) -> np.ndarray:
    return lt.use_ops[lt.use_ptr[b] : lt.use_ptr[b + 1]]


def _parameter_count(trace: Trace) -> float:
    params = trace.meta.get("trainable_parameters") or trace.meta.get("parameters")
    if params:
        return float(params)
    mask = trace.buffers["category"] == CATEGORY["parameter"]
    return float(trace.buffers["nbytes"][mask].sum()) / 4.0


def _feasible(sim: OffloadSim, host_needed: float, hardware: Hardware) -> tuple[bool, str]:
    notes = []
    if not sim.within_budget:
        notes.append(f"device memory over budget by {sim.over_budget_bytes} bytes")
    if host_needed > hardware.host_capacity_bytes * hardware.gpus:
        notes.append(f"needs {host_needed:.3g} bytes of host memory")
    return not notes, "; ".join(notes)


def ideal(trace: Trace, lt: Lifetimes, hardware: Hardware) -> BaselineResult:
    sim = simulate_offload(lt.op_durations_s, lt.op_bytes, [], {}, float("inf"))
    return BaselineResult("ideal", sim, 0.0, True)


def _pcie_links(hardware: Hardware) -> dict[str, float]:
    return {"pcie_d2h": hardware.pcie_bytes_per_s, "pcie_h2d": hardware.pcie_bytes_per_s}


def _gradient_stream(trace: Trace, lt: Lifetimes, cpu_op: int, link: str, gpus: int) -> list[Move]:
    """Each gradient leaves for host memory (its 1/gpus shard, after the reduce-scatter) as soon as
    backward has produced it, and the CPU optimizer step waits for all of them. The device holds
    a gradient only from the end of its last backward op until its write completes; callers
    take every gradient buffer out of the trace's bytes (the trace frees last iteration's
    gradients at zero_grad and allocates this iteration's in backward, two generations that a
    per-buffer give-back would count twice)."""
    moves = []
    for b in np.flatnonzero(trace.buffers["category"] == CATEGORY["gradient"]).tolist():
        uses = _uses(lt, b)
        produced = uses[uses < cpu_op]
        if produced.size == 0:
            continue
        nbytes = int(trace.buffers["nbytes"][b])
        moves.append(Move(link, nbytes // gpus, int(produced[-1]), True, wait_op=cpu_op,
                          device_delta_on_issue=nbytes, device_delta_on_complete=-nbytes))
    return moves


def _optimizer_on_cpu(trace: Trace, lt: Lifetimes) -> tuple[np.ndarray, int]:
    """Op times with the GPU's optimizer ops taken out (the ZeRO baselines step on the CPU),
    and the op that stands for the CPU step (the first optimizer op; the last op if none)."""
    durations = lt.op_durations_s.copy()
    optimizer_ops = np.flatnonzero(trace.ops["phase"] == PHASE["optimizer"])
    durations[optimizer_ops] = 0.0
    return durations, int(optimizer_ops[0]) if optimizer_ops.size else lt.num_ops - 1


def _checkpoints_to_host(trace: Trace, lt: Lifetimes, moves: list[Move], write_link: str, read_link: str) -> float:
    """DeepSpeed's cpu_checkpointing on a checkpointed trace: adds the moves, returns the host bytes."""
    act_moves, act_host = _layer_activation_moves(trace, lt, write_link, read_link)
    moves += act_moves
    return act_host


def _zero_offload_on(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
                     checkpoints_to_host: bool) -> BaselineResult:
    n = lt.num_ops
    cat, phase = trace.buffers["category"], trace.ops["phase"]
    params = _parameter_count(trace)
    g = hardware.gpus
    durations, cpu_op = _optimizer_on_cpu(trace, lt)
    allgather_s = 4 * params * (g - 1) / g / hardware.gpu.interconnect_bytes_per_s if g > 1 else 0.0
    durations[cpu_op] = params / cpu_adam_params_per_s() + allgather_s
    base = lt.op_bytes - _live_bytes_of(trace, lt, (cat == CATEGORY["optimizer_state"]) | (cat == CATEGORY["gradient"]))
    moves = []
    moves += _gradient_stream(trace, lt, cpu_op, "pcie_d2h", g)
    first_forward = int(np.flatnonzero(phase == PHASE["forward"])[0]) if (phase == PHASE["forward"]).any() else 0
    moves.append(Move("pcie_h2d", int(4 * params / g), cpu_op, True, wait_op=first_forward + n))
    host = 16.0 * params
    if checkpoints_to_host:
        host += _checkpoints_to_host(trace, lt, moves, "pcie_d2h", "pcie_h2d")
    sim = simulate_offload(durations, base, moves, _pcie_links(hardware), budget_bytes)
    ok, note = _feasible(sim, host, hardware)
    return BaselineResult("zero_offload", sim, host, ok, note)


def _zero_infinity_on(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
                      checkpoints_to_host: bool) -> BaselineResult:
    cat = trace.buffers["category"]
    params = _parameter_count(trace)
    g = hardware.gpus
    links = hardware.link_bytes_per_s()
    durations, cpu_op = _optimizer_on_cpu(trace, lt)
    # CPU-Adam on this GPU's partition, states (fp32 master, m, v: 12 B/param) swapped in
    # and out of its NVMe array, updated fp32 parameters written back (4 B/param)
    share = params / g
    swap_s = max(12 * share / max(links["ssd_read"], 1.0), 16 * share / max(links["ssd_write"], 1.0))
    durations[cpu_op] = max(params / cpu_adam_params_per_s(), swap_s)
    persistent = np.isin(cat, [CATEGORY["optimizer_state"], CATEGORY["parameter"], CATEGORY["gradient"]])
    base = lt.op_bytes - _live_bytes_of(trace, lt, persistent)
    moves = []
    moves += _gradient_stream(trace, lt, cpu_op, "host_write", g)
    param_buffers = np.flatnonzero(cat == CATEGORY["parameter"])
    for phase_ids in _FORWARD, _BACKWARD:
        windows = sorted(_layer_windows(trace, lt, param_buffers, phase_ids).values())
        for i, (first, last, nbytes) in enumerate(windows):
            issue = windows[i - 1][0] if i > 0 else first  # fixed timing: one layer ahead
            moves.append(Move("ssd_read", nbytes // g, issue, False, wait_op=first, device_delta_on_issue=nbytes))
            moves.append(Move(None, 0, last, True, device_delta_on_issue=-nbytes))
    host = 8.0 * params
    if checkpoints_to_host:  # on the PCIe share the NVMe traffic leaves
        host += _checkpoints_to_host(trace, lt, moves, "host_write", "host_read")
    sim = simulate_offload(durations, base, moves, links, budget_bytes)
    ok, note = _feasible(sim, host, hardware)
    return BaselineResult("zero_infinity", sim, host, ok, note)


Checkpointed = tuple[Trace, Lifetimes]


def _best_of(runner: Any, trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
             checkpointed: Checkpointed | None) -> BaselineResult:
    """The faster feasible of: no activation checkpointing (activations on the GPU), and,
    given the checkpointed trace, activation checkpointing with the checkpoints in host
    memory (DeepSpeed's `cpu_checkpointing`). The infeasible faster one when neither fits."""
    results = [runner(trace, lt, hardware, budget_bytes, False)]
    results[0].note = "; ".join(x for x in ("no activation checkpointing", results[0].note) if x)
    if checkpointed is not None:
        ck = runner(checkpointed[0], checkpointed[1], hardware, budget_bytes, True)
        ck.note = "; ".join(x for x in ("activation checkpointing, checkpoints in host memory", ck.note) if x)
        results.append(ck)
    feasible = [r for r in results if r.feasible]
    return min(feasible or results, key=lambda r: r.sim.step_s)


def zero_offload(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
                 checkpointed: Checkpointed | None = None) -> BaselineResult:
    return _best_of(_zero_offload_on, trace, lt, hardware, budget_bytes, checkpointed)


def zero_infinity(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
                  checkpointed: Checkpointed | None = None) -> BaselineResult:
    return _best_of(_zero_infinity_on, trace, lt, hardware, budget_bytes, checkpointed)


def _layer_windows(trace: Trace, lt: Lifetimes, buffers: np.ndarray,
                   phase_ids: tuple[int, ...]) -> dict[str, tuple[int, int, int]]:
    """Per layer: (first op, last op, bytes) of the given buffers' uses in the given phases."""
    phase = trace.ops["phase"]
    out: dict[str, list] = {}
    for b in buffers.tolist():
        uses = _uses(lt, b)
        uses = uses[np.isin(phase[uses], phase_ids)]
        if uses.size == 0:
            continue
        key = layer_of(trace.module_of_buffer(b))
        entry = out.setdefault(key, [int(uses[0]), int(uses[-1]), 0])
        entry[0] = min(entry[0], int(uses[0]))
        entry[1] = max(entry[1], int(uses[-1]))
        entry[2] += int(trace.buffers["nbytes"][b])
    return {k: (a, z, nb) for k, (a, z, nb) in out.items()}


_FORWARD = (PHASE["forward"],)
_BACKWARD = (PHASE["backward"], PHASE["recompute"])


def saved_activations(trace: Trace, lt: Lifetimes) -> np.ndarray:
    """Activation buffers (>= 1 KiB) used in forward and again in backward (or its
    recomputation): what autograd saves, and what an activation offload can move. The
    forward's transients, freed before backward, are not among them."""
    use_phase = trace.ops["phase"][lt.use_ops]

    def uses_in(phases: tuple[int, ...]) -> np.ndarray:  # per buffer, from the CSR of uses
        count = np.concatenate([[0], np.cumsum(np.isin(use_phase, phases))])
        return count[lt.use_ptr[1:]] - count[lt.use_ptr[:-1]]

    cat = trace.buffers["category"]
    keep = (cat == CATEGORY["activation"]) & (trace.buffers["nbytes"] >= 1024)
    return np.flatnonzero(keep & (uses_in(_FORWARD) > 0) & (uses_in(_BACKWARD) > 0)).astype(np.int64)


def _layer_activation_moves(trace: Trace, lt: Lifetimes, write_link: str, read_link: str) -> tuple[list[Move], float]:
    """Layer-granular activation offload to host memory: a layer's saved activations leave when
    its forward ends and come back when the backward of the layer after it starts. Returns the
    moves and the host bytes they need."""
    acts = saved_activations(trace, lt)
    forward = _layer_windows(trace, lt, acts, _FORWARD)
    backward = _layer_windows(trace, lt, acts, _BACKWARD)
    layers = [k for k in sorted(forward, key=lambda k: forward[k][0]) if k in backward and ".layers." in k]
    moves = []
    host = 0.0
    for i, key in enumerate(layers):
        f_first, f_last, nbytes = forward[key]
        b_first = backward[key][0]
        # prefetched when the backward of the next layer (in forward order) starts
        issue = backward[layers[i + 1]][0] if i + 1 < len(layers) else b_first
        issue = min(issue, b_first)
        moves.append(Move(write_link, nbytes, f_last, True, device_delta_on_complete=-nbytes, key=i))
        moves.append(Move(read_link, nbytes, issue, False, wait_op=b_first, device_delta_on_issue=nbytes, after_key=i))
        host += nbytes
    return moves, host


def torchtune_activations(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float) -> BaselineResult:
    links = {"host_write": hardware.pcie_bytes_per_s, "host_read": hardware.pcie_bytes_per_s}
    moves, host = _layer_activation_moves(trace, lt, "host_write", "host_read")
    sim = simulate_offload(lt.op_durations_s, lt.op_bytes, moves, links, budget_bytes)
    ok, note = _feasible(sim, host, hardware)
    return BaselineResult("torchtune_activations", sim, host, ok, note)


def run_baselines(trace: Trace, lt: Lifetimes, hardware: Hardware, budget_bytes: float,
                  checkpointed: Checkpointed | None = None) -> dict[str, BaselineResult]:
    """The baselines of one trace, by name; `checkpointed` is the same step captured
    with full activation checkpointing, and its lifetimes (the ZeRO baselines' second way).
    ZeRO-Infinity offloads to NVMe: without a drive it is not among them."""
    results = {
        "ideal": ideal(trace, lt, hardware),
        "zero_offload": zero_offload(trace, lt, hardware, budget_bytes, checkpointed),
    }
    if hardware.nvme.drives > 0:
        results["zero_infinity"] = zero_infinity(trace, lt, hardware, budget_bytes, checkpointed)
    results["torchtune_activations"] = torchtune_activations(trace, lt, hardware, budget_bytes)
    return results
