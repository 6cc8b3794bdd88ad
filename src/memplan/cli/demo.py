"""`memplan demo`: the main job on the embedded default, end to end, in about a minute.

The default is a GPT-2 (124M) fine-tuning step as it would run on one GPU: batch 8,
sequence 1024, bf16 weights, AdamW (foreach), full activation checkpointing, traced on
fake tensors (no memory, no GPU needed). The demo

1. captures the step once (`memplan trace`) and exports a PyTorch memory snapshot;
2. estimates that trace on an A10G (`memplan estimate TRACE`);
3. replays it through the caching allocator, expandable segments and the ideal one,
   plans its addresses (`memplan plan`) and replays the plan (`memplan simulate`);
4. reorders the operators of the step's graph (`memplan reorder`, which traces the
   step as one operator graph; batch 1 and seq 128 to stay quick);
5. plans offloading of that trace to one NVMe drive and host memory (`memplan offload TRACE`)
   under a budget the step does not fit in: halfway between its resident floor (what no
   plan can move: at the busiest op, the bytes not idle there) and its peak, so the
   methods differ (on the whole A10G every method would keep the step at full speed);
6. checks a capture against torch.profiler on a small real CPU training step;
7. draws the report (`memplan report`).

Every step goes through the same command-line entry points a user would type, and
writes its JSON next to the report in the output directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.cli import SUBCOMMANDS, main, print_json
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them

    from memplan.trace import Trace

DEFAULT_MODEL = "gpt2"
DEFAULT_SETUP = ["--batch", "8", "--seq", "1024", "--precision", "bf16-true", "--checkpointing", "full"]
DEFAULT_GPU = "a10g"
STAGES = 7  # what the progress bar counts: the numbered steps of the module docstring
OFFLOAD_BUDGET_FRACTION = 0.5  # of the way from the resident floor to the peak


def offload_budget_bytes(trace: Trace) -> int:
    """The demo's offloading budget: `OFFLOAD_BUDGET_FRACTION` of the way from the step's
    resident floor (`memplan.offload.lifetimes.resident_floor_bytes`) to its peak."""
    from memplan.offload.lifetimes import op_peak_bytes, resident_floor_bytes

    floor = resident_floor_bytes(trace)
    peak = int(op_peak_bytes(trace).max(initial=0))
    return floor + int(OFFLOAD_BUDGET_FRACTION * (peak - floor))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help=SUBCOMMANDS["demo"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--output-dir", default="memplan-out", help="where outputs go (default memplan-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _run_cli(argv: list[str], log: io.TextIOBase) -> str:
    """Run one memplan subcommand in-process; return its stdout, send its stderr to `log`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(log):
        code = main(argv)
    if code != 0:
        raise UserError(f"demo step 'memplan {' '.join(argv)}' failed (exit {code}); see the demo log")
    return out.getvalue()


@contextlib.contextmanager
def _quiet_fds() -> Iterator[None]:
    """Send what is written on the raw stdout and stderr file descriptors to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _real_cpu_check() -> dict[str, Any]:
    """A small real CPU training step: captured peak vs torch.profiler's peak."""
    from memplan import models
    from memplan.capture import capture
    from memplan.capture.groundtruth import profiler_peak_bytes
    from memplan.capture.step import build_training_step

    step = build_training_step(models.tiny_config("gpt2"), models.TrainingSetup(batch=4, seq=64), device="cpu")
    step.run()
    with _quiet_fds():  # the profiler's C++ side prints start/stop lines on the raw fds
        truth = profiler_peak_bytes(step.run)
    trace = capture(step.run, model=step.model, optimizer=step.optimizer, inputs=step.batches)
    captured = trace.peak()[0]
    return {"model": "tiny gpt2 (real, cpu)", "captured_peak_bytes": captured, "profiler_peak_bytes": truth,
            "error": (captured - truth) / truth}


def _output_paths(out_dir: Path) -> dict[str, Path]:
    """Where each output of the demo goes."""
    return {
        "trace": out_dir / f"{DEFAULT_MODEL}-step.memtrace",
        "snapshot": out_dir / f"{DEFAULT_MODEL}-step.pickle",
        "plan": out_dir / "plan.json",
        "estimate": out_dir / "estimate.json",
        "reorder": out_dir / "reorder.json",
        "offload": out_dir / "offload.json",
        "report": out_dir / "report",
        "log": out_dir / "demo.log",
    }


def _json_stage(argv: list[str], path: Path, log: io.TextIOBase) -> dict[str, Any]:
    """Run one subcommand with --json, keep its output in `path`, return it parsed."""
    text = _run_cli([*argv, "--json"], log)
    path.write_text(text)
    return json.loads(text)


