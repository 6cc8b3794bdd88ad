"""Reading a value out of a fake tensor: the policy, and the refusal."""

import pytest
import torch

from memplan.program.reads import ReadRefused
from memplan.program.world import DeviceRedirect, World


def _fake_loss(world):
    return world.fake(torch.empty, ())


def test_a_floating_point_read_of_a_fake_tensor_is_zero_and_counted():
    world = World("cuda", None)
    loss = _fake_loss(world)
    with DeviceRedirect(world):
        values = (loss.item(), float(loss), f"{loss:.2f}", (loss * 2).tolist())
    assert values == (0.0, 0.0, "0.00", 0.0)
    assert sum(world.reads.answered.values()) == 4


def test_finiteness_checks_of_fake_tensors_read_as_finite():
    world = World("cuda", None)
    loss = _fake_loss(world)
    with DeviceRedirect(world):
        checks = (bool(torch.isnan(loss)), bool(torch.isnan(loss) | torch.isinf(loss)),
                  bool(torch.isfinite(loss).all()), bool(~torch.isfinite(loss)))
    assert checks == (False, False, True, False)


def test_a_branch_on_a_comparison_of_a_fake_tensor_is_refused_naming_the_line():
    world = World("cuda", None)
    loss = _fake_loss(world)
    with DeviceRedirect(world), pytest.raises(ReadRefused, match=r"test_reads.py:\d+: a Python branch on .*bool"):
        if loss > 10:
            pass


def test_an_integer_read_of_a_fake_tensor_is_refused():
    world = World("cuda", None)
    ids = world.fake(torch.empty, (4,), dtype=torch.long)
    with DeviceRedirect(world), pytest.raises(ReadRefused, match="item"):
        ids.sum().item()


def test_reads_of_real_tensors_are_their_values():
    world = World("cuda", None)
    with DeviceRedirect(world):
        labels = torch.tensor([1, -100, 3]).to("cuda")
        assert int((labels != -100).sum()) == 2 and labels.tolist() == [1, -100, 3]
