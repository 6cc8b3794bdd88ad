"""`memplan offload MODEL --gpu NAME --nvme SPEC --host-mem SIZE`: plan and simulate TERAIO-style offloading."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from memplan.models import add_setup_flags

    p = subparsers.add_parser(
        "offload",
        help="plan lifetime-aware offloading to NVMe and host memory (TERAIO) and simulate the step",
        description="Capture MODEL's training step on fake tensors, plan which idle tensors leave "
        "device memory and when (greedy benefit/cost with one bandwidth timeline per link), "
        "simulate the step with the transfers, and compare with ZeRO-Offload-, ZeRO-Infinity- "
        "and torchtune-like baselines in the same simulator.",
    )
    p.add_argument("model", metavar="MODEL", help="registry model name, e.g. llama-3-8b")
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
    p.add_argument("--plan-output", default=None, metavar="plan.json", help="write the plan as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from memplan.cli import print_json
    from memplan.errors import UserError
    from memplan.estimation.pipeline import capture_step
    from memplan.hardware.links import make_hardware
    from memplan.models import load_config, setup_from_args
    from memplan.offload.evaluate import RECOMPUTE_POLICIES, evaluate
    from memplan.parallel.layout import Layout
    from memplan.parallel.transform import rank_trace
    from memplan.trace.io import atomic_write
    from memplan.trace.model import Trace
    from memplan.units import format_bytes, parse_size

    if args.zero == 3 and args.gpus < 2:
        raise UserError("--zero 3 shards over the node's GPUs: give --gpus N with N >= 2")
    hardware = make_hardware(args.gpu, nvme=args.nvme, host_mem=args.host_mem, gpus=args.gpus, pcie=args.pcie)
    budget = None if args.budget is None else parse_size(args.budget)
    setup = setup_from_args(args)
    if args.try_checkpointing and setup.checkpointing != "none":
        raise UserError(f"--try-checkpointing tries every checkpointing policy itself: drop --checkpointing "
                        f"{setup.checkpointing}")
    if setup.optimizer_impl is None:
        # one foreach kernel touches every state at once: nothing could be away during it
        setup = dataclasses.replace(setup, optimizer_impl="loop")
        sys.stderr.write("memplan: offload plans a per-parameter optimizer step (--optimizer-impl loop)\n")

    config = load_config(args.model)

    def captured(step_setup: Any, what: str, planned: bool = True) -> tuple[Trace | None, Trace]:
        """(the trace memplan plans, None unless `planned`; the whole step's trace) under `step_setup`."""
        sys.stderr.write(f"memplan: capturing {args.model}{what} on fake tensors ...\n")
        step = capture_step(config, step_setup, "cuda")
        if args.zero == 0 or not planned:
            return (step.trace if planned else None), step.trace
        return rank_trace(step, Layout(world_size=args.gpus, zero=3), step_setup, 0), step.trace

    trace, whole = captured(setup, "")
    assert trace is not None
    checkpointed = planned_full = None
    alternatives = {}
    if setup.checkpointing == "none":
        # the ZeRO baselines' activation offload (DeepSpeed's cpu_checkpointing) needs activation checkpointing;
        # memplan plans this step too only when it searches the checkpointing policies
        planned_full, checkpointed = captured(dataclasses.replace(setup, checkpointing="full"),
                                              " with full activation checkpointing (the ZeRO baselines')",
                                              planned=args.try_checkpointing)
    if args.try_checkpointing:
        for policy in RECOMPUTE_POLICIES:
            if policy == "full":
                alternatives[policy] = planned_full
                continue
            alternatives[policy], _ = captured(dataclasses.replace(setup, checkpointing=policy),
                                               f" with checkpointing {policy}")
    sys.stderr.write(f"memplan: planning {trace.num_ops} ops{' under 4 checkpointing policies' if alternatives else ''}"
                     f"{f' (one FSDP2 rank of {args.gpus})' if args.zero == 3 else ''} ...\n")
    report, plan = evaluate(trace, hardware, budget, checkpointed, alternatives,
                            baseline_trace=whole if args.zero == 3 else None)
    report = {"model": args.model, "setup": setup.to_dict(), "zero": args.zero, **report}
    if args.plan_output:
        doc = json.dumps(plan.to_json()).encode()
        atomic_write(args.plan_output, lambda f: f.write(doc))
        report["plan_output"] = args.plan_output
    if args.json:
        print_json(report)
        return 0
    out = sys.stdout
    out.write(
        f"{args.model} on {hardware.gpu.name} (budget {format_bytes(report['budget_bytes'])}, "
        f"peak without offload {format_bytes(report['peak_device_bytes_without_offload'])})\n"
        f"  ideal step      {report['ideal_step_s']:.3f} s\n"
        f"  memplan         {report['planned_step_s']:.3f} s  {report['throughput_vs_ideal']:.1%} of ideal"
        f"{' with checkpointing ' + report['checkpointing'] if report['checkpointing'] != 'none' else ''}"
        f"  (peak {format_bytes(report['peak_device_bytes'])}, {format_bytes(report['offloaded_bytes'])} offloaded, "
        f"planned in {report['plan_elapsed_s']:.1f} s)\n"
    )
    if report["step_lower_bound_s"] is not None and report["step_lower_bound_s"] > report["ideal_step_s"]:
        out.write(f"  link bound      {report['step_lower_bound_s']:.3f} s  {report['throughput_upper_bound']:.1%} of ideal "
                  f"at most, for any plan on these links\n")
    for policy, c in report.get("checkpointing_search", {}).items():
        flag = "" if c["feasible"] else "  (over budget)"
        out.write(f"    checkpointing {policy:<13}{c['planned_step_s']:.3f} s  {c['throughput_vs_ideal']:.1%} of ideal{flag}\n")
    for name, b in report["baselines"].items():
        flag = f"  ({b['note']})" if b["feasible"] else f"  infeasible: {b['note']}"
        out.write(f"  {name:<22}{b['step_s']:.3f} s  {b['throughput_vs_ideal']:.1%} of ideal{flag}\n")
    if args.plan_output and plan.tensors.unnamed:
        what = ", ".join(f"{format_bytes(n)} of {c}s" for c, n in sorted(plan.tensors.unnamed.items()))
        out.write(f"  plan written to {args.plan_output}: for the simulation only; it moves {what}, which "
                  "memplan.offload.run does not move (plan with categories=memplan.offload.runtime_categories() "
                  "for a plan it applies)\n")
    elif args.plan_output:
        out.write(f"  plan written to {args.plan_output}; apply it to this step's training with "
                  f"memplan.offload.run(model, optimizer, memplan.offload.load_plan({args.plan_output!r}), "
                  "directory=...)\n")
    return 0
