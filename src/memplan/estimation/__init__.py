"""Estimate and fit: per-GPU peak memory of a training step, and the layouts that fit.

The public entry points are also `memplan.estimate(model, setup, layout, device=...)`
and `memplan.fit(model, gpu, gpus, setup)`; this package is named `estimation` so that
`memplan.estimate` can be the function.

The names below are imported on first use, so that a command line parses (and prints its
help, with the margin of `memplan.estimation.margin`) without torch. `fit` is the
submodule `memplan.estimation.fit` here; its function is `memplan.fit`.
"""

import importlib

_LAZY_NAMES = {
    "Estimate": "memplan.estimation.pipeline",
    "RankEstimate": "memplan.estimation.pipeline", "estimate": "memplan.estimation.pipeline",
    "DeviceProfile": "memplan.hardware.devices", "device_profile": "memplan.hardware.devices",
    "list_devices": "memplan.hardware.devices",
}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - the type depends on the name
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'memplan.estimation' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
