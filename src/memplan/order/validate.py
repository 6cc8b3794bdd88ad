"""Independent check of an operator order for a traced step (shares no code with the solver).

Given the GraphModule and an order (operator node names), `validate_order`:

1. checks the order is a permutation of the graph's `call_function` nodes;
2. checks every operator runs after the operators whose values it takes;
3. groups values into memory blocks on its own (union-find over the operator schema's
   alias sets: a view or an in-place result joins its argument; graph constants that
   share a storage join), and checks that every write to a block keeps its place
   relative to every other access of that block, as in the traced program;
4. checks random operators keep their traced relative order (same random numbers);
5. recomputes the theoretical peak by its own walk (a block is allocated by the first
   operator whose fresh output it is, freed after the last operator that touches it;
   persistent blocks and inputs count throughout) and returns it.

The orders it checks are memplan's own (see docs/reorder.md §4, step 6), so a violation
is memplan's mistake: it raises `OrderBug` (a `memplan.errors.MemplanBug`) at the first.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.errors import MemplanBug


class OrderBug(MemplanBug):
    """An order memplan made breaks a dependency of the traced step."""


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[fx.Node] = []
        for v in value:
            out.extend(_nodes_in(v))
        return out
    if isinstance(value, dict):
        return _nodes_in(list(value.values()))
    return []


class _Blocks:
    """Union-find over (node, output index) keys."""

    def __init__(self) -> None:
        self.parent: dict[object, object] = {}

    def find(self, key: object) -> object:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: object, b: object) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


@dataclass
class _Memory:
    """The graph's memory blocks: the union-find, the persistent values (inputs and one
    key per constant storage) and the fresh operator outputs, each with its bytes, and
    the operator that creates each fresh output."""

    blocks: _Blocks = field(default_factory=_Blocks)
    persistent: dict[object, int] = field(default_factory=dict)
    fresh: dict[object, int] = field(default_factory=dict)
    creator: dict[object, fx.Node] = field(default_factory=dict)


def _out_nbytes(value: object) -> list[int]:
    if isinstance(value, torch.Tensor):
        try:
            return [int(value.untyped_storage().nbytes())]
        except Exception:  # noqa: BLE001
            return [int(value.numel() * value.element_size())]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _out_nbytes(v)]
    return []


def validate_order(gm: fx.GraphModule, order_names: Sequence[str]) -> int:
    """Check `order_names` for `gm` (see the module docstring); return its peak in bytes."""
    program = [n for n in gm.graph.nodes if n.op == "call_function"]
    new_pos = _check_data_order(program, order_names)
    memory = _memory_blocks(gm)
    accesses = _block_accesses(program, memory.blocks)
    _check_block_hazards(accesses, new_pos)
    _check_random_order(program, new_pos)
    return _peak_of_new_order(gm, len(order_names), memory, accesses, new_pos)


def _check_data_order(program: list[fx.Node], order_names: Sequence[str]) -> dict[fx.Node, int]:
    """Each operator's position in the new order, after checking the order is a
    permutation of `program` that runs every operator after its inputs."""
    by_name = {n.name: n for n in program}
    if len(order_names) != len(program) or set(order_names) != set(by_name):
        raise OrderBug(f"the order has {len(order_names)} operators, the graph {len(program)}, or names differ")
    new_pos = {by_name[name]: p for p, name in enumerate(order_names)}
    for node in program:
        for arg in _nodes_in((node.args, node.kwargs)):
            if arg in new_pos and new_pos[arg] >= new_pos[node]:
                raise OrderBug(f"{node.name} runs before its input {arg.name}")
    return new_pos


def _memory_blocks(gm: fx.GraphModule) -> _Memory:
    """Group `gm`'s values into memory blocks (see the module docstring, item 3)."""
    memory = _Memory()
    const_key: dict[object, object] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                memory.persistent[(node, 0)] = _out_nbytes(val)[0]
        elif node.op == "get_attr":
            obj = getattr(gm, node.target)
            if isinstance(obj, torch.Tensor):
                ref = StorageWeakRef(obj.untyped_storage())
                if ref in const_key:
                    memory.blocks.union((node, 0), const_key[ref])
                else:
                    const_key[ref] = (node, 0)
                    memory.persistent[(node, 0)] = _out_nbytes(obj)[0]
        elif node.op == "call_function":
            if node.target is operator.getitem:
                memory.blocks.union((node, 0), (node.args[0], node.args[1]))
                continue
            _join_call_outputs(node, memory)
    return memory


