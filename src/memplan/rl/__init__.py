"""RL post-training memory, phase by phase: `memplan.estimate_rl` (GRPO, PPO, DPO, RLOO
under TRL, verl or OpenRLHF, with a colocated or separate vLLM rollout): each phase's
residents and peak, which allocator holds what, the peak phase and the verdict
(`memplan.rl.estimate`), the cheapest changes that fit (`memplan.rl.whatfits`), and each
trainer's own configuration file read as its flags (`memplan.rl.config`)."""

from memplan.rl.estimate import RLEstimate, estimate_rl

__all__ = ["RLEstimate", "estimate_rl"]
