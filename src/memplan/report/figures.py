"""The report's pictures, drawn with matplotlib into PNG files.

matplotlib (Agg backend) is used because it draws publication-quality static images
with no browser, no network and no JavaScript: the report opens offline and the same
PNGs go into the README's gallery.

Every function takes data (a trace, a replay, a JSON document) and returns a
`matplotlib.figure.Figure`; `save_png` writes it. Colours are one fixed colour per
trace category, so every picture reads the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from memplan.report.colors import (  # noqa: E402
    ALLOCATOR_COLORS,
    CATEGORY_COLORS,
    GENERATION_COLORS,
    INFEASIBLE_COLOR,
    PHASE_COLORS,
    RL_PHASE_SHADES,
    SERVING_COLORS,
)
from memplan.trace.model import CATEGORIES, PHASES, Trace  # noqa: E402

GIB = float(1 << 30)


def unit_for(nbytes: float) -> tuple[float, str]:
    """(bytes per unit, unit name) so that `nbytes` reads as a number above 1."""
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= scale:
            return float(scale), name
    return 1.0, "B"


def _style(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)


def _phase_bands(ax: Any, trace: Trace) -> None:
    """Shade the background by the phase of the op running at each event."""
    if trace.num_ops == 0:
        return
    first = trace.ops["first_event"]
    phase = trace.ops["phase"]
    change = np.flatnonzero(np.diff(phase)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [trace.num_ops]])
    for s, e in zip(starts, ends):
        x0 = int(first[s])
        x1 = int(first[e]) if e < trace.num_ops else trace.num_events
        ax.axvspan(x0, x1, color=PHASE_COLORS[PHASES[int(phase[s])]], linewidth=0, zorder=0)


def memory_over_time(trace: Trace, title: str = "") -> Figure:
    """Live bytes after each event, stacked by category, phases shaded behind."""
    n = trace.num_events
    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=110)
    _style(ax)
    if n:
        kind = trace.events["kind"]
        buf = trace.events["buffer"]
        delta = np.where(kind == 0, trace.buffers["nbytes"][buf], -trace.buffers["nbytes"][buf])
        cat = trace.buffers["category"][buf]
        scale, unit = unit_for(trace.peak()[0])
        series = []
        for c in range(len(CATEGORIES)):
            series.append(np.cumsum(np.where(cat == c, delta, 0)) / scale)
        # One point per pixel-sized bin, at the bin's highest total, so that one-event
        # spikes (the peak is often one) stay visible on long traces.
        total = np.sum(series, axis=0)
        bins = np.array_split(np.arange(n), min(n, 1500))
        at = np.array([b[np.argmax(total[b])] for b in bins])
        x = np.array([b[0] for b in bins] + [n])
        used = [c for c in range(len(CATEGORIES)) if series[c].max() > 0]
        _phase_bands(ax, trace)
        base = np.zeros(len(bins) + 1)
        for c in used:
            top = base + np.append(series[c][at], series[c][at][-1])
            ax.fill_between(x, base, top, step="post", color=CATEGORY_COLORS[CATEGORIES[c]],
                            linewidth=0, label=CATEGORIES[c], zorder=2)
            base = top
        peak, event = trace.peak()
        ax.set_ylim(0, peak / scale * 1.12)
        ax.axhline(peak / scale, color="#333333", linewidth=0.8, linestyle="--", zorder=3)
        ax.annotate(
            f"peak {peak / scale:.2f} {unit} ({trace.phase_at(event)})",
            (event, peak / scale),
            xytext=(6, 4),
            textcoords="offset points",
            fontsize=9,
            zorder=4,
        )
        handles, labels = ax.get_legend_handles_labels()
        phases = sorted({PHASES[int(p)] for p in trace.ops["phase"]}, key=PHASES.index)
        handles += [Patch(color=PHASE_COLORS[p], label=f"{p} phase") for p in phases]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8,
                  ncol=min(len(handles), 6), frameon=False)
        ax.set_xlim(0, n)
        ax.set_ylabel(f"live memory ({unit})")
    ax.set_xlabel("event (allocation or free, in order)")
    ax.set_title(title or "Memory over one training step, by category", fontsize=11)
    fig.tight_layout()
    return fig


def address_maps(
    panels: list[tuple[str, Trace, np.ndarray, np.ndarray]], title: str = ""
) -> Figure:
    """Address-by-time pictures side by side, at the same scale.

    Each panel is (label, trace, address per buffer, block bytes per buffer): every
    buffer is a rectangle from its allocation to its free event, at its address. White
    space below the top of a panel is memory reserved but not holding a live tensor.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), dpi=110, sharey=True)
    axes = np.atleast_1d(axes)
    scale, unit = unit_for(max(float((a + s).max()) if s.size else 0.0 for _, _, a, s in panels))
    top = 0.0
    for ax, (label, trace, addr, nbytes) in zip(axes, panels):
        _style(ax)
        lower, upper, _ = trace.lifetimes()
        placed = nbytes > 0
        y0 = addr[placed] / scale
        y1 = (addr[placed] + nbytes[placed]) / scale
        x0, x1 = lower[placed], upper[placed]
        verts = np.stack(
            [np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1), np.stack([x0, y1], 1)],
            axis=1,
        )
        colors = [CATEGORY_COLORS[CATEGORIES[int(c)]] for c in trace.buffers["category"][placed]]
        ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="none", linewidths=0))
        height = float(y1.max()) if y1.size else 0.0
        top = max(top, height)
        ax.axhline(height, color="#333333", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, max(trace.num_events, 1))
        ax.set_title(f"{label}: {height:.2f} {unit} of address space", fontsize=10)
        ax.set_xlabel("event")
    axes[0].set_ylim(0, top * 1.05 if top else 1)
    axes[0].set_ylabel(f"address ({unit})")
    used = sorted({CATEGORIES[int(c)] for c in panels[0][1].buffers["category"]}, key=CATEGORIES.index)
    fig.legend(
        handles=[Patch(color=CATEGORY_COLORS[c], label=c) for c in used],
        loc="lower center",
        ncol=len(used),
        fontsize=8,
        frameon=False,
    )
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def allocator_bars(results: dict[str, dict[str, Any]], title: str = "") -> Figure:
    """Peak requested, allocated and reserved per allocator (from AllocReplay.to_json())."""
    names = list(results)
    keys = [("peak_requested_bytes", "requested"), ("peak_allocated_bytes", "allocated"),
            ("peak_reserved_bytes", "reserved")]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    _style(ax)
    x = np.arange(len(names))
    width = 0.26
    scale, unit = unit_for(max(r["peak_reserved_bytes"] for r in results.values()))
    for i, (key, label) in enumerate(keys):
        values = [results[n][key] / scale for n in names]
        bars = ax.bar(x + (i - 1) * width, values, width, label=label,
                      color=["#bcd4e6", "#6a9fcb", "#2f5f8a"][i])
        if key == "peak_reserved_bytes":
            for bar, n in zip(bars, names):
                ax.annotate(f"{100 * results[n]['fragmentation']:.1f}% frag.",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title or "What each allocator would reserve", fontsize=11)
    fig.tight_layout()
    return fig


