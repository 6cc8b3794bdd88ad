"""The losses and log-probability passes of RL post-training trainers, as their code runs.

An RL trainer does not call the model's own loss: it scores the completion tokens of each
sequence with its own log-probability code and builds its objective from them. This module
reproduces that code in PyTorch so that memplan's capture records what it allocates, on
real and on fake tensors:

- `ChunkedLogProb`: TRL 1.16.0's `ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py
  L299-465), which GRPOTrainer and DPOTrainer patch into the model (`add_fused_lm_head`,
  trl/trainer/utils.py L1548-1690): the head runs on `[min(N, 4096), 32768]` tiles of one
  reused buffer (`mm_buf`, allocated at the full 32768 columns whatever the vocabulary),
  each tile folded into seven fp32 `[N]` running statistics; the backward recomputes each
  tile and accumulates `grad_hidden` `[N, H]` and (when the head trains) `grad_weight`
  `[V, H]` in fp32. On CUDA the fold is a Triton kernel that allocates nothing
  (`triton=True`); elsewhere it is `_forward_tile` / `_backward_tile` (L203-296), whose
  torch ops on the whole tile are reproduced here op for op;
- the fused head's caller (`_fused_forward`, utils.py L1599-1690): the hidden states and
  labels shifted one position, then on CUDA only the scored rows (`hidden_states[mask]`,
  the completion tokens: all of them, every completion taken at its full length) and the
  per-token results scattered back (`new_zeros(...).masked_scatter`), elsewhere every row
  and `masked_fill`;
- GRPO's objective on the per-token log-probabilities (`GRPOTrainer._compute_loss`,
  trl/trainer/grpo_trainer.py L3020-3185: the ratio to the old log-probabilities, the
  clipped surrogate, the KL term to the reference when `beta != 0`, the masked mean) and
  DPO's (`DPOTrainer._compute_loss`, trl/trainer/dpo_trainer.py L1285-1345: summed
  log-probabilities of chosen and rejected, the sigmoid loss on their margins).

A loss is named in `TrainingSetup.loss` as `KIND:C`, C the completion tokens scored at the
end of each sequence: `trl-grpo:C` (the policy's GRPO step), `trl-dpo:C` (DPO's policy
step; its batch holds the chosen rows then the rejected ones), `trl-dpo-ref:C` (the same
with the reference's no-gradient forward inside the loss, after the policy's, as
`DPOTrainer._compute_loss` runs it when the reference log-probabilities are not
precomputed: the model's own backbone stands for the reference's, whose parameters the
caller counts), `trl-logprobs:C` (the
no-gradient pass over the old policy or the reference: log-probabilities only), and verl's
(`memplan.models.verl_losses`: `verl-ppo:C`, `verl-logprobs:C`, `verl-ref-logprobs:C`). Assumes
no padding inside a batch (every prompt P tokens, every completion C), temperature 1, no
soft-capping or logit scaling (the model's `final_logit_softcapping` is refused by the
caller, `memplan.models.losses`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memplan.errors import UserError
from memplan.models.verl_losses import VERL_LOSSES, verl_head_loss

RL_LOSSES = ("trl-grpo", "trl-dpo", "trl-dpo-ref", "trl-logprobs", *VERL_LOSSES)
TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py L31
VOCAB_CHUNK_SIZE = 32768  # _CHUNKED_LOGPROB_CHUNK_SIZE, trl/trainer/utils.py L1506
IGNORE_INDEX = -100
# the per-token fields each loss asks the fused head for (grpo_trainer.py L1067-1073,
# dpo_trainer.py L954-960, and the default `("log_probs",)` of the reference's head)
OUTPUTS = {"trl-grpo": ("log_probs", "entropy"), "trl-dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
           "trl-dpo-ref": ("log_probs", "entropy", "mean_logits", "is_top1"), "trl-logprobs": ("log_probs",)}
GRPO_EPSILON = 0.2  # GRPOConfig.epsilon
DPO_BETA = 0.1  # DPOConfig.beta


def parse_rl_loss(loss: str) -> tuple[str, int] | None:
    """(kind, completion tokens) of an RL loss name, None for any other loss."""
    kind, _, count = loss.partition(":")
    if kind not in RL_LOSSES:
        return None
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"loss {loss!r}: write {kind}:C with C >= 1 the completion tokens scored")
    return kind, int(count)


def rl_head_loss(kind: str, completion: int, *, triton: bool, beta: float = 0.0,
                 backbone: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[..., torch.Tensor]:
    """What the model's output head computes under RL loss `kind`: a function of the head,
    the final hidden states [B, S, H] and the token ids [B, S] that returns the scalar the
    step backpropagates (or, for `trl-logprobs`, the log-probabilities' sum). `backbone`
    (token ids -> final hidden states) runs the reference's forward of `trl-dpo-ref`."""
    if kind in VERL_LOSSES:
        return verl_head_loss(kind, completion, cuda=triton,
                              objective=lambda log_probs, _: grpo_objective(log_probs, 0.0))

    def compute(head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if completion >= hidden.shape[1]:
            raise UserError(f"{completion} completion tokens leave no prompt in a {hidden.shape[1]}-token sequence")
        per_token = fused_head_per_token(head, hidden, input_ids, completion, OUTPUTS[kind], triton=triton)
        log_probs = torch.cat([per_token["log_probs"][:, -completion:]], dim=0)
        if kind == "trl-logprobs":
            return log_probs.sum()
        if kind == "trl-grpo":
            entropy = torch.cat([per_token["entropy"][:, -completion:]], dim=0)  # kept for TRL's metrics
            loss = grpo_objective(log_probs, beta)
            del entropy
            return loss
        if kind == "trl-dpo-ref" and backbone is not None:
            with torch.no_grad():
                ref_hidden = backbone(input_ids)
                ref = fused_head_per_token(head, ref_hidden, input_ids, completion, OUTPUTS["trl-logprobs"],
                                           triton=triton)["log_probs"][:, -completion:]
                del ref_hidden
            return dpo_objective(log_probs, ref)
        return dpo_objective(log_probs)
    return compute


def fused_head_per_token(head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, completion: int,
                         outputs: tuple[str, ...], *, triton: bool) -> dict[str, torch.Tensor]:
    """`_fused_forward` after the backbone (module docstring): per-token fields [B, S-1],
    zero on the prompt's positions."""
    labels = input_ids.clone()
    labels[:, : labels.shape[1] - completion] = IGNORE_INDEX
    hidden_states = hidden[:, :-1]
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    weight, bias = head.weight, getattr(head, "bias", None)
    if triton:  # the scored rows only: hidden_states[mask], labels[mask] (the last C - 1 + 1 positions)
        rows = hidden_states[:, -completion:].reshape(-1, hidden_states.shape[-1])
        targets = labels[:, -completion:].reshape(-1)
    else:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        targets = labels.clamp(min=0).reshape(-1)
    per_token = ChunkedLogProb.apply(rows, weight, bias, targets, triton, outputs)
    fields = dict(zip(("log_probs", "entropy", "mean_logits", "is_top1"), per_token))
    if triton:
        return {k: v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in fields.items() if v is not None}
    return {k: v.view(mask.shape).masked_fill(~mask, 0) for k, v in fields.items() if v is not None}


def grpo_objective(log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """GRPO's loss on [B, C] log-probabilities (grpo_trainer.py L3020-3185, loss_type "dapo",
    TRL's default): the token-level ratio to the old log-probabilities, the clipped
    surrogate, the KL term when `beta != 0`, the sum over completion tokens normalised.
    The old log-probabilities, reference log-probabilities and advantages are the
    batch's inputs in TRL; here they are made alongside (same shapes). The entropy is kept
    for TRL's metrics and masks, outside the loss (no entropy bonus by default)."""
    mask = torch.ones_like(log_probs)
    advantages = torch.zeros(log_probs.shape[0], 1, dtype=log_probs.dtype, device=log_probs.device)
    old = log_probs.detach()
    coef_1 = torch.exp(log_probs - old)
    coef_2 = torch.clamp(coef_1, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        ref = torch.zeros_like(log_probs)
        per_token_kl = torch.exp(ref - log_probs) - (ref - log_probs) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    normalizer = mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / normalizer


def dpo_objective(log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """DPO's sigmoid loss (dpo_trainer.py L1300-1345, loss_type "sigmoid", the default) on
    [2B, C] log-probabilities, chosen rows first; the reference's (precomputed: inputs of
    the loss, zeros here of the same shapes) summed the same way."""
    logps = log_probs.sum(dim=1)
    chosen, rejected = logps.chunk(2, dim=0)
    if ref_log_probs is None:
        ref_chosen, ref_rejected = torch.zeros_like(chosen), torch.zeros_like(rejected)
    else:
        ref_chosen, ref_rejected = ref_log_probs.sum(dim=1).chunk(2, dim=0)
    margins = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(DPO_BETA * margins).mean()


def _forward_tile(tile: torch.Tensor, targets: torch.Tensor, stats: dict[str, torch.Tensor], vocab_start: int,
                  n_cols: int, outputs: tuple[str, ...]) -> None:
    """trl `_forward_tile` (chunked_logprob.py L210-253): one tile folded into the running
    statistics with torch ops on the whole tile (temperature 1, no soft-cap, scale 1)."""
    z = tile.float() * 1.0 * 1.0  # _torch_transform: z * logit_scale, then * inv_t
    local = targets - vocab_start
    if "mean_logits" in outputs:
        stats["z_sum"] += z.sum(-1)
    if "is_top1" in outputs:
        before_target = torch.arange(n_cols, device=z.device) < local.unsqueeze(-1)
        stats["max_before_target"].copy_(torch.maximum(
            stats["max_before_target"], z.masked_fill(~before_target, -float("inf")).amax(-1)))
    running_max = stats["running_max"]
    new_m = torch.maximum(running_max, z.amax(-1))
    rescale = torch.exp(running_max - new_m)
    e = torch.exp(z - new_m.unsqueeze(-1))
    stats["sum_exp"].mul_(rescale).add_(e.sum(-1))
    if "entropy" in outputs:
        stats["x_sum_exp"].mul_(rescale).add_((e * z).sum(-1))
    running_max.copy_(new_m)
    in_tile = (local >= 0) & (local < n_cols)
    target_z = z.gather(-1, local.clamp(0, n_cols - 1).unsqueeze(-1)).squeeze(-1)
    stats["target_logit"].copy_(torch.where(in_tile, target_z, stats["target_logit"]))


def _backward_tile(tile: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, entropy: torch.Tensor,
                   grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, vocab_start: int,
                   n_cols: int) -> None:
    """trl `_backward_tile` (chunked_logprob.py L256-296): the tile turned into the logits'
    gradient in place, with torch ops on the whole tile. `y` (the scaled tile) stays alive to
    the end, as TRL's local of that name does."""
    y = tile.float() * 1.0  # y = tile.float() * logit_scale
    z = y * 1.0  # z = y * inv_t (no soft-cap)
    log_p = z - log_z.unsqueeze(-1)
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    if grad_logprobs is not None:
        is_target = torch.arange(vocab_start, vocab_start + n_cols, device=z.device) == targets.unsqueeze(-1)
        grad += grad_logprobs.unsqueeze(-1) * (is_target.float() - p)
    if grad_entropy is not None:
        grad -= grad_entropy.unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
    grad = grad * 1.0
    tile.copy_(grad * 1.0)
    del y


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class ChunkedLogProb(torch.autograd.Function):
    """TRL's `ChunkedLogProbFunction` (module docstring), temperature 1, with `triton`
    choosing the CUDA fold (nothing allocated) or the torch fold."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, triton: bool, outputs: tuple[str, ...]) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        n_tokens, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
        compute_dtype = _compute_dtype(hidden)
        stats = {name: torch.full((n_tokens,), fill, device=device, dtype=torch.float32) for name, fill in (
            ("running_max", -float("inf")), ("sum_exp", 0.0), ("x_sum_exp", 0.0), ("sq_sum_exp", 0.0),
            ("z_sum", 0.0), ("max_before_target", -float("inf")), ("target_logit", 0.0))}
        mm_buf = torch.empty((min(n_tokens, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=device, dtype=compute_dtype)
        for token_start in range(0, n_tokens, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tokens)
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                tile = mm_buf[: token_end - token_start, : end - start]
                torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                if not triton:
                    _forward_tile(tile, targets[token_start:token_end],
                                  {k: v[token_start:token_end] for k, v in stats.items()}, start, end - start, outputs)
        del mm_buf
        log_z = stats["running_max"] + torch.log(stats["sum_exp"])
        logprobs = stats["target_logit"] - log_z
        entropy = log_z - stats["x_sum_exp"] / stats["sum_exp"] if "entropy" in outputs else None
        mean_logits = stats["z_sum"] / vocab if "mean_logits" in outputs else None
        is_top1 = ((stats["target_logit"] >= stats["running_max"]) & (stats["target_logit"] > stats["max_before_target"])
                   if "is_top1" in outputs else None)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype, ctx.triton = compute_dtype, triton
        ctx.mark_non_differentiable(*(x for x in (mean_logits, is_top1) if x is not None))
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 *_: Any) -> tuple[Any, ...]:
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n_tokens, vocab, compute_dtype = hidden.shape[0], weight.shape[0], ctx.compute_dtype
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_bias else None
        mm_buf = torch.empty((min(n_tokens, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=hidden.device,
                             dtype=compute_dtype)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        for token_start in range(0, n_tokens, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tokens)
            rows = slice(token_start, token_end)
            hidden_chunk = hidden[rows].to(compute_dtype)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                w_chunk = weight[start:end].to(compute_dtype)
                tile = mm_buf[: token_end - token_start, : end - start]
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                if not ctx.triton:
                    _backward_tile(tile, targets[rows], log_z[rows], entropy[rows],
                                   grad_logprobs[rows] if grad_logprobs is not None else None,
                                   grad_entropy[rows] if grad_entropy is not None else None, start, end - start)
                _accumulate(grad_hidden, grad_weight, grad_bias, tile, w_chunk, hidden_chunk, rows, start, end,
                            ctx.triton)
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


def _accumulate(grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                tile: torch.Tensor, w_chunk: torch.Tensor, hidden_chunk: torch.Tensor, rows: slice, start: int,
                end: int, cuda: bool) -> None:
    """trl `_addmm_fp32` into the fp32 accumulators (chunked_logprob.py L51-60): on CUDA
    with 16-bit inputs `torch.addmm(..., out_dtype=float32, out=acc)`, which allocates
    nothing (left out here: a CPU build has no such kernel); elsewhere
    `acc.addmm_(a.float(), b.float())`, whose casts copy a 16-bit tile."""
    if cuda and tile.dtype in (torch.float16, torch.bfloat16):
        if grad_bias is not None:
            grad_bias[start:end] += tile.sum(dim=0, dtype=torch.float32)
        return
    if grad_hidden is not None:
        grad_hidden[rows].addmm_(tile.float(), w_chunk.float())
    if grad_weight is not None:
        grad_weight[start:end].addmm_(tile.t().float(), hidden_chunk.float())
    if grad_bias is not None:
        grad_bias[start:end] += tile.sum(dim=0, dtype=torch.float32)
