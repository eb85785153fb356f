"""Attention during the shared-prefix phases: one module per backend, and the function that dispatches to them.

- ``dispatch``: the function registered with transformers' ``AttentionInterface``; outside a phase it calls the
  model's own implementation, inside one the phase's backend;
- ``expand``: SDPA over each row's gathered prompt keys/values (any device);
- ``flex``: packed rows and one compiled ``flex_attention`` call per layer (CUDA's default);
- ``dense``: no phases at all, every ``[prompt | completion]`` row through the model's own forward (the reference).

Backends are chosen by name (``ATTENTION_BACKENDS`` in ``inputs.py``).
"""

from .dispatch import (
    ATTENTION_NAME,
    ReentrantCheckpointError,
    implementation_name,
    intercepting,
    is_shared_prefix_name,
    original_implementation_name,
    shared_prefix_attention,
)

__all__ = [
    "ATTENTION_NAME",
    "ReentrantCheckpointError",
    "implementation_name",
    "intercepting",
    "is_shared_prefix_name",
    "original_implementation_name",
    "shared_prefix_attention",
]
