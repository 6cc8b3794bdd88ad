"""The command a user types to train, read as its launcher reads it.

`parse_command(["torchrun", "--nproc-per-node", "8", "train.py", "--lr", "1e-4"])` returns a
`Launch`: the program to run in memplan's own process (a script path or a module name), its
own arguments (untouched), and the world the launcher would start (`world_size` ranks,
`nproc_per_node` of them per node), with the environment each rank gets.

Each launcher is parsed with its own parser where it has one, so that every option it takes
is read as it reads it:

- `python [-u|-O|-B...] SCRIPT|-m MODULE ARGS...` (also `python3`, a path to a Python):
  one process, no distributed environment;
- `torchrun ...` and `python -m torch.distributed.run ...`: PyTorch's own parser
  (`torch.distributed.run.get_args_parser`, torch/distributed/run.py); the world is
  `--nnodes` (the maximum of `MIN:MAX`) x `--nproc-per-node`, the environment what its
  elastic agent sets per worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR, MASTER_PORT; `torch/distributed/elastic/agent/server/
  local_elastic_agent.py`, `_start_workers`).

- `accelerate launch [--config_file F] [options] SCRIPT|-m MODULE ARGS...`: accelerate's own
  parser and config file (`accelerate.commands.launch`: `launch_command_parser`,
  `_validate_launch_command`), and the environment its launcher gives each worker
  (`accelerate.utils.launch.prepare_multi_gpu_env`: `ACCELERATE_USE_FSDP`, `FSDP_*`,
  `ACCELERATE_MIXED_PRECISION`, ... for a multi-GPU, FSDP or Megatron launch, then
  torchrun's; `prepare_simple_launcher_cmd_env` for one process; `prepare_deepspeed_cmd_env`
  for DeepSpeed on one machine: ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_*, as
  `deepspeed_launcher` gives torchrun). TPU and multi-machine DeepSpeed launches are refused.
- `trl sft|dpo|grpo|... ARGS`: TRL's own CLI (the `trl` console script's entry point,
  `trl.cli:main`) run here until it hands its `accelerate launch` of trl/scripts/NAME.py to
  accelerate; that launch is read as `accelerate launch` above.
- `litgpt finetune_lora|finetune_full|pretrain|... ARGS`: LitGPT's console script's entry point
  (`litgpt.__main__:main`, jsonargparse), called as its wrapper calls it: it parses and trains
  in the process it runs in (Lightning Fabric starts no process for one device, and none under
  torchrun's environment).
- `tune run [TORCHRUN-OPTIONS] RECIPE --config CONFIG [KEY=VALUE...]`: torchtune's own parser
  and recipe lookup (`torchtune._cli.run.Run`, torchtune/_cli/run.py in torchtune 0.6.1): a
  recipe or config named as torchtune ships them is its file in torchtune's `recipes/`, another
  recipe a module path; the recipe runs as a script with `--config` and the overrides as typed,
  the working directory appended to `sys.path` (`Run._run_cmd`). With torchrun options it is
  torchrun's world (`Run._run_distributed`), as for `torchrun` above.
- `deepspeed [options] SCRIPT|--module MODULE ARGS...`: DeepSpeed's own parser
  (`deepspeed.launcher.runner.parse_args`) and resource rules (`fetch_hostfile`,
  `parse_inclusion_exclusion`, `apply_num_nodes_and_gpus`): the world is every slot left
  (`--num_gpus` per node on one node without a hostfile: the GPUs of a machine memplan does not
  run on cannot be counted), each rank gets the environment its per-node launcher sets
  (`deepspeed/launcher/launch.py`, `main`: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, CROSS_RANK,
  CROSS_SIZE, LOCAL_SIZE, RANK, LOCAL_RANK) and `--local_rank=L` before the program's own
  arguments unless `--no_local_rank`.

`LAUNCHERS` maps each supported first word to its parser; another launcher is one more
entry (docs/run.md says what each of the others would need). Anything else is a
`UserError` naming those supported.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import UserError

_GPU_FOR_PARSING: contextvars.ContextVar[Callable[[], AbstractContextManager]] = contextvars.ContextVar(
    "gpu_for_parsing", default=contextlib.nullcontext)
MASTER_ADDR = "127.0.0.1"
MASTER_PORT = "29500"  # torchrun's default (--master-port)


@dataclass(frozen=True)
class Launch:
    """One training command: what to run, with which arguments, in which world."""

    launcher: str  # "python", "torchrun", "accelerate", "trl", "litgpt", "tune" or "deepspeed"
    target: str  # a script path, a module name when `module`, a console script's name when `entry`
    args: tuple[str, ...]  # the program's own arguments, as typed
    module: bool = False
    world_size: int = 1
    nproc_per_node: int = 1
    distributed: bool = False  # whether the launcher sets the distributed environment
    env: dict[str, str] = field(default_factory=dict)  # the launcher's own settings for every rank
    entry: str | None = None  # a console script's entry point, `module:function`
    path_after: tuple[str, ...] = ()  # folders the launcher appends to `sys.path` (tune run: the working directory)
    local_rank_arg: bool = False  # `--local_rank=L` goes before the program's arguments (deepspeed)

    @property
    def argv0(self) -> str:
        """`sys.argv[0]` as the program sees it (`-m`: the module's file is unknown until it runs)."""
        return self.target if not self.module else "-m"

    @property
    def folder(self) -> Path:
        """The program's own folder: its script's, a console script's package's, else the
        working directory (`python -m`)."""
        if self.entry is not None:
            import importlib.util

            spec = importlib.util.find_spec(self.entry.split(":")[0].split(".")[0])
            locations = list(spec.submodule_search_locations or []) if spec is not None else []
            return Path(locations[0]) if locations else Path.cwd()
        return Path(self.target).resolve().parent if not self.module else Path.cwd()

    @property
    def path_entry(self) -> str | None:
        """What the interpreter puts first on `sys.path` for this program: the script's folder,
        the working directory for `-m` (""), nothing of the program's for a console script
        (its wrapper's own folder)."""
        if self.entry is not None:
            return None
        return "" if self.module else str(self.folder)

    def rank_args(self, rank: int) -> tuple[str, ...]:
        """The arguments rank `rank`'s process gets after its script (`sys.argv[1:]`)."""
        if self.local_rank_arg:
            return (f"--local_rank={rank % self.nproc_per_node}", *self.args)
        return self.args

    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment the launcher gives rank `rank` (nothing for a plain `python`)."""
        if not self.distributed:
            return dict(self.env)
        local = rank % self.nproc_per_node
        if self.launcher == "deepspeed":  # deepspeed/launcher/launch.py, main
            return {**self.env, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(self.world_size),
                    "LOCAL_SIZE": str(self.nproc_per_node), "CROSS_RANK": str(rank // self.nproc_per_node),
                    "CROSS_SIZE": str(self.world_size // self.nproc_per_node),
                    "MASTER_ADDR": self.env.get("MASTER_ADDR", MASTER_ADDR),
                    "MASTER_PORT": self.env.get("MASTER_PORT", MASTER_PORT)}
        return {**self.env, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node), "GROUP_RANK": str(rank // self.nproc_per_node),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": self.env.get("MASTER_ADDR", MASTER_ADDR),
                "MASTER_PORT": self.env.get("MASTER_PORT", MASTER_PORT), "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}


_PYTHON_FLAGS = frozenset("-u -O -OO -B -E -s -S -I -q -b -bb -d -v".split())


def _python_launch(words: list[str], launcher: str = "python") -> Launch:
    """`python [flags] SCRIPT|-m MODULE ARGS...`."""
    rest = list(words[1:])
    while rest and rest[0] in _PYTHON_FLAGS:
        rest.pop(0)
    if rest and rest[0] in ("-W", "-X"):
        rest = rest[2:]
    if not rest:
        raise UserError(f"`{' '.join(words)}` names no script: give `python train.py ...` or `python -m module ...`")
    if rest[0] == "-c":
        raise UserError("`python -c CODE` is not a training program memplan can run: save it as a script")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise UserError("`python -m` names no module")
        if rest[1] in ("torch.distributed.run", "torch.distributed.launch"):
            return _torchrun_launch(["torchrun", *rest[2:]])
        return Launch(launcher, rest[1], tuple(rest[2:]), module=True)
    if rest[0].startswith("-"):
        raise UserError(f"python option {rest[0]} is not one memplan run reads: put it in the environment "
                        "(PYTHONWARNINGS, ...) or leave it out")
    return Launch(launcher, rest[0], tuple(rest[1:]))


def _torchrun_launch(words: list[str]) -> Launch:
    """`torchrun [options] SCRIPT|-m MODULE ARGS...`, read by PyTorch's own parser."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args(words[1:])
    except (SystemExit, Exception) as exc:  # argparse exits on a bad option
        raise UserError(f"torchrun could not read `{' '.join(words[1:])}`: {exc}") from None
    return _torchrun_world(args, "torchrun", args.training_script, tuple(args.training_script_args),
                           module=bool(args.module))


def _torchrun_world(args: Any, launcher: str, target: str, program_args: tuple[str, ...], module: bool,
                    path_after: tuple[str, ...] = ()) -> Launch:
    """The `Launch` of torchrun's parsed options `args` (its world and environment) running `target`."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        nproc = int(args.nproc_per_node)
    except ValueError:
        raise UserError(f"torchrun --nproc-per-node {args.nproc_per_node}: memplan needs the number of processes "
                        "per node (the GPUs it would start): give a whole number") from None
    _min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.no_python:
        raise UserError("torchrun --no-python runs a binary, not a Python program memplan can trace")
    env = {}
    if args.master_addr:
        env["MASTER_ADDR"] = str(args.master_addr)
    if args.master_port:
        env["MASTER_PORT"] = str(args.master_port)
    return Launch(launcher, target, program_args, module=module, world_size=max_nodes * nproc,
                  nproc_per_node=nproc, distributed=True, env=env, path_after=path_after)


def _accelerate_launch(words: list[str]) -> Launch:
    """`accelerate launch ...`, read by accelerate's own parser and config file."""
    if words[1:2] != ["launch"]:
        raise UserError(f"memplan run runs `accelerate launch ...`, not `accelerate {' '.join(words[1:2])}`")
    from accelerate.commands.launch import launch_command_parser

    try:
        args = launch_command_parser().parse_args(words[2:])
    except (SystemExit, Exception) as exc:  # argparse exits on a bad option
        raise UserError(f"accelerate launch could not read `{' '.join(words[2:])}`: {exc}") from None
    return _accelerate_launch_of(args, "accelerate", " ".join(words[2:]))


def _accelerate_launch_of(args: Any, launcher: str, typed: str) -> Launch:
    """The `Launch` of accelerate's parsed launch arguments (its config file read, its
    per-worker environment made)."""
    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    try:
        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    except (SystemExit, Exception) as exc:  # accelerate raises ValueError on a bad combination
        raise UserError(f"accelerate launch could not read `{typed}`: {exc}") from None
    if args.tpu or (args.use_deepspeed and args.num_machines > 1):
        raise UserError("accelerate launch on TPU or with DeepSpeed on several machines: memplan run does not "
                        "run these yet (docs/run.md, Launchers)")
    if args.main_process_port is None:
        args.main_process_port = 0  # a free port: the check of the default one is no concern of a fake group
    distributed = bool(args.use_fsdp or args.multi_gpu or args.use_megatron_lm or args.use_deepspeed) and not args.cpu
    if args.use_deepspeed:  # one machine: torchrun's world with DeepSpeed's environment (deepspeed_launcher)
        from accelerate.utils.launch import prepare_deepspeed_cmd_env

        fields = list(defaults.deepspeed_config) if defaults else []  # accelerate.commands.launch, launch_command
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mixed_precision_from_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args) if distributed else prepare_simple_launcher_cmd_env(args)[1]
    env = {k: v for k, v in env.items() if os.environ.get(k) != v}
    nproc = int(args.nproc_per_node) if distributed else 1
    return Launch(launcher, args.training_script, tuple(args.training_script_args), module=bool(args.module),
                  world_size=int(args.num_processes) if distributed else 1, nproc_per_node=nproc,
                  distributed=distributed, env=env)


