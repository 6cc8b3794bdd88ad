"""The launcher's world in one process: the fake process group, and the ranks that differ.

**The process group.** `install` replaces `torch.distributed.init_process_group` for the
run: whatever backend the program asks for (`nccl`, `gloo`, `cpu:gloo,cuda:nccl`), it joins
PyTorch's fake process group (`torch.testing._internal.distributed.fake_pg.FakeStore`,
backend "fake": collectives are no-ops that return correctly shaped outputs) as the rank the
launcher's environment names, in a world of the launcher's size; `init_method`, `store` and
`device_id` are not used. Device meshes the program makes for `cuda` are made for the fake
`cpu` (`DeviceMesh`'s `device_type`), as memplan traces every CUDA job (docs/capture.md), so
FSDP2, DTensor and their collectives run on the fake cpu tensors. This is memplan's traced
layouts' fake group (`memplan.parallel.traced`), joined by the program's own calls.

**The ranks that differ** (`distinct_ranks`): a program's ranks run the same code on
different shards. From rank 0's model, every parameter that is a DTensor (FSDP2's shards,
TP's) gives each rank's local shape (`torch.distributed.tensor._utils.
_compute_local_shape_and_global_offset` at the rank's mesh coordinate): ranks with the same
shapes hold the same bytes and are one class, traced once (its first rank); a program with no
DTensor parameters (DDP, one process) is one class. What this cannot see: ranks that differ
by their data (sequences of another length) or by code that branches on the rank (pipeline
stages): `--ranks all` traces every rank.

`layout_of(models)` says what parallelism the program applied, for the report.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from memplan.program.patches import Patches
from memplan.program.world import World


def install(world: World, patches: Patches, *, rank: int, world_size: int) -> None:
    """The fake process group and cpu device meshes for the run (module docstring)."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    init = distributed_c10d.init_process_group

    def init_process_group(*_args: Any, **kwargs: Any) -> None:
        init("fake", store=FakeStore(), rank=rank, world_size=world_size,
             **({"timeout": kwargs["timeout"]} if "timeout" in kwargs else {}))

    patches.everywhere(init, init_process_group, ("torch.distributed", "accelerate", "transformers", "__main__"))
    patches.set(dist, "init_process_group", init_process_group)
    mesh_init = DeviceMesh.__init__

    def mesh_on_fake_cpu(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        mesh_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    patches.set(DeviceMesh, "__init__", mesh_on_fake_cpu)
    _ddp_on_fake_cpu(patches, world.cuda)
    _object_collectives_of_own_objects(patches, world_size)


def _object_collectives_of_own_objects(patches: Patches, world_size: int) -> None:
    """The object collectives answered with the rank's own objects. The fake group's
    collectives complete without writing their outputs, and `broadcast_object_list` sizes its
    receive buffer from the broadcast sizes (torch/distributed/distributed_c10d.py,
    `broadcast_object_list`: `torch.empty(torch.sum(object_sizes_tensor))`), which on a
    receiving rank would be uninitialised memory. Every rank runs the same program, so the
    rank's own objects stand for the others': `broadcast_object_list` leaves the list as the
    rank made it (Lightning's `strategy.broadcast(log_dir)`), `all_gather_object` and
    `gather_object` give the rank's object for every rank. A value only the source rank
    computes (the others passing None) stays None on the others."""
    from torch.distributed import distributed_c10d

    def broadcast_object_list(object_list: list, *_args: Any, **_kwargs: Any) -> None:
        return None

    def all_gather_object(object_list: list, obj: Any, *_args: Any, **_kwargs: Any) -> None:
        object_list[:] = [obj] * world_size

    def gather_object(obj: Any, object_gather_list: list | None = None, *_args: Any, **_kwargs: Any) -> None:
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * world_size

    for module in (dist, distributed_c10d):
        patches.set(module, "broadcast_object_list", broadcast_object_list)
        patches.set(module, "all_gather_object", all_gather_object)
        patches.set(module, "gather_object", gather_object)


def _ddp_on_fake_cpu(patches: Patches, cuda: bool) -> None:
    """`DistributedDataParallel(model, device_ids=[local_rank])` of a cuda run: the module's
    parameters are on the fake cpu, where DDP takes no device ids (a CPU module's; torch/nn/
    parallel/distributed.py, `__init__`), so they are left out. The fake process group's
    all-reduce completes with no value, which DDP's reducer refuses as a bucket's result
    (torch/csrc/distributed/c10d/comm.cpp, `parseHookResult`): each DDP's comm hook gives the
    bucket back as reduced, as NCCL's all-reduce does, in place."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_init = DistributedDataParallel.__init__

    def reduced_in_place(_state, bucket):  # noqa: ANN001, ANN202 - DDP checks these annotations against its own types
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def ddp_on_fake_cpu(self: Any, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
                        *args: Any, **kwargs: Any) -> None:
        if cuda:
            device_ids = output_device = None
        ddp_init(self, module, device_ids, output_device, *args, **kwargs)
        self.register_comm_hook(None, reduced_in_place)

    patches.set(DistributedDataParallel, "__init__", ddp_on_fake_cpu)


def teardown() -> int:
    """End the run's process group; the number of its groups of more than one rank (each an
    NCCL communicator on a GPU)."""
    if not dist.is_initialized():
        return 0
    from torch.distributed.distributed_c10d import _world

    groups = sum(1 for pg in list(_world.pg_map) if pg.size() > 1)
    dist.destroy_process_group()
    from memplan.parallel.traced import _forget_previous_meshes

    _forget_previous_meshes()
    return groups


def _dtensor_parameters(models: list[torch.nn.Module]) -> list[Any]:
    from torch.distributed.tensor import DTensor

    return [p for m in models for p in m.parameters() if isinstance(p, DTensor)]


def rank_signature(models: list[torch.nn.Module], rank: int) -> tuple:
    """The local shapes of every DTensor parameter on `rank` (module docstring)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shapes = []
    for p in _dtensor_parameters(models):
        mesh = p.device_mesh
        table = mesh.mesh
        where = (table == rank).nonzero()
        if where.shape[0] == 0:
            shapes.append(None)
            continue
        coordinate = [int(c) for c in where[0].tolist()]
        local, _offset = _compute_local_shape_and_global_offset(tuple(p.shape), tuple(table.shape), coordinate,
                                                                p.placements)
        shapes.append(tuple(local))
    return tuple(shapes)


