"""Benchmark and demo tooling, apart from the core: the CLI (``shared-prefix-logps bench|demo``), the demo, model
presets built from configs, methods compared side by side on GRPO-shaped batches, peak-memory measurement, reports."""
