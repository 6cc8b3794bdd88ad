"""memplan: how much GPU memory a training step takes, and how to make it take less."""

import importlib

from memplan.errors import UserError

__version__ = "0.1.0"

__all__ = ["Trace", "UserError", "load", "save", "validate", "__version__"]

# Names `memplan.<name>` gives, and the module each comes from; imported on first use,
# which keeps `import memplan` free of torch.
_LAZY_NAMES = {  # imported on first use: `memplan --help` imports neither numpy nor torch
    "Trace": "memplan.trace",
    "load": "memplan.trace",
    "save": "memplan.trace",
    "validate": "memplan.trace",
    "capture": "memplan.capture",
    "replay": "memplan.alloc",
    "planned_allocator": "memplan.runtime",
    "estimate": "memplan.estimation",
    "estimate_generation": "memplan.inference.generate",
    "fit": "memplan.estimation.fit",
    "reorder": "memplan.order.run",
    "plan_addresses": "memplan.layout",
    "save_address_plan": "memplan.layout",
    "pack": "memplan.layout",
    "estimate_serving": "memplan.inference",
    "estimate_rl": "memplan.rl",
}


# Subpackages `memplan.<name>` gives whole, imported on first use: `memplan.watch` is a
# package that is also callable (`memplan.watch(model, optimizer, ...)`).
_LAZY_PACKAGES = ("watch",)


def __getattr__(name: str):  # noqa: ANN202 - the type depends on the name
    if name in _LAZY_PACKAGES:
        return importlib.import_module(f"memplan.{name}")
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
