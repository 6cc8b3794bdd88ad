"""What the recorder makes of a step: storages, aliases, frees, categories, phases."""

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import models
from memplan.capture import capture, capture_model
from memplan.trace import CATEGORY, PHASE


def mlp_step(checkpoint: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(32, 8)

    def step(x):
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        else:
            out = model(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, x, step


def categories_of(trace, tensors):
    return {CATEGORY_NAMES[int(trace.buffers["category"][b])] for b in tensors}


CATEGORY_NAMES = {v: k for k, v in CATEGORY.items()}


def test_views_and_in_place_ops_alias_one_storage():
    x = torch.zeros(16)

    def step(x):
        y = x + 1  # one new storage
        v = y.view(4, 4)  # alias
        v.add_(1)  # in-place: same storage
        v.t().mul_(2)  # alias of an alias
        return y

    trace = capture(step, x)
    new = trace.buffers["alloc_op"] >= 0
    assert int(new.sum()) == 1
    assert int(trace.buffers["nbytes"][new][0]) == 16 * 4


def test_a_temporary_is_freed_when_its_last_reference_dies():
    def step():
        a = torch.ones(100)
        b = a * 2
        del a
        return b.sum()

    trace = capture(step)
    nbytes = trace.buffers["nbytes"]
    a = int(np.flatnonzero(nbytes == 400)[0])
    assert trace.buffers["free_event"][a] > trace.buffers["alloc_event"][a]


def test_parameters_gradients_optimizer_state_and_inputs_are_categorised():
    model, opt, x, step = mlp_step()
    step(x)  # optimizer state exists from the first step on
    trace = capture(step, x, model=model, optimizer=opt)
    cat = trace.buffers["category"]
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    state_bytes = 2 * param_bytes + 4 * 4  # exp_avg, exp_avg_sq, and 4 float32 `step` scalars
    pre = trace.buffers["alloc_op"] < 0
    assert int(trace.buffers["nbytes"][pre & (cat == CATEGORY["parameter"])].sum()) == param_bytes
    assert int(trace.buffers["nbytes"][cat == CATEGORY["optimizer_state"]].sum()) == state_bytes
    assert int(trace.buffers["nbytes"][cat == CATEGORY["input"]].sum()) == x.numel() * 4
    # zero_grad(set_to_none) frees the gradients, which backward allocated
    grads = cat == CATEGORY["gradient"]
    assert int(trace.buffers["nbytes"][grads].sum()) == param_bytes
    assert (trace.buffers["phase"][grads] == PHASE["backward"]).all()
    assert (trace.buffers["free_event"][grads] >= 0).all()


def test_tensors_saved_for_backward_are_activations():
    model, opt, x, step = mlp_step()
    trace = capture(step, x, model=model, optimizer=opt)
    fwd = trace.buffers["phase"] == PHASE["forward"]
    acts = fwd & (trace.buffers["category"] == CATEGORY["activation"])
    # ReLU saves its output [32, 16] (the Linear before it saves nothing new) and the
    # square saves the net output [32, 4]
    assert int(trace.buffers["nbytes"][acts].sum()) >= 32 * 16 * 4 + 32 * 4 * 4


def test_an_output_saved_for_backward_is_freed_with_a_retained_graph():
    # exp saves its own output; with the graph retained (`retain_graph=True`, as the
    # pipeline's zero-bubble input backward keeps it), the output lives as long as the graph
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        y = (x * 2).exp()
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        del y

    trace = capture(step, inputs=x)
    out = int(np.flatnonzero(trace.buffers["category"] == CATEGORY["activation"])[0])
    assert trace.buffers["nbytes"][out] == 64 * 64 * 4
    assert trace.buffers["free_event"][out] >= 0  # freed within the step, not kept by the recorder


def test_ops_get_forward_backward_and_optimizer_phases_in_that_order():
    model, opt, x, step = mlp_step()
    trace = capture(step, x, model=model, optimizer=opt)
    phases = trace.ops["phase"]
    first = {name: int(np.flatnonzero(phases == PHASE[name])[0]) for name in ("forward", "backward", "optimizer")}
    assert first["forward"] < first["backward"] < first["optimizer"]


def test_checkpointed_forward_runs_again_as_recompute_in_backward():
    model, opt, x, step = mlp_step(checkpoint=True)
    trace = capture(step, x, model=model, optimizer=opt)
    recompute = trace.ops["phase"] == PHASE["recompute"]
    names = {trace.op_name(i) for i in np.flatnonzero(recompute)}
    assert "aten.addmm.default" in names


def test_ops_are_attributed_to_modules_in_forward_and_backward():
    model, opt, x, step = mlp_step()
    trace = capture(step, x, model=model, optimizer=opt)
    fwd_modules = {trace.modules[m] for m in trace.ops["module"][trace.ops["phase"] == PHASE["forward"]]}
    bwd_modules = {trace.modules[m] for m in trace.ops["module"][trace.ops["phase"] == PHASE["backward"]]}
    assert {"0", "2"} <= fwd_modules
    assert {"0", "2"} <= bwd_modules


def test_gradient_accumulation_into_a_parameter_belongs_to_the_parameters_module():
    # AccumulateGrad nodes have no forward module; the second micro-batch adds into .grad there
    model, opt, x, _ = mlp_step()

    def two_micro_batches(x):
        for _ in range(2):
            model(x).square().mean().backward()

    trace = capture(two_micro_batches, x, model=model, optimizer=opt)
    names = [trace.op_names[n] for n in trace.ops["name"]]
    accumulate = [i for i, n in enumerate(names) if n == "aten.add_.Tensor"
                  and trace.ops["phase"][i] == PHASE["backward"]]
    assert len(accumulate) == 4  # the two weights and two biases, in the second micro-batch
    assert {trace.modules[trace.ops["module"][i]] for i in accumulate} == {"0", "2"}


def test_gradient_accumulation_numbers_the_micro_batches():
    setup = models.TrainingSetup(precision="32-true", batch=1, seq=16, grad_accum=3)
    trace = capture_model(models.tiny_config("gpt2"), setup, fake=True, device="cpu")
    fwd = trace.ops["phase"] == PHASE["forward"]
    assert sorted(set(trace.ops["microbatch"][fwd].tolist())) == [0, 1, 2]


def test_each_traced_iteration_is_numbered():
    model, opt, x, step = mlp_step()
    trace = capture(step, x, model=model, optimizer=opt, iterations=2)
    assert sorted(set(trace.ops["iteration"].tolist())) == [0, 1]
    made = trace.buffers["alloc_op"] >= 0
    assert sorted(set(trace.buffers["iteration"][made].tolist())) == [0, 1]


def test_matmul_ops_carry_flops():
    model, opt, x, step = mlp_step()
    trace = capture(step, x, model=model, optimizer=opt)
    addmm = [i for i in range(trace.num_ops) if trace.op_name(i) == "aten.addmm.default"]
    assert float(trace.ops["flops"][addmm[0]]) == 2 * 32 * 8 * 16


def test_fake_capture_uses_no_real_memory_for_a_huge_layer():
    with FakeTensorMode():
        layer = nn.Linear(65536, 65536)  # 16 GiB of fp32 weights, never materialised
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        x = torch.randn(4, 65536)

        def step(x):
            layer(x).sum().backward()
            opt.step()

        trace = capture(step, x, model=layer, optimizer=opt)
    assert trace.peak()[0] >= 2 * 65536 * 65536 * 4


def test_cuda_jobs_are_labelled_with_the_cuda_device():
    trace = capture_model(models.tiny_config("llama-2-7b"), models.TrainingSetup(precision="32-true", seq=16), fake=True, device="cuda")
    assert trace.devices == ["cuda:0"]
    assert trace.meta["device"] == "cuda"


def test_a_random_state_higher_order_op_of_a_compiled_graph_is_one_op_with_its_output():
    # Inductor's graphs of checkpointed blocks call run_and_save_rng_state(op, *args)
    # (torch/_prims/rng_prims.py): an operator without a schema, returning (state, op(*args))
    from torch._prims.rng_prims import run_and_save_rng_state

    from memplan.capture import Recorder

    a, b = torch.ones(64, 64), torch.ones(64, 64)
    with Recorder(compiled_regions=True) as rec:  # as a compiled step is recorded
        _state, out = run_and_save_rng_state(torch.ops.aten.mm.default, a, b)
    trace = rec.finish()
    names = [trace.op_name(i) for i in range(trace.num_ops)]
    assert any("run_and_save_rng_state" in n for n in names), names
    assert out.untyped_storage().nbytes() in trace.buffers["nbytes"].tolist()
    assert float(trace.ops["flops"][names.index(next(n for n in names if "rng" in n))]) == 2 * 64**3
