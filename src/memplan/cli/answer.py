"""How the CLI says whether a job fits: the margin flag, the verdict line, and the
`memplan estimate` command line of a candidate that `memplan fit` (or the estimate's
suggestion) shows, so that running it gives the same figures."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

from memplan.errors import UserError
from memplan.models.fields import flags_of
from memplan.units import format_bytes

if TYPE_CHECKING:  # imported where they are used: parsing the command line needs none of them
    from memplan.estimation import Estimate
    from memplan.estimation.search import Candidate

MARGIN_HELP = ("share of the capacity kept free for what the estimate does not see: fits when device used <= "
               "capacity x (1 - margin) (default %(search_margin)s)")


class DefaultsHelp(argparse.HelpFormatter):
    """Help with the estimate's and the searches' defaults filled in when the help is printed:
    they live in `memplan.estimation`, which imports torch, and parsing a command line needs
    none of them."""

    def _expand_help(self, action: argparse.Action) -> str:
        if "%(search_" not in (action.help or ""):
            return super()._expand_help(action)
        from memplan.estimation.margin import DEFAULT_MARGIN

        if "%(search_" not in (action.help or "").replace("%(search_margin)s", ""):
            return self._get_help_string(action) % {"search_margin": f"{DEFAULT_MARGIN:.0%}"}
        from memplan.estimation.fit import DEFAULT_TOP
        from memplan.estimation.maxshape import DEFAULT_STEP
        from memplan.estimation.whatfits import DEFAULT_MAX_NODES

        return self._get_help_string(action) % {
            "search_margin": f"{DEFAULT_MARGIN:.0%}", "search_top": DEFAULT_TOP, "search_step_seq": DEFAULT_STEP["seq"],
            "search_step_batch": DEFAULT_STEP["batch"], "search_max_nodes": DEFAULT_MAX_NODES}


def add_margin_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--margin", default=None, metavar="PCT", help=MARGIN_HELP)


def parse_margin(text: str | None) -> float:
    """`5%` or `0.05` -> 0.05; None (no --margin) -> the default margin."""
    from memplan.estimation.margin import DEFAULT_MARGIN

    if text is None:
        return DEFAULT_MARGIN
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise UserError(f"--margin takes a percentage like 5% or a fraction like 0.05, not {text!r}")
    return value


def margin_text(margin: float) -> str:
    """0.05 -> "5%", as `--margin` takes it back."""
    return f"{margin * 100:g}%"


def verdict(result: Estimate) -> str:
    """"fits: 70.1 GiB of 75.2 GiB usable (79.1 GiB, 5% margin)", or the demand that does not."""
    capacity = f"{format_bytes(result.capacity_bytes)}, {margin_text(result.margin)} margin"
    usable = format_bytes(result.usable_bytes)
    if result.fits:
        return f"fits: {format_bytes(result.device_used_bytes)} of {usable} usable ({capacity})"
    where = " (out of memory even after freeing the allocator's cache)" if result.oom is not None else ""
    return f"does NOT fit: needs {format_bytes(result.device_used_bytes)}{where}, {usable} usable ({capacity})"


def estimate_command(cand: Candidate, allocator: str, margin: float, args: argparse.Namespace) -> str:
    """The `memplan estimate` command line that estimates `cand` under `allocator` and `margin`
    on the GPU, capacity and model of `args`."""
    model = [args.model] if args.model is not None else ["--from", args.from_file]  # flags typed win over the file
    if getattr(args, "trust_remote_code", False):
        model.append("--trust-remote-code")
    argv = ["memplan", "estimate", *model, *flags_of(cand.setup), *flags_of(cand.layout), "--gpu", args.gpu]
    if args.capacity is not None:
        argv += ["--capacity", args.capacity]
    if allocator != "caching":
        argv += ["--allocator", allocator]
    from memplan.estimation.margin import DEFAULT_MARGIN

    if margin != DEFAULT_MARGIN:
        argv += ["--margin", margin_text(margin)]
    return shlex.join(argv)
