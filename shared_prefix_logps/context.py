"""State that travels with one phase of a shared-prefix forward.

The attention function receives the phase context as a model kwarg (``shared_prefix_context``), so it is bound into
activation-checkpointing closures and is still there when backward recomputes a layer. The lm_head proxy and the
mask function are not handed model kwargs; they read the context of the forward that is running from a
``ContextVar`` set around the model call.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

#: Name of the model kwarg that carries a phase context to the attention function.
CONTEXT_KWARG = "shared_prefix_context"

_ACTIVE: ContextVar[CaptureContext | SharedContext | None] = ContextVar("shared_prefix_logps_active", default=None)


@dataclass(eq=False)
class CaptureContext:
    """Phase 1: prompts are forwarded once and each layer's post-RoPE keys/values are recorded.

    Attributes:
        key_valid: (num_prompts, prefix_len) bool, False on left padding of the prefix.
        positions: (num_prompts, prefix_len) int64 position of each prefix token.
        needs_grad: whether the caller expects gradients through the captured keys/values.
        kv: attention module -> (key, value), each (num_prompts, num_kv_heads, prefix_len, head_dim).
        masks: attention masks built once per phase, keyed by their kind and sliding window.
    """

    key_valid: torch.Tensor
    positions: torch.Tensor
    needs_grad: bool
    kv: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)


@dataclass(eq=False)
class SharedContext:
    """Phase 2: completion rows attend over their group's captured prefix and, causally, over themselves.

    Attributes:
        capture: the Phase 1 context whose keys/values are the prefixes (None when every prefix is empty).
        group_index: (rows,) int64 index of each row's prompt in the capture.
        positions: (rows, completion_len) int64 position of each query token.
        query_valid: (rows, completion_len) bool, True where a query token's output is used.
        head_targets: (num_valid,) int64 next-token ids of the valid query tokens, in row-major order.
        temperature: divides the logits before the log-softmax.
        return_entropy: whether the head also computes the entropy of each valid token's distribution.
        needs_grad: whether the caller expects gradients.
        head_spec: the model's :class:`~shared_prefix_logps.model_support.HeadSpec` (scale, softcap, lm_head).
        logps / entropy: written by the lm_head proxy: (num_valid,) float32.
        masks: attention masks built once per phase, keyed by their kind and sliding window.
    """

    capture: CaptureContext | None
    group_index: torch.Tensor
    positions: torch.Tensor
    query_valid: torch.Tensor
    head_targets: torch.Tensor
    temperature: float
    return_entropy: bool
    needs_grad: bool
    head_spec: object
    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)


def active_context() -> CaptureContext | SharedContext | None:
    """The phase context of the model call that is running, or None outside the library's calls."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activated(context: CaptureContext | SharedContext):
    """Make ``context`` the active one for the duration of a model call."""
    token = _ACTIVE.set(context)
    try:
        yield context
    finally:
        _ACTIVE.reset(token)