def rank_breakdown(per_rank: list[dict[str, Any]], capacity_bytes: int | None, title: str = "") -> Figure:
    """Stacked bars: what each rank's peak is made of (from estimate JSON `per_rank`)."""
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(per_rank) + 3), 3.8), dpi=110)
    _style(ax)
    ranks = [str(r.get("rank", i)) for i, r in enumerate(per_rank)]
    bottom = np.zeros(len(per_rank))
    # estimate JSON names the categories in the plural ("activations", "temporaries")
    plural = {"parameter": "parameters", "gradient": "gradients", "activation": "activations",
              "temporary": "temporaries", "input": "inputs"}
    for cat in CATEGORIES:
        values = np.array([
            r.get("breakdown", {}).get(cat, r.get("breakdown", {}).get(plural.get(cat, cat), 0)) / GIB
            for r in per_rank
        ])
        if values.any():
            ax.bar(ranks, values, bottom=bottom, color=CATEGORY_COLORS[cat], label=cat)
            bottom += values
    reserved = [r.get("peak_reserved_bytes", 0) / GIB for r in per_rank]
    ax.scatter(ranks, reserved, marker="_", s=600, color="#333333", label="peak reserved", zorder=3)
    if capacity_bytes:
        ax.axhline(capacity_bytes / GIB, color="#c0392b", linestyle="--", linewidth=1, label="GPU capacity")
    ax.set_xlabel("rank")
    ax.set_ylabel("GiB at the peak")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title(title or "Per-rank peak, by category", fontsize=11)
    fig.tight_layout()
    return fig


