"""`memplan.watch(..., offload_plan=...)` on cpu: a tiny GPT-2 loop that keeps every step's
loss, measured at step 2 as it is, then run under the offload runtime from step 3 with a plan
made of the measured step ("auto") or read from a file: training bit-identical to the same loop
without the watch, exactly the tensors the plan moves written out, a lower real peak (the
profiler's) than the measured step's; and the refusals, each one line."""

import json

import pytest
import torch

import memplan
from memplan import models
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.errors import UserError
from memplan.offload import load_offload_plan

SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32)
STEPS = 5
MEASURED = 2  # step 2 measured and planned, steps 3-5 offloaded
PROFILED = 3  # the index (from 0) of the offloaded step the test measures with torch.profiler
BUDGET = "2.5MiB"  # the measured step peaks at 3,416,956 B
OPTIONS = {"min_nbytes": 1024}  # the tiny model's tensors are KiBs: every one may move


@pytest.fixture(scope="module")
def job(adamw_job):
    """`job(name="gpt2")`: the module's tiny AdamW job (model, optimizer, STEPS batches)."""
    return lambda name="gpt2": adamw_job(SETUP, STEPS, name)


def _iteration(model, optimizer, batch, losses):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.detach())  # every step's loss, kept


def _loop(model, optimizer, batches, profiled=None):
    """The loop; the profiler's peak of iteration `profiled` (from 0), if given."""
    losses, peak = [], None
    for i, batch in enumerate(batches):
        if i == profiled:
            peak = profiler_peak_bytes(lambda b=batch: _iteration(model, optimizer, b, losses))
        else:
            _iteration(model, optimizer, batch, losses)
    return losses, peak


@pytest.fixture(scope="module")
def reference(job):
    model, optimizer, batches = job()
    return model, _loop(model, optimizer, batches)[0]


@pytest.fixture(scope="module")
def auto(tmp_path_factory, job):
    out = tmp_path_factory.mktemp("watch-auto")
    model, optimizer, batches = job()
    with memplan.watch(model, optimizer, step=MEASURED, out_dir=out, offload_plan="auto", offload_budget=BUDGET,
                       offload_options=OPTIONS) as w:
        losses, peak = _loop(model, optimizer, batches, profiled=PROFILED)
    return model, losses, peak, w, out


def _bit_identical(reference, model, losses):
    ref_model, ref_losses = reference
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_auto_offloaded_loop_trains_bit_identically(reference, auto):
    model, losses, _, _, _ = auto
    _bit_identical(reference, model, losses)


def test_auto_plans_the_measured_step_and_runs_it_from_the_next(auto):
    _, _, _, w, out = auto
    stats = w.offload_stats
    plan = load_offload_plan(out / "offload-plan.json")
    assert (stats["planned_from_step"], stats["served_from_step"], stats["iterations"]) == (MEASURED, MEASURED + 1, 3)
    assert plan.feasible and plan.budget_bytes == 5 * 2**19
    assert set(stats["keys_written"]) == set(plan.tensors.moved)
    assert stats["storages_written"] == 3 * sum(plan.tensors.saved_moved)  # one per moved storage per step
    assert stats["bytes_written"] == stats["bytes_read"] > 0 and not stats["degraded"]
    assert json.loads((out / "offload.json").read_text()) == json.loads(json.dumps(stats, default=str))
    assert w.result["offload"] == str(out / "offload.json")


def test_the_measured_step_is_compared_without_offloading(auto):
    """Offloading starts after the measured step, so its comparison with the estimate holds."""
    _, _, _, w, _ = auto
    figures = w.result["compare"]["figures"]["peak_allocated_bytes"]
    assert figures["measured"] == figures["estimated"]


def test_an_offloaded_step_peaks_lower_than_the_measured_one(auto):
    _, _, peak, w, out = auto
    measured = memplan.trace.load(out / f"step{MEASURED}.memtrace").meta["profiler_peak_bytes"]
    print(f"measured step {measured} B, offloaded step {peak} B (profiler), planned "
          f"{w.offload_stats['planned_peak_bytes_after']} B")
    assert peak < 0.95 * measured


def test_a_plan_file_runs_the_same_moves(reference, auto, tmp_path, job):
    _, _, _, first, first_out = auto
    model, optimizer, batches = job()
    with memplan.watch(model, optimizer, step=MEASURED, out_dir=tmp_path, profile=False,
                       offload_plan=first_out / "offload-plan.json", offload_options=OPTIONS) as w:
        losses, _ = _loop(model, optimizer, batches)
    _bit_identical(reference, model, losses)
    assert w.offload_stats["keys_written"] == first.offload_stats["keys_written"]
    assert w.offload_stats["planned_from_step"] is None and w.offload_stats["iterations"] == 3


