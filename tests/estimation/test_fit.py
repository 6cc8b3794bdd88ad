"""`fit`: its rows are the traced estimates `estimate` gives, ranked by time per token; the
largest shape, the fewest GPUs and the smallest changes round-trip through the printed
`memplan estimate` command; bad flags are one line and exit code 2."""

import json
import shlex

import pytest

from memplan import models
from memplan.cli import build_parser, main
from memplan.cli.flags import layout_from_args, setup_from_args
from memplan.errors import UserError
from memplan.estimation import estimate
from memplan.estimation.fit import SearchSpace, fit
from memplan.estimation.search import Candidate
from memplan.estimation.steptime import step_time
from memplan.estimation.whatfits import what_fits
from memplan.hardware.devices import device_profile
from memplan.models.fields import flags_of
from memplan.parallel import Layout

ONE_SETUP = SearchSpace(micro_batches=(2,), checkpointing=("none",))


def _estimate_of(config, row, gpu="t4", capacity=None):
    return estimate(config, row.candidate.setup, row.candidate.layout, gpu=gpu, capacity=capacity,
                    allocator=row.allocator)


def test_fit_rows_are_the_traced_estimates_of_estimate_ranked_by_time_per_token():
    config = models.tiny_config("llama-2-7b")
    result = fit(config, "t4", 2, models.TrainingSetup(precision="32-true", seq=32, batch=2), top=5, progress=False, workers=2,
                 space=ONE_SETUP)
    rows = result.rows
    assert rows and all(r.traced and r.fits for r in rows)
    assert [r.s_per_token for r in rows] == sorted(r.s_per_token for r in rows)
    assert {r.parallel for r in rows} >= {"traced", "modelled"}  # FSDP2 / TP traced; ZeRO-1/2, DDP modelled
    profile = device_profile("t4")
    for row in rows:  # every figure a row shows is `memplan estimate`'s, in this process
        check = _estimate_of(config, row)
        assert (check.device_used_bytes, check.peak_allocated_bytes, check.peak_reserved_bytes, check.parallel) == \
            (row.device_used_bytes, row.peak_allocated_bytes, row.peak_reserved_bytes, row.parallel)
        timing = step_time(check, row.candidate.setup, row.candidate.layout, config, profile)
        assert timing.step_s == pytest.approx(row.time.step_s, rel=1e-12)


def test_the_step_time_counts_each_accumulated_micro_batch_once():
    config = models.tiny_config("llama-2-7b")
    profile, layout = device_profile("t4"), Layout()
    per_token = []
    for accum in (1, 2):
        setup = models.TrainingSetup(precision="32-true", seq=32, batch=2, grad_accum=accum)
        result = estimate(config, setup, layout, gpu="t4")
        timing = step_time(result, setup, layout, config, profile)
        assert timing.tokens_per_step == 2 * 32 * accum
        per_token.append(timing.s_per_token)
    # the trace holds every micro-batch: twice the tokens, about twice the time (the optimizer step once)
    assert 0.5 * per_token[0] < per_token[1] < per_token[0]


@pytest.mark.parametrize("setup", [
    models.TrainingSetup(seq=64, batch=4, grad_accum=2, checkpointing="selective-op", precision="bf16-true"),
    models.TrainingSetup(precision="32-true", lora_rank=8, lora_targets=("q_proj", "v_proj"), attn="eager", zero_grad="zeros"),
    models.TrainingSetup(precision="32-true", quant="nf4", lora_rank=16, double_quant=True, kbit_prep=False, loss="chunked:4",
                         activation_offload="torchtune", optimizer="adamw8bit", compile="model"),
])
def test_a_setup_and_layout_are_the_estimate_flags_that_give_them_back(setup):
    layout = Layout(world_size=8, zero=3, tp=2, pp=2, microbatches=4)
    args = build_parser().parse_args(["estimate", "gpt2", *flags_of(setup), *flags_of(layout)])
    assert setup_from_args(args).to_dict() == setup.to_dict()
    assert layout_from_args(args) == layout


@pytest.mark.parametrize("setup", [
    models.TrainingSetup(seq=64, batch=4, grad_accum=2, checkpointing="selective-op", precision="bf16-true"),
    models.TrainingSetup(precision="32-true", lora_rank=8, lora_targets=("q_proj", "v_proj"), attn="eager", zero_grad="zeros"),
    models.TrainingSetup(precision="32-true", quant="nf4", lora_rank=16, double_quant=True, kbit_prep=False, loss="chunked:4",
                         activation_offload="torchtune", optimizer="adamw8bit", compile="model"),
])
def test_the_watch_spells_a_setup_and_layout_as_flags_that_give_them_back(setup):
    # memplan.watch sits below the CLI and spells the flags itself (watch.job): the CLI must read them back
    from memplan.watch.job import layout_flags, setup_flags

    layout = Layout(world_size=8, zero=3, tp=2, pp=2, microbatches=4)
    args = build_parser().parse_args(["estimate", "gpt2", *setup_flags(setup), *layout_flags(layout)])
    assert setup_from_args(args).to_dict() == setup.to_dict()
    assert layout_from_args(args) == layout


