"""`memplan rl MODEL --algo grpo|ppo|dpo|rloo --trainer trl|verl|openrlhf ...`: the memory of
one RL post-training step, phase by phase, on one GPU.

The setup and layout flags are `memplan estimate`'s (the policy's micro-batch is
`--batch`, its steps per generation `--grad-accum`); the engine flags are vLLM's as the
trainers spell them (`--vllm-gpu-memory-utilization`, `--vllm-tensor-parallel-size`...).
A step that does not fit is an answer (exit 0): the phase that fails and by how much; a
setting the trainer does not have is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memplan.cli import SUBCOMMANDS, print_json
from memplan.cli.flags import add_layout_flags, add_setup_flags, layout_from_args, setup_from_args
from memplan.cli.table import echo, paragraph, table
from memplan.errors import UserError
from memplan.rl.trainers import ALGOS, OFFLOADS, REFERENCES, ROLLOUTS, TRAINERS, trainer_rules
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.rl.estimate import RLEstimate

ENGINE_FLAGS = (  # (flag, dest, type, help)
    ("--vllm-gpu-memory-utilization", "gpu_memory_utilization", float,
     "fraction of the GPU's total memory the engine may take (default: the trainer's)"),
    ("--vllm-tensor-parallel-size", "tp", int, "the engine's tensor-parallel size (default 1)"),
    ("--vllm-max-num-seqs", "max_num_seqs", int, "requests in one batch (default: the trainer's or vLLM's)"),
    ("--vllm-max-num-batched-tokens", "max_num_batched_tokens", int, "tokens in one batch (default: the trainer's)"),
    ("--vllm-max-model-len", "max_model_len", int, "longest request (default: the model's positions)"),
    ("--vllm-version", "engine_version", str, "vLLM version whose rules apply (default memplan serve's)"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "rl",
        help=SUBCOMMANDS["rl"],
        description="One step of RL post-training on one GPU, phase by phase: the engine's start, the weight sync, "
        "the rollout, the log-probability passes and the training step, each with its residents, its peak and "
        "the allocator holding each term; the peak phase, the verdict and the cheapest changes that fit.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="registry name, config.json path or Hub id org/name (or from --from)")
    p.add_argument("--algo", choices=ALGOS, default=None, help="the algorithm (default grpo)")
    p.add_argument("--trainer", choices=TRAINERS, default=None, help="the trainer whose placement applies (default trl)")
    p.add_argument("--from", dest="rl_from", default=None, metavar="FILE",
                   help="the trainer's own configuration: TRL GRPOConfig/DPOConfig JSON or YAML, verl ppo_trainer "
                        "YAML overrides, OpenRLHF arguments as JSON/YAML; flags given win")
    add_setup_flags(p, model_input=False)
    add_layout_flags(p)
    g = p.add_argument_group("RL step")
    g.add_argument("--rollout", choices=ROLLOUTS, default=None,
                   help="who generates (default vllm-colocate; hf: transformers generate on the policy, traced "
                        "as memplan generate traces it)")
    g.add_argument("--sleep-level", type=int, default=None, choices=(0, 1, 2),
                   help="the colocated engine's sleep level (0: sleep mode off; default: the trainer's)")
    g.add_argument("--prompt-len", type=int, default=None, metavar="P", help="prompt tokens (default 512)")
    g.add_argument("--completion-len", type=int, default=None, metavar="C", help="completion tokens (default 1024)")
    g.add_argument("--num-generations", type=int, default=None, metavar="G", help="completions per prompt (default 8)")
    g.add_argument("--reference", choices=REFERENCES, default=None,
                   help="the reference model: none, a copy, or the disabled LoRA adapter (default: the trainer's)")
    g.add_argument("--beta", type=float, default=None, help="KL coefficient (0: no reference; default the trainer's)")
    g.add_argument("--offload-between-phases", default=None, metavar="WHAT",
                   help="params,optimizer: what the trainer keeps on the host between phases (verl's "
                        "param_offload / optimizer_offload; OpenRLHF's --ds.enable_sleep: optimizer)")
    g.add_argument("--critic", default=None, metavar="MODEL", help="PPO's value model")
    g.add_argument("--reward-model", default=None, metavar="MODEL", help="a reward model scored on the GPU")
    for flag, dest, kind, text in ENGINE_FLAGS:
        g.add_argument(flag, flag.replace("-", "_").replace("__", "--", 1), dest=dest, type=kind, default=None,
                       help=text)
    g.add_argument("--gpu", default="h100-80gb", metavar="NAME", help="device profile (default h100-80gb)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="target device (default cuda)")
    g.add_argument("--margin", type=float, default=0.05, help="head-room kept free (default 0.05, as estimate)")
    g.add_argument("--what-fits", action="store_true", help="also try the RL knobs and list the changes that fit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _resolved(args: argparse.Namespace) -> dict[str, Any]:
    """Flags, over the `--from` file's values, over the defaults; and the file's report."""
    from_file: dict[str, Any] = {}
    report = None
    if args.rl_from is not None:
        from memplan.rl.config import read_rl_config

        values, report = read_rl_config(args.rl_from)
        from_file = values
    defaults = {"algo": "grpo", "trainer": "trl", "rollout": "vllm-colocate", "prompt_len": 512,
                "completion_len": 1024, "num_generations": 8}
    sections = ("setup", "layout", "engine", "generation", "offload")
    out = {**defaults, **{k: v for k, v in from_file.items() if k not in sections}}
    for key in list(defaults) + ["sleep_level", "reference", "beta", "critic", "reward_model", "model"]:
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    if out["algo"] == "dpo" and args.rollout is None and "rollout" not in from_file:
        out["rollout"] = "hf"  # DPO generates nothing
    out["setup_over"] = from_file.get("setup", {})
    out["layout_over"] = from_file.get("layout", {})
    out["engine"] = {**from_file.get("engine", {}),
                     **{d: getattr(args, d) for _, d, _, _ in ENGINE_FLAGS if getattr(args, d) is not None}}
    out["generation"] = from_file.get("generation", {})
    offload = dict(from_file.get("offload", {}))
    if args.offload_between_phases is not None:
        offload = {k: True for k in args.offload_between_phases.split(",") if k}
    out["offload"] = tuple(k for k in OFFLOADS if offload.get(k)) + tuple(
        k for k, on in offload.items() if on and k not in OFFLOADS)
    out["report"] = report
    return out


def run(args: argparse.Namespace) -> int:
    values = _resolved(args)
    if values.get("model") is None:
        raise UserError("a model is required: give MODEL or --from FILE naming one")
    setup = setup_from_args(args)
    layout = layout_from_args(args)
    setup, layout = _with_file(setup, layout, values, args)
    from memplan.rl.estimate import estimate_rl
    from memplan.rl.whatfits import what_fits

    result = estimate_rl(
        values["model"], values["algo"], values["trainer"], rollout=values["rollout"],
        prompt_len=values["prompt_len"], completion_len=values["completion_len"],
        num_generations=values["num_generations"], setup=setup, layout=layout, gpu=args.gpu, device=args.device,
        sleep_level=values.get("sleep_level"), reference=values.get("reference"), beta=values.get("beta"),
        critic=values.get("critic"), reward_model=values.get("reward_model"), engine=values["engine"],
        margin=args.margin, generation=values["generation"], offload=values["offload"])
    if args.what_fits:
        tried: list[str] = []
        result.what_fits = what_fits(result, tried=tried)
        result.what_fits_tried = tried
    out = result.to_json()
    if values["report"] is not None:
        out["from"] = values["report"]
    if args.json:
        print_json(out)
    else:
        render(result, values["report"])
    return 0


def _with_file(setup: Any, layout: Any, values: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any]:
    """The setup and layout with the `--from` file's fields, then the trainer's defaults
    (TRL: fp32 weights under bf16 autocast, gradient checkpointing), where no flag was typed."""
    typed = {a.dest for a in args._parser._actions
             if a.option_strings and getattr(args, a.dest, a.default) != a.default}
    trainer = trainer_rules(values["trainer"])
    setup_fields = {k: v for k, v in {**dict(trainer.setup_defaults), **values["setup_over"]}.items() if k not in typed}
    layout_fields = {k: v for k, v in values["layout_over"].items() if k not in typed}
    return replace(setup, **setup_fields), replace(layout, **layout_fields)


def render(r: RLEstimate, report: dict[str, Any] | None) -> None:
    """The phase table, the verdict, the changes that fit and the assumptions."""
    s = r.settings
    title = (f"{r.job.model}: {r.job.algo} on {r.job.trainer} {s['trainer_version']}, rollout {r.job.rollout}, "
             f"{r.job.gpu} x {r.job.layout.world_size}, P {r.job.prompt_len} + C {r.job.completion_len}, "
             f"micro-batch {s['micro_batch']}, sleep {s['sleep_level']}, reference {s['reference']}")
    rows = []
    for p in r.phases:
        top = max((i for i in p.items if i.kind == "transient"), key=lambda i: i.bytes, default=None)
        mark = " *" if p is r.peak_phase else ""
        rows.append([p.name + mark, format_bytes(p.device_used_bytes), format_bytes(p.allocator_bytes("torch")),
                     format_bytes(p.allocator_bytes("cumem")), format_bytes(p.allocator_bytes("outside")),
                     f"{top.label} {format_bytes(top.bytes)}" if top is not None and top.bytes else "residents"])
    echo(table(["phase", "device", "torch", "cumem", "outside", "sets the peak"], rows, title=title))
    echo(paragraph("device: as nvidia-smi shows it; a phase needs it less PyTorch's free cache, which PyTorch "
                   "gives back before an out-of-memory error (not to a vLLM wake-up)"))
    echo(paragraph(_verdict(r)))
    if r.what_fits_tried and not r.what_fits:
        echo(paragraph("no change tried fits: " + ", ".join(r.what_fits_tried)))
    for c in r.what_fits:
        echo(paragraph(f"fits with {c['change']}: peak {format_bytes(c['peak_bytes'])} in {c['peak_phase']} "
                       f"(margin {format_bytes(c['margin_bytes'])})"))
    if report is not None:
        echo(paragraph(f"--from {report['format']}: used {', '.join(report['used']) or 'nothing'}; ignored "
                       f"{', '.join(report['ignored']) or 'nothing'}"))
    for line in r.assumptions:
        echo(paragraph(f"- {line}"))


def _verdict(r: RLEstimate) -> str:
    peak, failing = r.peak_phase, r.failing_phase
    usable = format_bytes(r.usable_bytes)
    if failing is None:
        return (f"fits: peak {format_bytes(peak.needed_bytes)} needed in {peak.name}, {usable} usable "
                f"({r.job.margin:.0%} margin; {r.elapsed_s:.1f} s)")
    if failing.fails:
        return f"does not fit: {failing.name} fails: {failing.fails}"
    over = failing.needed_bytes - r.usable_bytes
    return (f"does not fit: {failing.name} needs {format_bytes(failing.needed_bytes)}, {format_bytes(over)} "
            f"over the {usable} usable ({r.job.margin:.0%} margin); peak phase {peak.name}")