def rl_phases(doc: dict[str, Any], title: str = "") -> Figure:
    """An RL step's phases in order (from `memplan rl --json`), each a shaded band with
    its device memory stacked by the allocator holding it; the GPU and its usable memory
    as lines."""
    phases = doc["phases"]
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(phases) + 2), 3.8), dpi=110)
    _style(ax)
    for i, _ in enumerate(phases):
        ax.axvspan(i - 0.5, i + 0.5, color=RL_PHASE_SHADES[i % len(RL_PHASE_SHADES)], linewidth=0, zorder=0)
    bottom = np.zeros(len(phases))
    for allocator, color in ALLOCATOR_COLORS.items():
        values = np.array([p["by_allocator"].get(allocator, 0) / GIB for p in phases])
        if values.any():
            ax.bar(range(len(phases)), values, bottom=bottom, width=0.6, color=color, label=allocator, zorder=2)
            bottom += values
    ax.axhline(doc["capacity_bytes"] / GIB, color="#c0392b", linestyle="--", linewidth=1, label="GPU capacity")
    ax.axhline(doc["usable_bytes"] / GIB, color="#c0392b", linestyle=":", linewidth=1, label="usable (margin)")
    ax.set_xticks(range(len(phases)), [p["name"] for p in phases], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("GiB on the GPU")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title(title or "RL step, phase by phase", fontsize=11)
    fig.tight_layout()
    return fig


def before_after(series: dict[str, np.ndarray], ylabel: str, title: str, xlabel: str = "step position") -> Figure:
    """Curves over time, one per variant (e.g. program order vs memplan's order)."""
    fig, ax = plt.subplots(figsize=(10, 3.8), dpi=110)
    _style(ax)
    palette = ["#9c9c9c", "#4e79a7", "#e15759", "#59a14f", "#f28e2b"]
    for i, (label, ys) in enumerate(series.items()):
        ys = np.asarray(ys, dtype=float)
        ax.plot(np.linspace(0, 1, ys.size) if ys.size > 1 else [0], ys, label=label,
                color=palette[i % len(palette)], linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return fig


def bars(values: dict[str, float], ylabel: str, title: str, infeasible: frozenset[str] = frozenset()) -> Figure:
    """One bar per named value (for results that carry no time series). The names in
    `infeasible` broke their budget: their value means nothing, so each is drawn as an
    empty hatched bar to the top of the axis, labelled "infeasible", not as a height."""
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    _style(ax)
    names = list(values)
    feasible = [values[n] for n in names if n not in infeasible]
    top = max(feasible, default=1.0) * 1.15 or 1.0
    for i, n in enumerate(names):
        if n in infeasible:
            ax.bar(i, top, color="none", edgecolor=INFEASIBLE_COLOR, hatch="//", linewidth=1)
            ax.annotate("infeasible\n(over budget)", (i, top / 2), ha="center", va="center", fontsize=8,
                        color=INFEASIBLE_COLOR, backgroundcolor="white")
            continue
        ax.bar(i, values[n], color="#4e79a7")
        ax.annotate(f"{values[n]:.3g}", (i, values[n]), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, top * 1.08)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    return fig


def stacked_bar(parts: dict[str, int], colors: dict[str, str], title: str, note: str = "",
                marks: dict[str, int] | None = None) -> Figure:
    """One horizontal bar of `parts` (bytes, in order, each labelled with its size), with a
    dashed vertical line and label per entry of `marks` (bytes) and a `note` under the bar."""
    fig, ax = plt.subplots(figsize=(10, 2.9), dpi=110)
    total = float(sum(parts.values())) or 1.0
    scale, unit = unit_for(max([total, *(marks or {}).values()]))
    left = 0.0
    for name, nbytes in parts.items():
        width = nbytes / scale
        ax.barh(0, width, left=left, height=0.5, color=colors[name], edgecolor="#555555", linewidth=0.6,
                label=f"{name} {width:.2f} {unit}")
        if nbytes / total >= 0.06:  # a label only where it fits inside its segment
            ax.annotate(name, (left + width / 2, 0), ha="center", va="center", fontsize=8)
        left += width
    for i, (label, nbytes) in enumerate((marks or {}).items()):
        ax.axvline(nbytes / scale, color=INFEASIBLE_COLOR if label == "capacity" else "#333333", linestyle="--",
                   linewidth=1)
        ax.annotate(label, (nbytes / scale, 0.3 + 0.12 * i), xytext=(-4, 0), textcoords="offset points",
                    ha="right", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.45, 0.6)
    ax.set_xlim(0, max(left, *((m / scale) for m in (marks or {}).values())) * 1.02)
    ax.set_xlabel(unit)
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=min(len(parts), 6))
    ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=8, color="#333333")
    fig.tight_layout(rect=(0, 0.06 if note else 0, 1, 1))
    return fig


