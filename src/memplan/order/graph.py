"""The whole training step as one fx graph, and the facts about it that ordering needs.

ROAM (Shu et al., arXiv 2310.19295; public code HuiyaoShu/ROAM) reorders the whole
training step (forward, loss, backward and optimizer) as one graph. This module makes
that graph with `make_fx` and derives from it what a scheduler needs:

- the operators (`call_function` nodes), in program order;
- storages: every distinct block of memory, with its size in bytes. Views and in-place
  operators alias their input's storage (read off the operator schema's alias
  annotations, `Tensor(a)` and `Tensor(a!)`); parameters, buffers and optimizer states
  (graph constants) and the step's inputs are persistent, alive the whole step;
- dependencies: data edges, plus the memory hazards that in-place updates create
  (read-after-write, write-after-read, write-after-write on one storage, in program
  order), plus the program order of random operators (so dropout draws the same
  numbers in any order);
- phases: forward up to the loss, backward, optimizer (from the first write to a
  persistent storage), which the Inductor-style baselines keep apart. Phase codes are
  the trace's (`memplan.trace.model.PHASE`), so a code means the same in both.

Capture: the graph is not functionalised: in-place optimizer updates stay in-place, so
the graph executes as a GraphModule with the memory behaviour of eager PyTorch, and
the hazards above keep every reorder equivalent. Tracing runs on fake tensors, in one
of two ways:

- `capture_step_graph(step_fn, *inputs)` with real model and optimizer in the closure:
  tracing runs under a `FakeTensorMode` that lifts the real parameters and optimizer
  states as graph constants (the very tensor objects, so running the GraphModule
  updates them in place) and leaves them untouched while tracing;
- `capture_model_step(spec, setup)`: the model, optimizer and batch are all built in
  one `FakeTensorMode` (an optimizer built over real parameters and traced with fake
  inputs drops its update from the graph: docs/sources.md §5), for any model size.

Assumptions: the step's optimizer state exists before tracing (one warm-up step),
otherwise its lazy creation is traced as part of every step; the step reads no tensor
value on the host (`.item()`, `if tensor:`) except where that only sets a scalar
constant (Adam's step counter on CPU), which the trace then fixes (see `scalar_reads`).
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from memplan import models
from memplan.capture.compiled import refuse_compiled_step
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.step import build_training_step
from memplan.errors import UserError
from memplan.trace.model import PHASE

PERSISTENT, INPUT, INTERMEDIATE = 0, 1, 2


@dataclass
class StepGraph:
    """A traced training step and the scheduling facts about its operators.

    Operators are numbered by program order (`ops[i]`). `preds[i]` are the operators
    that must run before `i`; `creates[i]` the storages `i` allocates; `uses[i]` every
    storage `i` reads, writes or returns a view of (a storage dies after its last use).
    Storage `s` has `storage_nbytes[s]` and `storage_kind[s]` (PERSISTENT, INPUT,
    INTERMEDIATE); `live_out` are storages the graph returns (alive to the end).
    `phase[i]` is the code of `i`'s phase in `memplan.trace.model.PHASE` (forward,
    backward or optimizer).
    """

    gm: fx.GraphModule
    ops: list[fx.Node]
    preds: list[list[int]]
    creates: list[list[int]]
    uses: list[list[int]]
    storage_nbytes: list[int]
    storage_kind: list[int]
    live_out: set[int]
    phase: list[int]
    scalar_reads: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def persistent_bytes(self) -> int:
        """Parameters, buffers, optimizer states and inputs: alive the whole step."""
        return sum(n for n, k in zip(self.storage_nbytes, self.storage_kind) if k != INTERMEDIATE)

    def succs(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.ops]
        for v, ps in enumerate(self.preds):
            for u in ps:
                out[u].append(v)
        return out


def _storage_nbytes(value: torch.Tensor) -> int:
    try:
        return int(value.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested): their own bytes
        return int(value.numel() * value.element_size())


def _tensor_args(node: fx.Node) -> list[tuple[fx.Node, int | None]]:
    """(arg node, index of the schema argument or None) for every node argument."""
    out: list[tuple[fx.Node, int | None]] = []
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
        for j, arg in enumerate(node.args):
            for leaf in _flatten_nodes(arg):
                out.append((leaf, j))
        for key, arg in node.kwargs.items():
            j = names.index(key) if key in names else None
            for leaf in _flatten_nodes(arg):
                out.append((leaf, j))
        return out
    for leaf in _flatten_nodes((node.args, node.kwargs)):
        out.append((leaf, None))
    return out


def _flatten_nodes(value: Any) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _flatten_nodes(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _flatten_nodes(v)]
    return []


def _flatten_storages(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _flatten_storages(v)]
    return []


def _is_random(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


@dataclass
class _Storages:
    """The storages of a graph, numbered in the order they are first seen."""

    nbytes: list[int] = field(default_factory=list)
    kind: list[int] = field(default_factory=list)

    def new(self, nbytes: int, kind: int) -> int:
        self.nbytes.append(nbytes)
        self.kind.append(kind)
        return len(self.nbytes) - 1


@dataclass
class _OpStorages:
    """Per operator (program order): the storages it creates, touches and writes."""

    ops: list[fx.Node] = field(default_factory=list)
    creates: list[list[int]] = field(default_factory=list)
    uses: list[list[int]] = field(default_factory=list)
    writes: list[list[int]] = field(default_factory=list)
    live_out: set[int] = field(default_factory=set)
    scalar_reads: int = 0


def step_graph(gm: fx.GraphModule, meta: dict[str, Any] | None = None) -> StepGraph:
    """The `StepGraph` of a traced step: its scheduling facts (see the module docstring)."""
    storages = _Storages()
    facts = _op_storages(gm, storages)
    preds = _dependencies(facts.ops, facts.uses, facts.writes)
    phase = _phases(facts.ops, preds, facts.writes, storages.kind)
    return StepGraph(
        gm=gm,
        ops=facts.ops,
        preds=[sorted(p) for p in preds],
        creates=facts.creates,
        uses=facts.uses,
        storage_nbytes=storages.nbytes,
        storage_kind=storages.kind,
        live_out=facts.live_out,
        phase=phase,
        scalar_reads=facts.scalar_reads,
        meta=dict(meta or {}),
    )


def _op_storages(gm: fx.GraphModule, storages: _Storages) -> _OpStorages:
    """Walk `gm`'s nodes in program order, numbering storages in `storages`: inputs and
    graph constants (one storage per distinct constant storage) are persistent, every
    fresh operator output is intermediate, aliases share their argument's storage."""
    const_storage: dict[Any, int] = {}
    node_storage: dict[fx.Node, Any] = {}
    facts = _OpStorages()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                node_storage[node] = storages.new(_storage_nbytes(val), INPUT)
            continue
        if node.op == "get_attr":
            obj = getattr(gm, node.target)
            if isinstance(obj, torch.Tensor):
                key = StorageWeakRef(obj.untyped_storage())
                if key not in const_storage:
                    const_storage[key] = storages.new(_storage_nbytes(obj), PERSISTENT)
                node_storage[node] = const_storage[key]
            continue
        if node.op == "output":
            for leaf in _flatten_nodes(node.args):
                facts.live_out.update(_flatten_storages(node_storage.get(leaf)))
            continue
        if node.op != "call_function":
            raise UserError(f"cannot schedule fx node {node.name} of kind {node.op}")

        facts.ops.append(node)
        arg_storage = [(leaf, j, node_storage.get(leaf)) for leaf, j in _tensor_args(node)]
        made: list[int] = []
        written: list[int] = []
        if node.target is operator.getitem:
            source = node_storage.get(node.args[0])
            item = source[node.args[1]] if isinstance(source, (list, tuple)) else source
            node_storage[node] = item
        elif node.target is torch.ops.aten._local_scalar_dense.default:
            facts.scalar_reads += 1
        else:
            _call_storages(node, arg_storage, node_storage, storages, made, written)
        touched = set()
        for _leaf, _j, st in arg_storage:
            touched.update(_flatten_storages(st))
        touched.update(_flatten_storages(node_storage.get(node)))
        facts.creates.append(made)
        facts.uses.append(sorted(touched))
        facts.writes.append(sorted(set(written)))
    return facts


