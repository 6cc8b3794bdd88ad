"""verl's log-probability code, as its actor runs it, for memplan's capture to trace.

verl (volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7) scores tokens with
the full logits: `DataParallelPPOActor._forward_micro_batch`
(verl/workers/actor/dp_actor.py L113-330, the default `use_remove_padding: True` path,
L164-305) runs the model over the batch's tokens flattened to `[total_nnz]`, takes the
whole `[total_nnz, vocabulary]` logits from the head, divides them by the temperature in
place (`logits_rmpad.div_(temperature)`), and then:

- `logprobs_from_logits` (verl/utils/torch_functional.py L72-100): on CUDA, flash-attn's
  Triton cross-entropy (`logprobs_from_logits_flash_attn`, L103-126), which keeps three
  fp32 `[N]` vectors (losses, log-sum-exp, z-losses), saves the logits and, with
  `inplace_backward` (when no entropy is asked for), writes their gradient over them;
  elsewhere `logprobs_from_logits_v2` (L166-197): a gather, then one `logsumexp` per row
  for fp32 logits or one `log_softmax` per row for 16-bit ones, stacked;
- `entropy_from_logits` when the entropy is asked for (L224-238): `softmax`, `logsumexp`
  and `sum(pd * logits)` over the whole logits: the compute-log-prob pass of the actor
  asks for it (`calculate_entropy = not is_lora`, verl/workers/fsdp_workers.py L1009), the
  reference's does not (L1058), the policy update only with `entropy_coeff != 0`
  (default 0, verl/trainer/config/actor/actor.yaml L89-92);
- the log-probabilities (and entropy) padded back to `[B, S]` and sliced to the response.

Losses (`TrainingSetup.loss`): `verl-ppo:C` (the actor's update: PPO's clipped surrogate,
`compute_policy_loss_vanilla`, on the response's log-probabilities), `verl-logprobs:C`
(the actor's old log-probabilities, with entropy) and `verl-ref-logprobs:C` (the
reference's, without). Temperature 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VERL_LOSSES = ("verl-ppo", "verl-logprobs", "verl-ref-logprobs")


class FlashCrossEntropy(torch.autograd.Function):
    """flash-attn's `cross_entropy_loss` (flash_attn/ops/triton/cross_entropy.py) as
    allocations: losses, log-sum-exp and z-losses fp32 `[N]`; the logits and log-sum-exp
    saved; the backward writes the logits' gradient over the logits with
    `inplace_backward`, into a new buffer otherwise."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
        rows = logits.shape[0]
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        z_losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        del z_losses
        ctx.save_for_backward(logits, lse, labels)
        ctx.inplace_backward = inplace_backward
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[Any, ...]:
        logits, _lse, _labels = ctx.saved_tensors
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        return grad, None, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, cuda: bool, inplace_backward: bool) -> torch.Tensor:
    """verl's `logprobs_from_logits` on flattened `[N, V]` logits (module docstring)."""
    if cuda:
        return -FlashCrossEntropy.apply(logits, labels, inplace_backward)
    if logits.dtype in (torch.float32, torch.float64):
        logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(logit, dim=-1) for logit in logits])
        return logits_labels - logsumexp_values
    rows = []
    for row_logits, row_labels in zip(logits, labels):
        row_logprobs = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logprobs.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's `entropy_from_logits` (torch_functional.py L224-238)."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def verl_head_loss(kind: str, completion: int, *, cuda: bool,
                   objective: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """What the output head computes under verl loss `kind` (module docstring): a function
    of the head, the final hidden states [B, S, H] and the token ids [B, S]; `objective`
    turns the response's [B, C] log-probabilities (and entropy) into the step's scalar."""
    def compute(head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        logits = head(hidden).reshape(batch * seq, -1)
        logits.div_(1.0)
        rolled = torch.roll(input_ids.reshape(-1), shifts=-1, dims=0)
        entropy_wanted = kind == "verl-logprobs"
        log_probs = logprobs_from_logits(logits, rolled, cuda=cuda, inplace_backward=not entropy_wanted)
        entropy = entropy_from_logits(logits) if entropy_wanted else None
        full = log_probs.reshape(batch, seq)[:, -completion - 1:-1]
        if kind == "verl-ppo":
            return objective(full, None)
        total = full.sum()
        if entropy is not None:
            total = total + entropy.reshape(batch, seq)[:, -completion - 1:-1].sum()
        return total
    return compute
