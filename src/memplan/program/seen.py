"""What memplan saw the program do: the setup a user would otherwise spell as flags.

Read from the live objects the program made, as the watch reads a job
(`memplan.models.live.infer_setup`: batch and sequence, dtype, autocast, optimizer and its
implementation, gradient accumulation, checkpointing flag, LoRA, head), and from what only a
run shows:

- the model: its class, parameter count (a sharded parameter counts its full size) and name;
- precision: the parameters' dtype, autocast at the first forward, and the optimizer's
  parameters' dtype (the master weights) and its states' dtypes (over every optimizer of the
  first step: one per parameter for an optimizer in backward, memplan.program.steps);
- the loss: the model's own (its output has a `loss`) or computed by the program;
- the parallel layout the program built (memplan.program.distributed: FSDP2 `fully_shard`,
  FSDP1, DDP, DTensor meshes);
- checkpointing: from the trace, where recomputation ran in backward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from memplan.models.live import DTYPE_NAMES, OPTIMIZER_NAMES, infer_setup, model_identity
from memplan.models.setup import TrainingSetup
from memplan.program.world import World


def _dtype(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _implementation(optimizer: torch.optim.Optimizer) -> str:
    """fused, foreach or loop: what the optimizer's step runs, PyTorch's default decided for
    the device the run stands for (torch/optim/optimizer.py, `_default_to_fused_or_foreach`)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None or "foreach" not in group:
        return "foreach" if group.get("foreach") else "loop"
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [p for g in optimizer.param_groups for p in g["params"]]
    _fused, foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable")), use_fused=False)
    return "foreach" if foreach else "loop"


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The program's own model inside the wrappers that hold exactly its parameters (DDP's
    `module`, Lightning Fabric's `_FabricModule._original_module`)."""
    for _ in range(4):
        inner = next((m for m in (getattr(model, "module", None), getattr(model, "_original_module", None))
                      if isinstance(m, torch.nn.Module)), None)
        if inner is None or {id(p) for p in inner.parameters()} != {id(p) for p in model.parameters()}:
            return model
        model = inner
    return model


