"""Benchmark suite: methods side by side on GRPO-shaped batches (``shared-prefix-logps bench``)."""
