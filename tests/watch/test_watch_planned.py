"""`memplan.watch(..., planned_allocator=True)` on cpu: a tiny GPT-2 loop that keeps every
step's loss, recorded before the measured step, planned, and served from the plan after it:
training bit-identical to the same loop without the watch, no conflict, under 1% fallbacks;
the Trainer callback passing the option through; and the refusals, each one line."""

import json

import pytest
import torch

import memplan
from memplan import models
from memplan.errors import UserError
from memplan.native import missing_build_tools
from memplan.runtime import FALLBACK_REASONS

SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32)
STEPS = 6
MEASURED = 3  # steps 1-2 recorded, 2 planned, 3 measured, 4-6 served from the plan


@pytest.fixture(scope="module", autouse=True)
def ext():
    missing = missing_build_tools()
    if missing:
        pytest.skip(f"cannot build the planned allocator here: missing {', '.join(missing)}")
    from memplan.runtime.build import cpu_extension

    return cpu_extension()


@pytest.fixture(scope="module")
def job(adamw_job):
    """`job(name="gpt2")`: the module's tiny AdamW job (model, optimizer, STEPS batches)."""
    return lambda name="gpt2": adamw_job(SETUP, STEPS, name)


def _loop(model, optimizer, batches):
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())  # every step's loss, kept
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory, job):
    out = tmp_path_factory.mktemp("watch")
    model, optimizer, batches = job()
    reference = model, _loop(model, optimizer, batches)
    model, optimizer, batches = job()
    with memplan.watch(model, optimizer, step=MEASURED, out_dir=out, profile=False, planned_allocator=True) as w:
        losses = _loop(model, optimizer, batches)
    return reference, (model, losses), w, out


def test_planned_loop_trains_bit_identically(runs):
    (ref_model, ref_losses), (model, losses), _, _ = runs
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_steps_after_the_measured_one_are_served_from_the_plan(runs):
    _, _, w, out = runs
    stats = w.allocator_stats
    print({k: stats[k] for k in ("requests", "served", "fallbacks", "conflicts", "fallback_reasons")})
    assert stats["conflicts"] == 0
    assert stats["fallbacks"] < 0.01 * stats["requests"]
    assert [it["iteration"] for it in stats["iterations"]] == [2, 3, 4]  # steps 4-6, one plan iteration each
    assert all(it["requests"] > 400 for it in stats["iterations"])
    assert set(stats["fallback_reasons"]) == set(FALLBACK_REASONS)
    assert sum(stats["fallback_reasons"].values()) == stats["fallbacks"]
    assert (stats["planned_from_step"], stats["served_from_step"]) == (MEASURED - 1, MEASURED + 1)
    assert json.loads((out / "allocator.json").read_text()) == json.loads(json.dumps(stats, default=str))
    assert w.result["allocator"] == str(out / "allocator.json")
    # the measured step itself runs on the default allocator, under the watch's recorder
    assert w.result["compare"]["figures"]["peak_allocated_bytes"]["difference"] < 0.01


def test_trainer_callback_passes_planned_allocator_through(tmp_path, train_with_callback, rows_of, job):
    from memplan.integrations.transformers import MemplanCallback

    model, _, batches = job()
    callback = MemplanCallback(step=MEASURED, out_dir=tmp_path / "watch", profile=False, planned_allocator=True)
    train_with_callback(model, rows_of(batches), SETUP.batch, STEPS, callback)
    stats = callback.watch.allocator_stats
    print({k: stats[k] for k in ("requests", "served", "fallbacks", "conflicts", "fallback_reasons")})
    assert len(stats["iterations"]) == STEPS - MEASURED
    assert stats["conflicts"] == 0
    assert stats["fallbacks"] < 0.01 * stats["requests"]
    assert (tmp_path / "watch" / "allocator.json").is_file()


def _linear():
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(("options", "message"), [
    ({"step": 2}, "needs step >= 3, not 2"),
    ({"step": 3, "planned_allocator": "yes"}, "takes True or False"),
])
def test_what_cannot_compose_is_refused_in_one_line(options, message):
    model, optimizer = _linear()
    with pytest.raises(UserError, match=message) as raised:
        memplan.watch(model, optimizer, **{"planned_allocator": True, **options})
    assert "\n" not in str(raised.value)


def test_a_run_that_ends_before_the_plan_serves_says_so(tmp_path, capsys):
    model, optimizer = _linear()
    with memplan.watch(model, optimizer, step=3, out_dir=tmp_path, planned_allocator=True) as w:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    err = capsys.readouterr().err
    assert "the planned allocator served nothing: it serves from step 4 and the run made 2 steps" in err
    assert w.allocator_stats["requests"] == 0
    assert json.loads((tmp_path / "allocator.json").read_text())["requests"] == 0
