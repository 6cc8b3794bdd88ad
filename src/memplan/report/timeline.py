"""The data behind the report's interactive memory timeline (drawn by `timeline.js`).

In the spirit of PyTorch's memory_viz (pytorch.org/memory_viz, `torch/cuda/_memory_viz.py`
and its `MemoryViz.js`): every tensor is a block stacked over the step, the blocks above
a freed one move down. memplan adds what it knows about each block (category, module
path, the op that made it, size, lifetime by phase), the caching allocator's segments
beside the plan's arena on the same time axis, and the total of other steps of the same
job (measured and estimated) overlaid.

**Compact by construction.** A trace of 100k buffers must not become a 100 MB page:
- the `MAX_BLOCKS` largest buffers of the device are drawn one by one (memory_viz keeps
  its `max_entries` largest the same way and summarises the rest);
- every other buffer is summed, per category, into "small tensors" bands, sampled at
  most `MAX_SAMPLES` times: each sample is the event of the largest total live memory
  in its slice of the step, so the peak is kept exactly;
- other steps' totals are sampled the same way.
The data is columnar JSON (one list per field, strings interned once): it grows with
`MAX_BLOCKS` and `MAX_SAMPLES`, not with the trace.
"""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memplan.alloc.caching import CachingAllocator
from memplan.alloc.conf import AllocConf
from memplan.alloc.simulate import record_replay
from memplan.layout.plan import AddressPlan, requests_by_group
from memplan.report.colors import category_colors, phase_colors
from memplan.trace.edit import device_view
from memplan.trace.model import CATEGORIES, PHASES, Trace
from memplan.units import format_bytes

MAX_BLOCKS = 3000  # buffers drawn one by one, the largest first
MAX_SAMPLES = 2000  # points of each sampled series (small tensors, other steps' totals)


class _Strings:
    """Interned strings: each distinct string is stored once, blocks refer to its index."""

    def __init__(self) -> None:
        self.table: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self._index:
            self._index[text] = len(self.table)
            self.table.append(text)
        return self._index[text]


def drawn_buffers(trace: Trace, max_blocks: int = MAX_BLOCKS) -> np.ndarray:
    """Ids of the buffers drawn one by one, in allocation order: the largest
    `max_blocks` of those with bytes (ties: the earlier allocated)."""
    nbytes = trace.buffers["nbytes"]
    ids = np.flatnonzero(nbytes > 0)
    if ids.shape[0] > max_blocks:
        order = np.lexsort((trace.buffers["alloc_event"][ids], -nbytes[ids]))
        ids = ids[order[:max_blocks]]
    return ids[np.argsort(trace.buffers["alloc_event"][ids], kind="stable")]


def tensor_name(trace: Trace, buffer: int) -> str:
    """What the tooltip calls a buffer: the capture's name for it (`grad.<fqn>`,
    `state.<fqn>.<key>`), else its category and module, else its category and id."""
    named = trace.meta.get("tensor_names", {}).get(str(buffer))
    if named:
        return str(named)
    category = CATEGORIES[int(trace.buffers["category"][buffer])]
    module = trace.module_of_buffer(buffer)
    return f"{category} of {module}" if module else f"{category} #{buffer}"


def sample_events(total: np.ndarray, max_samples: int = MAX_SAMPLES) -> np.ndarray:
    """At most `max_samples` event indices: in each equal slice of the axis, the event
    where `total` is largest (so the overall peak is always among them)."""
    n = total.shape[0]
    if n <= max_samples:
        return np.arange(n)
    edges = np.linspace(0, n, max_samples + 1).astype(np.int64)
    starts = edges[:-1]
    return starts + np.array([int(np.argmax(total[a:b])) for a, b in zip(starts, edges[1:], strict=True)])


def step_label(trace: Trace, name: str) -> str:
    """'estimated' for a fake-tensor capture, 'measured' for a real step or a snapshot."""
    kind = "estimated" if trace.meta.get("fake") else "measured"
    return f"{kind}: {name}"


def total_series(trace: Trace, axis_events: int) -> dict[str, Any]:
    """A step's device live bytes, sampled, with its event axis scaled onto `axis_events`."""
    view = device_view(trace)
    total = view.live_bytes()
    t = sample_events(total)
    scale = axis_events / max(1, view.num_events)
    return {"t": np.round(t * scale, 1).tolist(), "bytes": total[t].tolist(), "peak": int(total.max(initial=0))}