def console_script(name: str) -> str:
    """The entry point (`module:function`) of the console script `name` an installed package
    declares (its `console_scripts` entry points: what the `name` wrapper on the PATH runs)."""
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name=name)
    if not found:
        raise UserError(f"`{name}` is not installed in memplan's environment (no `{name}` console script): "
                        f"install the package that provides it where memplan runs")
    return next(iter(found)).value


def _trl_launch(words: list[str]) -> Launch:
    """`trl sft|dpo|grpo|... ARGS`: TRL's own CLI (its console script's entry point, run here)
    reads the arguments and hands an `accelerate launch` of its training script
    (trl/scripts/NAME.py) to accelerate (`trl.cli.accelerate_launcher.launch_training_script`);
    that launch, taken where accelerate would run it, is read as `accelerate launch`."""
    entry = _load_entry(console_script("trl"))
    import transformers.training_args  # noqa: F401 - imported as on the host: its imports probe torch.cuda
    from trl.cli import accelerate_launcher

    launches: list[Any] = []
    launch_script = accelerate_launcher.launch_training_script

    def take_launch(script_name: str, launch_args: list[str], training_script_args: list[str], **_kw: Any) -> None:
        launch_script(script_name, launch_args, training_script_args, launch_command_fn=launches.append)

    accelerate_launcher.launch_training_script = take_launch
    try:
        with _GPU_FOR_PARSING.get()():  # its TrainingArguments check the GPU the run is for (bf16)
            entry(list(words[1:]))
    except SystemExit as exc:  # argparse's --help or a bad option
        raise UserError(f"trl could not read `{' '.join(words[1:])}` (exit {exc.code})") from None
    finally:
        accelerate_launcher.launch_training_script = launch_script
    if not launches:
        raise UserError(f"`{' '.join(words)}` launches no training: memplan run runs TRL's training commands "
                        "(trl sft, dpo, grpo, kto, reward, rloo, ...)")
    return _accelerate_launch_of(launches[0], "trl", " ".join(words[1:]))


