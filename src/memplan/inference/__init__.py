"""Inference memory: what a serving engine (vLLM, SGLang) sizes on a GPU, term by term
(`estimate_serving`), and the KV-cache page arithmetic per attention kind it rests on
(`memplan.inference.kv`)."""

from memplan.inference.serve import ServingEstimate, estimate_serving

__all__ = ["ServingEstimate", "estimate_serving"]
