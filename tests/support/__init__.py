"""Helpers the tests share: tiny models built from configs, the dense-reference comparison, multi-process setup,
the offline TRL trainer and verl engine, TRL's loss transcribed. Importable as ``support.*`` (``pythonpath`` in
pyproject.toml)."""