def _load_entry(value: str) -> Callable[..., Any]:
    """The function an entry point `module:attr.attr` names."""
    import importlib

    module, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def _litgpt_launch(words: list[str]) -> Launch:
    """`litgpt finetune|pretrain ... ARGS`: LitGPT's console script, whose entry point parses
    its arguments (jsonargparse) and trains in the process it runs in (Lightning Fabric starts
    no other process for one device)."""
    return Launch("litgpt", words[0], tuple(words[1:]), entry=console_script("litgpt"))


def _tune_launch(words: list[str]) -> Launch:
    """`tune run [TORCHRUN-OPTIONS] RECIPE --config CONFIG ...`, read by torchtune's own parser and lookup."""
    if words[1:2] != ["run"]:
        raise UserError(f"memplan run runs `tune run RECIPE --config CONFIG`, not `tune {' '.join(words[1:2])}`")
    try:  # imported for the GPU the run is for: torchtune decides at import whether it has flex
        # attention (torchtune/utils/_import_guard.py, `_SUPPORTS_FLEX_ATTENTION`: CUDA of
        # capability >= 7.5), and the recipe runs in this process with that answer
        with _GPU_FOR_PARSING.get()():
            from torchtune._cli.run import ROOT, Run
    except ImportError as exc:  # torchtune imports torchao's internals, which move between releases
        raise UserError(f"`tune run` needs torchtune, which does not import here ({type(exc).__name__}: {exc}): "
                        "install a torchtune that imports with this torch and torchao (docs/run.md, tune run)") from None
    parser = argparse.ArgumentParser(prog="tune", exit_on_error=False)
    tune_run = Run(parser.add_subparsers())
    try:
        args = parser.parse_args(words[1:])
        config_at = args.recipe_args.index("--config") + 1
        config_name = args.recipe_args[config_at]
    except (SystemExit, Exception) as exc:  # argparse exits on a bad option; no --config is a ValueError
        raise UserError(f"tune run could not read `{' '.join(words[2:])}`: {exc} "
                        "(it takes `tune run RECIPE --config CONFIG [KEY=VALUE...]`)") from None
    recipe = tune_run._get_recipe(args.recipe)
    config = tune_run._get_config(config_name, recipe)
    program_args = list(args.recipe_args)
    if config is not None:
        program_args[config_at] = str(ROOT / "recipes" / "configs" / config.file_path)
    builtin = recipe is not None
    target = str(ROOT / "recipes" / recipe.file_path) if builtin else tune_run._convert_to_dotpath(args.recipe)
    path_after = (os.getcwd(),)
    if len(words) - 2 > len(args.recipe_args) + 1:  # torchrun options before the recipe (`_is_distributed_args`)
        if builtin and not recipe.supports_distributed:
            raise UserError(f"torchtune's recipe {recipe.name} does not support distributed training: "
                            "run it without torchrun options")
        return _torchrun_world(args, "tune", target, tuple(program_args), module=not builtin, path_after=path_after)
    return Launch("tune", target, tuple(program_args), module=not builtin, path_after=path_after)