def kv_pool_budget(doc: dict[str, Any], title: str) -> Figure:
    """A serving engine's device memory on one rank (the JSON of `memplan serve`): what lies
    outside PyTorch (CUDA context, NCCL, the non-torch rise), the weights, the activation
    reserve of the profile run, the CUDA-graph pool, the KV pool and what is left free, in the
    order that ends the engine's budget (a line) where the KV pool ends: vLLM counts its budget
    from start-up (the CUDA context and NCCL before it unless its rules count them, the graphs
    after it unless they count them too); SGLang's static budget is `mem_fraction_static` of
    the memory free at start-up, weights and KV pool, the activation and graph headroom after
    it. The concurrency the pool holds is the note."""
    outside = sum((doc.get("outside_budget_bytes") or {}).values())
    terms = {"non-torch": outside + int(doc.get("non_torch_rise_bytes", 0)),
             "weights": int(doc["weights"]["total_bytes"]),
             "activation reserve": int(doc["activation"]["total_bytes"]),
             "CUDA graphs": int((doc.get("cuda_graphs") or {}).get("pool_bytes", 0)),
             "KV pool": int(doc["kv"]["bytes"])}
    rules, settings = doc.get("engine_rules") or {}, doc.get("settings") or {}
    if doc.get("engine") == "sglang":
        order = ("non-torch", "weights", "KV pool", "activation reserve", "CUDA graphs")
        budget = outside + int(doc["budget_bytes"] * settings.get("mem_fraction_static", 1.0))
    else:
        before_kv = ("CUDA graphs",) if rules.get("graphs_in_budget") else ()
        order = ("non-torch", "weights", "activation reserve", *before_kv, "KV pool",
                 *(() if before_kv else ("CUDA graphs",)))
        budget = int(doc["budget_bytes"]) + (0 if rules.get("context_in_budget") else outside)
    parts = {name: terms[name] for name in order}
    capacity = int(doc["capacity_bytes"])
    parts["free"] = max(capacity - sum(parts.values()), 0)
    kv = doc["kv"]
    note = (f"KV pool: {kv.get('tokens', 0):,} tokens; {kv.get('max_concurrency', 0):g} requests of "
            f"max_model_len {settings.get('max_model_len')} at once")
    return stacked_bar(parts, SERVING_COLORS, title, note, {"engine budget": budget, "capacity": capacity})


def generation_peak(doc: dict[str, Any], title: str) -> Figure:
    """A `generate()` call's peak allocated memory by class (the JSON of `memplan generate`),
    the KV cache apart, with the peak reserved, device used and capacity as lines."""
    parts = {key: int(doc["breakdown"].get(key, 0)) for key in GENERATION_COLORS}
    used = int(doc["device_used_bytes"])
    marks = {"reserved": int(doc["peak_reserved_bytes"]), "device used": used}
    note = f"peak in the {doc.get('peak_phase', '?')}"
    capacity = doc.get("capacity_bytes")
    if capacity and capacity <= 2 * used:  # drawn where it is near; far above, it would squash the bar
        marks["capacity"] = int(capacity)
    elif capacity:
        scale, unit = unit_for(capacity)
        note += f"; capacity {capacity / scale:.1f} {unit} (off the scale)"
    return stacked_bar(parts, GENERATION_COLORS, title, note, marks)


def save_png(fig: Figure, path: Path) -> None:
    """Write `fig` as a PNG and release it."""
    fig.savefig(path, format="png")
    plt.close(fig)
