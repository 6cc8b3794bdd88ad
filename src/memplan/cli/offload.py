"""`memplan offload MODEL|TRACE --gpu NAME --nvme SPEC --host-mem SIZE`: plan and simulate TERAIO-style offloading."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import add_setup_flags, setup_from_args
from memplan.cli.from_file import from_json
from memplan.cli.inputs import model_arg, refuse_retracing, trace_path
from memplan.cli.table import echo, pairs, paragraph
from memplan.errors import UserError
from memplan.units import format_bytes, parse_size

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.hardware.links import Hardware
    from memplan.offload.steps import OffloadSteps


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "offload",
        help=SUBCOMMANDS["offload"],
        description="Capture MODEL's training step on fake tensors (or take the step a TRACE recorded), "
        "plan which idle tensors leave device memory and when (greedy benefit/cost with one bandwidth "
        "timeline per link), simulate the step with the transfers, and compare with ZeRO-Offload-, "
        "ZeRO-Infinity- and torchtune-like baselines in the same simulator.",
    )
    p.add_argument("model", metavar="MODEL|TRACE", nargs="?", default=None,
                   help="registry model name (e.g. llama-3-8b), config.json path, package.module:factory, "
                   "or a .memtrace / PyTorch snapshot pickle of the step")
    add_setup_flags(p)
    p.add_argument("--gpu", required=True, metavar="NAME", help="GPU profile, e.g. h100-nvl-94gb")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs in the node, one NVMe array each (default 1)")
    p.add_argument("--zero", type=int, choices=(0, 3), default=0, metavar="STAGE",
                   help="3: plan one FSDP2 (ZeRO-3) rank of the --gpus GPUs, parameters, gradients and optimizer "
                   "states sharded over them (TorchTitan, TERAIO's setting); 0: a whole replica per GPU (default)")
    p.add_argument("--nvme", default="4x990pro", metavar="SPEC",
                   help="one GPU's RAID-0 array: NxDRIVE (4x990pro, 2xpm1743) or NxBANDWIDTH (2x7GB/s); 0 for none")
    p.add_argument("--host-mem", default="0", metavar="SIZE", help="host memory offloading may use, whole node (default 0)")
    p.add_argument("--pcie", default=None, metavar="LINK",
                   help="pcie-gen4-x8, pcie-gen4-x16, pcie-gen5-x8 or pcie-gen5-x16 (default: the GPU's)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="device-memory budget (default: capacity less CUDA context and cuBLAS workspace)")
    p.add_argument("--try-checkpointing", action="store_true",
                   help="also plan the step under each activation-checkpointing policy (selective, selective-op, "
                   "full) and report the fastest plan, against the ideal step without recomputation")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="which device's buffers to plan when a TRACE has several (e.g. cuda:0)")
    p.add_argument("--plan-output", default=None, metavar="plan.json", help="write the plan as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from memplan.hardware.links import make_hardware
    from memplan.offload.evaluate import evaluate
    from memplan.offload.plan_file import save_offload_plan

    if args.zero == 3 and args.gpus < 2:
        raise UserError("--zero 3 shards over the node's GPUs: give --gpus N with N >= 2")
    hardware = make_hardware(args.gpu, nvme=args.nvme, host_mem=args.host_mem, gpus=args.gpus, pcie=args.pcie)
    budget = None if args.budget is None else parse_size(args.budget)
    path = trace_path(args.model)
    steps = _traced_steps(path, args) if path is not None else _captured_steps(args)
    sys.stderr.write(f"memplan: planning {steps.trace.num_ops} ops"
                     f"{' under 4 checkpointing policies' if steps.alternatives else ''}"
                     f"{f' (one FSDP2 rank of {args.gpus})' if args.zero == 3 else ''} ...\n")
    report, plan = evaluate(steps.trace, hardware, budget, steps.checkpointed, steps.alternatives,
                            baseline_trace=steps.baseline_trace)
    report = {"model": args.model, "setup": steps.setup, "zero": args.zero, **report, **from_json(args)}
    if args.plan_output:
        save_offload_plan(plan, args.plan_output)
        report["plan_output"] = args.plan_output
    if args.json:
        print_json(report)
        return 0
    _render(report, plan, hardware, args)
    return 0


def _traced_steps(path: Path, args: argparse.Namespace) -> OffloadSteps:
    """The step a trace file recorded, as it is: no other setup, layout or checkpointing policy."""
    from memplan.offload.steps import traced_steps
    from memplan.trace import load

    trace = load(path)
    refuse_retracing(args.model, trace, args)
    if args.zero == 3:
        raise UserError(f"{args.model} is a trace of one device: it cannot be re-traced as one FSDP2 rank "
                        "(--zero 3): pass the model instead of the trace")
    if args.try_checkpointing:
        raise UserError(f"{args.model} is a trace: it cannot be re-traced under other checkpointing policies "
                        "(--try-checkpointing): pass the model instead of the trace")
    return traced_steps(trace, args.device)


def _captured_steps(args: argparse.Namespace) -> OffloadSteps:
    """MODEL's step captured on fake tensors, and its variants (`memplan.offload.steps`)."""
    from memplan.models import load_config
    from memplan.offload.steps import captured_steps

    if args.device is not None:
        raise UserError("--device picks a device of a TRACE; a captured MODEL step runs on one GPU")
    setup = setup_from_args(args)
    if args.try_checkpointing and setup.checkpointing != "none":
        raise UserError(f"--try-checkpointing tries every checkpointing policy itself: drop "
                        f"`checkpointing={setup.checkpointing}`")
    config = model_arg(args)
    return captured_steps(load_config(config) if isinstance(config, str) else config, setup, zero=args.zero,
                          gpus=args.gpus, try_checkpointing=args.try_checkpointing, name=args.model)


