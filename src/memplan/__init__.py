"""memplan: how much GPU memory a training step takes, and how to make it take less."""

from memplan.errors import UserError
from memplan.trace import Trace, load, save, validate

__version__ = "0.1.0"

__all__ = ["Trace", "UserError", "load", "save", "validate", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy imports keep `import memplan` fast
    if name == "capture":
        from memplan.capture import capture

        return capture
    if name == "simulate":
        from memplan.alloc import simulate

        return simulate
    if name == "planned_allocator":
        from memplan.runtime import planned_allocator

        return planned_allocator
    if name in ("estimate", "fit"):
        import memplan.estimation as estimation

        return getattr(estimation, name)
    if name == "reorder":
        from memplan.order.run import reorder

        return reorder
    if name in ("plan", "pack"):
        import memplan.layout as layout

        return getattr(layout, name)
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
