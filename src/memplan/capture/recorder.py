"""The dispatch-level recorder: every storage allocation and free of a training step.

A `TorchDispatchMode` sees every ATen op below autograd, in forward, backward
(recomputation included) and the optimizer. For each op it maps the input and output
tensors to their *storages*: an output whose storage has not been seen before is a
new allocation; views and in-place ops return a storage that is already known, so
they alias it. A weak reference on each storage fires when PyTorch releases it,
which is the free. This is the method of PyTorch's own
`torch.distributed._tools.mem_tracker.MemTracker`, extended to keep the whole
lifetime trace instead of running totals.

It works the same on real tensors and under `FakeTensorMode` (fake tensors have
storages with the real byte size and no memory), so a 70B-parameter step traces on
a laptop.

What it cannot see: memory a kernel allocates internally without returning it as a
tensor (scratch buffers inside some CPU kernels, cuBLAS workspaces). Those are either
negligible on CPU or modelled explicitly by the estimator; for oneDNN's CPU matmuls the
recorder keeps each matmul's arguments (`meta["matmul_args"]`), from which the estimate
measures the kernel's scratchpad (`memplan.capture.onednn`).

Assumptions:
- Storages that already exist when they are first seen (parameters, inputs,
  optimizer state from an earlier step) are *pre-existing*: they are allocated at the
  very start of the trace, before any op.
- `events["op"]` is the most recent op started at or before the event (frees happen
  between ops, when Python or autograd drops the last reference).
- Phase detection: backward is "the autograd engine is running a graph task";
  recompute is "a module's forward runs inside backward" (activation checkpointing);
  optimizer is "inside `Optimizer.step`"; everything else in the step is forward.
"""

from __future__ import annotations

import bisect
import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _pop_mode,
    _push_mode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from memplan.capture.onednn import matmul_signature
from memplan.models import tracing
from memplan.trace.model import (
    ALLOC,
    BUFFER_COLUMNS,
    CATEGORY,
    FREE,
    OP_COLUMNS,
    PHASE,
    Trace,
)
from memplan.trace.validate import validate

_UNKNOWN = -1  # category decided at finalisation from the lifetime rule

# Library ops whose kernel is itself a sequence of ops (a `CompositeExplicitAutograd` kernel
# written in Python): the recorder runs that kernel with itself active again, so that what
# the ops inside allocate and free is in the trace. bitsandbytes' 4-bit matmul, `gemm_4bit`,
# has no CPU kernel: its `default` kernel (`bitsandbytes/backends/default/ops.py`,
# `_gemm_4bit_default_impl`) dequantises the nested absmax (double quantisation) and the
# weight, in the input's dtype, then calls `F.linear`; CUDA allocates the same buffers
# (`backends/cuda/ops.py`, `_dequant_linear_fallback`) wherever the batch has more than
# 1,536 rows, and below that wherever its per-architecture table prefers it to the fused
# kernel (docs/estimation.md, "Quantised bases"). optimum-quanto's quantisation
# (`quanto::quantize_affine`, `quantize_symmetric`, `optimum/quanto/library/quantize.py` at
# 0.2.7: the `default` kernel is the only one) makes its fp32 quotient, the rounded and the
# clamped copies before the uint8 codes, which the KV cache of `memplan generate --cache
# quantized:int4` peaks on when it re-quantises the whole cache; its `unpack` runs a C++ kernel
# on CPU and CUDA (`extensions/cpp/unpack.cpp`) with the same masks, shift and concatenation
# as its `default` one (`library/unpack.py`), which is run here.
COMPOSITE_OPS = frozenset({"bitsandbytes::gemm_4bit", "quanto::quantize_affine", "quanto::quantize_symmetric",
                           "quanto::unpack"})
_COMPOSITE_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _linear_flops(x: torch.Tensor, weight: torch.Tensor, *_args: Any, out_val: Any = None, **_kwargs: Any) -> int:
    """FLOPs of `aten.linear` (2 per multiply-add), which `torch.utils.flop_counter` counts
    through its `mm`/`addmm` decomposition and so has no entry for; the recorder sees it
    whole inside a composite kernel."""
    return 2 * out_val.numel() * weight.shape[-1]


_EXTRA_FLOPS = {torch.ops.aten.linear: _linear_flops}