def _run_stages(paths: dict[str, Path], log: io.TextIOBase,
                advance: Callable[[str], None]) -> tuple[Trace, dict[str, Any]]:
    """Every stage of the demo on the one captured trace: the trace, and the results by stage."""
    from memplan.trace import load, save_snapshot

    trace_file = str(paths["trace"])
    _run_cli(["trace", DEFAULT_MODEL, *DEFAULT_SETUP, "-o", trace_file], log)
    trace = load(paths["trace"])
    save_snapshot(trace, paths["snapshot"])
    advance("estimate it on one GPU")
    results: dict[str, Any] = {
        "estimate": _json_stage(["estimate", trace_file, "--gpu", DEFAULT_GPU], paths["estimate"], log)}
    advance("allocators and the address plan")
    _run_cli(["plan", trace_file, "-o", str(paths["plan"])], log)
    results["allocators"] = {
        a: json.loads(_run_cli(["simulate", trace_file, "--allocator", a, "--json"]
                               + (["--plan", str(paths["plan"])] if a == "planned" else []), log))
        for a in ("caching", "expandable", "ideal", "planned")
    }
    advance("reorder the operators")
    results["reorder"] = _json_stage(["reorder", DEFAULT_MODEL, "--batch", "1", "--seq", "128", "--precision", "bf16-true",
                                      "--time-limit", "10"], paths["reorder"], log)
    advance("plan offloading")
    results["offload"] = _json_stage(["offload", trace_file, "--gpu", DEFAULT_GPU, "--nvme", "1x990pro",
                                      "--host-mem", "32GiB", "--budget", str(offload_budget_bytes(trace))],
                                     paths["offload"], log)
    advance("real CPU step vs torch.profiler")
    results["real_cpu_check"] = _real_cpu_check()
    advance("draw the report")
    _run_cli(["report", trace_file, str(paths["plan"]), str(paths["estimate"]), str(paths["reorder"]),
              str(paths["offload"]), "-o", str(paths["report"])], log)
    advance("done")
    return trace, results


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    out_dir = Path(args.output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory: choose another --output-dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = _output_paths(out_dir)
    with open(paths["log"], "w") as log, Progress(
        TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("capture the training step", total=STAGES)
        trace, results = _run_stages(paths, log, lambda next_description: progress.update(
            task, advance=1, description=next_description))
    summary = trace.summary(top=0)
    doc = {
        "model": DEFAULT_MODEL,
        "setup": trace.meta.get("setup"),
        "peak_bytes": summary["peak_bytes"],
        "peak_phase": summary["peak_phase"],
        "breakdown": summary["breakdown"],
        **results,
        "outputs": {k: str(v) for k, v in paths.items()} | {"report": str(paths["report"] / "index.html")},
    }
    if args.json:
        print_json(doc)
        return 0
    _render(summary, results, paths, out_dir)
    return 0


def _render(summary: dict[str, Any], results: dict[str, Any], paths: dict[str, Path], out_dir: Path) -> None:
    """The demo's answers as question/answer rows on stdout."""
    echo(render_text(summary, results, paths, out_dir))


def render_text(summary: dict[str, Any], results: dict[str, Any], paths: dict[str, Path], out_dir: Path) -> str:
    """The demo's answers: a headline, question/answer rows and where the report is."""
    est = results["estimate"]
    rows = [(f"device memory used on one {DEFAULT_GPU} (estimate)",
             f"{format_bytes(est['device_used_bytes'])} — {'fits' if est['fits'] else 'does not fit'}")]
    rows += [(f"reserved by the {a} allocator",
              f"{format_bytes(r['peak_reserved_bytes'])} ({100 * r['fragmentation']:.1f}% fragmentation)")
             for a, r in results["allocators"].items()]
    reo = results["reorder"]
    rows.append(("peak after reordering (batch 1, seq 128)",
                 f"{format_bytes(reo['optimized_peak_bytes'])} vs {format_bytes(reo['baseline_peak_bytes'])} "
                 f"in program order"))
    rows += offload_rows(results["offload"])
    real = results["real_cpu_check"]
    rows.append(("real CPU step: captured vs profiler peak",
                 f"{format_bytes(real['captured_peak_bytes'])} vs {format_bytes(real['profiler_peak_bytes'])} "
                 f"({100 * real['error']:+.2f}%)"))
    return (paragraph(f"{DEFAULT_MODEL} training step (batch 8, seq 1024, bf16, AdamW, full checkpointing): "
                      f"peak live {format_bytes(summary['peak_bytes'])} in {summary['peak_phase']}")
            + "\n" + pairs(rows, title="memplan on the default job") + "\n"
            + paragraph(f"report: {paths['report'] / 'index.html'}  (all outputs in {out_dir}/)"))


def offload_rows(off: dict[str, Any]) -> list[tuple[str, str]]:
    """The offload panel: the budget against the peak, then each method's throughput
    against an unlimited GPU, or why it does not fit."""
    rows = [(f"offloading under a {format_bytes(off['budget_bytes'])} budget",
             f"peak without offload {format_bytes(off['peak_device_bytes_without_offload'])}")]
    methods = {"memplan": {"throughput_vs_ideal": off["throughput_vs_ideal"], "feasible": off["feasible"],
                           "note": ""}} | off["baselines"]
    for name, r in methods.items():
        if r["feasible"]:
            rows.append((f"  {name}: throughput vs unlimited GPU", f"{100 * r['throughput_vs_ideal']:.1f}%"))
        else:
            rows.append((f"  {name}", "over budget"))
    return rows