def _deepspeed_launch(words: list[str]) -> Launch:
    """`deepspeed [options] SCRIPT ARGS...`, read by DeepSpeed's own parser and resource rules."""
    from deepspeed.launcher.runner import (
        apply_num_nodes_and_gpus,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    try:
        args = parse_args(words[1:])
    except (SystemExit, Exception) as exc:  # argparse exits on a bad option
        raise UserError(f"deepspeed could not read `{' '.join(words[1:])}`: {exc}") from None
    if args.no_python or args.autotuning:
        raise UserError("deepspeed --no_python / --autotuning do not run one Python training program memplan "
                        "can trace: leave them out")
    pool = fetch_hostfile(args.hostfile)
    if not pool:
        if args.num_gpus < 1:
            raise UserError("deepspeed without --num_gpus starts one process per GPU of the machine it runs on: "
                            "give --num_gpus N (the GPUs of the node memplan run traces for)")
        if args.num_nodes > 1:
            raise UserError("deepspeed --num_nodes > 1 needs a hostfile (--hostfile) naming the nodes")
        pool = {"localhost": args.num_gpus}
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise UserError("deepspeed cannot take --num_nodes/--num_gpus with --include/--exclude")
    try:
        active = apply_num_nodes_and_gpus(parse_inclusion_exclusion(pool, args.include, args.exclude),
                                          args.num_nodes, args.num_gpus)
    except (ValueError, AssertionError) as exc:
        raise UserError(f"deepspeed's resources: {exc}") from None
    slots = [len(ids) for ids in active.values()]
    if len(set(slots)) != 1:
        raise UserError(f"deepspeed's nodes have different numbers of GPUs ({slots}): memplan run needs "
                        "the same number per node")
    env = {"MASTER_PORT": str(args.master_port)}
    if args.master_addr:
        env["MASTER_ADDR"] = args.master_addr
    return Launch("deepspeed", args.user_script, tuple(args.user_args), module=bool(args.module),
                  world_size=sum(slots), nproc_per_node=slots[0], distributed=True, env=env,
                  local_rank_arg=not args.no_local_rank)


LAUNCHERS: dict[str, Callable[[list[str]], Launch]] = {
    "python": _python_launch,
    "torchrun": _torchrun_launch,
    "accelerate": _accelerate_launch,
    "trl": _trl_launch,
    "litgpt": _litgpt_launch,
    "tune": _tune_launch,
    "deepspeed": _deepspeed_launch,
}


def launcher_of(word: str) -> str | None:
    """The launcher a command's first word names (`python3.11`, `/usr/bin/python` -> python)."""
    name = Path(word).name
    if name in LAUNCHERS:
        return name
    if name.startswith("python") and name[6:].replace(".", "").isdigit():
        return "python"
    return None


def run_launched(launch: Launch) -> None:
    """Run the program in this process as its launcher starts it, `sys.argv` already set: a
    script by `runpy.run_path`, a module by `runpy.run_module`, a console script by calling its
    entry point as its wrapper does (`sys.exit(main())`: a non-zero result is an exit status)."""
    import runpy

    if launch.entry is not None:
        status = _load_entry(launch.entry)()
        if status not in (None, 0):
            raise SystemExit(status)
    elif launch.module:
        runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(launch.target, run_name="__main__")


def parse_command(words: list[str], gpu: Callable[[], AbstractContextManager] | None = None) -> Launch:
    """The `Launch` of a training command (module docstring); `UserError` for one memplan cannot run.
    `gpu`: a context in which `torch.cuda` answers as the GPU the run is for
    (`memplan.program.cuda_api.answering`), entered by a launcher whose own CLI checks it (trl)
    or whose package, imported to read the command, decides at import what the GPU can do
    (torchtune)."""
    if not words:
        raise UserError("memplan run needs the training command after `--`, e.g. "
                        "`memplan run -- torchrun --nproc-per-node 8 train.py`")
    name = launcher_of(words[0])
    if name is None:
        if words[0].endswith(".py") and os.path.exists(words[0]):
            raise UserError(f"`{words[0]}` is a script: give the command that runs it, `python {words[0]} ...`")
        raise UserError(f"memplan run does not know the launcher `{words[0]}`: it runs "
                        f"{', '.join(sorted(LAUNCHERS))} commands")
    token = _GPU_FOR_PARSING.set(gpu or contextlib.nullcontext)
    try:
        return LAUNCHERS[name](words)
    finally:
        _GPU_FOR_PARSING.reset(token)
