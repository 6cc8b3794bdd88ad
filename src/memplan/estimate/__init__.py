"""Estimate and fit: per-GPU peak memory of a training step, and the layouts that fit."""
