"""State that travels with one phase of a shared-prefix forward.

The attention function receives the phase context as a model kwarg (``shared_prefix_context``), so it is bound into
activation-checkpointing closures and is still there when backward recomputes a layer. The lm_head proxy and the
mask function are not handed model kwargs; they read the context of the forward that is running from a
``ContextVar`` set around the model call.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

#: Name of the model kwarg that carries a phase context to the attention function.
CONTEXT_KWARG = "shared_prefix_context"

_ACTIVE: ContextVar[CaptureContext | SharedContext | HeadCheckContext | None] = ContextVar(
    "shared_prefix_logps_active", default=None
)

# Whether any thread is inside :func:`activated`, read before the ContextVar. Dynamo cannot trace a ContextVar lookup
# (it breaks the graph at every lm_head and mask builder of a compiled model), but it guards on a module global: a
# compiled plain forward then traces only this flag, stays one graph, and is recompiled if the flag changes.
_ANY_ACTIVE = False
_active_count = 0
_count_lock = threading.Lock()


@dataclass(eq=False)
class CaptureContext:
    """Phase 1: prompts are forwarded once and each layer's post-RoPE keys/values are recorded.

    Two layouts. ``padded`` (the ``expand`` backend): one row per prompt, left-padded. ``packed`` (the ``flex``
    backend): a single row holding the real prefix tokens of every prompt back to back, no padding.

    Attributes:
        key_valid: (num_prompts, prefix_len) bool, False on left padding ((1, total) all True when packed).
        positions: (num_prompts, prefix_len) int64 position of each prefix token ((1, total) when packed).
        needs_grad: whether the caller expects gradients through the captured keys/values.
        packed: the layout: False (padded), or the packed backend ("flex" or "flash"; True means flex); when
            packed, ``segments`` (total,) int64 gives each token's prompt index.
        kv: attention module -> (key, value), each (rows, num_kv_heads, length, head_dim) in the layout above,
            filled after the forward with the pairs released from the model's output (see ``routing``).
        routes: attention module -> :class:`~.routing.RouteBox` of its raw (key, value), which
            ride on the layer's attention output during the forward (one entry per layer that ran).
        masks: attention masks built once per phase, keyed by their kind and sliding window.
        finished: set once the phase's forward has returned; attention calls after that are activation-checkpoint
            recomputations during backward.
        router: when router statistics were requested, ``(counts, probs, tokens)`` of each prompt's prefix tokens,
            (num_prompts, E), (num_prompts, E), (num_prompts,) float32 (see :mod:`~shared_prefix_logps.moe_router`).
    """

    key_valid: torch.Tensor
    positions: torch.Tensor
    needs_grad: bool
    packed: bool | str = False
    segments: torch.Tensor | None = None
    kv: dict = field(default_factory=dict)
    routes: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)
    finished: bool = False
    router: tuple | None = None

    def kv_of(self, module) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) recorded for attention ``module``; a clear error if Phase 1 never reached it."""
        try:
            return self.kv[module]
        except KeyError:
            raise ValueError(
                f"attention layer {type(module).__name__} was not seen while the prompts were forwarded; "
                "this model's layers cannot share a prefix"
            ) from None


@dataclass(eq=False)
class SharedContext:
    """Phase 2: completion rows attend over their group's captured prefix and, causally, over themselves.

    Padded layout (``expand``): one row per completion, (rows, C). Packed layout (``flex``): one row holding the
    valid query tokens of every completion back to back, (1, num_valid).

    Attributes:
        capture: the Phase 1 context whose keys/values are the prefixes (None when every prefix is empty).
        group_index: (rows,) int64 index of each row's prompt in the capture.
        positions: (rows, completion_len) int64 position of each query token ((1, num_valid) when packed).
        query_valid: (rows, completion_len) bool, True where a query token's output is used (packed: all True, or
            the single False placeholder forwarded when no token is valid).
        head_targets: (num_valid,) int64 next-token ids of the valid query tokens, in row-major order.
        temperature: divides the logits before the log-softmax.
        return_entropy: whether the head also computes the entropy of each valid token's distribution.
        needs_grad: whether the caller expects gradients.
        head_spec: the model's :class:`~shared_prefix_logps.model.HeadSpec` (scale, softcap, lm_head).
        packed: the layout, as for :class:`CaptureContext`; when packed, ``query_rows`` (num_valid,) int64 gives each
            query token's row.
        logps / entropy: (num_valid,) float32: written by the lm_head proxy (riding on its output, ``route``), then
            replaced by the ones released from the model's output.
        route: :class:`~shared_prefix_logps.forward.routing.RouteBox` of the head's results.
        masks: attention masks built once per phase, keyed by their kind and sliding window.
        finished: as for :class:`CaptureContext`.
        called: attention modules the phase's forward has run (each may run once).
        router: when router statistics were requested, ``(counts, probs, tokens)`` of each row's Phase 2 tokens (its
            last prompt token and every real completion token), (rows, E), (rows, E), (rows,) float32.
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
    packed: bool | str = False
    query_rows: torch.Tensor | None = None
    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    route: object = None
    masks: dict = field(default_factory=dict)
    finished: bool = False
    called: set = field(default_factory=set)
    router: tuple | None = None


@dataclass(eq=False)
class HeadCheckContext:
    """A plain forward during which the lm_head proxy also computes the fused head's logits, for comparison.

    Attributes:
        spec: the model's :class:`~shared_prefix_logps.model.HeadSpec`.
        fused_logits: (tokens, V) float32 logits of the fused computation on the lm_head's input, written by the
            proxy; the proxy returns the module's own output unchanged.
        calls: how many times the lm_head ran in the forward.
    """

    spec: object
    fused_logits: torch.Tensor | None = None
    calls: int = 0


class PhaseHandle:
    """What travels as the ``shared_prefix_context`` model kwarg: an opaque holder of the phase context.

    Wrappers traverse forward kwargs and rebuild what they recognise: FSDP2's input casting rebuilds dataclasses
    (``dataclasses.replace``), so a context passed directly would arrive as a copy and the keys/values recorded
    into it would be lost. A plain object with no tensors and no dataclass fields passes through unchanged; copying
    it (``copy``/``deepcopy``) keeps the same context.
    """

    __slots__ = ("context",)

    def __init__(self, context):
        self.context = context

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def cached(context: CaptureContext | SharedContext, key, build):
    """``context.masks[key]``, built by ``build()`` on first use: masks depend on the layer only through its
    sliding window, so each is built once per phase."""
    if key not in context.masks:
        context.masks[key] = build()
    return context.masks[key]


def active_context() -> CaptureContext | SharedContext | HeadCheckContext | None:
    """The phase context of the model call that is running, or None outside the library's calls."""
    if not _ANY_ACTIVE:
        return None
    return _ACTIVE.get()


def _count_active(step: int) -> None:
    global _ANY_ACTIVE, _active_count
    with _count_lock:
        _active_count += step
        _ANY_ACTIVE = _active_count > 0


@contextlib.contextmanager
def activated(context: CaptureContext | SharedContext | HeadCheckContext):
    """Make ``context`` the active one for the duration of a model call."""
    token = _ACTIVE.set(context)
    _count_active(1)
    try:
        yield context
    finally:
        _count_active(-1)
        _ACTIVE.reset(token)
