"""`--allocator planned`: the STWeaver plan of the traced step, replayed by the planned allocator."""

import json

import memplan
from memplan import models
from memplan.cli import main

TINY_LLAMA = models.tiny_config("llama-2-7b")
SETUP = models.TrainingSetup(seq=32, precision="bf16-true")


def _estimate(allocator):
    return memplan.estimate(TINY_LLAMA, SETUP, None, device="cuda", allocator=allocator)


def test_planned_reserved_covers_the_allocated_peak_and_undercuts_the_caching_allocator():
    planned, caching = _estimate("planned"), _estimate("caching")
    assert planned.peak_allocated_bytes == caching.peak_allocated_bytes  # same 512-B-rounded tensors
    assert planned.peak_allocated_bytes <= planned.peak_reserved_bytes < caching.peak_reserved_bytes


def test_planned_allocator_on_the_command_line(capsys):
    code = main(["estimate", "gpt2", "--seq", "32", "--allocator", "planned", "--gpu", "a10g", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["allocator"] == "planned"
    assert data["peak_allocated_bytes"] <= data["peak_reserved_bytes"] < data["device_used_bytes"]
