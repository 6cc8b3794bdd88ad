"""RL post-training memory, phase by phase: `memplan.estimate_rl` (GRPO, PPO, DPO, RLOO
under TRL, verl or OpenRLHF, with a colocated or separate vLLM rollout): each phase's
residents and peak, which allocator holds what, the peak phase and the verdict
(`memplan.rl.estimate`), the cheapest changes that fit (`memplan.rl.whatfits`), and each
trainer's own configuration file read as its flags (`memplan.rl.config`).

The names below are imported on first use, so that a command line parses without torch.
"""

import importlib

_LAZY_NAMES = {"RLEstimate": "memplan.rl.estimate", "estimate_rl": "memplan.rl.estimate"}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - the type depends on the name
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
