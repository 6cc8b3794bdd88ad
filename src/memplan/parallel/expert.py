"""Expert parallelism (`--ep E`) applied to a transformers mixture-of-experts model.

The layout is the one transformers' native distributed training and torchtitan (expert
tensor parallel degree 1) compose: the routed experts of each MoE block are split over an
EP group of E ranks (whole experts per rank, `Shard(0)` on the expert dimension) that
borrows its ranks from the data-parallel (and tensor-parallel) ones, so the experts are
FSDP2-sharded over the rest, efsdp = dp x tp / E ranks holding the same experts, while
the dense parts are FSDP2-sharded over dp (`memplan.parallel.apply`); tokens reach the
experts' ranks by an all-to-all and come back by another
(`transformers/distributed/configuration_utils.py` `DistributedConfig.efsdp_size`,
`transformers/distributed/fsdp.py` `apply_fully_sharded_data_parallelism`, torchtitan's
`torchtitan/distributed/expert_parallel.py` `ExpertParallel` and
`models/llama4/infra/parallelize.py` `apply_fsdp`).

What runs is transformers' own EP code (`transformers/distributed/expert_parallel.py`):
the model's `ep_plan` (`grouped_gemm`: `MoEParamShard` on the expert weights;
`ep_dispatch_experts`: the experts reached through an `EPImplementation`), applied by
`apply_expert_parallelism` with `AllToAllEP`: each (token, expert) pair sorted by expert
and sent to the expert's rank with `all_to_all_single_autograd` (a functional collective,
so its output and its backward's buffers are real tensors of the step), the per-rank
counts exchanged first and read back to the host as split sizes, the experts run on the
received rows, the results sent back by a second all-to-all, weighted and summed per
token; with TP, each TP rank sends its slice of the tokens and the outputs are
all-gathered back over TP.

The one host read is the split sizes, `.tolist()` of the per-rank token counts. On fake
tensors there are no counts: `AssumedCountsAllToAll` answers exactly those reads with the
counts of the step's routing assumption (`memplan.models.moe.assigned_experts`, the
assignment the step's experts are given), computed on the host for this rank's slice of
the tokens and, for what it receives, for every sender's slice (each sender routes its
own micro-batch by the same rule). On real tensors it runs transformers' code unchanged
and checks that the counts the real all-to-all used are the ones the assumption gives
(`ExpertParallelBug` otherwise), so the traced split sizes are checked against every
real run. Under `worst` and `capacity:F` the hot experts live on the first EP rank, so
rank 0, the rank a parallel estimate traces, is the most loaded one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import MemplanBug, UserError
from memplan.models.moe import Routing, assigned_experts, expert_modules

if TYPE_CHECKING:  # transformers takes a second to import
    from torch.distributed.device_mesh import DeviceMesh

IMPLEMENTATION = "memplan_all_to_all"  # its name in transformers' EPImplementationInterface
DISPATCH_STYLE = "ep_dispatch_experts"


class ExpertParallelBug(MemplanBug):
    """The split sizes memplan assumed are not the ones a real all-to-all used."""


class _HostReads(TorchDispatchMode):
    """Answers a fake tensor's scalar reads (`aten._local_scalar_dense`: `.item()`,
    `.tolist()`) with given values, in order; every other op runs as it is."""

    def __init__(self, values: list[int]) -> None:
        super().__init__()
        self.values = list(values)
        self.expected = len(values)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            if not self.values:
                raise ExpertParallelBug("transformers' all-to-all read more token counts than memplan supplied")
            return self.values.pop(0)
        return func(*args, **(kwargs or {}))


def split_sizes(tokens: int, top_k: int, routing: Routing, num_experts: int, ep: int, ep_rank: int, tp: int,
                tp_rank: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each EP rank, rows it receives from each) under `routing`,
    for micro-batches of `tokens` tokens: every sender routes its micro-batch by the same
    rule, and with TP the sender of EP rank r sends the slice r mod tp of it (DTensor's
    `Shard(0)` split: `torch.chunk` sizes, empty past the end)."""
    with unset_fake_temporarily():
        ids = assigned_experts(tokens, top_k, num_experts, routing, "cpu")
        chunk = -(-tokens // tp)

        def per_rank(tp_slice: int) -> torch.Tensor:
            rows = ids[tp_slice * chunk:(tp_slice + 1) * chunk].reshape(-1)
            return torch.bincount(rows, minlength=num_experts).view(ep, num_experts // ep)

        send = per_rank(tp_rank).sum(dim=1).tolist()
        receive = [int(per_rank(r % tp)[ep_rank].sum()) for r in range(ep)]
    return send, receive


def assumed_counts_all_to_all() -> type:
    """transformers' `AllToAllEP` with the split sizes of the routing assumption on fake
    tensors (module docstring)."""
    from transformers.distributed.expert_parallel import AllToAllEP

    class AssumedCountsAllToAll(AllToAllEP):
        def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            self.routing = getattr(experts, "memplan_routing", None)
            self.num_experts = getattr(experts, "memplan_num_experts", None)

        def _assumed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> tuple[list[int], list[int]]:
            return split_sizes(hidden_states.size(0), top_k_index.size(-1), self.routing, self.num_experts,
                               self.ep_mesh.size(), self.ep_mesh.get_local_rank(), self.tp_mesh.size(),
                               self.tp_mesh.get_local_rank())

        def _dispatch_tokens(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> Any:
            if not isinstance(hidden_states, FakeTensor):
                out = super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
                if self.routing is not None and self.routing.kind != "router":
                    state = out[-1]
                    assumed = self._assumed(hidden_states, top_k_index)
                    if (list(state.send_sizes), list(state.recv_sizes)) != assumed:
                        raise ExpertParallelBug(f"all-to-all split sizes {state.send_sizes} / {state.recv_sizes}, "
                                                f"memplan assumed {assumed[0]} / {assumed[1]}")
                return out
            if self.routing is None or self.routing.kind == "router":
                raise UserError("expert parallelism on fake tensors needs a routing assumption (balanced, worst "
                                "or capacity:F), not the router's own counts")
            send, receive = self._assumed(hidden_states, top_k_index)
            reads = _HostReads(send + receive)
            with reads:
                out = super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            if reads.values:
                raise ExpertParallelBug(f"transformers' all-to-all read {reads.expected - len(reads.values)} token "
                                        f"counts, memplan supplied {reads.expected}")
            return out

    return AssumedCountsAllToAll


def register_implementation() -> None:
    """Register `AssumedCountsAllToAll` in transformers' EP registry (idempotent)."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    if IMPLEMENTATION not in EPImplementationInterface._global_mapping:
        EPImplementationInterface.register(IMPLEMENTATION, assumed_counts_all_to_all())


def expert_mesh(dp: int, tp: int, ep: int, device: str = "cpu") -> DeviceMesh:
    """The experts' view of the ranks, ("efsdp", "ep"): EP groups of `ep` consecutive
    ranks (global rank = efsdp index x ep + EP rank), as transformers'
    `initialize_distributed_mesh` lays out its expert mesh (pp and dp_replicate 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (dp * tp // ep, ep), mesh_dim_names=("efsdp", "ep"))


def expert_plan(model: nn.Module) -> dict[str, str]:
    """The model's EP plan (its config's `base_model_ep_plan`), one entry per module or
    parameter (transformers' `_expand_parallel_plan`, what `_resolve_parallel_plans` does)."""
    plan = getattr(model, "ep_plan", None)
    if not plan:
        raise UserError(f"{type(model).__name__} has no expert-parallel plan in transformers: it cannot take `ep`")
    return model._expand_parallel_plan(dict(plan))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split `model`'s routed experts over `ep_mesh` with transformers' EP plan and
    `AssumedCountsAllToAll` (module docstring); returns the experts modules, which FSDP2
    then shards over the expert mesh's "efsdp" dimension."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    register_implementation()
    plan = expert_plan(model)
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=IMPLEMENTATION)
    dispatched = {name for name, style in plan.items() if style == DISPATCH_STYLE}
    return [module for name, module in expert_modules(model) if name in dispatched]
