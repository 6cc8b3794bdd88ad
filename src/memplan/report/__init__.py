"""`memplan report`: one self-contained HTML page with figures, from memplan's outputs.

Inputs are files memplan writes: traces (`.memtrace`, or PyTorch snapshot pickles),
plans (`memplan plan`), and the JSON of `memplan estimate`, `memplan reorder`,
`memplan offload`, `memplan rl` (its phases as a shaded timeline), `memplan serve` and
`memplan generate` (their panels: `report/inference.py`). `build_report(inputs, out_dir)`
writes `out_dir/index.html` and one PNG per figure beside it, and each trace's interactive
timeline (`report/timeline.py`): its data inline, drawn by memplan's own `timeline.js`
copied beside the page. The page loads nothing from the network.

Each figure has a one-line caption saying what to look at. Inputs that do not belong
together (a plan made for another trace) are refused with a UserError before anything
is written.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memplan.alloc import replay
from memplan.alloc.caching import CachingAllocator
from memplan.alloc.conf import AllocConf
from memplan.alloc.simulate import record_replay
from memplan.errors import UserError
from memplan.inference.generate import GENERATE_FORMAT
from memplan.inference.serve import SERVE_FORMAT
from memplan.layout.plan import AddressPlan
from memplan.report import figures
from memplan.report.inference import (
    generate_section,
    generation_settings,
    generation_verdict,
    serve_section,
    serving_settings,
    serving_verdict,
)
from memplan.report.timeline import planned_addresses, timeline_section
from memplan.trace import load
from memplan.trace.edit import device_view
from memplan.trace.model import Trace
from memplan.units import format_bytes

__all__ = ["ReportInputs", "build_report", "read_inputs"]


@dataclass
class ReportInputs:
    """What the report was given, sorted by kind."""

    traces: list[tuple[str, Trace]] = field(default_factory=list)
    plans: list[tuple[str, Any]] = field(default_factory=list)
    estimates: list[tuple[str, dict]] = field(default_factory=list)
    reorders: list[tuple[str, dict]] = field(default_factory=list)
    offloads: list[tuple[str, dict]] = field(default_factory=list)
    compares: list[tuple[str, dict]] = field(default_factory=list)
    ooms: list[tuple[str, dict]] = field(default_factory=list)
    rls: list[tuple[str, dict]] = field(default_factory=list)
    serves: list[tuple[str, dict]] = field(default_factory=list)
    generates: list[tuple[str, dict]] = field(default_factory=list)


def read_inputs(paths: list[str | os.PathLike]) -> ReportInputs:
    """Load and classify every input; UserError for unknown or mismatched ones."""
    inputs = ReportInputs()
    if not paths:
        raise UserError("give at least one input: a .memtrace, a plan, or estimate/reorder/offload/serve/generate "
                        "JSON")
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise UserError(f"report input {path} does not exist")
        with open(path, "rb") as fh:
            head = fh.read(1)
        if head in (b"{", b"["):
            try:
                doc = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"cannot read {path}: {exc}") from None
            kind = _json_kind(doc)
            if kind is None:
                raise UserError(
                    f"{path} is JSON memplan does not know: expected a plan, or the --json output of "
                    "estimate, reorder, offload, compare, rl, serve or generate"
                )
            if kind == "plan":
                inputs.plans.append((path.name, AddressPlan.from_json(doc, source=str(path))))
            else:
                getattr(inputs, kind + "s").append((path.name, doc))
        else:
            inputs.traces.append((path.name, load(str(path))))
    for name, plan in inputs.plans:
        if not inputs.traces:
            raise UserError(f"plan {name} needs the trace it was made for among the inputs")
        if not any(_belongs(plan, trace) for _, trace in inputs.traces):
            raise UserError(
                f"plan {name} does not belong to any given trace ({', '.join(n for n, _ in inputs.traces)}): "
                "make it with 'memplan plan' from that trace"
            )
    return inputs


def _json_kind(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    if doc.get("format") == "memplan-plan":
        return "plan"
    if doc.get("format") == "memplan-compare":
        return "compare"
    if doc.get("format") == "memplan-oom":
        return "oom"
    if doc.get("format") == SERVE_FORMAT:
        return "serve"
    if doc.get("format") == GENERATE_FORMAT:
        return "generate"
    if "per_rank" in doc:
        return "estimate"
    if "phases" in doc and "algo" in doc:
        return "rl"
    if "baseline_peak_bytes" in doc:
        return "reorder"
    if "ideal_step_s" in doc or "planned_step_s" in doc:
        return "offload"
    return None


def _belongs(plan: Any, trace: Trace) -> bool:
    try:
        plan.check_belongs_to(trace)
    except UserError:
        return False
    return True


def caching_addresses(trace: Trace, expandable: bool = False) -> tuple[Trace, np.ndarray, np.ndarray]:
    """Replay through the caching allocator; per buffer its block address (from 0) and size."""
    view = device_view(trace)
    conf = AllocConf.parse("expandable_segments:True" if expandable else None)
    rep = record_replay(view, CachingAllocator(conf))
    addr = np.asarray(rep.block_addr, np.int64)
    size = np.asarray(rep.block_nbytes, np.int64)
    base = addr[size > 0].min() if (size > 0).any() else 0
    return view, np.where(size > 0, addr - base, 0), size


@dataclass
class _Page:
    out_dir: Path
    sections: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)

    def figure(self, fig: Any, name: str, caption: str) -> None:
        figures.save_png(fig, self.out_dir / name)
        self.figures.append(name)
        self.sections.append(
            f'<figure><img src="{html.escape(name)}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )

    def heading(self, text: str) -> None:
        self.sections.append(f"<h2>{html.escape(text)}</h2>")

    def paragraph(self, text: str) -> None:
        self.sections.append(f"<p>{html.escape(text)}</p>")

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
        )
        self.sections.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def step_description(model: Any, setup: Any) -> str:
    """Which training step a panel shows, from the model and the setup its JSON or trace
    carries: "gpt2, batch 8 x seq 1024, bf16, checkpointing full" ("model" alone when the
    setup is unknown, e.g. a PyTorch snapshot)."""
    name = str(model) if model else "a step"
    if not isinstance(setup, dict) or not setup:
        return name
    parts = []
    if setup.get("batch") is not None:
        shape = f"batch {setup['batch']}"
        shape += f" x seq {setup['seq']}" if setup.get("seq") else ""
        shape += f", {setup['grad_accum']} micro-batches" if setup.get("grad_accum", 1) > 1 else ""
        parts.append(shape)
    precision = setup.get("precision") or "/".join(
        v for v in (setup.get("dtype"), f"autocast {setup['autocast']}" if setup.get("autocast") not in (None, "none")
                    else None) if v)
    if precision:
        parts.append(precision)
    for key, label in (("checkpointing", "checkpointing"), ("lora_rank", "LoRA rank"), ("quant", "quant")):
        if setup.get(key) not in (None, "none", 0):
            parts.append(f"{label} {setup[key]}")
    return f"{name}, {', '.join(parts)}" if parts else name


def estimate_verdict(doc: dict[str, Any]) -> str | None:
    """The verdict of an estimate's JSON as one line: fits or not, device used against the
    usable memory, the capacity and the margin (None without a capacity)."""
    capacity = doc.get("capacity_bytes")
    if not capacity:
        return None
    used = doc.get("device_used_bytes", 0)
    margin = doc.get("margin")
    usable = doc.get("usable_bytes") or (int(capacity * (1 - margin)) if margin is not None else capacity)
    margin_text = f"{100 * margin:g}% margin" if margin is not None else "no margin"
    verdict = "fits" if doc.get("fits") else "does NOT fit"
    where = doc.get("gpu") or doc.get("device") or "the device"
    return (f"{verdict} on {where}: {format_bytes(used)} device used of {format_bytes(usable)} usable "
            f"({format_bytes(capacity)}, {margin_text})")


def offload_verdict(doc: dict[str, Any]) -> str:
    """An offload result's verdict: whether memplan's plan holds its budget, and its throughput."""
    budget = format_bytes(doc.get("budget_bytes", 0))
    if not doc.get("feasible", True):
        return f"memplan's offload plan does NOT hold the {budget} budget"
    return (f"memplan's offload plan holds the {budget} budget at "
            f"{100 * doc.get('throughput_vs_ideal', 0.0):.1f}% of an unlimited GPU's throughput")


def rl_verdict(doc: dict[str, Any]) -> str:
    """An RL step's verdict: its peak phase against the usable memory, or the phase that fails."""
    usable = f"{format_bytes(doc.get('usable_bytes', 0))} usable ({format_bytes(doc.get('capacity_bytes', 0))}, " \
             f"{100 * doc.get('margin', 0):g}% margin)"
    if doc.get("fits"):
        return (f"fits on {doc.get('gpu') or doc.get('device')}: peak phase {doc.get('peak_phase')} needs "
                f"{format_bytes(doc.get('peak_bytes', 0))} of {usable}")
    return (f"does NOT fit on {doc.get('gpu') or doc.get('device')}: {doc.get('failing_phase')} is over "
            f"{usable} by {format_bytes(doc.get('over_by_bytes', 0))}")


