"""The traces one offload evaluation takes (`memplan.offload.evaluate.evaluate`), from a model
or from a trace file.

From a model (`captured_steps`): its step captured on fake tensors for CUDA with a
per-parameter optimizer step (one foreach kernel touches every state at once, so nothing
could be away during it), optionally one FSDP2 rank of `gpus` (ZeRO-3, TERAIO's setting,
with the whole step for the ZeRO baselines), the same step with full activation
checkpointing (the ZeRO baselines' activation offload, DeepSpeed's `cpu_checkpointing`,
needs it) and, with `try_checkpointing`, the step under each checkpointing policy, each
planned too. From a trace (`traced_steps`): the step as it was recorded, one device of it.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memplan.capture.step import capture_step
from memplan.errors import UserError
from memplan.models.registry import FactorySpec
from memplan.models.setup import TrainingSetup
from memplan.offload.evaluate import RECOMPUTE_POLICIES
from memplan.parallel.layout import Layout
from memplan.parallel.transform import rank_trace
from memplan.trace import edit as trace_edit
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig


@dataclass
class OffloadSteps:
    """The traces one offload evaluation takes (module docstring)."""

    trace: Trace  # the trace memplan plans
    setup: dict[str, Any]  # the setup it was captured under ({} when unknown)
    baseline_trace: Trace | None = None  # the whole step, when `trace` is one FSDP2 rank's
    checkpointed: Trace | None = None  # the step with full activation checkpointing (the ZeRO baselines')
    alternatives: dict[str, Trace] = field(default_factory=dict)  # checkpointing policy -> planned trace


def traced_steps(trace: Trace, device: str | None = None) -> OffloadSteps:
    """The step a trace recorded, as it is, on `device` (where it has several)."""
    if trace.meta.get("device", "cuda") != "cuda":
        raise UserError(f"the trace records a {trace.meta['device']} job: offloading plans a GPU's step; capture "
                        "it for cuda (memplan trace without --real) or pass the model instead")
    view = trace_edit.device_view(trace, device)
    if view.num_ops == 0:
        raise UserError("the trace records no ops (a PyTorch memory snapshot holds allocations only): offloading "
                        "needs the ops that use each buffer; capture the step with memplan trace")
    setup = trace.meta.get("setup") if isinstance(trace.meta.get("setup"), dict) else {}
    if setup and TrainingSetup.from_dict(setup).resolved_optimizer_impl("cuda") != "loop":
        sys.stderr.write("memplan: the trace's optimizer steps every state in one kernel: no state can be away "
                         "during it (capture with `optimizer_impl=loop` to let them leave)\n")
    return OffloadSteps(view, setup)


def captured_steps(config: PretrainedConfig | FactorySpec, setup: TrainingSetup, *, zero: int = 0, gpus: int = 1,
                   try_checkpointing: bool = False, name: str = "the model") -> OffloadSteps:
    """The model's step captured on fake tensors, and the variants the evaluation compares
    it with (module docstring); progress on stderr."""
    if setup.activation_offload != "none":
        raise UserError("memplan offload plans which tensors leave the GPU itself: drop `activation_offload`")
    if try_checkpointing and setup.checkpointing != "none":
        raise UserError(f"`try_checkpointing` tries every checkpointing policy itself: drop "
                        f"`checkpointing={setup.checkpointing}`")
    if zero == 3 and gpus < 2:
        raise UserError("ZeRO-3 shards over the node's GPUs: give 2 GPUs or more")
    if setup.optimizer_impl is None:
        setup = dataclasses.replace(setup, optimizer_impl="loop")
        sys.stderr.write("memplan: offload plans a per-parameter optimizer step (`optimizer_impl=loop`)\n")

    def captured(step_setup: TrainingSetup, what: str, planned: bool = True) -> tuple[Trace | None, Trace]:
        """(the trace memplan plans, None unless `planned`; the whole step's trace) under `step_setup`."""
        sys.stderr.write(f"memplan: capturing {name}{what} on fake tensors ...\n")
        step = capture_step(config, step_setup, "cuda")
        if zero == 0 or not planned:
            return (step.trace if planned else None), step.trace
        return rank_trace(step, Layout(world_size=gpus, zero=3), step_setup, 0), step.trace

    trace, whole = captured(setup, "")
    assert trace is not None
    steps = OffloadSteps(trace, setup.to_dict(), baseline_trace=whole if zero == 3 else None)
    if setup.checkpointing == "none":
        # the ZeRO baselines' activation offload (DeepSpeed's cpu_checkpointing) needs activation checkpointing;
        # memplan plans this step too only when it searches the checkpointing policies
        planned_full, steps.checkpointed = captured(dataclasses.replace(setup, checkpointing="full"),
                                                    " with full activation checkpointing (the ZeRO baselines')",
                                                    planned=try_checkpointing)
        if planned_full is not None:
            steps.alternatives["full"] = planned_full
    if try_checkpointing:
        for policy in RECOMPUTE_POLICIES:
            if policy != "full":
                alternative, _ = captured(dataclasses.replace(setup, checkpointing=policy),
                                          f" with checkpointing {policy}")
                assert alternative is not None
                steps.alternatives[policy] = alternative
        steps.alternatives = {policy: steps.alternatives[policy] for policy in RECOMPUTE_POLICIES}
    return steps