def _call_storages(
    node: fx.Node,
    arg_storage: list[tuple[fx.Node, int | None, Any]],
    node_storage: dict[fx.Node, Any],
    storages: _Storages,
    made: list[int],
    written: list[int],
) -> None:
    """Set `node_storage[node]` for an operator call from its schema's alias sets: a
    return in an argument's alias set (`Tensor(a)`) shares that argument's storage, any
    other tensor gets a new storage (appended to `made`); arguments in a written alias
    set (`Tensor(a!)`) go to `written`."""
    schema = getattr(node.target, "_schema", None)
    alias_of: dict[str, Any] = {}
    if schema is not None:
        for j, sarg in enumerate(schema.arguments):
            info = sarg.alias_info
            if info is None:
                continue
            for _leaf, jj, st in arg_storage:
                if jj == j and st is not None:
                    for name in info.before_set:
                        alias_of.setdefault(name, st)
                    if info.is_write:
                        written.extend(_flatten_storages(st))
    returns = list(schema.returns) if schema is not None else []
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and len(returns) == 1):
        node_storage[node] = _return_storage(val, 0, returns, alias_of, storages, made)
    elif isinstance(val, (list, tuple)):
        node_storage[node] = [_return_storage(v, k, returns, alias_of, storages, made) for k, v in enumerate(val)]