def distinct_ranks(models: list[torch.nn.Module], world_size: int) -> dict[int, list[int]]:
    """Each class of ranks with the same parameter shards: its first rank -> every rank in it."""
    classes: dict[tuple, list[int]] = {}
    for rank in range(world_size):
        classes.setdefault(rank_signature(models, rank), []).append(rank)
    return {ranks[0]: ranks for ranks in classes.values()}


def layout_of(models: list[torch.nn.Module]) -> dict[str, Any]:
    """What parallelism the program applied to its models (module docstring)."""
    if not dist.is_initialized() and not _dtensor_parameters(models):
        return {"world_size": 1}
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    modules = [m for root in models for m in root.modules()]
    facts: dict[str, Any] = {"world_size": dist.get_world_size() if dist.is_initialized() else None}
    fsdp2 = [m for m in modules if isinstance(m, FSDPModule)]
    if fsdp2:
        facts["fsdp2_modules"] = len(fsdp2)
        policy = getattr(getattr(fsdp2[-1], "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        if policy is not None:
            facts["fsdp2_mixed_precision"] = {"param_dtype": str(policy.param_dtype).removeprefix("torch."),
                                              "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch.")}
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        facts["fsdp1"] = True
    if any(isinstance(m, DistributedDataParallel) for m in models):
        facts["ddp"] = True
    meshes: dict[str, list[str]] = {}
    for p in _dtensor_parameters(models):
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        key = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.mesh.shape))
        placements = meshes.setdefault(key, [])
        for placement in map(str, p.placements):
            if placement not in placements:
                placements.append(placement)
    if meshes:
        facts["dtensor_meshes"] = meshes
    return facts