@pytest.fixture
def tiny_config_path(tmp_path):
    path = tmp_path / "tiny-llama.json"
    models.tiny_config("llama-2-7b").to_json_file(str(path))
    return str(path)


def _run_printed_command(command, capsys):
    """`memplan estimate ...` as fit printed it, through the CLI: its JSON."""
    argv = shlex.split(command)
    assert argv[:2] == ["memplan", "estimate"]
    assert main([*argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_max_seq_round_trips_through_the_printed_estimate_command(tiny_config_path, capsys):
    # 360 MiB is about the tiny model's CUDA context and workspace plus a few sequences
    code = main(["fit", tiny_config_path, "--gpu", "t4", "--gpus", "1", "--capacity", "360MiB", "--max", "seq",
                 "--step", "16", "--batch", "16", "--workers", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["limit"] == "memory" and doc["max"] is not None
    assert doc["above"]["setup"]["seq"] == doc["max"] + 16 and not doc["above"]["fits"]
    again = _run_printed_command(doc["at"]["command"], capsys)
    assert again["device_used_bytes"] == doc["at"]["device_used_bytes"] <= doc["at"]["usable_bytes"]
    above = _run_printed_command(doc["above"]["command"], capsys)
    assert above["device_used_bytes"] > doc["at"]["usable_bytes"]


def test_what_fits_finds_the_smallest_changes_and_each_round_trips(tiny_config_path, capsys):
    # the base and three single changes (the checkpointing policies come first)
    code = main(["fit", tiny_config_path, "--gpu", "t4", "--gpus", "1", "--capacity", "360MiB", "--what-fits",
                 "--seq", "64", "--batch", "16", "--top", "2", "--max-nodes", "4", "--workers", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and not doc["base"]["fits"] and doc["estimates"] == 4
    rows = doc["configurations"]
    assert 1 <= len(rows) <= 2 and all(len(r["changes"]) == 1 and r["fits"] for r in rows)
    assert rows[0]["changes"][0].startswith("checkpointing")
    for row in rows:
        again = _run_printed_command(row["command"], capsys)
        assert again["device_used_bytes"] == row["device_used_bytes"] <= row["usable_bytes"]


def test_activation_offload_by_memplan_s_planner_is_refused_in_one_line_pointing_at_memplan_offload():
    with pytest.raises(UserError, match="memplan offload MODEL") as info:
        models.TrainingSetup(precision="32-true", activation_offload="memplan")
    assert "\n" not in str(info.value)

def test_a_job_that_fits_as_it_is_is_its_own_answer():
    config = models.tiny_config("gpt2")
    result = what_fits(config, "h100-80gb", models.TrainingSetup(precision="32-true", seq=32, batch=2), progress=False, workers=1)
    assert result.base.fits and result.rows == [result.base] and result.estimates == 1


def test_gpus_auto_is_the_fewest_gpus_whose_traced_row_fits():
    # wide enough that its optimizer state (fp32 AdamW) matters next to the CUDA context
    config = models.tiny_config("llama-2-7b", hidden_size=512, intermediate_size=1408, vocab_size=32000)
    setup = models.TrainingSetup(precision="32-true", seq=32)
    space = SearchSpace(micro_batches=(1,), checkpointing=("full",), max_pp=1)
    one = estimate(config, setup, Layout(), gpu="t4")
    capacity = int((one.device_used_bytes - 64 * 2**20) / 0.95)  # one GPU is 64 MiB short
    result = fit(config, "t4", "auto", setup, capacity=capacity, progress=False, workers=1, space=space)
    assert result.gpus == 2 and result.rows and all(r.fits for r in result.rows)
    assert result.below is not None and result.below.traced and not result.below.fits
    top = result.rows[0]
    check = _estimate_of(config, top, capacity=capacity)
    assert check.device_used_bytes == top.device_used_bytes <= top.usable_bytes


def test_a_candidate_is_one_setup_under_one_layout():
    cand = Candidate(models.TrainingSetup(precision="32-true"), Layout(world_size=2, zero=3))
    assert cand.key() != Candidate(models.TrainingSetup(precision="32-true"), Layout(world_size=2, zero=2)).key()


@pytest.mark.parametrize(("flags", "says"), [
    (["--gpus", "1", "--max", "depth"], "unknown --max target"),
    (["--gpus", "auto", "--max", "seq"], "give --gpus N, not auto"),
    (["--gpus", "auto", "--what-fits"], "give --gpus N, not auto"),
    (["--gpus", "1", "--max", "seq", "--what-fits"], "give one of them"),
    (["--gpus", "1", "--max", "seq", "--top", "3"], "leave --top out"),
    (["--gpus", "1", "--step", "64"], "add --max"),
    (["--gpus", "1", "--allow-quant"], "add --what-fits"),
    (["--gpus", "4", "--zero", "3"], "leave them out"),
    (["--gpus", "0"], "--gpus takes"),
    (["--gpus", "two"], "--gpus takes"),
    (["--gpus", "1", "--margin", "150%"], "--margin takes"),
    (["--gpus", "1", "--gpu", "h900"], "h900"),
])
def test_bad_fit_flags_are_one_line_and_exit_code_2(capsys, flags, says):
    argv = ["fit", "gpt2", "--gpu", "t4", *flags]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("memplan: error: ") and says in err and "Traceback" not in err
