"""The RL trainers' scoring code as memplan reproduces it computes what log_softmax does."""

from dataclasses import replace

import torch

from memplan.models.registry import tiny_config
from memplan.models.rl_losses import ChunkedLogProb
from memplan.models.setup import TrainingSetup
from memplan.models.verl_losses import entropy_from_logits, logprobs_from_logits
from memplan.rl.passes import no_grad_pass


def test_chunked_log_probs_and_entropy_equal_log_softmax_on_real_tensors():
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8), torch.randn(40, 8)
    targets = torch.randint(0, 40, (6,))
    logps, entropy, _, _ = ChunkedLogProb.apply(hidden, weight, None, targets, False, ("log_probs", "entropy"))
    reference = torch.log_softmax(hidden @ weight.t(), dim=-1)
    assert torch.allclose(logps, reference.gather(1, targets[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1), atol=1e-5)


def test_verls_row_by_row_log_probs_and_entropy_equal_log_softmax_on_real_tensors():
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 30), torch.randint(0, 30, (5,))
    reference = torch.log_softmax(logits, dim=-1)
    ours = logprobs_from_logits(logits, labels, cuda=False, inplace_backward=True)
    assert torch.allclose(ours, reference.gather(1, labels[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(entropy_from_logits(logits), -(reference.exp() * reference).sum(-1), atol=1e-5)


def test_verls_scoring_holds_the_whole_logits_where_trls_holds_tiles():
    config = tiny_config("qwen2.5-0.5b")
    setup = TrainingSetup(batch=2, seq=24)
    verl = no_grad_pass(config, replace(setup, loss="verl-ref-logprobs:8"), "cpu", None)
    logits_bytes = 2 * 24 * config.vocab_size * 4
    assert verl.transient_bytes >= logits_bytes
