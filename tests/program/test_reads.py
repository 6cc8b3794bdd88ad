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


def test_trunc_normal_of_a_fake_weight_ends_after_its_first_draw():
    world = World("cuda", None)
    weight = world.fake(torch.empty, (64, 64))
    with DeviceRedirect(world):
        torch.nn.init.trunc_normal_(weight, std=0.02)  # asks whether any sample falls outside [-2, 2]
    assert sum(n for site, n in world.reads.answered.items() if site.endswith("__bool__")) == 1


def test_a_dtensor_over_a_fake_shard_is_read_as_its_shard():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = World("cuda", None)
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        loss = DTensor.from_local(_fake_loss(world), init_device_mesh("cpu", (1,)), [Replicate()])
        with DeviceRedirect(world):
            assert loss.item() == 0.0
    finally:
        dist.destroy_process_group()


def _non_finite_count(grads):
    """DeepSpeed's ZeRO-1/2 overflow check (`has_overflow_partitioned_grads_serial` and
    `has_overflow`, deepspeed/runtime/zero/stage_1_and_2.py; `has_inf_or_nan`,
    deepspeed/runtime/utils.py, DeepSpeed 0.19.8): a one-element count of the gradients with a
    non-finite value, made a byte flag and read."""
    count = torch.zeros([1], dtype=torch.float, device="cuda")
    for g in grads:
        count += torch.isfinite(g.amax()).logical_and(torch.isfinite(g.amin())).logical_not()
    return count.bool().byte().to("cuda")


def test_a_count_of_non_finite_checks_of_fake_gradients_reads_zero_as_an_integer():
    world = World("cuda", None)
    grads = [world.fake(torch.empty, (8,)), world.fake(torch.empty, (4, 4))]
    with DeviceRedirect(world):
        flag = _non_finite_count(grads)
        assert (flag[0].item(), bool(flag[0]), int(flag)) == (0, False, 0)


def test_a_count_changed_by_any_other_op_is_refused():
    world = World("cuda", None)
    grads = [world.fake(torch.empty, (8,))]
    with DeviceRedirect(world), pytest.raises(ReadRefused, match="item"):
        flag = _non_finite_count(grads)
        flag.add_(grads[0].sum().byte())  # a value of the weights, not a finiteness check
        flag[0].item()


def test_a_count_of_finite_checks_is_refused():
    world = World("cuda", None)
    grad = world.fake(torch.empty, (8,))
    with DeviceRedirect(world), pytest.raises(ReadRefused, match="item"):
        count = torch.zeros([1], device="cuda")
        count += torch.isfinite(grad).all()  # 1 under the assumption: only a zero count is answered
        count.byte().item()


def test_a_count_whose_data_is_rebound_is_refused():
    world = World("cuda", None)
    grads = [world.fake(torch.empty, (8,))]
    with DeviceRedirect(world), pytest.raises(ReadRefused, match="item"):
        flag = _non_finite_count(grads)
        flag.data = grads[0][:1].byte()
        flag.item()