def timeline_data(
    trace: Trace,
    name: str,
    plan: AddressPlan | None = None,
    others: Sequence[tuple[str, Trace]] = (),
    max_blocks: int = MAX_BLOCKS,
) -> dict[str, Any]:
    """Everything `timeline.js` draws for one trace (see the module doc)."""
    view = device_view(trace)
    n = view.num_events
    ids = drawn_buffers(view, max_blocks)
    strings = _Strings()
    blocks = _blocks(view, ids, strings)
    blocks["addr"], segments = _caching_layout(view, ids)
    data: dict[str, Any] = {
        "label": step_label(trace, name),
        "events": n,
        "categories": list(CATEGORIES),
        "category_colors": category_colors(),
        "phase_colors": phase_colors(),
        "phases": _phase_runs(view),
        "phase_names": list(PHASES),
        "blocks": blocks,
        "small": _small_series(view, ids),
        "segments": segments,
        "overlays": [total_series(other, n) | {"label": step_label(other, other_name)} for other_name, other in others],
        "strings": strings.table,
        "buffers": int(np.count_nonzero(view.buffers["nbytes"] > 0)),
        "peak": int(view.live_bytes().max(initial=0)),
    }
    if plan is not None:
        blocks["plan"], data["arena_bytes"], data["unplanned"] = _planned_offsets(view, ids, plan)
    return data


def _blocks(view: Trace, ids: np.ndarray, strings: _Strings) -> dict[str, list]:
    nbytes = view.buffers["nbytes"][ids]
    ops = view.buffers["alloc_op"][ids]
    return {
        "id": ids.tolist(),
        "alloc": view.buffers["alloc_event"][ids].tolist(),
        "free": view.free_event_or_end()[ids].tolist(),
        "nbytes": nbytes.tolist(),
        "size": [format_bytes(int(b)) for b in nbytes],
        "category": view.buffers["category"][ids].tolist(),
        "name": [strings(tensor_name(view, int(b))) for b in ids],
        "module": [strings(view.module_of_buffer(int(b))) for b in ids],
        "op": [strings(view.op_name(int(op)) if op >= 0 else "") for op in ops],
        "phase": view.buffers["phase"][ids].tolist(),
    }


def _small_series(view: Trace, ids: np.ndarray) -> dict[str, Any]:
    """Live bytes of the drawn buffers and, per category, of all the others, sampled."""
    drawn = np.zeros(view.num_buffers, bool)
    drawn[ids] = True
    drawn_live = view.live_bytes(drawn)
    category = view.buffers["category"]
    small = {c: view.live_bytes(~drawn & (category == i)) for i, c in enumerate(CATEGORIES)}
    total = drawn_live + sum(small.values())
    t = sample_events(total)
    small_ids = np.flatnonzero(~drawn & (view.buffers["nbytes"] > 0))
    return {
        "t": t.tolist(),
        "drawn": drawn_live[t].tolist(),
        "by_category": [small[c][t].tolist() for c in CATEGORIES],
        "count": int(small_ids.shape[0]),
        "largest": int(view.buffers["nbytes"][small_ids].max(initial=0)),
    }


def _phase_runs(view: Trace) -> list[list[int]]:
    """[first event, end event, phase] of each run of ops in one phase."""
    if view.num_ops == 0:
        return []
    first = view.ops["first_event"]
    phase = view.ops["phase"]
    change = np.flatnonzero(np.diff(phase)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [view.num_ops]])
    return [[int(first[s]), int(first[e]) if e < view.num_ops else view.num_events, int(phase[s])]
            for s, e in zip(starts, ends, strict=True)]


def _caching_layout(view: Trace, ids: np.ndarray) -> tuple[list[int], dict[str, list]]:
    """The caching allocator's address of each drawn block and its segments over time
    (cudaMalloc to cudaFree, from `CachingAllocator.segment_log`), from address 0."""
    allocator = CachingAllocator(AllocConf.parse(None))
    replay = record_replay(view, allocator)
    addr = np.asarray(replay.block_addr, np.int64)
    size = np.asarray(replay.block_nbytes, np.int64)
    opened: dict[int, tuple[int, int]] = {}
    segments: list[tuple[int, int, int, int]] = []
    for event, sign, address, nbytes, *_ in allocator.segment_log:
        if sign > 0:
            opened[address] = (event, nbytes)
        elif address in opened:
            start, length = opened.pop(address)
            segments.append((start, event, address, length))
    segments += [(start, view.num_events, address, length) for address, (start, length) in opened.items()]
    used = [s[2] for s in segments] + addr[size > 0].tolist()
    base = min(used) if used else 0
    segments.sort()
    return (addr[ids] - base).tolist(), {
        "start": [s[0] for s in segments],
        "end": [s[1] for s in segments],
        "addr": [s[2] - base for s in segments],
        "nbytes": [s[3] for s in segments],
    }


