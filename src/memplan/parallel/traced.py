"""Trace one rank of a parallel job in one process: fake tensors, fake process group.

`capture_rank_step(config, setup, layout, rank, device)` initialises PyTorch's fake process
group (`torch.testing._internal.distributed.fake_pg.FakeStore`,
`dist.init_process_group("fake", ..., rank=rank, world_size=N)`: collectives are no-ops
that return correctly shaped outputs), builds the model, applies the layout with the
same code as the real gloo runs (`memplan.parallel.apply`: DDP, FSDP2 `fully_shard`,
DTensor TP over a cpu device mesh), builds the optimizer over the resulting parameters
and captures one step after one warm-up step, everything on fake *cpu* tensors (a
CPU-only PyTorch aborts when autograd runs on fake cuda tensors). This is torchtitan's
`scripts/estimate/estimation.py` recipe, with memplan's recorder in place of
`FSDPMemTracker`, and extended to DDP and TP.

DTensors (FSDP2's sharded parameters, TP weights) are wrapper tensors with no storage
of their own: the recorder here lets DTensor's dispatch run first (it answers
`NotImplemented` for ops on DTensors) and records the rank-local ops and storages it
runs, so collectives' output buffers, FSDP2's all-gather/reduce-scatter buffers and
DTensor redistributions are all in the trace.

FSDP2 keeps each group's unsharded parameters in storages it frees and re-allocates
in place (`untyped_storage().resize_(0)` on reshard, `resize_(n)` on unshard:
`_fsdp_param.free_storage` / `alloc_storage`). A storage resize is no ATen op, so no
dispatch mode sees it; while recording, those two functions are wrapped to report a
free and a new allocation (the same instrumentation point PyTorch's own
`FSDPMemTracker` relies on: FSDP2's internals, not the op stream).

What the fake group cannot show: memory inside the communication backend. NCCL's
are a device-profile term of the estimate (`memplan.hardware.devices`). gloo, the
CPU backend, allocates per all-gather one buffer of the output's size inside the op on
the calling thread, then one on its own worker thread, freed when the collective
completes (measured with torch.profiler on gloo runs; none for reduce-scatter). They
normally follow each other, so one buffer stands for both; on a loaded machine they
sometimes overlap on one rank, or the worker's outlives the op, which no trace can know.
A reduce-scatter on gloo is an all-reduce of a clone of its input, one input-sized buffer
while the op runs (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`). `gloo_staging_buffers`
adds both to a cpu trace; one buffer per all-gather, live while the all-gather op runs:
every rank issues the same collective at the same point of the step, so it completes
before the next op starts, and before FSDP2's copy-out allocates the unsharded
parameters (the profiler timeline of a real run shows the staging buffer freed before
those allocations; in the trace they follow the all-gather op with no op in between, so
they are recorded under it, and the staging buffer ends at the first of them).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor

from memplan import models
from memplan.capture.api import capture
from memplan.capture.compiled import refuse_compiled_step
from memplan.capture.pipeline import build_pipeline_stage
from memplan.capture.recorder import Recorder
from memplan.capture.step import StepTrace, TrainingStep
from memplan.errors import UserError
from memplan.models.build import carried_between_steps, transformer_blocks, transformer_blocks_path
from memplan.models.setup import TrainingSetup
from memplan.parallel.apply import (
    apply_stage_layout,
    build_parallel_step,
    device_mesh,
    pipeline_mesh,
)
from memplan.parallel.layout import MULTI_STAGE_SCHEDULES, Layout
from memplan.parallel.schedules import schedule_rank_step
from memplan.trace.edit import ExtraBuffer
from memplan.trace.model import CATEGORY, FREE, Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

# FSDP2's all-gathers, and FSDP1's on CPU (`FlatParamHandle._all_gather_flat_param` gathers
# into the chunks of the unsharded flat parameter with the list form, `dist.all_gather`)
GLOO_STAGED_OPS = ("c10d._allgather_base_.default", "c10d.allgather_into_tensor_coalesced_.default",
                   "c10d.allgather_.default")
GLOO_CLONED_OPS = ("c10d._reduce_scatter_base_.default", "c10d.reduce_scatter_tensor_coalesced_.default")


class DistributedRecorder(Recorder):
    """The dispatch-level recorder, seeing through DTensors to their local storages."""

    def __init__(self, *, record_flops: bool = True, compiled_regions: bool = False) -> None:
        super().__init__(record_flops=record_flops, compiled_regions=compiled_regions)
        self._alias_count: dict[int, int] = {}  # buffer -> extra storages that stand for it
        self._alias_refs: list[weakref.ref] = []

    def _make_free_callback(self, idx: int) -> Any:
        free = super()._make_free_callback(idx)

        def on_free(ref: weakref.ref) -> None:
            if self._alias_count.get(idx, 0) > 0:  # another storage of the same buffer lives on
                self._alias_count[idx] -= 1
                return
            free(ref)

        return on_free

    def _wait_tensor(self, func: Any, args: Any, kwargs: Any) -> Any:
        """`wait_tensor` returns its input on a real process group; a fake tensor's
        wait returns a new storage. Either way it is the same buffer, not an allocation."""
        out = func(*args, **kwargs)
        source, result = args[0].untyped_storage(), out.untyped_storage()
        idx = self._ids.get(source)
        if idx is not None and result is not source and self._ids.get(result) is None:
            self._ids[result] = idx
            self._alias_count[idx] = self._alias_count.get(idx, 0) + 1
            self._alias_refs.append(weakref.ref(result, self._make_free_callback(idx)))
        return out

    def buffer_of(self, tensor: torch.Tensor, *, op: int = -1) -> int:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        return super().buffer_of(tensor, op=op)

    def leaf_module(self, leaf: torch.Tensor) -> str:
        if isinstance(leaf, DTensor):
            leaf = leaf._local_tensor
        return super().leaf_module(leaf)

    def note_saved(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        super().note_saved(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches to local ops, which come back here
        if _on_meta_device(args, kwargs or {}):
            # allocates nothing: transformers' TP styles make a meta tensor to learn a
            # global shape's strides (`TensorParallelLayer._from_local_last_dim_shard`)
            return func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return self._wait_tensor(func, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def storage_freed(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage was resized to zero bytes: its buffer ends here."""
        idx = self._ids.get(tensor.untyped_storage())
        if idx is None:
            return
        del self._ids[tensor.untyped_storage()]
        self._refs.pop(idx, None)  # its weak reference must not report a second free
        if self._b.nbytes[idx] > 0:
            self._ev_kind.append(FREE)
            self._ev_buffer.append(idx)
            self._ev_op.append(len(self._op_name) - 1)

    def storage_allocated(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage was resized from zero bytes: a new buffer starts here."""
        storage = tensor.untyped_storage()
        if self._ids.get(storage) is not None:
            self.storage_freed(tensor)
        idx = self._new_buffer(storage, tensor.device, preexisting=False, op=len(self._op_name) - 1)
        self._marked[idx] = CATEGORY["parameter"]  # FSDP2's unsharded (gathered) parameters

    @contextlib.contextmanager
    def extra_hooks(self) -> Iterator[None]:
        with self.fsdp_storage_hooks(), sharding_propagation_unrecorded():
            yield

    @contextlib.contextmanager
    def fsdp_storage_hooks(self) -> Iterator[None]:
        """Report FSDP2's in-place storage frees and re-allocations (module docstring).
        `_fsdp_param_group` holds its own name for `alloc_storage`: a group on a one-rank
        mesh (the experts of an EP layout whose EP group spans dp x tp) skips the
        all-gather and allocates its unsharded parameters there (`wait_for_unshard`)."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

        def alloc_storage(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            alloc(tensor)
            if before == 0 and tensor.untyped_storage().nbytes() > 0:
                self.storage_allocated(tensor)

        def free_storage(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            free(tensor)
            if before > 0:
                self.storage_freed(tensor)

        _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
        _fsdp_param_group.alloc_storage = alloc_storage
        try:
            with self.flat_param_storage_hooks():
                yield
        finally:
            _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
            _fsdp_param_group.alloc_storage = alloc

    @contextlib.contextmanager
    def flat_param_storage_hooks(self) -> Iterator[None]:
        """FSDP1's in-place storage frees and re-allocations of its flat parameters (the
        unsharded, padded flat parameter and the low-precision shard: `FlatParamHandle`
        calls `torch.distributed.utils._alloc_storage` / `_free_storage`, which resize the
        storage), reported as for FSDP2."""
        from torch.distributed.fsdp import _flat_param

        alloc, free = _flat_param._alloc_storage, _flat_param._free_storage

        def alloc_storage(tensor: torch.Tensor, size: torch.Size) -> None:
            before = tensor.untyped_storage().nbytes()
            alloc(tensor, size)
            if before == 0 and tensor.untyped_storage().nbytes() > 0:
                self.storage_allocated(tensor)

        def free_storage(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            free(tensor)
            if before > 0:
                self.storage_freed(tensor)

        _flat_param._alloc_storage, _flat_param._free_storage = alloc_storage, free_storage
        try:
            yield
        finally:
            _flat_param._alloc_storage, _flat_param._free_storage = alloc, free


def _on_meta_device(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an op makes a tensor on the meta device from meta tensors (or none)."""
    from torch.utils._pytree import tree_flatten

    device = kwargs.get("device")
    if device is None or torch.device(device).type != "meta":
        return False
    return all(t.device.type == "meta" for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def sharding_propagation_unrecorded() -> Iterator[None]:
    """DTensor's output-shape propagation run outside the recorder and the trace's fake mode.

    Before an op on DTensors runs locally, DTensor runs it once on global-shape fake tensors to
    learn its output's shape (`ShardingPropagator._propagate_tensor_meta_non_cached`, torch
    2.13 `distributed/tensor/_sharding_prop.py` L520-575), under `detect_fake_mode() or
    FakeTensorMode()`: on real tensors a fresh fake mode, which allocates nothing; inside the
    trace's own fake mode those global-shape arguments (a whole embedding table for a
    vocabulary-sharded lookup) would be recorded as allocations. With every mode set aside
    while it runs, it makes its fresh fake mode, as on a real run."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def unrecorded(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return propagate(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = unrecorded
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


@contextlib.contextmanager
def fsdp_host_to_device_copies() -> Iterator[None]:
    """FSDP2's copy of each host-resident shard to the GPU before its all-gather, for a
    CUDA job traced on cpu tensors with `CPUOffloadPolicy`: `FSDPParam.all_gather_inputs`
    returns `sharded_param_data.to(self.device, non_blocking=True)` (`_fsdp_param.py`),
    a new GPU tensor of the shard's size, which the all-gather's copy-in reads and drops;
    on the fake cpu that `.to` is the shard itself. Here it is a copy (a device buffer)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    inputs = FSDPParam.all_gather_inputs

    def copied(self: Any) -> list[torch.Tensor]:
        tensors = inputs.fget(self)
        return [t.clone() for t in tensors] if self.offload_to_cpu else tensors

    FSDPParam.all_gather_inputs = property(copied)
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = inputs


def parallel_step_trace(step: TrainingStep, *, warmup: int = 1, meta: dict[str, Any] | None = None) -> Trace:
    """`memplan.capture.capture` of `step` with the DTensor-aware recorder: the trace of a
    step whose model runs on a (real or fake) process group."""
    return capture(step.run, model=step.model, optimizer=step.optimizer, iterations=1, warmup=warmup,
                   meta=meta, inputs=[step.batches, carried_between_steps(step.model)],
                   recorder=DistributedRecorder())


def _forget_previous_meshes() -> None:
    """DTensor caches sharding decisions keyed by mesh *value*, and the cached results
    hold the mesh object (and its process-group names) of the first call: after the
    fake group of one rank is destroyed, the next rank's trace would reach into it."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    _clear_sharding_prop_cache()  # and the C++ fast path's cache (DTensor's dispatch moved to C++)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """PyTorch's fake process group of `world_size` ranks, joined as `rank`, for the
    duration of the block (module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("a process group is already initialised in this process: trace ranks in a fresh one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_previous_meshes()


def _on_target_device(trace: Trace, device: str) -> Trace:
    """`trace`'s buffers labelled with the job's device (a "cuda" job is traced on cpu)."""
    if device == "cuda":
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    return trace


def capture_rank_step(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, rank: int,
                      device: str = "cpu") -> StepTrace:
    """`rank` of `layout`, its step traced with DDP / FSDP2 / DTensor TP applied on a
    fake process group (see the module docstring)."""
    refuse_compiled_step(setup, "on the ranks of a traced parallel layout (`zero=3`, `tp`)")
    with fake_process_group(rank, layout.world_size):
        mesh = device_mesh(layout)  # real rank tables: a mesh cannot be built on fake tensors
        copies = fsdp_host_to_device_copies() if device == "cuda" and setup.cpu_offload == "params" \
            else contextlib.nullcontext()
        with FakeTensorMode(allow_non_fake_inputs=True), copies:
            step = build_parallel_step(config, setup, layout, target_device=device, mesh=mesh)
            trace = parallel_step_trace(step, meta={**step.meta, "fake": True, "rank": rank,
                                                    "layout": layout.to_dict()})
    traced = StepTrace.of_model(_on_target_device(trace, device), config, setup, blocks_path=step.meta["blocks_path"],
                                parameters=step.meta["parameters"], layers=step.meta["layers"])
    # under CP each rank's attention kernels see its own seq / cp queries (half of them at
    # some ring steps): the sequence the GPU kernels' workspaces are sized by
    return replace(traced, seq=traced.seq // layout.cp)


def capture_stage_step(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, stage: int,
                       device: str = "cpu") -> StepTrace:
    """The first rank of pipeline `stage` of `layout`, its step traced on a fake process
    group; the trace's meta holds the rank, the layout and the pipeline.

    The stage's 1F1B step (`memplan.capture.pipeline`: embeddings on the first stage,
    the final norm, LM head and loss on the last) runs on the fake process group of
    `layout.world_size` ranks, with `layout`'s TP applied to the stage's modules over
    the TP dimension of a ("pp", "pp_dp", "pp_tp") mesh, the same DTensor plan as the
    non-pipelined TP step (`memplan.parallel.apply.apply_stage_layout`). `config` holds
    every stage's blocks; each stage takes an equal share. The point-to-point sends and
    receives between stages are not run: a received activation or gradient is a fresh
    buffer, as a receive buffer would be.

    The fake group is joined as global rank 0 for every stage: the first rank of stage s
    (global rank s * dp * tp) has the same TP and DP coordinates (0, 0), hence the same
    shards, and DTensor caches sharding strategies keyed by mesh *value*, which leaves out
    the calling rank, so a second stage traced in the same process as another global rank
    would reach into the first one's (destroyed) process groups.

    Under a multi-stage schedule (`memplan.parallel.schedules`: interleaved 1F1B,
    interleaved zero bubble, ZB-V) the rank's step is PyTorch's own schedule over the
    rank's two chunks, with its sends and receives on the fake group; the schedule reads
    its row of actions by the pipeline rank, so the group is joined as the stage's first
    rank, `stage` x dp x tp."""
    refuse_compiled_step(setup, "on pipeline stages (`pp`)")
    rank = stage * layout.dp * layout.tp
    if layout.schedule in MULTI_STAGE_SCHEDULES:
        return _capture_schedule_rank(config, setup, layout, stage, device)
    with fake_process_group(0, layout.world_size):
        mesh = pipeline_mesh(layout)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = models.build_model(config, setup, device="cpu")
            layers, blocks_path = len(transformer_blocks(model)) // layout.pp, transformer_blocks_path(model)

            def distribute(owned: list[torch.nn.Module]) -> None:
                with unset_fake_temporarily():  # see memplan.parallel.apply.build_parallel_step
                    apply_stage_layout(model, layout, blocks_path, owned, mesh)

            stage_model, optimizer, step = build_pipeline_stage(
                model, setup, stages=layout.pp, stage=stage, microbatches=layout.microbatches,
                distribute=distribute, target_device=device)
            meta = {"model": type(model).__name__, "setup": setup.to_dict(), "device": device,
                    "parameters": models.count_parameters(config), "blocks_path": blocks_path,
                    "layers": layers, "fake": True, "rank": rank, "layout": layout.to_dict(),
                    "pipeline": {"stages": layout.pp, "stage": stage, "microbatches": layout.microbatches,
                                 "schedule": "1f1b"}}
            trace = capture(step, model=stage_model, optimizer=optimizer, iterations=1, warmup=1, meta=meta,
                            recorder=DistributedRecorder())
    return StepTrace.of_model(_on_target_device(trace, device), config, setup, blocks_path=blocks_path,
                              parameters=meta["parameters"], layers=layers)


def _capture_schedule_rank(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, stage: int,
                           device: str) -> StepTrace:
    """`capture_stage_step` under a multi-stage schedule (see there)."""
    rank = stage * layout.dp * layout.tp
    with fake_process_group(rank, layout.world_size):
        mesh = pipeline_mesh(layout)
        with FakeTensorMode(allow_non_fake_inputs=True):
            step = schedule_rank_step(config, setup, layout, stage, mesh, target_device=device)
            meta = {**step.meta, "fake": True, "rank": rank, "layout": layout.to_dict()}
            trace = capture(step.run, model=step.model, optimizer=step.optimizer, iterations=1, warmup=1, meta=meta,
                            recorder=DistributedRecorder())
    return StepTrace.of_model(_on_target_device(trace, device), config, setup, blocks_path=meta["blocks_path"],
                              parameters=meta["parameters"], layers=meta["layers"])


def gloo_staging_buffers(trace: Trace) -> list[ExtraBuffer]:
    """gloo's per-all-gather staging buffers and per-reduce-scatter input clones (module
    docstring), for a cpu job on gloo."""
    return _all_gather_staging(trace) + _reduce_scatter_clones(trace)


def _reduce_scatter_clones(trace: Trace) -> list[ExtraBuffer]:
    """gloo runs a reduce-scatter as an all-reduce of a copy of its input
    (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`: `buffers.push_back(
    inputTensors[i].clone())`, then the rank's chunk copied out when the work is waited
    on): one input-sized buffer while the op runs (measured: allocated after the
    reduce-scatter's output and freed when `dist.reduce_scatter_tensor` returns)."""
    first = trace.ops["first_event"]
    extras = []
    for i in range(trace.num_ops):
        if trace.op_name(i) not in GLOO_CLONED_OPS:
            continue
        inputs = trace.op_inputs(i)
        if not inputs.shape[0]:
            continue
        largest = inputs[int(np.argmax(trace.buffers["nbytes"][inputs]))]
        start = int(first[i])
        stop = int(first[i + 1]) if i + 1 < trace.num_ops else trace.num_events
        extras.append(ExtraBuffer(int(trace.buffers["nbytes"][largest]), start,
                                  stop if stop < trace.num_events else -1, "other",
                                  trace.phase_at(min(start, trace.num_events - 1)),
                                  device=int(trace.buffers["device"][largest])))  # the clone is where its input is
    return [x for x in extras if x.nbytes > 0]


def _all_gather_staging(trace: Trace) -> list[ExtraBuffer]:
    """One output-sized gloo staging buffer per all-gather, live while the op runs."""
    first = trace.ops["first_event"]
    extras = []
    for i in range(trace.num_ops):
        if trace.op_name(i) not in GLOO_STAGED_OPS:
            continue
        outputs = np.unique(trace.op_outputs(i))  # the list form's chunks share one buffer
        nbytes = int(trace.buffers["nbytes"][outputs].sum())
        start = int(first[i])
        stop = int(first[i + 1]) if i + 1 < trace.num_ops else trace.num_events
        # the collective ends before FSDP2's copy-out allocates the unsharded parameters;
        # with no op in between, those allocations are recorded under the all-gather op
        own = np.isin(trace.events["buffer"][start:stop], outputs)
        end = start + int(np.argmin(own)) if not own.all() else stop
        extras.append(ExtraBuffer(nbytes, start, end if end < trace.num_events else -1, "other",
                                  trace.phase_at(start), device=trace.main_device()))
    return [x for x in extras if x.nbytes > 0]
