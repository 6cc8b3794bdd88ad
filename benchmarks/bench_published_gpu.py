"""`memplan estimate` against published peak-memory measurements of real GPU fine-tuning runs.

The estimate is checked against what real GPU runs reported (docs/sources.md §10). The
cases, their sources (URL and the quoted figure), the metric each source printed and
every setup detail the source leaves unstated (`guessed`) are data, in
`benchmarks/published_gpu.json`; nothing in memplan is tuned to them. For each case this
script runs `memplan.estimate(model, setup, layout, device="cuda", gpu=...)` and compares
the reported metric with the matching figure:

- `max_memory_allocated` and `active_peak` (torch.cuda's `active_bytes.all.peak`, equal
  to allocated bytes for whole-block requests) -> `peak_allocated_bytes`;
- `max_memory_reserved`, and `reserved_after_step_p99` (a high percentile of
  `memory_reserved()` read after each step: the reserved peak of the longest steps) ->
  `peak_reserved_bytes`;
- `nvidia_smi` -> `device_used_bytes`. Where the source also measured its own CUDA context
  (`context_measured`), the table adds memplan's reserved bytes plus that context as a
  second figure: the device profile's context is CUDA 12's (lazy loading), and an
  older run's can be four times larger. The main error column keeps the profile's.

Error is (memplan - published) / published. A case marked `setup_reproducible: false`
(its activation-checkpointing policy or mixed-precision scheme has no memplan flag) stays
in the table and the overall mean, and is left out of the second mean. The LitGPT runs are
traced with LitGPT's own model and loop (`impl: litgpt`); torchtune and torchtitan use
their own model code, which memplan does not trace; the HF Trainer runs (the
Transformers docs' bert-large series, a sequence-classification fine-tune: `head: seq-cls`)
and PEFT's MetaMathQA runs use the Hugging Face modules memplan traces. The `notes` column
says where the setup is guessed or the step differs from the step memplan traces.

Where `benchmarks/published_runs/` knows the trainer's own command for a case, the row also
gets `memplan run -- <command>` (a fresh process per case: `run_through_trainer`), the
trainer's program traced as it runs, and the summary gives the median error of those rows
beside the flag-built estimate's on the same rows. Writes the `bench:published_gpu` table of
BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_published_gpu.py [--only ID ...] [--table-only] [--no-trainer] [--no-write]

Each case's last measurement is stored in `benchmarks/results/published_gpu/ID.json`: `--only`
re-measures the cases named and the table keeps the others' stored rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.errors import UserError  # noqa: E402
from memplan.estimation import estimate  # noqa: E402
from memplan.hardware.devices import device_profile  # noqa: E402
from memplan.parallel import Layout  # noqa: E402
from published_runs import Prepare, trainer_runs  # noqa: E402

CASES_JSON = Path(__file__).resolve().parent / "published_gpu.json"
# Each case's last measurement, one file per case: `--only` re-measures some cases and the table
# keeps the others' stored rows (each with the time it was measured).
ROWS_DIR = Path(__file__).resolve().parent / "results" / "published_gpu"
COMMAND = ".venv/bin/python benchmarks/bench_published_gpu.py"
UNIT_BYTES = {"B": 1, "GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20}
METRIC_FIELD = {
    "max_memory_allocated": "peak_allocated_bytes",
    "active_peak": "peak_allocated_bytes",
    "max_memory_reserved": "peak_reserved_bytes",
    "reserved_after_step_p99": "peak_reserved_bytes",
    "nvidia_smi": "device_used_bytes",
}


def figure_bytes(figure: dict[str, Any]) -> int:
    """A `{"value", "unit"}` figure in bytes, in the unit the source printed it in."""
    return int(round(figure["value"] * UNIT_BYTES[figure["unit"]]))


def published_bytes(case: dict[str, Any]) -> int:
    """The published figure in bytes."""
    return figure_bytes(case["published"])


def setup_label(case: dict[str, Any]) -> str:
    """One short line: what was trained, how, on how many GPUs."""
    if case.get("kind") == "loss_op":
        op = case["loss_op"]
        return (f"loss op {op['loss']}: {op['tokens']} tokens x hidden {op['hidden']}, vocabulary {op['vocab']}, "
                f"{op['dtype']}, forward + backward")
    s, layout = case["setup"], case["layout"]
    if s.get("lora_rank"):
        targets = ",".join(t.removesuffix("_proj") for t in s.get("lora_targets") or [])
        method = f"{'DoRA' if s.get('dora') else 'LoRA'} r{s['lora_rank']} ({targets})"
    else:
        method = "full"
    if s.get("quant", "none") != "none":
        method = f"{s['quant']}{' double-quant' if s.get('double_quant') else ''} base, {method}"
    if s.get("head", "lm") == "seq-cls":
        method += f" seq-cls ({s.get('num_labels', 2)} labels)"
    precision = s["dtype"] if s.get("autocast", "none") == "none" else f"{s['dtype']}+{s['autocast']} autocast"
    ac = {"none": "no AC", "full": "full AC", "selective": "selective AC",
          "selective-op": "op-level selective AC"}[s["checkpointing"]]
    world = layout.get("world_size", 1)
    parallel = f"FSDP2 x{world}" if layout.get("zero") == 3 else f"{world} GPU"
    if layout.get("fsdp_param_dtype"):
        parallel += f" ({layout['fsdp_param_dtype']} params)"
    accum = f" x {s['grad_accum']} accum" if s.get("grad_accum", 1) > 1 else ""
    name = s.get("optimizer", "adamw")
    optimizer = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adafactor": "Adafactor", "adamw8bit": "bnb AdamW8bit",
                 "paged-adamw8bit": "bnb PagedAdamW8bit", "paged-adamw": "bnb PagedAdamW", "lion": "bnb Lion",
                 "ao-adamw8bit": "torchao AdamW8bit", "ao-adamw4bit": "torchao AdamW4bit",
                 "ao-adamw-fp8": "torchao AdamWFp8"}[name]
    if s.get("optimizer_impl"):
        optimizer += f" {s['optimizer_impl']}"
    if s.get("optimizer_in_backward"):
        optimizer += " in backward"
    if s.get("cpu_offload", "none") != "none":
        optimizer += f", CPU offload ({s['cpu_offload']})"
    for flag, label in (("loss", "{} loss"), ("compile", "compile {}"), ("activation_offload", "{} activation offload")):
        if s.get(flag, "none") not in ("none", "full"):
            parallel += ", " + label.format(s[flag])
    code = ", LitGPT's GPT" if s.get("impl", "hf") == "litgpt" else ""
    return f"{method}{code}, {precision}, b{s['batch']}{accum} x s{s['seq']}, {optimizer}, {ac}, {parallel}"


def loss_op_peak_bytes(op: dict[str, Any]) -> int:
    """Peak bytes one loss op (forward and backward) allocates beyond its inputs, on a CUDA
    GPU: the [tokens, hidden] hidden states and the [vocab, hidden] classifier traced on
    fake tensors through memplan's fused-linear loss (Liger's algorithm, CUDA code path)
    or transformers' `ForCausalLMLoss` on the classifier's logits (`full`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.loss.loss_utils import ForCausalLMLoss

    from memplan.capture import capture
    from memplan.models.build import TORCH_DTYPES
    from memplan.models.losses import FusedLinearCrossEntropy

    with FakeTensorMode():
        dtype = TORCH_DTYPES[op["dtype"]]
        hidden = torch.randn(op["tokens"], op["hidden"], dtype=dtype, requires_grad=True)
        weight = torch.randn(op["vocab"], op["hidden"], dtype=dtype, requires_grad=True)
        labels = torch.randint(0, op["vocab"], (op["tokens"],))

        def step() -> None:
            if op["loss"] == "fused-linear":
                loss = FusedLinearCrossEntropy.apply(hidden, weight, labels, None, True)
            else:
                loss = ForCausalLMLoss((hidden @ weight.t()).unsqueeze(0), labels.unsqueeze(0), op["vocab"])
            loss.backward()
            hidden.grad = weight.grad = None

        trace = capture(step, inputs=[hidden, weight, labels], record_flops=False)
    before = int(trace.buffers["nbytes"][trace.buffers["alloc_op"] < 0].sum())
    return trace.peak()[0] - before


def run_loss_op_case(case: dict[str, Any]) -> dict[str, Any]:
    """One loss op's peak against its published figure."""
    start = time.perf_counter()
    predicted = loss_op_peak_bytes(case["loss_op"])
    published = published_bytes(case)
    return {"id": case["id"], "published_bytes": published, "memplan_bytes": predicted, "field": "op_peak_bytes",
            "error_pct": 100.0 * (predicted - published) / published, "with_source_context_bytes": None,
            "with_source_context_error_pct": None, "breakdown": {}, "peak_phase": "loss op",
            "parallel": "single device", "elapsed_s": time.perf_counter() - start}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Estimate one case and compare it with its published figure."""
    if case.get("kind") == "loss_op":
        return run_loss_op_case(case)
    setup = models.TrainingSetup.from_dict(case["setup"])
    layout = Layout(**case["layout"])
    start = time.perf_counter()
    cache: dict[Any, Any] = {}
    result = estimate(case["model"], setup, layout, device="cuda", gpu=case["gpu"], cache=cache)
    elapsed_s = time.perf_counter() - start
    field = METRIC_FIELD[case["metric"]]
    predicted = int(getattr(result, field))
    published = published_bytes(case)
    with_context = None
    if case["metric"] == "nvidia_smi" and "context_measured" in case:
        # device used with the source's own measured context in place of the profile's
        # (the captured steps are reused from the cache)
        with_context = estimate(case["model"], setup, layout, device="cuda", gpu=case["gpu"], cache=cache,
                                cuda_context=figure_bytes(case["context_measured"])).device_used_bytes
    return {
        "id": case["id"],
        "published_bytes": published,
        "memplan_bytes": predicted,
        "field": field,
        "error_pct": 100.0 * (predicted - published) / published,
        "with_source_context_bytes": with_context,
        "with_source_context_error_pct": (None if with_context is None
                                          else 100.0 * (with_context - published) / published),
        "breakdown": result.per_rank[0].breakdown,
        "peak_phase": result.per_rank[0].peak_phase,
        "parallel": result.parallel,
        "elapsed_s": elapsed_s,
    }


ROOT = Path(__file__).resolve().parent.parent
# memplan run's limit on the time to an optimizer step: Inductor compiling an 8B model's
# blocks (and torchao's float8 ones) on two loaded cores takes more than its default 600 s
MAX_SECONDS = 1800
# Cases whose published run used software that cannot run here (the Transformers docs' 2022
# Trainer on PyTorch 1.10): the summary also gives the median without them.
PAST_SOFTWARE = ("hf-trainer-",)
SRC = ROOT / "src"


def _shown(command: list[str], workdir: str) -> list[str]:
    """The command as the table shows it: the run's scratch folder as DIR, the repository's
    own files relative to its root."""
    return [word.replace(workdir, "DIR").replace(f"{ROOT}/", "") for word in command]


def run_through_trainer(case: dict[str, Any], prepare: Prepare) -> dict[str, Any]:
    """`memplan run --gpu GPU -- <the trainer's command>` for one case, in a fresh process
    (each program's imports and patches stay its own): the case's metric from the run's
    answer, the largest over the traced ranks."""
    field = METRIC_FIELD[case["metric"]]
    with tempfile.TemporaryDirectory(prefix=f"memplan-published-{case['id']}-") as tmp:
        run = prepare(case, Path(tmp))
        shown = _shown(run.command, tmp)
        out = Path(tmp) / "memplan-run"
        memplan = [sys.executable, "-m", "memplan", "run", "--gpu", case["gpu"], "--json", "-o", str(out),
                   "--max-seconds", str(MAX_SECONDS), "--"]
        env = {**os.environ, **run.env, "PYTHONPATH": os.pathsep.join(
            [str(SRC), *filter(None, [run.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])])}
        start = time.perf_counter()
        done = subprocess.run(memplan + run.command, cwd=run.cwd or tmp, env=env, capture_output=True, text=True)
        elapsed_s = time.perf_counter() - start
        if done.returncode != 0:
            tail = " / ".join(done.stderr.strip().splitlines()[-4:]) or "(no output)"
            return {"failed": f"memplan run exit {done.returncode}: {tail}", "elapsed_s": elapsed_s,
                    "command": shown, "notes": run.notes}
        answer = json.loads((out / "run.json").read_text())
    predicted = max(int(r[field]) for r in answer["per_rank"])
    published = published_bytes(case)
    with_context = None
    if case["metric"] == "nvidia_smi" and "context_measured" in case:
        # device used with the source's own measured context in place of the profile's, as run_case
        with_context = (predicted - device_profile(case["gpu"]).context_bytes()
                        + figure_bytes(case["context_measured"]))
    return {"memplan_bytes": predicted, "error_pct": 100.0 * (predicted - published) / published,
            "with_source_context_bytes": with_context,
            "with_source_context_error_pct": (None if with_context is None
                                              else 100.0 * (with_context - published) / published),
            "peak_phase": answer["per_rank"][0].get("peak_phase"), "seen": answer.get("seen", {}),
            "elapsed_s": elapsed_s, "command": shown, "notes": run.notes}


def _trainer_cells(row: dict[str, Any]) -> str:
    """The two "through the trainer" cells of a row: figure and error, or why there are none."""
    trainer = row.get("trainer")
    if trainer is None:
        return "- | -"
    if "failed" in trainer:
        return "failed | -"
    return f"{_gib(trainer['memplan_bytes'])} | {trainer['error_pct']:+.1f}"


def _trainer_notes(row: dict[str, Any]) -> list[str]:
    trainer = row.get("trainer")
    if trainer is None:
        return []
    # rows stored before the commands were shown relative: the same spelling
    command = re.sub(re.escape(tempfile.gettempdir()) + r"/memplan-published-[^/ ]*", "DIR",
                     " ".join(trainer["command"]))
    command = re.sub(r"\S*/benchmarks/published_runs/", "benchmarks/published_runs/", command)
    said = [f"through the trainer: `memplan run -- {command}`"] + trainer["notes"]
    if trainer.get("with_source_context_bytes") is not None:
        said.append(f"through the trainer with the source's measured context: "
                    f"{_gib(trainer['with_source_context_bytes'])}, {trainer['with_source_context_error_pct']:+.1f}%")
    if "failed" in trainer:
        said.append(f"the run failed: {trainer['failed']}")
    return said


def _trainer_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The median |error| of the rows run through the trainer, beside the flag-built estimate's
    on the same rows."""
    ran = [r for r in rows if "error_pct" in (r.get("trainer") or {})]
    failed = [r["id"] for r in rows if "failed" in (r.get("trainer") or {})]
    if not ran:
        return []
    through = [abs(r["trainer"]["error_pct"]) for r in ran]
    flags = [abs(r["error_pct"]) for r in ran if "error_pct" in r]
    groups: dict[str, list[float]] = {}
    for r in ran:  # the trainer is the case id's first word: litgpt, torchtune, torchao, ...
        name = "hf-trainer" if r["id"].startswith(PAST_SOFTWARE) else r["id"].split("-")[0]
        groups.setdefault(name, []).append(abs(r["trainer"]["error_pct"]))
    by_trainer = ", ".join(f"{name} {statistics.median(errs):.1f}% ({len(errs)})" for name, errs in groups.items())
    line = (f"Through the trainer (`memplan run`): median absolute error {statistics.median(through):.1f}% "
            f"over {len(ran)} rows (mean {statistics.mean(through):.1f}%)"
            + (f", where the flag-built estimate of the same rows has median {statistics.median(flags):.1f}%"
               if flags else "")
            + f"; median per trainer (rows): {by_trainer}")
    current = [abs(r["trainer"]["error_pct"]) for r in ran if not r["id"].startswith(PAST_SOFTWARE)]
    line += (f"; without the HF Trainer rows (measured in 2022 on PyTorch 1.10, which cannot run here: "
             f"bench:hf_trainer_2022) median {statistics.median(current):.1f}% over {len(current)} rows"
             if current and len(current) < len(ran) else "")
    return [line + (f"; {len(failed)} row(s) failed to run: {', '.join(failed)}." if failed else ".")]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def table(cases: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """The BENCHMARKS.md section: command, table, summary."""
    lines = [
        "## memplan estimate vs published GPU peak memory",
        "",
        "Published peak-memory figures of real GPU fine-tuning runs (sources, quotes and every",
        "guessed setup detail in `benchmarks/published_gpu.json`), against `memplan estimate` on the",
        "same model, setup and GPU profile. Error = (memplan - published) / published. The",
        "LitGPT runs are traced with LitGPT's own GPT and fine-tuning loop (--impl litgpt); the",
        "torchtune and torchtitan runs use their own model code, not the Hugging Face",
        "modules memplan traces; the HF Trainer (bert-large classification, V100) and PEFT",
        "MetaMathQA (Llama-3.2-3B, L40S) runs use the Hugging Face modules. For nvidia-smi",
        "figures whose source also measured its CUDA context, `notes` gives memplan's reserved",
        "bytes plus that measured context (the profile's context is CUDA 12's). Reproduce with:",
        "",
        "```",
        COMMAND,
        "```",
        "",
        "The column \"through the trainer\" is `memplan run -- <command>`: the trainer's own program",
        "(`tune run`, torchtitan's `train.py`, `litgpt finetune_*`, a Trainer script) traced as it runs,",
        "with a checkpoint of shapes only and local synthetic data of the published shapes",
        "(`benchmarks/published_runs/`; each row's notes say what was made up).",
        "",
        "| source | model | setup | GPU | metric | published | memplan | error % | through the trainer | error % "
        "| notes |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case, row in zip(cases, rows):
        if "refused" in row:  # a technique this version of memplan does not apply yet
            lines.append(f"| [{case['source']}]({case['url']}) | {case['model']} | {setup_label(case)} | {case['gpu']} "
                         f"| {case['metric']} | {case['published']['value']} {case['published']['unit']} | - | - "
                         f"| {_trainer_cells(row)} | not estimated: {row['refused']} |")
            continue
        published = f"{case['published']['value']} {case['published']['unit']} ({_gib(row['published_bytes'])})"
        notes = "; ".join(["guessed: " + g for g in case.get("guessed", [])]
                          + case.get("known_differences", []) + _trainer_notes(row))
        if row["with_source_context_bytes"] is not None:
            notes = (f"with the source's measured context ({case['context_measured']['value']} "
                     f"{case['context_measured']['unit']}): {_gib(row['with_source_context_bytes'])}, "
                     f"{row['with_source_context_error_pct']:+.1f}%; " + notes)
        lines.append(
            f"| [{case['source']}]({case['url']}) | {case['model']} | {setup_label(case)} | {case['gpu']} "
            f"| {case['metric']} | {published} | {_gib(row['memplan_bytes'])} | {row['error_pct']:+.1f} "
            f"| {_trainer_cells(row)} | {notes} |"
        )
    trainer_lines = _trainer_summary(rows)
    refused = len([r for r in rows if "refused" in r])
    cases = [c for c, r in zip(cases, rows) if "refused" not in r]
    rows = [r for r in rows if "refused" not in r]
    errors = [abs(r["error_pct"]) for r in rows]
    lines.append("")
    if rows:
        worst = max(rows, key=lambda r: abs(r["error_pct"]))
        lines.append(f"Mean absolute error {statistics.mean(errors):.1f}% over {len(rows)} cases "
                     f"(median {statistics.median(errors):.1f}%); worst {worst['id']} {worst['error_pct']:+.1f}%"
                     + (f"; {refused} case(s) name a technique this version does not apply and are not estimated."
                        if refused else "."))
    else:
        lines.append(f"No case estimated: {refused} case(s) name a technique this version does not apply.")
    lines += trainer_lines
    contexts = [abs(r["with_source_context_error_pct"]) for r in rows if r["with_source_context_error_pct"] is not None]
    if contexts:
        lines.append(f"The {len(contexts)} nvidia-smi cases with the source's own measured CUDA context in place of "
                     f"the profile's: mean absolute error {statistics.mean(contexts):.1f}%, "
                     f"median {statistics.median(contexts):.1f}%.")
    matched = [abs(r["error_pct"]) for c, r in zip(cases, rows) if c.get("setup_reproducible", True)]
    if len(matched) < len(rows):
        lines.append(f"Over the {len(matched)} cases whose setup memplan's flags can express "
                     f"(not those marked setup_reproducible: false): mean absolute error "
                     f"{statistics.mean(matched):.1f}%, median {statistics.median(matched):.1f}%.")
    return "\n".join(lines)


def measured_row(case: dict[str, Any], runs: dict[str, Prepare], with_trainer: bool) -> dict[str, Any]:
    """One case measured now: the flag-built estimate and, where a trainer command is known,
    the run through the trainer; printed as it comes."""
    try:
        row = run_case(case)
    except UserError as exc:  # a technique not applied yet: the case waits for it
        row = {"id": case["id"], "refused": str(exc)}
        print(f"{case['id']}: not estimated: {exc}", flush=True)
    else:
        breakdown = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in row["breakdown"].items())
        print(f"{row['id']}: published {_gib(row['published_bytes'])}, memplan {row['field']} "
              f"{_gib(row['memplan_bytes'])} ({row['error_pct']:+.1f}%), peak in {row['peak_phase']}, "
              f"{row['parallel']}, {row['elapsed_s']:.1f} s; breakdown GiB: {breakdown}", flush=True)
    if with_trainer and case["id"] in runs:
        trainer = row["trainer"] = run_through_trainer(case, runs[case["id"]])
        print(f"{case['id']}: through the trainer: "
              + (trainer["failed"] if "failed" in trainer else
                 f"{_gib(trainer['memplan_bytes'])} ({trainer['error_pct']:+.1f}%), peak in "
                 f"{trainer['peak_phase']}") + f", {trainer['elapsed_s']:.1f} s", flush=True)
    row["measured_at"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    return row


def stored_row(case_id: str) -> dict[str, Any] | None:
    """The row a case's last measurement stored (ROWS_DIR), or None."""
    path = ROWS_DIR / f"{case_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=CASES_JSON, help="JSON file of published cases")
    parser.add_argument("--only", nargs="*", default=None, metavar="ID",
                        help="measure only these case ids; the table keeps the other rows' last measurement")
    parser.add_argument("--table-only", action="store_true",
                        help="measure nothing: write the table from the stored rows")
    parser.add_argument("--no-write", action="store_true",
                        help="print only; leave BENCHMARKS.md and the stored rows alone")
    parser.add_argument("--no-trainer", action="store_true",
                        help="leave out the runs through the trainers' own code (benchmarks/published_runs)")
    args = parser.parse_args(argv)

    cases = json.loads(args.cases.read_text())["cases"]
    measure = set() if args.table_only else {c["id"] for c in cases} if args.only is None else set(args.only)
    runs = trainer_runs()
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for case in cases:
        if case["id"] in measure:
            row = measured_row(case, runs, with_trainer=not args.no_trainer)
            if args.no_trainer and (old := stored_row(case["id"])) and "trainer" in old:
                row["trainer"] = old["trainer"]
            if not args.no_write:
                ROWS_DIR.mkdir(parents=True, exist_ok=True)
                (ROWS_DIR / f"{case['id']}.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
        elif (row := stored_row(case["id"])) is None:
            missing.append(case["id"])
            continue
        rows.append(row)
    if missing:  # the cases measured are stored; the table waits for the others
        print(f"BENCHMARKS.md not written: no stored measurement of {', '.join(missing)} in {ROWS_DIR}: "
              f"measure them (--only ID ...)", file=sys.stderr)
        return 1
    section = table(cases, rows)
    print("\n".join(section.splitlines()[-3:]))
    if not args.no_write:
        write_section("published_gpu", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
