"""Inference: the memory of generation and serving (memplan generate, memplan serve)."""

from memplan.inference.generate import estimate_generation  # noqa: F401
