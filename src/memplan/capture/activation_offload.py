"""Activation offloading in the captured step: torchtune's `OffloadActivations`, reproduced.

torchtune (torchtune/training/_activation_offloading.py, v0.6.1) offloads activations with
a `saved_tensors_hooks` context around the model's forward (`get_act_offloading_ctx_manager`,
used by every torchtune recipe with `enable_activation_offloading=True`). Its class cannot
run here (it asks for CUDA streams in its constructor, and torchtune's package imports
datasets, torchdata and tokenizers), so `TorchtuneOffload` reproduces what it allocates,
in program order, with its defaults (`use_pin_memory=True`, `use_streams=True`,
`max_fwd_stash_size=5`, `min_offload_size=1024`):

- pack (forward): every saved tensor gets an id. One of at least 1024 bytes
  (`element_size() * nelement()`) that is not an `nn.Parameter` or `nn.Buffer` is copied
  to a new pinned host tensor (`torch.empty_like(..., pin_memory=True, device="cpu")`,
  `copy_(non_blocking=True)`); the device tensor stays in a forward stash until a saved
  tensor 5 ids later is packed (the copy stream's event), and the rest of the stash at the
  first backward node. Smaller tensors, parameters and buffers are kept as they are;
- unpack (backward): a host copy is brought back to the device (`.to("cuda",
  non_blocking=True)`) unless its device tensor is still in the forward stash; a tensor
  brought back stays in a backward stash until the next autograd node that unpacks an
  offloaded tensor has run (a hook on that node frees the previous node's tensors), or is
  dropped after its own node where a view of it outlives the node (`record_stream`), and
  whatever is left is freed when backward ends (a queued engine callback);
- the output head runs without offloading (`NoOpManager` around `model.output`: a
  forward pre-hook on the head enters it); torchtune's recipes compute the loss outside
  the context, so here the no-op lasts from the head to the end of the model's forward,
  which covers a Hugging Face model's loss computed inside its forward.

Streams only make the copies asynchronous: on CPU (real steps, and a CUDA job traced on
fake cpu tensors) the copies are synchronous, and every allocation and free happens at
the same point of the program as on the GPU. The host copies are marked as pinned host
memory (`memplan.models.tracing.mark_host`), so an estimate reports them apart from the
device's memory (`host_peak_bytes`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from memplan.capture.recorder import note_saved
from memplan.models import tracing

MIN_OFFLOAD_BYTES = 1024  # OffloadActivations(min_offload_size=1024)
MAX_FWD_STASH = 5  # OffloadActivations(max_fwd_stash_size=5)


class NoOffload(saved_tensors_hooks):
    """torchtune's `NoOpManager`: saved tensors kept as they are (innermost hooks win)."""

    def __init__(self) -> None:
        super().__init__(_keep, _keep)


def _keep(tensor: Any) -> Any:
    note_saved(tensor)
    return tensor


class TorchtuneOffload(saved_tensors_hooks):
    """`OffloadActivations()` with torchtune's defaults, on CPU (module docstring)."""

    def __init__(self) -> None:
        self.tracker: dict[int, tuple[torch.Tensor, torch.device | None]] = {}  # id -> (tensor, device it left)
        self.tensor_id = 0
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}
        self.curr_graph_id: int | None = None
        self.curr_autograd_node: Any = None
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        self.noop: NoOffload | None = None  # entered from the output head to the end of the forward
        super().__init__(self.pack, self.unpack)

    def head_starts(self) -> None:
        """The output head starts: saved tensors stay where they are (`NoOpManager`)."""
        if self.noop is None:
            self.noop = NoOffload()
            self.noop.__enter__()

    def forward_ends(self) -> None:
        """The model's forward returned: offloading resumes."""
        if self.noop is not None:
            self.noop.__exit__(None, None, None)
            self.noop = None

    def pack(self, activation: torch.Tensor) -> int:
        if self.is_first_forward_call:
            self.is_first_forward_call = False
            self.is_first_backward_call = True
        note_saved(activation)
        num_bytes = activation.element_size() * activation.nelement()
        self.tensor_id += 1
        tensor_id = self.tensor_id
        if num_bytes < MIN_OFFLOAD_BYTES or isinstance(activation, (nn.Parameter, nn.Buffer)):
            self.tracker[tensor_id] = (activation, None)
            return tensor_id
        for old in list(self.fwd_stash):  # the copies made long enough ago are done
            if old > tensor_id - MAX_FWD_STASH:
                break
            del self.fwd_stash[old]
        host = torch.empty_like(activation, pin_memory=activation.is_cuda, device="cpu")
        tracing.mark_host(host, "pinned")
        host.copy_(activation, non_blocking=True)
        self.tracker[tensor_id] = (host, activation.device)
        self.fwd_stash[tensor_id] = activation
        return tensor_id

    def _first_backward_call(self) -> None:
        self.curr_graph_id = torch._C._current_graph_task_id()

        def wait_and_del_remaining_references() -> None:
            self.bwd_tensor_stash.clear()

        torch.autograd.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)
        self.is_first_backward_call = False
        self.is_first_forward_call = True

    def unpack(self, tensor_id: int) -> torch.Tensor:
        if self.is_first_backward_call:
            self._first_backward_call()
        tensor, device = self.tracker.pop(tensor_id)
        if device is None:
            return tensor
        graph_id = torch._C._current_graph_task_id()
        node = torch._C._current_autograd_node()
        prev_node_ids: list[int] = []
        if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
            self.curr_autograd_node = node
            prev_node_ids = list(self.bwd_tensor_stash)
        brought_back = tensor_id not in self.fwd_stash
        if not brought_back:
            tensor = self.fwd_stash[tensor_id]
            refcount = 0
        else:
            # a new device tensor, also where the step's device is the CPU itself
            tensor = tensor.to(device, non_blocking=True, copy=True)
            self.bwd_tensor_stash[tensor_id] = tensor
            refcount = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

        def hook(outputs: Any, _inputs: Any) -> Any:
            if brought_back and tensor_id in self.bwd_tensor_stash:
                unpacked = self.bwd_tensor_stash[tensor_id]
                if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > refcount:
                    del self.bwd_tensor_stash[tensor_id]  # record_stream: freed when its last user is
            self.fwd_stash.clear()
            for old in prev_node_ids:
                self.bwd_tensor_stash.pop(old, None)
            return outputs

        node.register_hook(hook)
        return tensor


def activation_offload_context(model: nn.Module, mode: str) -> TorchtuneOffload | None:
    """The context the model's forward runs in for `TrainingSetup.activation_offload`
    (`torchtune`: `TorchtuneOffload`, with the output head and what follows it in the
    model's forward not offloaded: from the head's forward pre-hook, or `head_starts()`
    where a chunked or fused loss runs the head, to the end of the model's forward);
    None for "none"."""
    if mode == "none":
        return None
    if mode != "torchtune":
        raise ValueError(f"no activation-offloading context for {mode!r}")
    offload = TorchtuneOffload()
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None:
        head.register_forward_pre_hook(lambda *_args: offload.head_starts())
    model.register_forward_hook(lambda *_args: offload.forward_ends(), always_call=True)
    return offload