def _join_call_outputs(node: fx.Node, memory: _Memory) -> None:
    """Join each output of an operator call to the arguments in its return's alias set,
    or record it as a fresh block."""
    schema = getattr(node.target, "_schema", None)
    val = node.meta.get("val")
    outputs = list(val) if isinstance(val, (list, tuple)) else [val]
    sets_to_arg: dict[str, list[object]] = {}
    if schema is not None:
        values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
        for sarg, value in zip(schema.arguments, values):
            if sarg.alias_info is not None:
                for name in sarg.alias_info.before_set:
                    sets_to_arg.setdefault(name, []).extend((a, 0) for a in _nodes_in(value))
    returns = list(schema.returns) if schema is not None else []
    single_list = len(returns) == 1 and isinstance(val, (list, tuple))
    for k, out in enumerate(outputs):
        ret = returns[0] if single_list else (returns[k] if k < len(returns) else None)
        aliased = []
        if ret is not None and ret.alias_info is not None:
            for name in ret.alias_info.before_set:
                aliased.extend(sets_to_arg.get(name, []))
        if aliased:
            for a in aliased:
                memory.blocks.union((node, k), a)
        elif isinstance(out, torch.Tensor):
            memory.fresh[(node, k)] = _out_nbytes(out)[0]
            memory.creator[(node, k)] = node


def _block_accesses(program: list[fx.Node], blocks: _Blocks) -> dict[object, list[tuple[fx.Node, bool]]]:
    """Accesses of each block (by its root), in program order: (operator, writes?)."""
    accesses: dict[object, list[tuple[fx.Node, bool]]] = {}
    for node in program:
        schema = getattr(node.target, "_schema", None)
        written: set[fx.Node] = set()
        if schema is not None:
            values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
            for sarg, value in zip(schema.arguments, values):
                if sarg.alias_info is not None and sarg.alias_info.is_write:
                    written.update(_nodes_in(value))
        touched: dict[object, bool] = {}
        for arg in _nodes_in((node.args, node.kwargs)):
            if arg.op in ("placeholder", "get_attr", "call_function"):
                root = blocks.find((arg, 0)) if node.target is not operator.getitem else blocks.find((arg, node.args[1]))
                touched[root] = touched.get(root, False) or arg in written
        val = node.meta.get("val")
        count = len(val) if isinstance(val, (list, tuple)) else 1
        for k in range(count):
            root = blocks.find((node, k))
            touched.setdefault(root, False)
        for root, is_write in touched.items():
            accesses.setdefault(root, []).append((node, is_write))
    return accesses


def _check_block_hazards(accesses: dict[object, list[tuple[fx.Node, bool]]], new_pos: dict[fx.Node, int]) -> None:
    """Every write to a block keeps its place relative to the block's other accesses."""
    for seq in accesses.values():
        last_write_pos = -1
        prev_reads_max = -1
        for node, is_write in seq:
            p = new_pos[node]
            if is_write:
                if p < last_write_pos or p < prev_reads_max:
                    raise OrderBug(f"{node.name} writes a block before an access that the program made first")
                last_write_pos = p
                prev_reads_max = p
            else:
                if p < last_write_pos:
                    raise OrderBug(f"{node.name} reads a block before the write the program made first")
                prev_reads_max = max(prev_reads_max, p)


def _check_random_order(program: list[fx.Node], new_pos: dict[fx.Node, int]) -> None:
    """Random operators keep their program order (they draw the same numbers)."""
    random = [n for n in program if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    for a, b in zip(random, random[1:]):
        if new_pos[a] > new_pos[b]:
            raise OrderBug(f"random operators {a.name} and {b.name} swapped: different random numbers")


def _peak_of_new_order(
    gm: fx.GraphModule,
    num_ops: int,
    memory: _Memory,
    accesses: dict[object, list[tuple[fx.Node, bool]]],
    new_pos: dict[fx.Node, int],
) -> int:
    """The theoretical peak of the new order, by its own walk (module docstring, item 5)."""
    blocks = memory.blocks
    block_bytes: dict[object, int] = {}
    for key, nbytes in memory.fresh.items():
        block_bytes[blocks.find(key)] = nbytes
    persistent_roots = {blocks.find(k) for k in memory.persistent}
    outputs = {blocks.find((n, 0)) for n in _nodes_in(next(n for n in gm.graph.nodes if n.op == "output").args)}
    last_touch: dict[object, int] = {}
    first_touch: dict[object, int] = {}
    for root, seq in accesses.items():
        positions = [new_pos[node] for node, _ in seq]
        last_touch[root] = max(positions)
    for key, node in memory.creator.items():
        first_touch[blocks.find(key)] = new_pos[node]
    allocs: dict[int, int] = {}
    frees: dict[int, int] = {}
    for root, nbytes in block_bytes.items():
        if root in persistent_roots:
            continue
        allocs[first_touch[root]] = allocs.get(first_touch[root], 0) + nbytes
        if root not in outputs:
            end = last_touch.get(root, first_touch[root])
            frees[end] = frees.get(end, 0) + nbytes
    live = sum(memory.persistent.values())
    peak = live
    for p in range(num_ops):
        live += allocs.get(p, 0)
        peak = max(peak, live)
        live -= frees.get(p, 0)
    return peak
