"""torchtune's activation offloading reproduced in the captured step: what moves, that the
host copies are recorded as host memory, and that training is unchanged."""

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture import capture
from memplan.capture.activation_offload import MIN_OFFLOAD_BYTES, TorchtuneOffload
from memplan.capture.recorder import Recorder
from memplan.capture.step import build_training_step, capture_model


def _host_nbytes(trace):
    return trace.buffers["nbytes"][trace.host_mask("pinned")].tolist()


def test_tensors_of_at_least_1024_bytes_move_to_host_memory_and_small_ones_stay():
    """A Linear saves its input (here 2 x 256 fp32 = 2048 B) and its weight's transpose
    (8 x 256 fp32), and a tanh its output of 2 x 8 fp32 (64 B): the input and the
    transpose are copied to the host, the tanh's output is not. The transpose moves
    because torchtune's test is `isinstance(activation, nn.Parameter)`, and a view of a
    parameter is a plain tensor (memplan's own runtime keeps such views)."""
    layer = nn.Linear(256, 8)
    x = torch.randn(2, 256, requires_grad=True)
    offload = TorchtuneOffload()
    with Recorder() as rec:
        with offload:
            y = torch.tanh(layer(x))
        y.sum().backward()
    trace = rec.finish()
    assert sorted(_host_nbytes(trace)) == [2 * 256 * 4, 8 * 256 * 4]
    assert 2 * 8 * 4 < MIN_OFFLOAD_BYTES
    assert not offload.tracker and not offload.fwd_stash and not offload.bwd_tensor_stash


def test_offloading_does_not_change_training():
    config = models.tiny_config("llama-2-7b")
    params = {}
    for mode in ("none", "torchtune"):
        step = build_training_step(config, models.TrainingSetup(precision="32-true", batch=2, seq=32, activation_offload=mode))
        for _ in range(2):
            step.run()
        params[mode] = [p.detach().clone() for p in step.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params["none"], params["torchtune"]))


def test_a_cuda_job_keeps_its_host_copies_apart_from_the_device_and_its_device_peak_drops():
    config = models.tiny_config("llama-2-7b")
    traces = {mode: capture_model(config, models.TrainingSetup(precision="32-true", batch=2, seq=64, activation_offload=mode))
              for mode in ("none", "torchtune")}
    offloaded = traces["torchtune"]
    assert set(offloaded.devices) == {"cuda:0", "host:pinned"}
    host = _host_nbytes(offloaded)
    assert host and min(host) >= MIN_OFFLOAD_BYTES
    from memplan.trace.edit import device_view

    assert device_view(offloaded).peak()[0] < traces["none"].peak()[0]


def test_the_output_head_and_the_loss_are_not_offloaded():
    """torchtune's NoOpManager around the head: a step with a 4096-token vocabulary offloads
    the same bytes as one with 512 tokens (the logits and the loss stay on the device)."""
    host = {}
    for vocab in (512, 4096):
        config = models.tiny_config("llama-2-7b", vocab_size=vocab)
        setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, activation_offload="torchtune")
        with FakeTensorMode(allow_non_fake_inputs=True):
            step = build_training_step(config, setup)
            trace = capture(step.run, model=step.model, optimizer=step.optimizer, warmup=1, inputs=step.batches)
        host[vocab] = sum(_host_nbytes(trace))
    assert host[512] == host[4096] > 0
