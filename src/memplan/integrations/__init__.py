"""Training frameworks driving `memplan.watch` from their own callbacks (docs/watch.md):
`memplan.integrations.transformers.MemplanCallback` (Hugging Face `Trainer`),
`memplan.integrations.accelerate` (loops under `accelerator.accumulate`), and
`memplan.integrations.lightning.MemplanCallback` (importable where Lightning is installed).
Each module imports its framework itself; this package imports none."""
