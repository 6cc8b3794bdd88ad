"""A search's progress on stderr: each stage's total is known when it starts; without a
terminal, one line when a stage starts and one when it ends."""

from memplan import models
from memplan.estimation.search import Candidate, Evaluator, FitJob, Task
from memplan.parallel import Layout


def test_without_a_terminal_each_stage_is_a_line_when_it_starts_and_one_when_it_ends(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    models.tiny_config("gpt2").to_json_file(str(path))
    job = FitJob(str(path), "t4")
    with Evaluator(job, workers=1, progress=True, label="memplan fit") as ev:
        ev.stage("first", 2)
        ev.run([Task([Candidate(models.TrainingSetup(seq=32), Layout())], [True])])
        ev.skip(1)
        ev.stage("second", 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memplan fit:")]
    assert lines[0] == "memplan fit: first (at most 2 candidates)"
    assert lines[1].startswith("memplan fit: first: 2 candidates, ") and lines[1].endswith(" s")
    assert lines[2] == "memplan fit: second (at most 1 candidates)"
    assert lines[3].startswith("memplan fit: second: 0 candidates, ")
