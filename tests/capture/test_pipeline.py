"""One 1F1B pipeline stage: the schedule, and its capture."""

import numpy as np
import pytest

from memplan import models
from memplan.capture.pipeline import capture_pipeline_stage, one_f_one_b
from memplan.errors import UserError
from memplan.trace import PHASE


def test_first_of_four_stages_warms_up_with_three_forwards():
    assert one_f_one_b(4, 0, 6) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
        ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5),
    ]


def test_last_stage_alternates_from_the_start():
    assert one_f_one_b(2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_fewer_micro_batches_than_warm_up_runs_all_forwards_first():
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.fixture(scope="module")
def stages():
    config = models.tiny_config("llama-2-7b", num_hidden_layers=4)
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    return [
        capture_pipeline_stage(config, setup, stages=2, stage=s, microbatches=4, fake=True) for s in (0, 1)
    ]


def test_first_stage_runs_two_forwards_before_its_first_backward(stages):
    trace = stages[0]
    phase = trace.ops["phase"]
    first_bwd = int(np.flatnonzero(phase == PHASE["backward"])[0])
    embeddings = sum(
        1 for i in range(first_bwd) if trace.op_name(i) == "aten.embedding.default"
    )
    assert embeddings == 2


def test_each_stage_owns_only_its_parameters(stages):
    first, last = stages
    params = {
        name: int(t.buffers["nbytes"][t.buffers["category"] == 0].sum()) for name, t in (("first", first), ("last", last))
    }
    # tiny llama: vocab 512 x hidden 64 embeddings on stage 0, norm + lm_head on stage 1
    assert params["first"] != params["last"] and min(params.values()) > 0


def test_fake_stage_capture_matches_the_real_one():
    config = models.tiny_config("llama-2-7b", num_hidden_layers=4)
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32)
    real = capture_pipeline_stage(config, setup, stages=2, stage=0, microbatches=3, fake=False, device="cpu")
    fake = capture_pipeline_stage(config, setup, stages=2, stage=0, microbatches=3, fake=True, device="cpu")
    assert real.peak()[0] == fake.peak()[0]


def test_a_model_without_a_llama_layout_is_refused():
    with pytest.raises(UserError, match="Llama-style"):
        capture_pipeline_stage(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", seq=16), stages=2, stage=0,
                               microbatches=2)


def test_buffers_carry_their_micro_batch_under_the_interleaved_schedule(stages):
    trace = stages[0]
    fwd = trace.ops["phase"] == PHASE["forward"]
    embedding = [i for i in np.flatnonzero(fwd) if trace.op_name(i) == "aten.embedding.default"]
    assert [int(trace.ops["microbatch"][i]) for i in embedding] == [0, 1, 2, 3]
