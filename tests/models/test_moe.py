"""Mixtures of experts: the routing assumptions, the experts taking them, fp32 experts on
fake tensors, and the MoE registry families on real and fake tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import models
from memplan.capture import capture_model
from memplan.errors import UserError
from memplan.models.moe import (
    Routing,
    assigned_experts,
    expert_modules,
    experts_of,
    parse_routing,
)

MOE_FAMILIES = ["mixtral-8x22b", "qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-20b", "deepseek-v2-lite", "deepseek-v3"]


@pytest.mark.parametrize(("text", "message"), [
    ("uniform", "routing must be one of balanced, worst, capacity:F, router"),
    ("capacity:0.5", "capacity factor must be a number >= 1"),
    ("capacity:lots", "capacity factor must be a number >= 1"),
    ("capacity:inf", "capacity factor must be a number >= 1"),
])
def test_a_bad_routing_is_one_line(text, message):
    with pytest.raises(UserError, match=message) as exc:
        models.TrainingSetup(precision="32-true", routing=text)
    assert "\n" not in str(exc.value)


def test_routings_parse():
    assert parse_routing("capacity:1.25") == Routing("capacity", 1.25)
    assert str(parse_routing("capacity:2")) == "capacity:2"
    assert parse_routing("worst") == Routing("worst")


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 300), experts=st.integers(1, 64), top_k=st.integers(1, 8),
       kind=st.sampled_from(["balanced", "worst", "capacity"]), factor=st.floats(1.0, 16.0))
def test_every_assignment_gives_each_token_k_distinct_experts_within_its_bound(tokens, experts, top_k, kind,
                                                                              factor):
    top_k = min(top_k, experts)
    routing = Routing(kind, factor if kind == "capacity" else None)
    ids = assigned_experts(tokens, top_k, experts, routing, "cpu")
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < experts
    assert all(len(set(row)) == top_k for row in ids.tolist())
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    if kind == "balanced":
        assert int(counts.max()) - int(counts.min()) <= 1
    elif kind == "worst":
        assert counts[:top_k].tolist() == [tokens] * top_k
    else:
        assert int(counts.max()) <= routing.capacity(tokens, top_k, experts)
        # filled in order: every expert before the last one used is full
        used = int(torch.nonzero(counts).max())
        assert bool((counts[:used] == min(routing.capacity(tokens, top_k, experts), tokens)).all())


def test_capacity_one_is_balanced_and_a_large_factor_is_worst():
    balanced = torch.bincount(assigned_experts(64, 2, 8, Routing("balanced"), "cpu").reshape(-1), minlength=8)
    capacity = torch.bincount(assigned_experts(64, 2, 8, Routing("capacity", 1.0), "cpu").reshape(-1), minlength=8)
    assert torch.equal(balanced, capacity)
    worst = assigned_experts(64, 2, 8, Routing("worst"), "cpu")
    assert torch.equal(assigned_experts(64, 2, 8, Routing("capacity", 4.0), "cpu"), worst)


def test_experts_of_reads_each_family_s_own_key():
    assert experts_of(models.load_config("mixtral-8x7b")) == (8, 2)
    assert experts_of(models.load_config("qwen3-30b-a3b")) == (128, 8)
    assert experts_of(models.load_config("deepseek-v3")) == (256, 8)
    assert experts_of(models.load_config("gpt-oss-120b")) == (128, 4)
    assert experts_of(models.load_config("llama-2-7b")) is None


def test_a_routing_on_a_dense_model_is_refused_in_one_line():
    with pytest.raises(UserError, match="has no experts: leave `routing` out"):
        models.build_model(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", routing="worst"))
    models.build_model(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true"))  # the default is no routing


def test_the_router_s_own_routing_needs_real_tensors():
    with pytest.raises(UserError, match="router's real token counts"):
        capture_model(models.tiny_config("mixtral-8x7b"), models.TrainingSetup(precision="32-true", seq=16, routing="router"), fake=True)


@pytest.mark.parametrize("routing", ["balanced", "worst", "capacity:1.5"])
def test_the_experts_run_on_the_assumed_assignment_and_the_router_still_runs(routing):
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=16, routing=routing)
    model = models.build_model(models.tiny_config("mixtral-8x7b"), setup)
    seen, routers = [], []
    for _, module in expert_modules(model):
        module.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda _m, _a, out: routers.append(out))
    models.forward_loss(model, models.make_batch(model, setup))
    expected = assigned_experts(32, 2, 4, parse_routing(routing), "cpu")
    assert len(seen) == 2 and all(torch.equal(ids, expected) for ids in seen)
    assert len(routers) == 2  # the router's logits and weights are computed (and trained) as before


def test_the_model_s_own_router_is_left_alone_on_real_tensors():
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=16, routing="router")
    model = models.build_model(models.tiny_config("mixtral-8x7b"), setup)
    assert all(not m._forward_pre_hooks for _, m in expert_modules(model))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_traces_on_fake_tensors_as_it_runs_on_real_ones_in_fp32(family):
    # fp32 experts run torch._grouped_mm, whose PyTorch meta kernel is bf16-only
    # (memplan.capture.grouped_mm gives it CUDA's one output); DeepSeek's latent attention,
    # gpt-oss's sinks and biased experts, OLMoE's q/k norms run as they are
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")
    config = models.tiny_config(family)
    real = capture_model(config, setup, fake=False, device="cpu").peak()[0]
    fake = capture_model(config, setup, fake=True, device="cpu").peak()[0]
    assert fake == real


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_traces_in_bf16_for_a_cuda_job(family):
    trace = capture_model(models.tiny_config(family), models.TrainingSetup(batch=1, seq=32, precision="bf16-true"),
                          fake=True, device="cuda")
    names = {trace.op_name(i) for i in range(trace.num_ops)}
    assert "aten._grouped_mm.default" in names and trace.peak()[0] > 0
    assert math.isfinite(trace.peak()[0])
