"""Mixtures of experts: which models have routed experts, and the routing a step runs with.

Transformers' MoE blocks (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3) all end in
one experts module, decorated by `transformers.integrations.moe.use_experts_implementation`
and called as `experts(hidden_states, top_k_index, top_k_weights)` with the router's choice
of `top_k` experts per token ([tokens, top_k] expert ids). How many tokens each expert
gets is data: on fake tensors there is none, and the memory of a step can depend on it
(expert parallelism's all-to-all buffers and the experts' inputs on the receiving rank
are sized by those counts: `memplan.parallel.expert`). So a traced step runs with a
stated assignment (`TrainingSetup.routing`), which replaces the router's expert ids as
they enter the experts module (a forward pre-hook; the router itself, its logits and its
weights run and are traced as they are). Real runs take the same hook, so a real step
and its trace route alike; `router` keeps the model's own router (real tensors only).

With T tokens in a micro-batch (batch x sequence), top-k experts per token and E routed
experts, slot j of token t goes to:

- `balanced`: expert (t k + j) mod E, every expert gets T k / E slots (±1);
- `worst`: expert j, every token of the micro-batch to the same top-k experts (0 .. k-1),
  which get T tokens each and the others none. Under expert parallelism experts 0 .. k-1
  live on the first EP rank(s), so rank 0 is the most loaded one;
- `capacity:F`: each expert takes at most C = ceil(F T k / E) slots of a micro-batch (the
  expert capacity of the Switch Transformer, Fedus et al. 2021 §2.1, and GShard, Lepikhin
  et al. 2020 §2.2, with k slots per token); tokens beyond it are dropped. The assignment
  is the heaviest that capacity allows: experts filled to capacity in order (slot
  p = j T + t to expert p // min(C, T)), so F = 1 is `balanced` and F >= E / k is
  `worst`. F < 1 would drop tokens that transformers' dropless experts always compute,
  so it is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memplan.errors import UserError

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

ROUTINGS = ("balanced", "worst", "capacity:F", "router")
# Where each family's config keeps its routed-expert count (Mixtral, gpt-oss; Qwen-MoE, OLMoE; DeepSeek).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERT_INDEX_NAMES = ("top_k_index", "router_indices")  # the experts' argument names for the router's choice


@dataclass(frozen=True)
class Routing:
    """A parsed `TrainingSetup.routing` (module docstring)."""

    kind: str
    factor: float | None = None

    def __str__(self) -> str:
        return f"capacity:{self.factor:g}" if self.kind == "capacity" else self.kind

    def capacity(self, tokens: int, top_k: int, num_experts: int) -> int:
        """Slots one expert takes from a micro-batch of `tokens` (capacity:F only)."""
        return math.ceil(self.factor * tokens * top_k / num_experts)


def parse_routing(text: str) -> Routing:
    """`Routing` of a `--routing` value; UserError (one line) for anything else."""
    if text in ("balanced", "worst", "router"):
        return Routing(text)
    name, _, value = str(text).partition(":")
    if name == "capacity":
        try:
            factor = float(value)
        except ValueError:
            factor = float("nan")
        if not factor >= 1 or math.isinf(factor):
            raise UserError(f"capacity factor must be a number >= 1 (below 1 transformers' dropless experts would "
                            f"still compute the tokens a capacity drops), not {value!r}: e.g. capacity:1.25")
        return Routing("capacity", factor)
    raise UserError(f"routing must be one of {', '.join(ROUTINGS)}, not {text!r}")


def experts_of(config: PretrainedConfig | Any) -> tuple[int, int] | None:
    """(routed experts, experts per token) of a mixture-of-experts config; None for a dense one."""
    count = next((getattr(config, k, None) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), None)
    if not isinstance(count, int) or count < 1:
        return None
    return count, int(getattr(config, "num_experts_per_tok", None) or 1)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules of a transformers model (those `use_experts_implementation`
    decorates: it gives each an `_is_expert_parallel` flag), by qualified name."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def assigned_experts(tokens: int, top_k: int, num_experts: int, routing: Routing,
                     device: torch.device | str) -> torch.Tensor:
    """[tokens, top_k] int64 expert ids of `routing` (module docstring), made with torch ops
    on `device`, so on fake tensors as on real ones."""
    t = torch.arange(tokens, device=device).unsqueeze(1)
    j = torch.arange(top_k, device=device).unsqueeze(0)
    if routing.kind == "balanced":
        return (t * top_k + j) % num_experts
    if routing.kind == "worst":
        return (t * 0 + j).contiguous()
    per_expert = min(routing.capacity(tokens, top_k, num_experts), tokens)
    return torch.div(j * tokens + t, per_expert, rounding_mode="floor")


def check_routing(config: PretrainedConfig | Any, routing: str, *, fake: bool) -> None:
    """UserError for a routing the model or the tensors cannot take: one other than the
    default on a dense model, `router` on fake tensors (no token counts exist there)."""
    rule = parse_routing(routing)
    if experts_of(config) is None:
        if routing != "balanced":
            raise UserError(f"`routing={routing}` describes how a mixture-of-experts model routes its tokens; "
                            f"model type {getattr(config, 'model_type', '?')!r} has no experts: leave `routing` out")
        return
    if rule.kind == "router" and fake:
        raise UserError("`routing=router` needs the router's real token counts: run on real tensors "
                        "(memplan trace --real), or assume balanced, worst or capacity:F")


def apply_routing(model: nn.Module, config: PretrainedConfig | Any, routing: str) -> None:
    """Make every experts module of `model` take `routing`'s assignment in place of the
    router's expert ids (module docstring); `router` leaves the model as it is. Each
    experts module keeps the rule and the global expert count (`memplan_routing`,
    `memplan_num_experts`) for what splits it later (expert parallelism)."""
    rule = parse_routing(routing)
    experts = experts_of(config)
    if experts is None:
        return
    for _, module in expert_modules(model):
        module.memplan_routing = rule
        module.memplan_num_experts = experts[0]
        if rule.kind != "router":
            module.register_forward_pre_hook(_replace_expert_ids, with_kwargs=True)


def _replace_expert_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the router's [tokens, top_k] expert ids -> the assumed ones."""
    positional = list(args)
    if len(positional) >= 2:
        hidden, index = positional[0], positional[1]
    else:
        hidden = positional[0] if positional else kwargs["hidden_states"]
        key = next((k for k in EXPERT_INDEX_NAMES if k in kwargs), None)
        if key is None:
            raise UserError(f"{type(module).__name__} is called without the router's expert ids: cannot apply "
                            "`routing` to it")
        index = kwargs[key]
    assigned = assigned_experts(hidden.shape[0], index.shape[-1], module.memplan_num_experts,
                                module.memplan_routing, index.device).to(index.dtype)
    if len(positional) >= 2:
        positional[1] = assigned
    else:
        kwargs[key] = assigned
    return tuple(positional), kwargs
