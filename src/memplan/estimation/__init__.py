"""Estimate and fit: per-GPU peak memory of a training step, and the layouts that fit.

The public entry points are also `memplan.estimate(model, setup, layout, device=...)`
and `memplan.fit(model, gpu, gpus, setup)`; this package is named `estimation` so that
`memplan.estimate` can be the function.
"""

from memplan.estimation.fit import fit
from memplan.estimation.pipeline import Estimate, RankEstimate, estimate
from memplan.hardware.devices import DeviceProfile, device_profile, list_devices

__all__ = ["DeviceProfile", "Estimate", "RankEstimate", "device_profile", "estimate", "fit", "list_devices"]