def _summary_section(page: _Page, inputs: ReportInputs) -> None:
    """The page's first lines: each estimate's verdict with its capacity and margin, each
    offload plan's budget, each trace's peak, and which step each one is."""
    lines = []
    for _name, doc in inputs.estimates:
        verdict = estimate_verdict(doc)
        step = step_description(doc.get("model"), doc.get("setup"))
        lines.append(f"Estimate ({step}): {verdict or 'no capacity given, so no verdict'}")
    for _name, doc in inputs.offloads:
        lines.append(f"Offload ({step_description(doc.get('model'), doc.get('setup'))}): {offload_verdict(doc)}")
    for _name, doc in inputs.rls:
        lines.append(f"RL step ({doc.get('algo')} on {doc.get('trainer')}, "
                     f"{step_description(doc.get('model'), (doc.get('settings') or {}).get('setup'))}): "
                     f"{rl_verdict(doc)}")
    for _name, doc in inputs.serves:
        lines.append(f"Serving ({serving_settings(doc)}): {serving_verdict(doc)}")
    for _name, doc in inputs.generates:
        lines.append(f"Generation ({generation_settings(doc)}): {generation_verdict(doc)}")
    for name, trace in inputs.traces:
        peak, event = trace.peak()
        lines.append(f"Trace ({step_description(trace.meta.get('model', name), trace.meta.get('setup'))}): "
                     f"peak {format_bytes(peak)} live in {trace.phase_at(event)}")
    if lines:
        page.sections.append('<div class="verdict">' + "".join(f"<p>{html.escape(x)}</p>" for x in lines)
                             + "</div>")


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;
max-width:1100px;color:#222;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2.2rem;border-bottom:1px solid #ddd}
figure{margin:1rem 0}img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.9rem;margin-top:.3rem}
table{border-collapse:collapse;font-size:.88rem;margin:.6rem 0}
td,th{border:1px solid #ddd;padding:.25rem .6rem;text-align:right}
th{background:#f5f5f5}td:first-child,th:first-child{text-align:left}
.verdict{background:#f7f7f7;border-left:4px solid #4e79a7;padding:.4rem 1rem;margin:1rem 0}
.verdict p{margin:.3rem 0}
"""


def build_report(paths: list[str | os.PathLike], out_dir: str | os.PathLike,
                 compare: Sequence[str | os.PathLike] = ()) -> Path:
    """Write `out_dir/index.html`, its PNGs and `timeline.js` from `paths`; return the page's
    path. Each trace's timeline overlays the `compare` traces and the other traces of its model."""
    inputs = read_inputs(paths)  # refuses bad input before anything is written
    overlays = _overlay_traces(inputs, compare)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    page = _Page(out_dir)
    _summary_section(page, inputs)
    for i, (name, trace) in enumerate(inputs.traces):
        plan = next((p for _, p in inputs.plans if _belongs(p, trace)), None)
        _trace_section(page, i, name, trace, plan)
        others = [(n, t) for n, t in overlays if t is not trace and t.meta.get("model") == trace.meta.get("model")]
        page.sections.append(timeline_section(out_dir, i, name, trace, plan, others))
    for i, (name, doc) in enumerate(inputs.estimates):
        _estimate_section(page, i, name, doc)
    for i, (name, doc) in enumerate(inputs.reorders):
        _reorder_section(page, i, name, doc)
    for i, (name, doc) in enumerate(inputs.offloads):
        _offload_section(page, i, name, doc)
    for i, (name, doc) in enumerate(inputs.serves):
        serve_section(page, i, name, doc)
    for i, (name, doc) in enumerate(inputs.generates):
        generate_section(page, i, name, doc)
    for name, doc in inputs.compares:
        _compare_section(page, name, doc)
    for name, doc in inputs.ooms:
        _oom_section(page, name, doc)
    for i, (name, doc) in enumerate(inputs.rls):
        _rl_section(page, i, name, doc)
    return _write_page(page, paths)


def _overlay_traces(inputs: ReportInputs, compare: list[str | os.PathLike]) -> list[tuple[str, Trace]]:
    """The report's traces and the `--compare` traces (which get no section of their own)."""
    extra = read_inputs(compare) if compare else ReportInputs()
    if len(extra.traces) != len(compare):
        raise UserError("--compare takes traces (.memtrace or a PyTorch snapshot pickle), not plans or JSON results")
    return inputs.traces + extra.traces


def _trace_section(page: _Page, i: int, name: str, trace: Trace, plan: AddressPlan | None) -> None:
    """A trace's figures: memory over the step, peak per allocator, addresses over time."""
    stem = f"trace{i}"
    label = trace.meta.get("model", name)
    peak, event = trace.peak()
    page.heading(f"{label} — one training step ({name})")
    page.paragraph(f"Step: {step_description(label, trace.meta.get('setup'))}.")
    page.figure(
        figures.memory_over_time(trace, f"{label}: live memory over the step"),
        f"{stem}_memory.png",
        f"Live tensor memory by category; the dashed line is the peak, "
        f"{format_bytes(peak)} in {trace.phase_at(event)}.",
    )
    results = {a: replay(trace, allocator=a, segment_map=False).to_json()
               for a in ("caching", "expandable", "ideal")}
    if plan is not None:
        results["planned"] = replay(trace, allocator="planned", plan=plan, segment_map=False).to_json()
    page.figure(
        figures.allocator_bars(results, f"{label}: peak memory per allocator"),
        f"{stem}_allocators.png",
        "Bars compare what each allocator reserves; the gap between allocated and reserved is fragmentation.",
    )
    view, addr, size = caching_addresses(trace)
    panels = [("caching allocator", view, addr, size)]
    if plan is not None:
        paddr, psize, unplanned = planned_addresses(view, plan)
        panels.append(("planned arena", view, paddr, psize))
        caption = (f"Same scale: white space under the dashed line is reserved but unused — the caching "
                   f"allocator's fragmentation; the plan packs the same tensors tightly"
                   f"{f' ({unplanned} unplanned allocations not drawn)' if unplanned else ''}.")
    else:
        _, eaddr, esize = caching_addresses(trace, expandable=True)
        panels.append(("expandable segments", view, eaddr, esize))
        caption = ("Same scale: every tensor is a rectangle at its address from allocation to free; "
                   "white space under the dashed line is reserved but unused.")
    page.figure(figures.address_maps(panels, f"{label}: addresses over time"), f"{stem}_addresses.png", caption)
    page.table(
        ["allocator", "peak requested", "peak allocated", "peak reserved", "fragmentation", "segments"],
        [[a, format_bytes(r["peak_requested_bytes"]), format_bytes(r["peak_allocated_bytes"]),
          format_bytes(r["peak_reserved_bytes"]), f"{100 * r['fragmentation']:.1f}%", r["segments"]]
         for a, r in results.items()],
    )


def _estimate_section(page: _Page, i: int, name: str, doc: dict[str, Any]) -> None:
    """An estimate's per-rank breakdown, as a figure and a table."""
    page.heading(f"Estimate: {doc.get('model', name)} ({name})")
    page.paragraph(f"Step: {step_description(doc.get('model', name), doc.get('setup'))}. "
                   f"{estimate_verdict(doc) or 'No capacity was given, so there is no verdict.'}")
    page.figure(
        figures.rank_breakdown(doc["per_rank"], doc.get("capacity_bytes")),
        f"estimate{i}_ranks.png",
        "Each bar is one rank's peak by category; the black tick is its reserved memory, the red line the GPU.",
    )
    page.table(
        ["rank", "peak allocated", "peak reserved", "device used", "phase of the peak", "host peak",
         "host pinned / pageable / managed"],
        [[r.get("rank"), format_bytes(r.get("peak_allocated_bytes", 0)),
          format_bytes(r.get("peak_reserved_bytes", 0)), format_bytes(r.get("device_used_bytes", 0)),
          r.get("peak_phase", ""), format_bytes(r.get("host_peak_bytes", 0)),
          " / ".join(format_bytes(r.get(f"host_{kind}_bytes", 0)) for kind in ("pinned", "pageable", "managed"))]
         for r in doc["per_rank"]],
    )
    if any(r.get("host_peak_bytes", 0) for r in doc["per_rank"]):
        page.paragraph("Host memory (offloaded optimizer state, parameters and gradients; bitsandbytes' paged "
                       "state in CUDA managed memory) is not in the device figures: its peak over the step, and "
                       "at that peak how much is pinned, pageable and managed.")


def _rl_section(page: _Page, i: int, name: str, doc: dict[str, Any]) -> None:
    """An RL step's phases: the shaded timeline and a table of each phase."""
    page.heading(f"RL step: {doc.get('algo')} on {doc.get('trainer')}, {doc.get('model', name)} ({name})")
    page.figure(figures.rl_phases(doc), f"rl{i}_phases.png",
                "Each band is one phase of the step, in order; its bar is the GPU memory it holds, by allocator "
                "(PyTorch's, vLLM's sleep-mode pool, outside both); the dashed line is the GPU, the dotted one "
                "what the margin leaves.")
    page.table(["phase", "device", "torch", "cumem", "outside", "fails"],
               [[p["name"], format_bytes(p["device_used_bytes"]),
                 *(format_bytes(p["by_allocator"].get(a, 0)) for a in ("torch", "cumem", "outside")),
                 p.get("fails") or ""] for p in doc["phases"]])
    page.paragraph(f"Step: {step_description(doc.get('model', name), (doc.get('settings') or {}).get('setup'))}. "
                   f"{rl_verdict(doc)}.")


def _reorder_section(page: _Page, i: int, name: str, doc: dict[str, Any]) -> None:
    """A reorder result: live memory per operator order, and the peaks."""
    page.heading(f"Operator order ({name})")
    page.paragraph(f"Step reordered: {step_description(doc.get('model'), doc.get('setup'))}"
                   + ("" if doc.get("setup") else " (its setup is not in the reorder JSON)") + ".")
    series = doc.get("timelines") or {}
    if series:
        page.figure(
            figures.before_after({k: np.asarray(v) / 2**30 for k, v in series.items()}, "live GiB",
                                 "Live memory under each operator order"),
            f"reorder{i}_timeline.png",
            "Lower is better: memplan's order keeps fewer tensors alive at once than program order.",
        )
    labels = {"baseline_peak_bytes": "program order", "inductor_peak_bytes": "best Inductor order",
              "optimized_peak_bytes": "memplan order", "lower_bound_bytes": "lower bound"}
    values = {label: doc[k] / 2**30 for k, label in labels.items() if isinstance(doc.get(k), (int, float))}
    page.figure(figures.bars(values, "peak GiB", "Peak memory per operator order"), f"reorder{i}_peaks.png",
                "Program order, the best Inductor-style order and memplan's order, with the lower bound.")


def _offload_section(page: _Page, i: int, name: str, doc: dict[str, Any]) -> None:
    """An offload result: device memory and links over the step, and throughput against the baselines."""
    page.heading(f"Offloading ({name})")
    page.paragraph(f"Step: {step_description(doc.get('model'), doc.get('setup'))}. {offload_verdict(doc)}.")
    series = doc.get("timelines") or {}
    if series:
        page.figure(
            figures.before_after({k: np.asarray(v) for k, v in series.items()}, "GiB or GB/s",
                                 "Device memory and link use over the step"),
            f"offload{i}_timeline.png",
            "Device memory stays under the budget while the links carry the offloaded tensors.",
        )
    throughput = {"memplan": doc.get("throughput_vs_ideal", 0.0)}
    infeasible = set() if doc.get("feasible", True) else {"memplan"}
    for base, v in (doc.get("baselines") or {}).items():
        throughput[base] = v.get("throughput_vs_ideal", 0.0) if isinstance(v, dict) else 0.0
        if isinstance(v, dict) and not v.get("feasible", True):
            infeasible.add(base)
    over = f" Over the budget, so not drawn as a throughput: {', '.join(sorted(infeasible))}." if infeasible else ""
    page.figure(figures.bars(throughput, "throughput / ideal", "Throughput against an unlimited-memory GPU",
                             infeasible=frozenset(infeasible)),
                f"offload{i}_throughput.png",
                "Higher is better: memplan's lifetime-aware plan against the baselines, as a fraction of ideal."
                + over)


def _signed(doc: dict[str, Any]) -> str:
    """A difference entry of `memplan compare` as "+1.2 MiB (+0.4%)"."""
    if doc.get("difference_bytes") is None:
        return "-"
    rel = doc.get("difference")
    sign = "+" if doc["difference_bytes"] >= 0 else "-"
    text = f"{sign}{format_bytes(abs(doc['difference_bytes']))}"
    return text + (f" ({100 * rel:+.2f}%)" if rel is not None else "")


def _size_or_dash(value: Any) -> str:
    return "-" if value is None else format_bytes(value)


def _compare_section(page: _Page, name: str, doc: dict[str, Any]) -> None:
    """Measured against estimated: the peaks, the breakdown at the peak, phases, unmatched buffers."""
    measured, estimated = doc["measured"], doc["estimated"]
    page.heading(f"Measured vs estimated ({measured['label']} against {estimated['label']})")
    rows = [[k.replace("_bytes", "").replace("_", " "), _size_or_dash(v["measured"]), _size_or_dash(v["estimated"]),
             _signed(v)] for k, v in doc["figures"].items()]
    rows += [[f"at the peak: {k}", _size_or_dash(v["measured"]), _size_or_dash(v["estimated"]), _signed(v)]
             for k, v in doc["breakdown"].items()]
    rows.append(["phase of the peak", doc["peak_phase"]["measured"], doc["peak_phase"]["estimated"], ""])
    page.table(["figure", "measured", "estimated", "estimate - measured"], rows)
    for key, title in (("only_measured", "only in the measured step"), ("only_estimated", "only in the estimate")):
        buffers = doc.get(key)
        if buffers:
            page.paragraph(f"Largest buffers live at the peak {title}:")
            page.table(["size", "category", "phase", "name"],
                       [[format_bytes(b["nbytes"]), b["category"], b["phase"], b["name"]] for b in buffers])
    for note in measured.get("notes", []) + estimated.get("notes", []):
        page.paragraph(note)


def _oom_section(page: _Page, name: str, doc: dict[str, Any]) -> None:
    """An out-of-memory error and the changes that fit."""
    page.heading(f"Out of memory ({name})")
    page.paragraph(doc.get("message", ""))
    fits = (doc.get("suggestions") or {}).get("fits") or []
    if fits:
        page.table(["change", "estimated peak", "capacity"],
                   [[c["command"], format_bytes(c["peak_bytes"]), format_bytes(c["capacity_bytes"])] for c in fits])
    refused = (doc.get("suggestions") or {}).get("refused")
    if refused:
        page.paragraph(f"No suggestions: {refused}")


def _write_page(page: _Page, paths: list[str | os.PathLike]) -> Path:
    """Write the page's HTML atomically as `index.html` beside its figures; return its path."""
    out_dir = page.out_dir
    index = out_dir / "index.html"
    body = "\n".join(page.sections)
    doc = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>memplan report</title>"
           f"<style>{_CSS}</style></head><body><h1>memplan report</h1>"
           f"<p>Inputs: {html.escape(', '.join(str(Path(p).name) for p in paths))}</p>{body}</body></html>\n")
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".index.", suffix=".html")
    with os.fdopen(fd, "w") as fh:
        fh.write(doc)
    os.chmod(tmp, 0o644)
    os.replace(tmp, index)
    return index
