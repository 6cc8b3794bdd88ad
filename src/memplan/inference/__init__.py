"""Inference memory: a transformers `generate()` call traced on fake tensors
(`estimate_generation`), what a serving engine (vLLM, SGLang) sizes on a GPU, term by term
(`estimate_serving`), and the KV-cache page arithmetic per attention kind both rest on
(`memplan.inference.kv`)."""

from memplan.inference.generate import estimate_generation
from memplan.inference.serve import ServingEstimate, estimate_serving

__all__ = ["ServingEstimate", "estimate_generation", "estimate_serving"]
