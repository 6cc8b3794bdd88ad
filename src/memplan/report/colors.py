"""One colour per trace category and per phase, for every picture of the report: the
matplotlib figures (`report.figures`) and the interactive timeline (`report.timeline`,
which hands these to `timeline.js`), so a category reads the same in each."""

from __future__ import annotations

from memplan.trace.model import CATEGORIES, PHASES

CATEGORY_COLORS = {
    "parameter": "#4e79a7",
    "gradient": "#f28e2b",
    "optimizer_state": "#59a14f",
    "activation": "#e15759",
    "temporary": "#b07aa1",
    "input": "#76b7b2",
    "other": "#9c9c9c",
}
PHASE_COLORS = {
    "forward": "#e8f1fa",
    "backward": "#fdf0e6",
    "recompute": "#fbe8ea",
    "optimizer": "#edf6ea",
    "other": "#ffffff",
}
ALLOCATOR_COLORS = {"torch": "#4e79a7", "cumem": "#f28e2b", "outside": "#9c9c9c"}  # who holds an RL phase's bytes
RL_PHASE_SHADES = ("#e8f1fa", "#fdf0e6", "#edf6ea", "#fbe8ea", "#f3eefa", "#eef6f6")  # one band per RL phase
INFEASIBLE_COLOR = "#c0392b"  # a result that breaks its budget: drawn hatched, in red
KV_CACHE_COLOR = "#edc948"
# the terms of a serving engine's memory budget and of a generate() call's peak; the terms a
# training step also has take its categories' colours
SERVING_COLORS = {
    "non-torch": CATEGORY_COLORS["other"],
    "weights": CATEGORY_COLORS["parameter"],
    "activation reserve": CATEGORY_COLORS["activation"],
    "CUDA graphs": CATEGORY_COLORS["temporary"],
    "KV pool": KV_CACHE_COLOR,
    "free": "#ffffff",
}
GENERATION_COLORS = {
    "weights": CATEGORY_COLORS["parameter"],
    "kv_cache": KV_CACHE_COLOR,
    "activations": CATEGORY_COLORS["activation"],
    "other": CATEGORY_COLORS["other"],
}

def category_colors() -> list[str]:
    """The colours in `CATEGORIES` order (the index a trace stores)."""
    return [CATEGORY_COLORS[c] for c in CATEGORIES]

def phase_colors() -> list[str]:
    """The phase shades in `PHASES` order."""
    return [PHASE_COLORS[p] for p in PHASES]
