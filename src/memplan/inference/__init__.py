"""Inference memory: a transformers `generate()` call traced on fake tensors
(`estimate_generation`), what a serving engine (vLLM, SGLang) sizes on a GPU, term by term
(`estimate_serving`), and the KV-cache page arithmetic per attention kind both rest on
(`memplan.inference.kv`).

The names below are imported on first use, so that a command line parses without torch.
"""

import importlib

_LAZY_NAMES = {"estimate_generation": "memplan.inference.generate", "ServingEstimate": "memplan.inference.serve", "estimate_serving": "memplan.inference.serve"}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - the type depends on the name
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