def _render(report: dict[str, Any], plan: Any, hardware: Hardware, args: argparse.Namespace) -> None:
    """The report as method/result rows on stdout, then where the plan went."""
    ckpt = report["checkpointing"]
    rows = [("ideal step", f"{report['ideal_step_s']:.3f} s"),
            ("memplan", f"{report['planned_step_s']:.3f} s, {report['throughput_vs_ideal']:.1%} of ideal"
             f"{' with checkpointing ' + ckpt if ckpt != 'none' else ''} (peak "
             f"{format_bytes(report['peak_device_bytes'])}, {format_bytes(report['offloaded_bytes'])} offloaded, "
             f"planned in {report['plan_elapsed_s']:.1f} s)"
             f"{'' if report['feasible'] else '; over budget: no plan fits it'}")]
    if report["step_lower_bound_s"] is not None and report["step_lower_bound_s"] > report["ideal_step_s"]:
        rows.append(("link bound", f"{report['step_lower_bound_s']:.3f} s, {report['throughput_upper_bound']:.1%} "
                     "of ideal at most, for any plan on these links"))
    for policy, c in report.get("checkpointing_search", {}).items():
        rows.append((f"  checkpointing {policy}", f"{c['planned_step_s']:.3f} s, {c['throughput_vs_ideal']:.1%} "
                     f"of ideal{'' if c['feasible'] else ' (over budget)'}"))
    for name, b in report["baselines"].items():
        note = f" ({b['note']})" if b["feasible"] and b["note"] else "" if b["feasible"] else f"; infeasible: {b['note']}"
        rows.append((name, f"{b['step_s']:.3f} s, {b['throughput_vs_ideal']:.1%} of ideal{note}"))
    echo(pairs(rows, title=f"{args.model} on {hardware.gpu.name} (budget {format_bytes(report['budget_bytes'])}, "
               f"peak without offload {format_bytes(report['peak_device_bytes_without_offload'])})"))
    if args.plan_output and plan.tensors.unnamed:
        what = ", ".join(f"{format_bytes(n)} of {c}s" for c, n in sorted(plan.tensors.unnamed.items()))
        echo(paragraph(f"plan written to {args.plan_output}: for the simulation only; it moves {what}, which "
                       "memplan.offload.run does not move (plan with categories=memplan.offload.runtime_categories() "
                       "for a plan it applies)"))
    elif args.plan_output:
        echo(paragraph(f"plan written to {args.plan_output}; apply it to this step's training with "
                       f"memplan.offload.run(model, optimizer, memplan.offload.load_offload_plan({args.plan_output!r}), "
                       "memplan.offload.RunOptions(directory=...))"))