def _return_storage(
    value: Any, ret_index: int, returns: list, alias_of: dict[str, Any], storages: _Storages, made: list[int]
) -> Any:
    """Storage (or nested list of storages) of the value of return `ret_index`."""
    info = returns[ret_index].alias_info if ret_index < len(returns) else None
    if info is not None:
        for name in info.before_set:
            if name in alias_of:
                return alias_of[name]
    if isinstance(value, torch.Tensor):
        s = storages.new(_storage_nbytes(value), INTERMEDIATE)
        made.append(s)
        return s
    if isinstance(value, (list, tuple)):
        return [_return_storage(v, ret_index, returns, alias_of, storages, made) for v in value]
    return None


def _dependencies(ops: list[fx.Node], uses: list[list[int]], writes: list[list[int]]) -> list[set[int]]:
    """Predecessors of each operator: data edges; the read-after-write, write-after-read
    and write-after-write hazards on each storage, in program order; and the program
    order of random operators."""
    index_of = {node: i for i, node in enumerate(ops)}
    preds: list[set[int]] = [set() for _ in ops]
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    last_random = -1
    for i, node in enumerate(ops):
        for leaf in _flatten_nodes((node.args, node.kwargs)):
            if leaf in index_of:
                preds[i].add(index_of[leaf])
        wrote = set(writes[i])
        for s in uses[i]:
            if s in last_writer:
                preds[i].add(last_writer[s])
            if s in wrote:
                preds[i].update(readers.get(s, ()))
                readers[s] = []
                last_writer[s] = i
            else:
                readers.setdefault(s, []).append(i)
        if _is_random(node.target):
            if last_random >= 0:
                preds[i].add(last_random)
            last_random = i
        preds[i].discard(i)
    return preds


def _phases(ops: list[fx.Node], preds: list[set[int]], writes: list[list[int]], kind: list[int]) -> list[int]:
    """Forward up to the loss, backward from the gradient seed, optimizer from the first
    write to a persistent storage (program order); codes of `memplan.trace.model.PHASE`."""
    seed = next(
        (i for i, n in enumerate(ops)
         if n.target is torch.ops.aten.ones_like.default
         and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 0),
        None,
    )
    first_update = next(
        (i for i, w in enumerate(writes) if any(kind[s] == PERSISTENT for s in w) and (seed is None or i > seed)),
        None,
    )
    phase = []
    for i in range(len(ops)):
        if first_update is not None and i >= first_update:
            phase.append(PHASE["optimizer"])
        elif seed is not None and i >= seed:
            phase.append(PHASE["backward"])
        else:
            phase.append(PHASE["forward"])
    return phase


