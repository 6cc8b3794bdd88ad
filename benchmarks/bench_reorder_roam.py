"""Benchmark: memplan reorder on ROAM's own benchmark set (docs/sources.md §5).

ROAM (Shu et al., arXiv 2310.19295; public code HuiyaoShu/ROAM) reports 15.9% less
theoretical peak than PyTorch's order on average (up to 41%) over 14 runs: alexnet,
vgg11, mnasnet0_5, mobilenet_v2, efficientnet_b0, vit_b_16 (torchvision) and
roberta-base, each at batch 1 and 32, whole training step with Adam. This script runs
memplan on exactly that set, with the definitions, pipeline and time limit of
`bench_reorder.py` (whose `run_case` it calls): the whole step traced on fake tensors
with a CUDA job's defaults (foreach Adam split per parameter, fp32), the theoretical
peak (ROAM's definition) of the program order, of the best Inductor-style order and of
memplan's order, and the proven lower bound.

Inputs: images 3x224x224, 1000 classes, cross-entropy loss, torchvision models built
with `weights=None`; roberta-base (transformers, masked-LM loss) at seq 512, the seq of
`bench_reorder.py`'s roberta-base rows and the model's maximum (ROAM does not state
its seq). Batch-norm buffers (running mean/var, batch counter) are persistent state,
updated in place by the forward pass, as in eager PyTorch.

torchvision is a benchmark-only dependency (`pip install torchvision==0.28.0`). With a
CPU-only torch, PyPI's torchvision wheel (built for CUDA) must NOT go into the project's
virtualenv: its compiled extension does not load, and transformers, which imports
torchvision when it is installed, then fails to import its models in every process.
Install it into a directory of its own and put that on PYTHONPATH for this script only:

    .venv/bin/pip install --no-deps --target /tmp/roam_tv/site torchvision==0.28.0
    PYTHONPATH=/tmp/roam_tv/site .venv/bin/python benchmarks/bench_reorder_roam.py
Writes the `<!-- bench:reorder_roam -->` section of BENCHMARKS.md.

    [PYTHONPATH=DIR] .venv/bin/python benchmarks/bench_reorder_roam.py [--time-limit 60] [--only alexnet]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_reorder import _summary, progress_line, reproduce_command, run_case  # noqa: E402 - after the path insert

# ROAM's figures on this set (docs/sources.md §5): theoretical peak vs PyTorch's order
ROAM_MEAN_REDUCTION = 0.159
ROAM_MAX_REDUCTION = 0.41
# ROAM's per-run reductions, from its repository (HuiyaoShu/ROAM): 1 - results/ours_mem_ss.csv
# "required memory" / results/pt_res.csv "simulated_mem_usage" (their mean is the 15.9%)
ROAM_RUN_REDUCTIONS = {
    ("alexnet", 1): 0.107, ("alexnet", 32): 0.107, ("vgg11", 1): 0.045, ("vgg11", 32): 0.185,
    ("mnasnet0_5", 1): 0.103, ("mnasnet0_5", 32): 0.006, ("mobilenet_v2", 1): 0.276,
    ("mobilenet_v2", 32): 0.310, ("efficientnet_b0", 1): 0.053, ("efficientnet_b0", 32): 0.004,
    ("vit_b_16", 1): 0.281, ("vit_b_16", 32): 0.003, ("roberta-base", 1): 0.343, ("roberta-base", 32): 0.411,
}

IMAGE_SIZE = 224
NUM_CLASSES = 1000
ROBERTA_SEQ = 512
# ROAM's own roberta input (roam/tools/load_models.py): torchtext's RoBERTa-base encoder on
# "Hello world", i.e. <s> Hello world </s>, 4 tokens. Run as extra rows, outside the 14.
ROAM_ROBERTA_SEQ = 4
BATCHES = (1, 32)

# (label, model spec, seq or None for images)
CASES = [
    ("alexnet", "bench_reorder_roam:alexnet", None),
    ("vgg11", "bench_reorder_roam:vgg11", None),
    ("mnasnet0_5", "bench_reorder_roam:mnasnet0_5", None),
    ("mobilenet_v2", "bench_reorder_roam:mobilenet_v2", None),
    ("efficientnet_b0", "bench_reorder_roam:efficientnet_b0", None),
    ("vit_b_16", "bench_reorder_roam:vit_b_16", None),
    ("roberta-base", "roberta-base", ROBERTA_SEQ),
]
EXTRA_CASES = [("roberta-base", "roberta-base", ROAM_ROBERTA_SEQ)]

_TORCHVISION_MODELS: Any = None


def torchvision_models() -> Any:
    """`torchvision.models`, also where torchvision's compiled extension cannot load.

    A torchvision wheel built for CUDA (PyPI's manylinux wheel) on a CPU-only torch has
    a `_C.so` that links CUDA libraries: it does not load, and `import torchvision` then
    fails registering fake kernels for its detection operators (`torchvision::nms`). The
    classification models used here are pure Python and call none of those operators,
    so they are imported from the package without running its `__init__`.
    """
    global _TORCHVISION_MODELS
    if _TORCHVISION_MODELS is not None:
        return _TORCHVISION_MODELS
    try:
        import torchvision.models as tv_models
    except (RuntimeError, OSError):
        import types

        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("torchvision")
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["torchvision"] = package
        import torchvision.models as tv_models
    _TORCHVISION_MODELS = tv_models
    return tv_models


def image_classifier(name: str) -> Callable[[Any], Any]:
    """A memplan model factory: torchvision's `name` (weights=None, 1000 classes) whose
    forward(pixel_values, labels) returns the cross-entropy loss."""

    def factory(setup):  # noqa: ANN001, ANN202 - a memplan model factory
        import contextlib

        import torch
        from torch import nn
        from transformers.initialization import no_init_weights

        build = getattr(torchvision_models(), name)
        # fake weights have no values: skip torch.nn.init (trunc_normal_ reads a scalar back)
        with no_init_weights() if _fake() else contextlib.nullcontext():
            net = build(weights=None, num_classes=NUM_CLASSES)

        class ImageClassifier(nn.Module):
            def __init__(self, net: nn.Module) -> None:
                super().__init__()
                self.net = net

            def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return nn.functional.cross_entropy(self.net(pixel_values), labels)

        model = ImageClassifier(net)

        def make_batch(setup, device, seed):  # noqa: ANN001, ANN202
            generator = None if _fake() else torch.Generator().manual_seed(seed)
            pixels = torch.randn((setup.batch, 3, IMAGE_SIZE, IMAGE_SIZE), generator=generator, device=device)
            labels = torch.randint(0, NUM_CLASSES, (setup.batch,), generator=generator, device=device)
            return {"pixel_values": pixels, "labels": labels}

        model.make_batch = make_batch
        if _fake():
            # as bench_reorder.vit_base: model.to under FakeTensorMode fails for Conv2d;
            # the model is already on the device, in fp32
            model.to = lambda *args, **kwargs: model
        return model

    factory.__name__ = name
    factory.__doc__ = f"torchvision {name} (weights=None) classifying 3x{IMAGE_SIZE}x{IMAGE_SIZE} images, cross-entropy loss."
    return factory


def _fake() -> bool:
    from memplan.models import is_fake_mode_active

    return is_fake_mode_active()


alexnet = image_classifier("alexnet")
vgg11 = image_classifier("vgg11")
mnasnet0_5 = image_classifier("mnasnet0_5")
mobilenet_v2 = image_classifier("mobilenet_v2")
efficientnet_b0 = image_classifier("efficientnet_b0")
vit_b_16 = image_classifier("vit_b_16")


def _gib(nbytes: int) -> str:
    """GiB with 3 decimals: the small CNNs (mnasnet0_5 at batch 1) peak at 0.05 GiB."""
    return f"{nbytes / 2**30:.3f}"


def _input(seq: int | None) -> str:
    return f"seq {seq}" if seq else f"3x{IMAGE_SIZE}x{IMAGE_SIZE}"


def bound_ceiling(rows: list[tuple[str, int, int | None, dict]]) -> float:
    """Mean reduction vs program order if every run reached its lower bound: no order
    can do better than this on these graphs."""
    return statistics.mean(1 - r["lower_bound"] / r["baseline"] for *_x, r in rows if r["lower_bound"] is not None)


def summary_line(rows: list[tuple[str, int, int | None, dict]]) -> str:
    """bench_reorder's summary, the lower bound's ceiling, and ROAM's figures."""
    return (
        f"{_summary(rows)}; reaching the lower bound on every run would give a mean of "
        f"{100 * bound_ceiling(rows):.1f}%. ROAM on this set: mean {100 * ROAM_MEAN_REDUCTION:.1f}%, "
        f"up to {100 * ROAM_MAX_REDUCTION:.0f}%"
    )


def _table_row(label: str, batch: int, seq: int | None, r: dict) -> str:
    red = 1 - r["optimized"] / r["baseline"]
    red_i = 1 - r["optimized"] / r["inductor"]
    bound = _gib(r["lower_bound"]) if r["lower_bound"] is not None else "-"
    return (
        f"| {label} | {batch} | {_input(seq)} | {r['num_nodes']} | {_gib(r['baseline'])} | "
        f"{_gib(r['inductor'])} | {_gib(r['optimized'])} | {100 * red:.1f}% | {100 * red_i:.1f}% | "
        f"{bound} | {r['optimize_s']:.1f} | {r['total_s']:.1f} |"
    )


def _roam_runs_line(rows: list[tuple[str, int, int | None, dict]]) -> str:
    """memplan vs ROAM run by run (ROAM's reductions from its repository's CSVs)."""
    parts = []
    for label, batch, _seq, r in rows:
        roam = ROAM_RUN_REDUCTIONS.get((label, batch))
        if roam is not None:
            parts.append(f"{label} b{batch} {100 * (1 - r['optimized'] / r['baseline']):.1f} / {100 * roam:.1f}")
    return "; ".join(parts)


def write_section(rows: list[tuple[str, int, int | None, dict]], extra_rows: list[tuple[str, int, int | None, dict]],
                  failed: list[tuple[str, int, str]], time_limit_s: float, command: str) -> None:
    lines = [
        "<!-- bench:reorder_roam -->",
        "## Operator reordering on ROAM's own benchmark set (memplan reorder vs ROAM's 15.9%)",
        "",
        f"Command: `{command}`",
        "",
        "ROAM's 14 runs (docs/sources.md §5): torchvision alexnet, vgg11, mnasnet0_5, mobilenet_v2,",
        "efficientnet_b0, vit_b_16 (weights=None, 3x224x224 images, 1000 classes, cross-entropy)",
        f"and roberta-base (transformers, masked-LM loss, seq {ROBERTA_SEQ}: ROAM does not state its seq;",
        "512 is the model's maximum and the seq of the `reorder` table's roberta-base rows), each",
        "at batch 1 and 32. Whole training step with foreach Adam (as ROAM), fp32, traced on fake",
        "tensors with a CUDA job's defaults; otherwise the definitions and pipeline of the",
        "`reorder` table (`bench_reorder.run_case`): theoretical peak (ROAM's definition;",
        "parameters, Adam states, batch-norm buffers and inputs included) of the program order",
        "(eager PyTorch), of the best Inductor-style order (LPMF, BFS, DFS or traced, per forward",
        f"/ backward / optimizer graph) and of memplan's order (`optimize_order`, {time_limit_s:g} s limit,",
        "validated); lower bound = `lower_bound_bytes` (no order of this graph can go below it).",
        "Total time includes tracing. GiB = 2^30 bytes.",
        "",
        "| model | batch | input | nodes | program-order GiB | Inductor-style GiB | memplan GiB | vs program | "
        "vs Inductor | lower bound GiB | optimise s | total s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_table_row(*row) for row in rows]
    lines += [f"| {label} | {batch} | failed: {reason} | | | | | | | | | |" for label, batch, reason in failed]
    lines += ["", f"**ROAM's set** ({len(rows)} of {len(rows) + len(failed)} runs): {summary_line(rows)}."]
    if rows:
        lines += ["", "Run by run, memplan / ROAM % below program order (ROAM's from its repository, "
                  "HuiyaoShu/ROAM `results/pt_res.csv` vs `results/ours_mem_ss.csv`, whose mean is "
                  f"its 15.9%): {_roam_runs_line(rows)}."]
    if extra_rows:
        lines += [
            "",
            f"Extra rows: roberta-base at seq {ROAM_ROBERTA_SEQ}, the input ROAM's repository uses",
            "(`roam/tools/load_models.py`: torchtext's RoBERTa-base encoder on \"Hello world\",",
            "4 tokens; here with transformers' masked-LM head and loss).",
            "",
            "| model | batch | input | nodes | program-order GiB | Inductor-style GiB | memplan GiB | vs program | "
            "vs Inductor | lower bound GiB | optimise s | total s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [_table_row(*row) for row in extra_rows]
        swapped = [row for row in rows if row[0] != "roberta-base"] + extra_rows
        lines += ["", f"With roberta-base at seq {ROAM_ROBERTA_SEQ} in place of seq {ROBERTA_SEQ} "
                  f"({len(swapped)} runs): {_summary(swapped)}; lower-bound ceiling "
                  f"{100 * bound_ceiling(swapped):.1f}%."]
    lines += ["<!-- /bench:reorder_roam -->"]
    from benchmarks_md import write_section as write_bench_section

    write_bench_section("reorder_roam", "\n".join(lines))


def _run(label: str, spec: str, seq: int | None, batch: int, time_limit_s: float,
         rows: list, failed: list) -> None:
    try:
        row = run_case(spec, batch, seq, time_limit_s, optimizer="adam")
    except Exception as exc:  # noqa: BLE001 - a model that does not trace is a failed row
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        reason = f"{type(exc).__name__}: {text}".replace("|", "/")
        failed.append((label, batch, reason))
        print(f"{label} b{batch}: FAILED {reason}", flush=True)
        return
    rows.append((label, batch, seq, row))
    print(progress_line(f"{label} b{batch} {_input(seq)}", row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default all)")
    parser.add_argument("--no-extra", action="store_true", help=f"skip the roberta-base seq {ROAM_ROBERTA_SEQ} rows")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if importlib.util.find_spec("torchvision") is None:
        print("torchvision is not installed (a benchmark-only dependency): pip install torchvision==0.28.0 "
              "(with a CPU-only torch: --no-deps --target DIR, then PYTHONPATH=DIR; see the module docstring)",
              file=sys.stderr)
        return 2
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torchvision_models()
    rows: list = []
    extra_rows: list = []
    failed: list = []
    start = time.perf_counter()
    cases = [(c, rows) for c in CASES] + ([] if args.no_extra else [(c, extra_rows) for c in EXTRA_CASES])
    for (label, spec, seq), into in cases:
        if args.only and label not in args.only:
            continue
        for batch in BATCHES:
            _run(label, spec, seq, batch, args.time_limit, into, failed)
    if rows:
        print(summary_line(rows), flush=True)
    print(f"all runs: {time.perf_counter() - start:.0f} s", flush=True)
    tv_dir = Path(importlib.util.find_spec("torchvision").origin).parents[1]
    prefix = f"PYTHONPATH={tv_dir} " if str(tv_dir) in os.environ.get("PYTHONPATH", "").split(os.pathsep) else ""
    command = prefix + reproduce_command("bench_reorder_roam.py", args.time_limit, args.only,
                                         "--no-extra" if args.no_extra else "")
    if rows and not args.no_write:
        write_section(rows, extra_rows, failed, args.time_limit, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