@pytest.mark.parametrize(("options", "words"), [
    ({"offload_plan": "auto"}, "needs offload_budget="),
    ({"offload_plan": "auto", "offload_budget": "1GiB", "capacity": "1GiB"}, "give offload_budget= instead"),
    ({"offload_plan": "auto", "offload_budget": "1GiB", "planned_allocator": True, "step": 3}, "do not compose"),
    ({"offload_plan": "auto", "offload_budget": "1GiB", "offload_options": {"chunk": 1}}, "no field 'chunk'"),
    ({"offload_plan": "auto", "offload_budget": "lots"}, "lots"),
    ({"offload_budget": "1GiB"}, "go with offload_plan"),
    ({"offload_plan": 3}, "a plan file or \"auto\""),
    ({"offload_plan": "missing-plan.json"}, "cannot read the plan"),
    ({"offload_plan": "auto", "offload_budget": "1GiB", "gpu": "no-such-gpu"}, "no-such-gpu"),
], ids=["no-budget", "capacity", "planned-allocator", "unknown-option", "bad-budget", "no-plan", "not-a-path",
        "missing-file", "unknown-gpu"])
def test_what_cannot_run_is_refused_in_one_line(tmp_path, options, words, job):
    model, optimizer, _ = job()
    with pytest.raises(UserError) as err:
        memplan.watch(model, optimizer, out_dir=tmp_path, **{"step": MEASURED, **options})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_plan_of_another_model_is_refused_when_the_watch_starts(auto, tmp_path, job):
    _, _, _, _, out = auto
    model, optimizer, _ = job("llama-2-7b")
    with pytest.raises(UserError, match="made for another model"):
        memplan.watch(model, optimizer, out_dir=tmp_path, offload_plan=out / "offload-plan.json",
                      offload_options=OPTIONS)


def test_trainer_callback_passes_offload_plan_through(tmp_path, train_with_callback, rows_of, job):
    from memplan.integrations.transformers import MemplanCallback

    model, _, batches = job()
    callback = MemplanCallback(step=MEASURED, out_dir=tmp_path / "watch", profile=False, offload_plan="auto",
                               offload_budget=BUDGET, offload_options=OPTIONS)
    train_with_callback(model, rows_of(batches), SETUP.batch, STEPS, callback)
    stats = callback.watch.offload_stats
    plan = load_offload_plan(tmp_path / "watch" / "offload-plan.json")
    assert stats["iterations"] == STEPS - MEASURED
    assert set(stats["keys_written"]) == set(plan.tensors.moved)
    assert stats["storages_written"] == (STEPS - MEASURED) * sum(plan.tensors.saved_moved)
    assert stats["bytes_written"] == stats["bytes_read"] > 0


def test_a_run_that_ends_before_the_runtime_starts_says_so(tmp_path, capsys, job):
    model, optimizer, batches = job()
    with memplan.watch(model, optimizer, step=MEASURED, out_dir=tmp_path, profile=False, offload_plan="auto",
                       offload_budget=BUDGET, offload_options=OPTIONS) as w:
        _loop(model, optimizer, batches[:MEASURED])
    assert "the offload runtime ran no step: the runtime runs from step 3 and the run made 2 steps" \
        in capsys.readouterr().err
    assert w.offload_stats["iterations"] == 0
    assert json.loads((tmp_path / "offload.json").read_text())["bytes_written"] == 0


def test_a_step_that_cannot_be_planned_says_why_and_the_job_goes_on(tmp_path, capsys, job, monkeypatch):
    from memplan.watch import offload

    def refuse(*_args, **_kwargs):
        raise UserError("this trace cannot be planned")

    monkeypatch.setattr(offload, "plan_offload", refuse)
    model, optimizer, batches = job()
    with memplan.watch(model, optimizer, step=MEASURED, out_dir=tmp_path, profile=False, offload_plan="auto",
                       offload_budget=BUDGET, offload_options=OPTIONS) as w:
        losses, _ = _loop(model, optimizer, batches)
    assert len(losses) == STEPS
    err = capsys.readouterr().err
    assert "memplan.watch: no offloading: step 2 could not be planned: this trace cannot be planned" in err
    assert w.offload_stats["iterations"] == 0 and w.offload_stats["skipped"].startswith("step 2 could not")
