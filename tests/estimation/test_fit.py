"""`fit`: every configuration it returns fits, they are ranked fastest first, and the CLI speaks JSON."""

import json

from memplan import models
from memplan.cli import main
from memplan.estimation import estimate
from memplan.estimation.fit import fit
from memplan.parallel import Layout


def test_fit_returns_only_configurations_whose_estimate_fits_ranked_by_time_per_token():
    config = models.tiny_config("llama-2-7b")
    configs = fit(config, "t4", 2, models.TrainingSetup(seq=32), progress=False)
    assert configs, "a tiny model fits on two T4s"
    per_token = [c["s_per_token"] for c in configs]
    assert per_token == sorted(per_token)
    first = configs[0]
    check = estimate(config, models.TrainingSetup(seq=32, batch=first["micro_batch"],
                                                  checkpointing=first["checkpointing"]),
                     Layout(world_size=2, zero=first["zero"], tp=first["tp"], pp=first["pp"],
                            microbatches=first["microbatches"]), gpu="t4", allocator=first["allocator"])
    assert check.fits and check.device_used_bytes == first["device_used_bytes"]


def test_fit_cli_prints_one_json_object_with_the_configurations(capsys):
    code = main(["fit", "gpt2", "--gpu", "h100-80gb", "--gpus", "1", "--seq", "64", "--top", "3", "--json"])
    out, _ = capsys.readouterr()
    data = json.loads(out)
    assert code == 0 and 1 <= len(data["configurations"]) <= 3
    assert all(c["device_used_bytes"] <= c["capacity_bytes"] for c in data["configurations"])