def _class_name(model: torch.nn.Module) -> str:
    """The program's own class of `model`: FSDP2's `fully_shard` makes the module an instance
    of a new class `FSDP<Name>` (bases `FSDPModule` and the original)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next((base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule)), cls)
    return cls.__name__


def _shapes_only(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's top-level tensors as meta tensors of their shapes and dtypes (what
    `infer_setup` reads), made outside every mode so that nothing records them. Holding the
    call's own tensors would keep the program's first batch alive to the end of the run,
    where the program frees it at its second step."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        def meta(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return torch.empty(value.shape, dtype=value.dtype, device="meta")
            return value

        return tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()}

class Seen:
    """The program's model, optimizer and calls, as the run saw them (module docstring)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.first_call: tuple[tuple, dict] | None = None
        self.calls_per_step: list[int] = []
        self._calls_since_step = 0
        self.autocast: tuple[str, torch.dtype] | None = None
        self.model_loss: bool | None = None
        self.optimizer_impl: str | None = None  # what the first optimizer's step ran
        self.first_step: list[torch.optim.Optimizer] = []  # the optimizers the first step took
        self.first_step_in_backward = False

    def note_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A top-level call: with gradients, a micro-batch of the step; without, an evaluation
        (LitGPT's sanity-check validation before its first step) that is no micro-batch."""
        if not any(m is module for m in self.models):
            self.models.append(module)
        if not torch.is_grad_enabled():
            return
        if self.first_call is None:
            self.first_call = _shapes_only(args, kwargs)
            self.note_autocast()
        self._calls_since_step += 1

    def note_autocast(self, _module: torch.nn.Module | None = None) -> None:
        """Autocast as the model's code runs: at its first call, and again at the first module
        it calls (accelerate enters autocast inside the model's `forward`, which it wraps:
        `Accelerator.prepare_model`)."""
        if self.autocast is None and torch.is_autocast_enabled("cpu"):
            self.autocast = ("cuda" if self.world.cuda else "cpu", torch.get_autocast_dtype("cpu"))

    def note_output(self, output: Any) -> None:
        if self.model_loss is None:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            self.model_loss = isinstance(loss, torch.Tensor)

    def note_step(self, optimizers: list[torch.optim.Optimizer], in_backward: bool = False) -> None:
        """One step of the program: the optimizers it took (several for an optimizer in backward,
        or for a wrapper of one optimizer per model part), and whether inside a backward."""
        if not self.first_step:
            self.first_step = list(optimizers)
            self.first_step_in_backward = in_backward
        for optimizer in optimizers:
            if not any(o is optimizer for o in self.optimizers):
                self.optimizers.append(optimizer)
                if len(self.optimizers) == 1:
                    self.optimizer_impl = _implementation(optimizer)
        self.calls_per_step.append(self._calls_since_step)
        self._calls_since_step = 0

    def setup(self) -> tuple[TrainingSetup, list[str]]:
        """The inferred `TrainingSetup` and the fields that could not be seen."""
        model = unwrapped(self.models[0]) if self.models else torch.nn.Module()
        optimizer = self.optimizers[0] if self.optimizers else None
        calls = [self.first_call] * max(1, self.calls_per_step[0] if self.calls_per_step else 1) \
            if self.first_call is not None else []
        setup, unseen = infer_setup(model, optimizer, calls, self.autocast)
        if self.first_step_in_backward and setup.grad_accum == 1 and setup.cpu_offload == "none":
            setup = dataclasses.replace(setup, optimizer_in_backward=True)
        return setup, unseen

    def optimizer_facts(self) -> dict[str, Any]:
        """Class and implementation of the first optimizer; master-weight and state dtypes of
        the optimizers of the first step (one per parameter for an optimizer in backward)."""
        if not self.optimizers:
            return {}
        optimizer = self.optimizers[0]
        stepped = self.first_step or [optimizer]
        params = [p for o in stepped for group in o.param_groups for p in group["params"]]
        states = Counter(_dtype(t.dtype) for o in stepped for state in o.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0)
        facts: dict[str, Any] = {"class": type(optimizer).__name__, "name": OPTIMIZER_NAMES.get(type(optimizer).__name__),
                 "implementation": self.optimizer_impl,
                 "master_weights": dict(Counter(_dtype(p.dtype) for p in params)),
                 "state_dtypes": dict(states)}
        if self.first_step_in_backward:
            facts["in_backward"] = len(stepped)  # optimizers stepped inside the backward
        return facts

    def describe(self) -> dict[str, Any]:
        """What memplan saw, for the report (module docstring)."""
        from memplan.program.distributed import layout_of

        model = unwrapped(self.models[0]) if self.models else None
        identity = model_identity(model) if model is not None else {}
        if model is not None:
            identity["class"] = _class_name(model)
        param_dtypes = Counter(_dtype(p.dtype) for p in model.parameters()) if model is not None else Counter()
        setup, unseen = self.setup()
        return {
            "model": identity,
            "models_called": [type(m).__name__ for m in self.models],
            "parameter_dtypes": dict(param_dtypes),
            "autocast": _dtype(self.autocast[1]) if self.autocast else None,
            "optimizer": self.optimizer_facts(),
            "loss": None if self.model_loss is None else ("the model's own (output.loss)" if self.model_loss
                                                          else "computed by the program"),
            "forward_calls_per_step": list(self.calls_per_step),
            "layout": layout_of(self.models),
            "setup": setup.to_dict(),
            "setup_not_seen": unseen,
            "compiled_eagerly": dict(self.world.compiled_eagerly),
            "graph_breaks": dict(self.world.graph_breaks),
        }

    def meta(self) -> dict[str, Any]:
        """What the trace's metadata says about the program's model and setup."""
        model = unwrapped(self.models[0]) if self.models else None
        identity = model_identity(model) if model is not None else {"name": "program", "parameters": 0}
        setup, _unseen = self.setup()
        return {"model": identity["name"], "parameters": identity["parameters"], "watched_model": identity,
                "setup": setup.to_dict()}
