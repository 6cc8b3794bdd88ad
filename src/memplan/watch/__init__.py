"""`memplan.watch`: memplan inside the real training job (docs/watch.md).

`memplan.watch(model, optimizer, step=N, out_dir=..., on_oom=True, capacity=None, setup=None)`
is a context manager (`memplan.watch.session.Watch`) around an unchanged training loop: it
measures iteration N for real, estimates the same step on fake copies of the live model and
optimizer, compares the two, writes the trace, the PyTorch snapshot and the report, and turns
an out-of-memory error into the cheapest changes that fit. The framework callbacks that drive
it are in `memplan.integrations`.

The package is itself callable, so that `memplan.watch(...)` is the function whether or not
`memplan.watch` has been imported as a module.
"""

import sys
import types

from memplan.watch.session import Watch, watch

__all__ = ["Watch", "watch"]


class _CallableModule(types.ModuleType):
    """This package, callable as `watch`."""

    def __call__(self, *args: object, **kwargs: object) -> Watch:
        return watch(*args, **kwargs)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule
