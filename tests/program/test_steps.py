"""The program's optimizer steps as the step window counts them."""

import torch

from memplan.program.steps import StepWindow


class _Container(torch.optim.Optimizer):
    """A wrapper that is itself an Optimizer and steps one optimizer per model part, as
    torchtitan's OptimizersContainer does."""

    def __init__(self, parts):
        self.optimizers = [torch.optim.AdamW(p.parameters()) for p in parts]
        super().__init__([p for part in parts for p in part.parameters()], {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()


def _counted(run):
    steps = []
    window = StepWindow(10, on_step=lambda optimizers, n: steps.append((optimizers, window.step_in_backward)))
    window.install()
    try:
        run()
    finally:
        window.remove()
    return steps


def test_a_wrapper_optimizer_is_one_step_of_the_optimizers_it_steps():
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    container = _Container(parts)

    def run():
        sum(p(torch.ones(1, 2)).sum() for p in parts).backward()
        container.step()

    [(optimizers, in_backward)] = _counted(run)
    assert optimizers == container.optimizers and not in_backward


def test_optimizers_stepped_inside_the_backward_are_one_step_taken_in_backward():
    model = torch.nn.Linear(2, 2)
    optimizers = {p: torch.optim.AdamW([p]) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: optimizers[q].step())

    [(stepped, in_backward)] = _counted(lambda: model(torch.ones(1, 2)).sum().backward())
    assert {id(o) for o in stepped} == {id(o) for o in optimizers.values()} and in_backward


def test_a_timeout_the_interpreter_dropped_is_raised_again():
    import time

    from memplan.program.steps import ProgramTimeout

    window = StepWindow(1, max_seconds=0.2)
    window.install()
    raised, deadline = 0, time.monotonic() + 10
    try:
        while raised < 2 and time.monotonic() < deadline:
            try:
                time.sleep(0.01)
            except ProgramTimeout:  # the first, dropped as in a finaliser ("Exception ignored in")
                raised += 1
    finally:
        window.remove()
    assert raised == 2
