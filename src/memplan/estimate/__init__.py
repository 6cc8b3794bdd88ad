"""Estimate and fit: per-GPU peak memory of a training step, and the layouts that fit."""

from memplan.estimate.devices import DeviceProfile, device_profile, list_devices
from memplan.estimate.pipeline import Estimate, RankEstimate, estimate

__all__ = ["DeviceProfile", "Estimate", "RankEstimate", "device_profile", "estimate", "list_devices"]