_ACTIVE: Recorder | None = None


def set_microbatch(microbatch: int) -> None:
    """Tell the running recorder which micro-batch the next ops belong to.

    For steps whose schedule interleaves micro-batches (pipeline parallelism): from
    the first call on, the recorder stops numbering micro-batches by itself. Outside a
    capture it does nothing, so a step can call it unconditionally.
    """
    if _ACTIVE is not None:
        _ACTIVE.explicit_microbatch = True
        _ACTIVE.microbatch = int(microbatch)


def note_saved(tensor: torch.Tensor) -> None:
    """Tell the running recorder that autograd saved `tensor` for backward, from a
    `saved_tensors_hooks` pack hook of the step's own (which hides the recorder's hooks,
    as the innermost hooks alone run). Outside a capture it does nothing."""
    if _ACTIVE is not None:
        _ACTIVE.note_saved(tensor)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor subclass's data (a DTensor's local shard,
    torchao's quantised optimizer states: codes, scales and maps), or the tensor itself."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]  # DTensor also names its device mesh here
    return [t for x in inner if isinstance(x, torch.Tensor) for t in inner_tensors(x)]


class _Buffers:
    """Growable per-buffer columns (Python lists until finalisation)."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []
        self.device: list[int] = []
        self.alloc_op: list[int] = []
        self.module: list[int] = []
        self.phase: list[int] = []
        self.iteration: list[int] = []
        self.microbatch: list[int] = []
        self.category: list[int] = []
        self.preexisting: list[bool] = []
        self.stream: list[int] = []

    def __len__(self) -> int:
        return len(self.nbytes)


def _counted_op(func: Any, args: Any, out: Any) -> tuple[Any, Any, Any]:
    """The op whose FLOPs `func` costs, with its arguments and output: `func` itself, or the
    op that a random-state higher-order op of a compiled graph runs
    (`torch._prims.rng_prims`: `run_and_save_rng_state(op, *args)` returns
    `(state, op(*args))`, `run_with_rng_state(state, op, *args)` returns `op(*args)`)."""
    name = getattr(func, "__name__", "")
    if name == "run_and_save_rng_state" and args:
        return getattr(args[0], "_overloadpacket", None), args[1:], out[1]
    if name == "run_with_rng_state" and len(args) > 1:
        return getattr(args[1], "_overloadpacket", None), args[2:], out
    return getattr(func, "_overloadpacket", None), args, out


class Recorder(TorchDispatchMode):
    """Record storage allocations, frees and ops; `finish()` returns the Trace.

    Use through `memplan.capture.capture`, which also sets iterations and marks
    parameters, gradients, optimizer state and inputs. Entering it directly records
    whatever runs inside the `with` block.
    """

    def __init__(self, *, record_flops: bool = True, compiled_regions: bool = False) -> None:
        super().__init__()
        self.compiled_regions = compiled_regions
        # compiled code calls higher-order ops at run time (`run_and_save_rng_state` /
        # `run_with_rng_state` around the random ops of a checkpointed region,
        # torch/_prims/rng_prims.py): each is recorded as one op with what it returns
        self.supports_higher_order_operators = compiled_regions
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._b = _Buffers()
        # events: parallel lists; pre-existing allocations are kept apart and prepended.
        self._ev_kind: list[int] = []
        self._ev_buffer: list[int] = []
        self._ev_op: list[int] = []
        self._pre: list[int] = []
        # ops
        self._op_name: list[int] = []
        self._op_module: list[int] = []
        self._op_phase: list[int] = []
        self._op_iteration: list[int] = []
        self._op_microbatch: list[int] = []
        self._op_first_event: list[int] = []
        self._op_flops: list[float] = []
        self._op_bytes: list[float] = []
        self._op_wall: list[float] = []  # seconds each op's kernel took here (meaningful on real tensors)
        self._fake = False  # an op saw a FakeTensor: the wall times are the fake kernels', not kept
        self._op_in: list[int] = []
        self._op_in_ptr: list[int] = [0]
        self._op_out: list[int] = []
        self._op_out_ptr: list[int] = [0]
        self._names: dict[str, int] = {}
        self._modules: dict[str, int] = {"": 0}
        self._devices: dict[str, int] = {}
        self._saved: set[int] = set()  # buffers autograd saved for backward
        self._saved_order: list[int] = []  # the same, in the order autograd first saved them
        self._matmuls: list[list[Any]] = []  # [op, its arguments] (`memplan.capture.onednn`)
        self._tensor_names: dict[int, str] = {}  # buffer -> the runtime's key (`name`)
        self._marked: dict[int, int] = {}  # buffer -> category forced by the runner
        self._leaf_modules: dict[int, str] = {}  # buffer of a marked tensor -> its owning module
        self.record_flops = record_flops
        self.active = False
        # step position, set by the runner
        self.iteration = 0
        self.microbatch = 0
        self.in_optimizer = False
        self.stream = 0  # the stream new buffers are allocated on (a program run follows its stream contexts)
        self.explicit_microbatch = False  # set by `set_microbatch`: no auto-numbering
        self._fwd_depth = 0
        self._module_stack: list[str] = []
        self._seq_ends: list[int] = []
        self._seq_modules: list[str] = []
        self._last_phase = PHASE["forward"]
        self.module_names: dict[int, str] = {}

    # --- string tables ---------------------------------------------------------------
    @staticmethod
    def _intern(table: dict[str, int], key: str) -> int:
        idx = table.get(key)
        if idx is None:
            idx = table[key] = len(table)
        return idx

    def reset_phase(self) -> None:
        """Start of an iteration: the next op is forward of micro-batch 0."""
        self.microbatch = 0
        self.explicit_microbatch = False
        self._last_phase = PHASE["forward"]

    # --- where are we ------------------------------------------------------------------
    def current_phase(self) -> int:
        if self.in_optimizer:
            return PHASE["optimizer"]
        if torch._C._current_graph_task_id() != -1:
            return PHASE["recompute"] if self._fwd_depth > 0 else PHASE["backward"]
        return PHASE["forward"]

    def current_module(self) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            variable = getattr(node, "variable", None)
            if variable is not None:
                # an AccumulateGrad node (its sequence number is the maximum, no module's):
                # the module of the parameter whose gradient it accumulates
                return self.leaf_module(variable)
            if node is not None:
                return self._module_of_sequence_nr(node._sequence_nr())
        return ""

    def leaf_module(self, leaf: torch.Tensor) -> str:
        """The module a marked tensor (a parameter) belongs to, or "" when it is unknown."""
        return self._leaf_modules.get(self._ids.get(leaf.untyped_storage(), -1), "")

    def _module_of_sequence_nr(self, seq: int) -> str:
        """The module whose forward created the autograd node with sequence number `seq`.

        Module forward hooks record the largest sequence number among each module's
        outputs, in completion order (inner modules first); the first module whose end
        is at or after `seq` made the node. This reads the autograd graph without adding
        hooks to it, so it changes no tensor lifetime (PyTorch's ModuleTracker registers
        grad hooks on every module's tensors, which keeps checkpointed activations alive).
        """
        i = bisect.bisect_left(self._seq_ends, seq)
        return self._seq_modules[i] if i < len(self._seq_modules) else ""

    # --- buffers -----------------------------------------------------------------------
    def _new_buffer(self, storage: Any, device: torch.device, *, preexisting: bool, op: int) -> int:
        b = self._b
        idx = len(b)
        self._ids[storage] = idx
        b.nbytes.append(int(storage.nbytes()))
        kind = tracing.host_kind(storage)
        b.device.append(self._intern(self._devices, f"host:{kind}" if kind is not None else str(device)))
        b.preexisting.append(preexisting)
        b.category.append(_UNKNOWN)
        b.stream.append(0 if preexisting else self.stream)
        if preexisting:
            b.alloc_op.append(-1)
            b.module.append(0)
            b.phase.append(PHASE["other"])
            b.iteration.append(-1)
            b.microbatch.append(-1)
            self._pre.append(idx)
        else:
            phase = self.current_phase()
            b.alloc_op.append(op)
            b.module.append(self._intern(self._modules, self.current_module()))
            b.phase.append(phase)
            b.iteration.append(self.iteration)
            b.microbatch.append(self.microbatch)
            self._ev_kind.append(ALLOC)
            self._ev_buffer.append(idx)
            self._ev_op.append(op)
        self._refs[idx] = weakref.ref(storage, self._make_free_callback(idx))
        return idx

    def _make_free_callback(self, idx: int) -> Any:
        def on_free(_ref: weakref.ref) -> None:
            if self.active:
                self._ev_kind.append(FREE)
                self._ev_buffer.append(idx)
                self._ev_op.append(len(self._op_name) - 1)
            self._refs.pop(idx, None)

        return on_free

    def buffer_of(self, tensor: torch.Tensor, *, op: int = -1) -> int:
        """The buffer id of `tensor`'s storage; unseen storages become pre-existing."""
        storage = tensor.untyped_storage()
        idx = self._ids.get(storage)
        if idx is None:
            idx = self._new_buffer(storage, tensor.device, preexisting=True, op=op)
        return idx

    def mark(self, tensor: torch.Tensor, category: str, module: str | None = None) -> None:
        """Force the category of `tensor`'s storage (parameters, gradients, states, inputs);
        `module` names the owning module of a pre-existing storage (e.g. a parameter's).
        A tensor subclass's inner storages each get the category."""
        for inner in inner_tensors(tensor):
            self._mark_one(inner, category, module)

    def _mark_one(self, tensor: torch.Tensor, category: str, module: str | None) -> None:
        idx = self.buffer_of(tensor)
        if module is not None:
            self._leaf_modules.setdefault(idx, module)
        if module is not None and self._b.preexisting[idx] and self._b.module[idx] == 0:
            self._b.module[idx] = self._intern(self._modules, module)
        current = self._marked.get(idx)
        # a parameter stays a parameter even if an optimizer also lists it
        if current is None or CATEGORY[category] < current:
            self._marked[idx] = CATEGORY[category]

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saved `tensor` for backward (called from a saved_tensors_hooks pack hook)."""
        idx = self._ids.get(tensor.untyped_storage())
        if idx is not None and idx not in self._saved:
            self._saved.add(idx)
            self._saved_order.append(idx)

    def name(self, tensor: torch.Tensor, name: str) -> None:
        """Name `tensor`'s storage as the offload runtime keys it (`grad.<fqn>`,
        `state.<fqn>.<key>`), so that a plan of this trace can be applied to real training.
        A tensor subclass's inner storages are not named (the runtime moves plain tensors)."""
        if not is_traceable_wrapper_subclass(tensor) or hasattr(tensor, "_local_tensor"):
            self._tensor_names.setdefault(self.buffer_of(tensor), name)

    def _on_host_mark(self, storage: Any, kind: str) -> None:
        """A storage was marked as host memory after the recorder first saw it
        (`memplan.models.tracing`): its buffer is on the host for its whole life."""
        idx = self._ids.get(storage)
        if idx is not None:
            self._b.device[idx] = self._intern(self._devices, f"host:{kind}")

    # --- module tracking hooks -----------------------------------------------------------
    def _fwd_pre(self, module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            # traced into a compiled region: its ops run as one region, charged to the
            # module that calls it (which Dynamo does not trace)
            return
        self._fwd_depth += 1
        self._module_stack.append(self.module_names.get(id(module), type(module).__name__))

    def _fwd_post(self, module: torch.nn.Module, _args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._fwd_depth = max(0, self._fwd_depth - 1)
        path = self._module_stack.pop() if self._module_stack else ""
        seqs = [t.grad_fn._sequence_nr() for t in _tensors(out) if t.grad_fn is not None]
        if seqs:
            end = max(seqs)
            if not self._seq_ends or end >= self._seq_ends[-1]:
                self._seq_ends.append(end)
                self._seq_modules.append(path)

    def extra_hooks(self) -> contextlib.AbstractContextManager:
        """Hooks a subclass needs while it records (none here)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def module_hooks(self, roots: list[torch.nn.Module]) -> Iterator[None]:
        """Name modules after their path under `roots`; track forward and recompute."""
        for root in roots:
            for name, mod in root.named_modules():
                self.module_names.setdefault(id(mod), name or type(root).__name__)
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._fwd_pre)
        post = torch.nn.modules.module.register_module_forward_hook(self._fwd_post, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    # --- the dispatch mode -------------------------------------------------------------
    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """With `compiled_regions`, torch.compile compiles with this mode off and runs the
        compiled code with it on (`torch/utils/_python_dispatch.py`), so the recorder sees
        what the compiled code allocates (`memplan.capture.compiled`); without it, Dynamo
        runs compiled functions eagerly while the recorder is active."""
        return self.compiled_regions

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            # finished (`finish`) but still on the mode stack: a recording its owner had to
            # close from inside an op (`memplan.watch`'s out-of-memory path) passes ops through
            return func(*args, **kwargs)
        if func.namespace in ("prim", "profiler") or tracing.in_fused_kernel():
            # metadata queries (prim.device) and profiler ranges (record_function, which
            # Optimizer.step opens before its hooks run) allocate nothing and are not ops;
            # inside a fused kernel the eager ops stand for one compiled kernel that only
            # writes existing storages (memplan.models.tracing.fused_kernel)
            return func(*args, **kwargs)
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a tensor subclass: its inner ops on plain tensors come back here
        schema_name = getattr(getattr(func, "_schema", None), "name", None)  # a higher-order op has none
        if schema_name in COMPOSITE_OPS:
            return self._run_composite(func, args, kwargs)
        op = len(self._op_name)
        signature = matmul_signature(schema_name, args, kwargs)
        if signature is not None:
            self._matmuls.append([op, signature])
        in_tensors = _tensors((args, kwargs))
        inputs = [self.buffer_of(t, op=op) for t in in_tensors]
        phase = self.current_phase()
        if (
            not self.explicit_microbatch
            and phase == PHASE["forward"]
            and self._last_phase in (PHASE["backward"], PHASE["recompute"])
        ):
            # forward again after a backward, without an optimizer step: next micro-batch
            self.microbatch += 1
        self._last_phase = phase
        module = self._intern(self._modules, self.current_module())
        self._op_name.append(self._intern(self._names, str(func)))
        self._op_module.append(module)
        self._op_phase.append(phase)
        self._op_iteration.append(self.iteration)
        self._op_microbatch.append(self.microbatch)
        self._op_first_event.append(len(self._ev_kind))
        self._op_in.extend(inputs)
        self._op_in_ptr.append(len(self._op_in))

        if not self._fake and in_tensors and is_fake(in_tensors[0]):  # a FakeTensor, or a DTensor wrapping one
            self._fake = True
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self._op_wall.append(time.perf_counter() - start)

        outputs = []
        moved = sum(t.nbytes for t in in_tensors)
        for t in _tensors(out):
            storage = t.untyped_storage()
            idx = self._ids.get(storage)
            if idx is None:
                idx = self._new_buffer(storage, t.device, preexisting=False, op=op)
            outputs.append(idx)
            moved += t.nbytes
        self._op_out.extend(outputs)
        self._op_out_ptr.append(len(self._op_out))
        self._op_bytes.append(float(moved))
        flops = float("nan")
        if self.record_flops:
            packet, f_args, f_out = _counted_op(func, args, out)
            counter = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
            if counter is not None:
                try:
                    flops = float(counter(*f_args, **kwargs, out_val=f_out))
                except Exception:  # noqa: BLE001 - FLOPs are best-effort metadata
                    flops = float("nan")
        self._op_flops.append(flops)
        return out

    def _run_composite(self, func: Any, args: Any, kwargs: dict) -> Any:
        """`func`'s composite kernel (`COMPOSITE_OPS`) run with this recorder active, so that
        each op inside is recorded instead of `func` as one op."""
        _push_mode(self)
        try:
            return func.redispatch(_COMPOSITE_KEYS, *args, **kwargs)
        finally:
            _pop_mode()

    def __enter__(self) -> Recorder:
        global _ACTIVE
        self.active = True
        _ACTIVE = self
        self._host_marks = tracing.add_listener(self._on_host_mark)
        self._host_marks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _ACTIVE = None
        self._host_marks.__exit__(*exc)
        super().__exit__(*exc)

    # --- finalisation --------------------------------------------------------------------
    def finish(self, meta: dict[str, Any] | None = None) -> Trace:
        """Stop recording and build the validated Trace."""
        self.active = False
        b = self._b
        n = len(b)
        npre = len(self._pre)
        kinds = np.concatenate(
            [np.full(npre, ALLOC, np.int8), np.asarray(self._ev_kind, np.int8)]
        )
        ev_buffer = np.concatenate(
            [np.asarray(self._pre, np.int64), np.asarray(self._ev_buffer, np.int64)]
        )
        ev_op = np.concatenate([np.full(npre, -1, np.int64), np.asarray(self._ev_op, np.int64)])
        events = np.arange(kinds.shape[0], dtype=np.int64)
        alloc_event = np.full(n, -1, np.int64)
        free_event = np.full(n, -1, np.int64)
        is_alloc = kinds == ALLOC
        alloc_event[ev_buffer[is_alloc]] = events[is_alloc]
        free_event[ev_buffer[~is_alloc]] = events[~is_alloc]

        phase = np.asarray(b.phase, np.int8)
        category = self._categories(phase, alloc_event, free_event, ev_op)
        buffers = {
            "nbytes": np.asarray(b.nbytes, np.int64),
            "alloc_event": alloc_event,
            "free_event": free_event,
            "category": category,
            "device": np.asarray(b.device, np.int16),
            "stream": np.asarray(b.stream, np.int32),
            "alloc_op": np.asarray(b.alloc_op, np.int64),
            "module": np.asarray(b.module, np.int32),
            "phase": phase,
            "iteration": np.asarray(b.iteration, np.int32),
            "microbatch": np.asarray(b.microbatch, np.int32),
        }
        ops = {
            "name": np.asarray(self._op_name, np.int32),
            "module": np.asarray(self._op_module, np.int32),
            "phase": np.asarray(self._op_phase, np.int8),
            "iteration": np.asarray(self._op_iteration, np.int32),
            "microbatch": np.asarray(self._op_microbatch, np.int32),
            "first_event": np.asarray(self._op_first_event, np.int64) + npre,
            "flops": np.asarray(self._op_flops, np.float64),
            "bytes_moved": np.asarray(self._op_bytes, np.float64),
        }
        assert set(buffers) == set(BUFFER_COLUMNS) and set(ops) == set(OP_COLUMNS)
        csr = {
            "op_inputs_ptr": np.asarray(self._op_in_ptr, np.int64),
            "op_inputs": np.asarray(self._op_in, np.int64),
            "op_outputs_ptr": np.asarray(self._op_out_ptr, np.int64),
            "op_outputs": np.asarray(self._op_out, np.int64),
        }
        trace = Trace(
            buffers=buffers,
            events={"kind": kinds, "buffer": ev_buffer, "op": ev_op},
            ops=ops,
            csr=csr,
            op_names=list(self._names),
            modules=list(self._modules),
            devices=list(self._devices) or ["cpu"],
            meta=dict(meta or {}),
        )
        if self._tensor_names:
            trace.meta["tensor_names"] = {str(b): name for b, name in sorted(self._tensor_names.items())}
        if self._saved_order:
            trace.meta["saved_order"] = list(self._saved_order)
        if self._matmuls:
            trace.meta["matmul_args"] = list(self._matmuls)
        if not self._fake and len(self._op_wall) == len(self._op_name):
            # measured op times for `offload.lifetimes.measured_op_durations_s` (real tensors only)
            trace.meta["op_wall_s"] = [float(f"{x:.4g}") for x in self._op_wall]
        return validate(trace)

    def _categories(
        self,
        phase: np.ndarray,
        alloc_event: np.ndarray,
        free_event: np.ndarray,
        ev_op: np.ndarray,
    ) -> np.ndarray:
        """Marked categories first; then activations (saved for backward, or made in
        forward/recompute and still live when the phase changes); the rest temporary."""
        n = phase.shape[0]
        category = np.full(n, CATEGORY["temporary"], np.int8)
        pre = np.asarray(self._b.preexisting, bool)
        category[pre] = CATEGORY["other"]
        op_phase = np.asarray(self._op_phase, np.int8)
        free_phase = np.full(n, -1, np.int16)
        freed = free_event >= 0
        free_ops = ev_op[free_event[freed]]
        free_phase[freed] = np.where(free_ops >= 0, op_phase[np.maximum(free_ops, 0)], -1)
        made_forward = (phase == PHASE["forward"]) | (phase == PHASE["recompute"])
        outlives_phase = (~freed) | (free_phase != phase)
        category[~pre & made_forward & outlives_phase] = CATEGORY["activation"]
        if self._saved:
            saved = np.fromiter(self._saved, np.int64)
            category[saved[~pre[saved]]] = CATEGORY["activation"]
        for idx, cat in self._marked.items():
            category[idx] = cat
        return category
