"""TRL's chunked log-probability head as memplan reproduces it computes what log_softmax does."""

import torch

from memplan.models.rl_losses import ChunkedLogProb


def test_chunked_log_probs_and_entropy_equal_log_softmax_on_real_tensors():
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8), torch.randn(40, 8)
    targets = torch.randint(0, 40, (6,))
    logps, entropy, _, _ = ChunkedLogProb.apply(hidden, weight, None, targets, False, ("log_probs", "entropy"))
    reference = torch.log_softmax(hidden @ weight.t(), dim=-1)
    assert torch.allclose(logps, reference.gather(1, targets[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1), atol=1e-5)