def split_foreach(gm: fx.GraphModule) -> int:
    """Replace each `aten._foreach_*` operator by one per-tensor operator per list element.

    A foreach optimizer (PyTorch's default on CUDA) updates every parameter in one call,
    so no update can start before the last gradient is final; ROAM moves updates early,
    which needs them per parameter. The per-tensor operators do the same arithmetic
    element by element (on CPU the foreach kernels are exactly this loop), and the
    list outputs' `getitem` users are rewired to the new nodes. An operator whose
    per-tensor form cannot be found (checked by running it on the fake values) is kept.
    Returns the number of foreach operators split.
    """
    split = 0
    for node in list(gm.graph.nodes):
        target = node.target
        packet = getattr(target, "_overloadpacket", None)
        name = getattr(packet, "__name__", "")
        if node.op != "call_function" or not name.startswith("_foreach_"):
            continue
        lists = [a for a in node.args if isinstance(a, (list, tuple))]
        if not lists:
            continue
        count = len(lists[0])
        if any(len(a) != count for a in lists):
            continue
        per_tensor = getattr(torch.ops.aten, name[len("_foreach_"):], None)
        if per_tensor is None:
            continue
        overloads = [target._overloadname, "Tensor", "Scalar", "default"]
        if target._overloadname == "List":
            overloads = ["Tensor", "default"]
        elif target._overloadname == "ScalarList":
            overloads = ["Scalar", "default"]
        first = tuple(a[0] if isinstance(a, (list, tuple)) else a for a in node.args)
        chosen = _pick_overload(per_tensor, overloads, first, node.kwargs)
        if chosen is None:
            continue
        new_nodes = []
        with gm.graph.inserting_before(node):
            for k in range(count):
                args_k = tuple(a[k] if isinstance(a, (list, tuple)) else a for a in node.args)
                args_k, kwargs_k = _bind(chosen, args_k, node.kwargs)
                new = gm.graph.call_function(chosen, args_k, kwargs_k)
                new.meta["val"] = _fake_run(chosen, args_k, kwargs_k)
                new_nodes.append(new)
        for user in list(node.users):
            if user.target is operator.getitem and isinstance(user.args[1], int):
                user.replace_all_uses_with(new_nodes[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            raise RuntimeError(f"split_foreach: {node.name} has list users")
        gm.graph.erase_node(node)
        split += 1
    if split:
        gm.graph.lint()
        gm.recompile()
    return split


def _meta_value(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_meta_value(a) for a in arg)
    return arg


def _fake_run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `op` on the fake values of its argument nodes (clones: in-place ops must not
    change the traced values)."""
    values = [_meta_value(a) for a in args]
    kw = {k: _meta_value(v) for k, v in kwargs.items()}
    try:
        return op(*_clones(values), **_clones(kw))
    except Exception:  # noqa: BLE001 - fake values from different modes: run on meta instead
        return op(*_on_meta(values), **_on_meta(kw))


def _clones(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clones(v) for v in value)
    if isinstance(value, dict):
        return {k: _clones(v) for k, v in value.items()}
    return value


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _bind(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Move positional arguments beyond the schema's positional ones to its keyword-only
    arguments (`_foreach_addcdiv_(self, t1, t2, scalars)` -> `addcdiv_(..., value=s)`)."""
    arguments = op._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    keyword = [a for a in arguments if a.kwarg_only]
    if len(args) <= len(positional):
        return args, dict(kwargs)
    extra = args[len(positional):]
    if len(extra) > len(keyword):
        return args, dict(kwargs)
    out = dict(kwargs)
    for sarg, value in zip(keyword, extra):
        out[sarg.name] = value
    return args[:len(positional)], out


def _pick_overload(packet: Any, names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for name in names:
        op = getattr(packet, name, None)
        if op is None:
            continue
        try:
            _fake_run(op, *_bind(op, args, kwargs))
        except Exception:  # noqa: BLE001 - a schema that does not bind these arguments
            continue
        return op
    return None


def _trace(step_fn: Callable[..., Any], inputs: tuple[Any, ...]) -> fx.GraphModule:
    try:
        return make_fx(step_fn)(*inputs)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise UserError(
            "the step cannot be traced as one graph: it depends on tensor values "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); remove data-dependent "
            "control flow (if/while on a tensor, .item(), .tolist(), nonzero) from the step"
        ) from exc
    except RuntimeError as exc:
        text = str(exc)
        if "data-dependent" in text or "data dependent" in text or "DataDependent" in text:
            raise UserError(
                "the step cannot be traced as one graph: it branches on tensor values; remove "
                "data-dependent control flow (if/while on a tensor, .item()) from the step"
            ) from exc
        raise


def reachable_tensors(step_fn: Callable[..., Any], depth: int = 4) -> list[torch.Tensor]:
    """Real tensors a step function can reach: through its closure, bound object and the
    globals it names, into modules (parameters, buffers), optimizers (state) and
    containers, `depth` levels of functions deep. Each tensor once."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or level < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                found.setdefault(id(t), t)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    found.setdefault(id(p), p)
            for state in obj.state.values():
                for value in state.values():
                    visit(value, level)
        elif isinstance(obj, (list, tuple, set)):
            for item in obj:
                visit(item, level)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, level)
        elif callable(obj) and hasattr(obj, "__code__"):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, level - 1)
                except ValueError:  # an empty cell
                    pass
            names = obj.__code__.co_names
            module_globals = getattr(obj, "__globals__", {})
            for name in names:
                if name in module_globals:
                    value = module_globals[name]
                    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, list, dict, tuple)) or (
                        callable(value) and getattr(value, "__module__", None) == obj.__module__
                    ):
                        visit(value, level - 1)
            if hasattr(obj, "__self__"):
                visit(obj.__self__, level - 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and level > 0:
            for value in vars(obj).values():
                visit(value, level - 1)

    visit(step_fn, depth)
    return [t for t in found.values() if not isinstance(t, FakeTensor)]


def capture_step_graph(step_fn: Callable[..., Any], *example_inputs: Any) -> StepGraph:
    """Trace `step_fn(*example_inputs)` (real tensors in its closure) as one graph.

    Runs on fake tensors: nothing of the real model or optimizer changes. The graph's
    constants are the real parameters and states, so `gm(*inputs)` runs a real step.
    """
    # FakeTensorMode runs an operator for real when none of its inputs is fake (an
    # optimizer's `buf.mul_(momentum)` on real state), so the real state the step can
    # reach is saved first and put back after tracing.
    saved = [(t, t.detach().clone()) for t in reachable_tensors(step_fn)]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            fake_inputs = tuple(
                mode.from_tensor(x) if isinstance(x, torch.Tensor) else
                ({k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
                 if isinstance(x, dict) else x)
                for x in example_inputs
            )
            gm = _trace(step_fn, fake_inputs)
            split = split_foreach(gm)
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)
    graph = step_graph(gm, {"foreach_split": split})
    if graph.scalar_reads:
        raise UserError(
            f"the step reads {graph.scalar_reads} tensor value(s) on the host (.item(), bool(tensor): "
            "data-dependent control flow, or an optimizer such as Adam/AdamW on CPU reading its step "
            "counter), so one traced graph cannot replay later steps; use an optimizer without host "
            "reads (SGD), or capturable=True on a GPU"
        )
    return graph


def capture_model_step(spec: Any, setup: Any = None, *, device: str = "cpu") -> StepGraph:
    """Build `spec` under `setup` on fake tensors and trace its whole training step.

    Model, optimizer and batch are built inside one `FakeTensorMode`; one warm-up step
    creates the optimizer state; the traced step is then forward, loss, backward,
    `optimizer.step()` and `zero_grad(set_to_none=True)`. `device="cuda"` takes CUDA's
    defaults (foreach optimizer) on fake cpu tensors.
    """
    setup = setup if setup is not None else models.TrainingSetup()
    if setup.grad_accum != 1:
        raise UserError("reorder traces one micro-batch per step: use `grad_accum=1`")
    if setup.zero_grad != "none":
        raise UserError("reorder traces steps whose zero_grad frees the gradients: drop `zero_grad=zeros`")
    if setup.loss != "full" or setup.activation_offload != "none":
        raise UserError("reorder traces the model's own loss without activation offloading: drop `loss` and "
                        "`activation_offload`")
    refuse_compiled_step(setup, "in the eager step graph that reorder orders (a compiled step's order is Inductor's)")
    start = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        step = build_training_step(spec, setup, device="cpu", target_device=device)
        step.run()  # warm-up: the optimizer state exists before tracing
        model, optimizer = step.model, step.optimizer

        def train_step(batch: dict[str, torch.Tensor]) -> None:
            with models.autocast(setup, "cpu"):
                loss = models.forward_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # a CUDA job's attention runs CUDA's fused kernels, its autocast CUDA's op lists
        # (see memplan.capture.cuda_kernels)
        kernels = kernels_as_on_cuda() if step.meta.get("attention_kernels") == "cuda" else contextlib.nullcontext()
        with kernels:
            gm = _trace(train_step, (step.batches[0],))
        split = split_foreach(gm)
    meta = {**step.meta, "trace_s": round(time.perf_counter() - start, 3), "foreach_split": split}
    return step_graph(gm, meta)
