"""The loss of a language-model step: the model's own, chunked, or fused with the head.

`step_loss(model, batch, setup)` is what one micro-batch's forward returns. For
`setup.loss`:

- `full`: the model's own head and loss (`build.forward_loss`: Hugging Face's
  `ForCausalLMLoss`, which upcasts the whole [B, S, V] logits to fp32);
- `chunked` / `chunked:N`: torchtune's chunked output and loss. The model's body runs to
  its final hidden states, then the output head runs on N chunks of the sequence
  (`TransformerDecoder.chunked_output`, torchtune/modules/transformer.py: `[self.output(chunk)
  for chunk in last_hidden_state.chunk(num_output_chunks, dim=1)]`), and
  `CEWithChunkedOutputLoss.forward` (torchtune/modules/loss/ce_chunked_output_loss.py, v0.6.1)
  upcasts one chunk at a time: `F.cross_entropy(chunk.float(), labels, reduction="sum")`
  summed over the chunks and divided by the number of labels that are not -100. torchtune
  itself is not a dependency (its package imports datasets, torchdata and tokenizers, and
  its recipes' CUDA streams cannot run here): these lines reproduce the two functions;
- `trl-grpo:C`, `trl-dpo:C`, `trl-logprobs:C`: an RL trainer's own scoring of the last C
  tokens of each sequence and its objective (`memplan.models.rl_losses`: TRL's fused
  chunked log-probability head, GRPO's and DPO's losses);
- `fused-linear`: Liger-Kernel's fused linear cross-entropy (`LigerFusedLinearCrossEntropyFunction`,
  liger_kernel/ops/fused_linear_cross_entropy.py, v0.8.5), reproduced in PyTorch by
  `FusedLinearCrossEntropy` (its Triton kernels need a GPU). The [B, S, V] logits never
  exist at once; the gradients are computed in forward, chunk by chunk.

Labels are shifted as Hugging Face, torchtune's recipes and Liger's `LigerForCausalLMLoss`
all shift them: padded with -100 and moved one position left, so the three losses are the
same number as `full` (docs/estimation.md, "Losses and activation offloading").

How the loss replaces the head: the output head (`get_output_embeddings()`) is swapped,
for the duration of the model's forward, for a module that computes the loss from the
final hidden states with the real head and returns it where the logits would be
(`_LossHead`), so the model's own forward (with every wrapper around it: peft, FSDP2,
DTensor TP) runs unchanged. A model that changes its logits after the head (Gemma-2's
soft-capping, Cohere's and Granite's scaling) returns something else than what the head
returned, and is refused: the chunked and fused losses would skip that step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memplan.errors import UserError
from memplan.models.build import _base_model, forward_loss, is_masked_lm
from memplan.models.rl_losses import parse_rl_loss, rl_head_loss

IGNORE_INDEX = -100  # Hugging Face's, torchtune's and Liger's ignore_index


def step_loss(model: nn.Module, batch: dict[str, torch.Tensor], loss: str = "full", *,
              chunks: int = 1, body: contextlib.AbstractContextManager | None = None,
              on_head: Callable[[], None] | None = None, cuda: bool = False) -> torch.Tensor:
    """The scalar loss of one micro-batch under `loss` (module docstring).

    `chunks`: the chunk count of a chunked loss (`TrainingSetup.loss_chunks()`). `body`: a
    context (e.g. activation offloading) the model's forward runs in. `on_head`: called
    when a chunked or fused loss starts its head, inside the model's forward (where a
    forward pre-hook on the head would run). `cuda`: the fused loss takes Liger's CUDA code
    path (a CUDA job traced on fake cpu tensors)."""
    context = body if body is not None else contextlib.nullcontext()
    if loss == "full":
        with context:
            return forward_loss(model, batch)
    labels = batch.get("labels")
    if labels is None:
        raise UserError(f"`loss={loss}` needs a batch with labels: use `loss=full`")
    head, name = output_head(model, loss)
    rl = parse_rl_loss(loss)
    if rl is not None and not hasattr(head, "weight"):
        raise UserError(f"--loss {loss} reads the output head's weight, and this head is a {type(head).__name__}")
    if loss == "fused-linear" and type(head) is not nn.Linear:
        raise UserError(f"`loss=fused-linear` takes the output head's weight, and this head is a "
                        f"{type(head).__name__} (an adapter or a wrapper): use `loss=chunked`")
    shifted = shift_labels(labels)

    def compute(hidden: torch.Tensor) -> torch.Tensor:
        if rl is not None:
            return rl_head_loss(*rl, triton=cuda, backbone=_backbone(model))(head, hidden, batch["input_ids"])
        if loss == "fused-linear":
            return fused_linear_cross_entropy(head, hidden, shifted, cuda=cuda)
        return chunked_output_loss(head, hidden, shifted, chunks)

    loss_head = _LossHead(compute, on_head)
    with _head_replaced(model, name, loss_head), context:
        output = model(**{k: v for k, v in batch.items() if k != "labels"})
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if loss_head.returned is None or logits is not loss_head.returned:
        raise UserError(f"{type(_base_model(model)).__name__} changes its logits after the output head (soft-capping "
                        f"or scaling), which `loss={loss}` would skip: use `loss=full`")
    loss_head.returned = None
    return logits


def _backbone(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> the final hidden states of the Hugging Face model's own backbone."""
    hf = _base_model(model)
    body = getattr(hf, hf.base_model_prefix)
    return lambda input_ids: body(input_ids=input_ids).last_hidden_state


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels one position left, -100 at the end (transformers' `ForCausalLMLoss`)."""
    padded = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    return padded[..., 1:].contiguous()


class _LossHead(nn.Module):
    """Stands in for the output head during the model's forward: runs the head and the
    loss on the final hidden states and returns the scalar loss where the logits would be.

    The loss is computed inside the model's forward, as torchtune's `chunked_output` runs
    the head there and Liger's `lce_forward` its fused loss: wrappers of the whole model
    (FSDP2's root, with its parameters gathered only during that forward and its
    pre-backward hooks on what the forward returns) see it as the model's output."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor], on_head: Callable[[], None] | None) -> None:
        super().__init__()
        self.compute = compute
        self.on_head = on_head
        self.returned: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.on_head is not None:
            self.on_head()
        self.returned = self.compute(hidden)
        return self.returned


def output_head(model: nn.Module, loss: str) -> tuple[nn.Module, str]:
    """The language-model head a chunked or fused `loss` runs itself, and its qualified name
    in the Hugging Face model under any peft wrapper; `UserError` where there is none."""
    hf = _base_model(model)
    get = getattr(hf, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise UserError(f"`loss={loss}` runs the model's output head itself, and {type(hf).__name__} has none "
                        "(no get_output_embeddings()): use `loss=full`")
    if is_masked_lm(model):
        raise UserError(f"`loss={loss}` is a causal language-model loss; {type(hf).__name__} is a masked LM, whose "
                        "head transforms the hidden states before its decoder: use `loss=full`")
    name = next(n for n, m in hf.named_modules() if m is head)
    return head, name


@contextlib.contextmanager
def _head_replaced(model: nn.Module, name: str, stand_in: nn.Module) -> Iterator[None]:
    """The module at `name` (in the Hugging Face model) replaced by `stand_in` for a while."""
    hf = _base_model(model)
    parent_name, _, attr = name.rpartition(".")
    parent = hf.get_submodule(parent_name) if parent_name else hf
    head = parent._modules[attr]
    parent._modules[attr] = stand_in
    try:
        yield
    finally:
        parent._modules[attr] = head


def chunked_output_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """torchtune's `TransformerDecoder.chunked_output` and `CEWithChunkedOutputLoss.forward`
    (module docstring) on the final hidden states [B, S, H] and shifted labels [B, S]."""
    logits = [head(chunk) for chunk in hidden.chunk(chunks, dim=1)]
    total_elements = (labels != IGNORE_INDEX).sum()
    label_chunks = [chunk.reshape(-1) for chunk in labels.chunk(chunks, dim=1)]
    logit_chunks = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
    total_loss: Any = 0.0
    for logits_chunk, labels_chunk in zip(logit_chunks, label_chunks):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=IGNORE_INDEX, reduction="sum")
    return total_loss / total_elements


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (`triton.next_power_of_2`; 1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def liger_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Rows of logits Liger's fused linear cross-entropy materialises at once
    (`fused_linear_cross_entropy_forward`, lines 102-105 of v0.8.5, `chunk_mem_const=1`):
    the next power of two of ceil(BT / ceil(V / H)), at most BT, so that a chunk of logits
    holds about as many elements as the [BT, H] input."""
    inc_factor = -(-vocab // hidden)
    return min(next_power_of_2(-(-tokens // inc_factor)), tokens)


def fused_linear_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *,
                               cuda: bool = False) -> torch.Tensor:
    """Liger's `LigerForCausalLMLoss` on the final hidden states: the head's weight (and
    bias) and the flattened [B*S, H] hidden states through `FusedLinearCrossEntropy`."""
    flat = hidden.view(-1, hidden.shape[-1])
    return FusedLinearCrossEntropy.apply(flat, head.weight, labels.view(-1), head.bias, cuda)


def _mm_out_applies(hidden: torch.Tensor, weight: torch.Tensor, cuda: bool) -> bool:
    """Liger's `_can_use_mm_out` (lines 32-48) inside `Function.forward`, where grad mode is
    off: CUDA, the input in the weight's dtype, and that dtype the autocast dtype if
    autocast is on."""
    if not cuda or hidden.dtype != weight.dtype:
        return False
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    for device in ("cuda", "cpu"):  # a CUDA job traced on fake cpu runs CPU autocast
        if torch.is_autocast_enabled(device):
            return hidden.dtype == torch.get_autocast_dtype(device)
    return True


def _cross_entropy_in_place(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """What `liger_cross_entropy_kernel` does to one chunk with mean reduction: the loss of
    each row divided by the number of labels (fp32 [rows]), and the gradient of the mean
    loss written over the logits in place ((softmax - one-hot) / count, ignored rows 0).
    The kernel works in fp32 registers; here the softmax is formed in the logits' own
    buffer, so that nothing of the chunk's size is allocated, as in the kernel."""
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
    picked = logits.gather(1, safe).float()
    rowmax = logits.amax(dim=1, keepdim=True)
    logits.sub_(rowmax).exp_()
    total = logits.sum(dim=1, keepdim=True, dtype=torch.float32)
    scale = valid.unsqueeze(1).float() / count
    rows = ((rowmax.float() + total.log() - picked) * scale).squeeze(1)
    logits.div_(total)
    logits.scatter_add_(1, safe, torch.full_like(picked, -1.0, dtype=logits.dtype))
    logits.mul_(scale)
    return rows


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's `LigerFusedLinearCrossEntropyFunction` (mean reduction, no softcap, no
    z-loss), reproduced in PyTorch with the allocations of `fused_linear_cross_entropy_forward`
    (liger_kernel/ops/fused_linear_cross_entropy.py, v0.8.5, lines 99-415):

    - `grad_input` zeros [BT, H], `grad_weight` (and `grad_bias`) zeros of the weight's
      dtype, `loss_1d` fp32 [BT], all for the whole forward;
    - per chunk of `liger_chunk_size` rows: logits = chunk @ weight.T (on CUDA, where
      `_can_use_mm_out` holds, into one [chunk, V] buffer reused by every chunk); the
      cross-entropy kernel turns them into their gradient in place; `grad_input[rows] =
      grad @ weight`; `grad_weight` += grad.T @ chunk (on CUDA with sm >= 8 an `addmm` into
      it; elsewhere Liger's fallback, a weight-sized product added in);
    - the three gradients are saved for backward, which only scales them in place by the
      incoming gradient (`fused_linear_cross_entropy_backward`; Liger skips the scaling when
      it is 1.0, which changes no allocation).

    The number of labels is kept as a tensor where Liger reads it with `.item()` (which a
    fake tensor cannot answer)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None, cuda: bool) -> torch.Tensor:
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        chunk = liger_chunk_size(tokens, width, vocab)
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if hidden.requires_grad and weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if hidden.requires_grad and bias is not None else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        count = (target != IGNORE_INDEX).sum()
        mm_out = _mm_out_applies(hidden, weight, cuda)
        storage = (torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)
                   if mm_out and (bias is None or bias.dtype == hidden.dtype) else None)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            rows = hidden[start:end]
            grad = _chunk_logits(rows, weight, bias, storage)
            loss_1d[start:end] = _cross_entropy_in_place(grad, target[start:end], count)
            if hidden.requires_grad:
                if mm_out and grad.dtype == grad_input.dtype:
                    torch.mm(grad, weight, out=grad_input[start:end])
                else:
                    grad_input[start:end] = grad @ weight
            if grad_weight is not None:
                _accumulate_grad_weight(grad_weight, grad, rows, cuda)
            if grad_bias is not None:
                torch.add(input=grad_bias, other=grad.sum(dim=0), out=grad_bias, alpha=1.0)
            del grad, rows
        del storage
        loss = torch.sum(loss_1d)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None,
                              grad_bias.detach() if grad_bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        for grad in (grad_input, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(grad_output)
        return grad_input, grad_weight, None, grad_bias, None


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  storage: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits (Liger lines 161-170): into the reused buffer where there is one."""
    if storage is not None:
        logits = storage[: rows.shape[0]]
        torch.mm(rows, weight.t(), out=logits)
        if bias is not None:
            logits.add_(bias)
        return logits
    logits = rows @ weight.t()
    return logits + bias if bias is not None else logits


def _accumulate_grad_weight(grad_weight: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor, cuda: bool) -> None:
    """grad_weight += grad.T @ rows, by Liger's branches (lines 324-376). On CUDA (sm >= 8
    assumed, A100 and later) an `addmm` into grad_weight, with the rows cast to the
    gradient's dtype where they differ; elsewhere a weight-sized product, made fp32, added in."""
    low = (torch.float16, torch.bfloat16)
    if cuda and grad.dtype in low and grad_weight.dtype in (torch.float32, grad.dtype):
        cast = rows.to(grad.dtype) if rows.dtype != grad.dtype else rows
        extra = {"out_dtype": torch.float32} if grad_weight.dtype == torch.float32 else {}
        torch.addmm(grad_weight, grad.t(), cast, out=grad_weight, **extra)
        return
    grad_weight += torch.mm(grad.t(), rows).float()