def planned_addresses(trace: Trace, plan: AddressPlan) -> tuple[np.ndarray, np.ndarray, int]:
    """Per buffer: planned offset and slot bytes (0 where the plan does not place it),
    and how many allocations it leaves to the dynamic space or the fallback."""
    addr = np.zeros(trace.num_buffers, np.int64)
    nbytes = np.zeros(trace.num_buffers, np.int64)
    unplanned = 0
    sizes = trace.buffers["nbytes"]
    for group, ids in requests_by_group(trace).items():
        entry = plan.for_iteration(group)
        for j, buf in enumerate(ids.tolist()):
            if sizes[buf] == 0:
                continue
            if entry is None or j >= entry.num_requests or int(entry.nbytes[j]) != int(sizes[buf]) or entry.offset[j] < 0:
                unplanned += 1
                continue
            addr[buf] = int(entry.offset[j])
            nbytes[buf] = int(sizes[buf])
    return addr, nbytes, unplanned


def _planned_offsets(view: Trace, ids: np.ndarray, plan: AddressPlan) -> tuple[list[int], int, int]:
    """Each drawn block's planned offset (-1: the plan leaves it to the dynamic space or
    the fallback), the arena's bytes, and how many of the trace's requests are unplanned."""
    offset, slot, unplanned = planned_addresses(view, plan)
    return np.where(slot[ids] > 0, offset[ids], -1).tolist(), int(plan.arena_bytes), int(unplanned)



SCRIPT = Path(__file__).with_name("timeline.js")

_CSS = (
    ".mp-timeline{margin:1em 0}.mp-row{display:flex;gap:1%}.mp-row .mp-panel{flex:1 1 49%;min-width:0}"
    ".mp-panel-title{font:bold 12px sans-serif;margin:6px 0 2px}.mp-hint{font:12px sans-serif;color:#555}"
    ".mp-legend{font:12px sans-serif;margin:4px 0}.mp-key{margin-right:12px;white-space:nowrap}"
    ".mp-swatch{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}"
    ".mp-tip{position:fixed;z-index:10;max-width:520px;background:#fffff4;border:1px solid #888;"
    "padding:4px 6px;font:12px sans-serif;pointer-events:none;box-shadow:2px 2px 4px #0003}"
    ".mp-tip-head{font-weight:bold;margin-bottom:2px;word-break:break-all}"
)


def timeline_section(
    out_dir: Path, index: int, name: str, trace: Trace, plan: AddressPlan | None,
    others: Sequence[tuple[str, Trace]] = (),
) -> str:
    """The HTML of one trace's interactive timeline; writes `timeline.js` beside the page.

    The data is inline JSON (`<script type="application/json">`): a page opened from
    file:// may not fetch a sibling file, and nothing is loaded from the network.
    """
    data = timeline_data(trace, name, plan, others)
    shutil.copyfile(SCRIPT, Path(out_dir) / SCRIPT.name)
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    element = f"timeline{index}"
    overlays = "; ".join(o["label"] for o in data["overlays"])
    return (
        f"<style>{_CSS}</style><h3>Interactive memory timeline</h3>"
        f"<p>Top: live memory, each tensor a block stacked in allocation order (blocks above a freed one "
        f"move down), small tensors summed per category on top"
        f"{html.escape(f', other steps dashed ({overlays})') if overlays else ''}. Below: the caching "
        f"allocator's segments and blocks{' beside the plan' + chr(39) + 's arena' if plan is not None else ''}"
        f", on the same time axis (allocator events; the background shades the phases).</p>"
        f'<div class="mp-timeline" data-src="{element}"></div>'
        f'<script type="application/json" id="{element}">{payload}</script>'
        f'<script src="{SCRIPT.name}"></script>'
    )
