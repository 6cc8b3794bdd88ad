"""The estimate's breakdown charges each buffer the block the caching allocator reserves
for it, under the `--alloc-conf` given (`memplan.alloc.conf.AllocConf.round_size`)."""

import memplan
from memplan import models
from memplan.alloc.conf import AllocConf
from memplan.capture.step import capture_step
from memplan.trace.model import CATEGORY

ROUNDUP = "roundup_power2_divisions:4"


def _charged_bytes(nbytes, round_size) -> int:
    return sum(round_size(int(n)) for n in nbytes if n > 0)


def _rounded_to_512(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def test_breakdown_rounds_each_buffer_as_the_alloc_conf_asks():
    config, setup = models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32)
    rank = memplan.estimate(config, setup, device="cpu", alloc_conf=ROUNDUP).per_rank[0]
    trace = capture_step(config, setup, "cpu").trace
    parameters = trace.buffers["nbytes"][trace.buffers["category"] == CATEGORY["parameter"]]
    by_conf = _charged_bytes(parameters, AllocConf.parse(ROUNDUP).round_size)
    assert by_conf != _charged_bytes(parameters, _rounded_to_512)  # the two rules differ on this model
    assert rank.breakdown["parameters"] == by_conf


def test_breakdown_without_an_alloc_conf_rounds_to_512_byte_blocks():
    config, setup = models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", batch=2, seq=32)
    rank = memplan.estimate(config, setup, device="cpu").per_rank[0]
    trace = capture_step(config, setup, "cpu").trace
    parameters = trace.buffers["nbytes"][trace.buffers["category"] == CATEGORY["parameter"]]
    assert rank.breakdown["parameters"] == _charged_bytes(parameters, _rounded_to_512)
