"""State that travels with one node call's forward.

The attention function receives the context as a model kwarg (``shared_prefix_context``), so it is bound into
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

#: Name of the model kwarg that carries a node call's context to the attention function.
CONTEXT_KWARG = "shared_prefix_context"

_ACTIVE: ContextVar[NodeContext | HeadCheckContext | None] = ContextVar("shared_prefix_logps_active", default=None)

# Whether any thread is inside :func:`activated`, read before the ContextVar. Dynamo cannot trace a ContextVar lookup
# (it breaks the graph at every lm_head and mask builder of a compiled model), but it guards on a module global: a
# compiled plain forward then traces only this flag, stays one graph, and is recompiled if the flag changes.
_ANY_ACTIVE = False
_active_count = 0
_count_lock = threading.Lock()


@dataclass(frozen=True)
class CallSettings:
    """How every node call of one entry-point call runs: decided once at the entry, read by the layouts' dispatch,
    the fused head and the model call.

    Attributes:
        layout: how the calls attend: ``expand``, ``flex`` or ``flash`` (``backends/layouts.py``).
        temperature: logits are divided by it before the log-softmax.
        return_entropy: also compute each scored pair's entropy.
        router: ``(num_experts, top_k)`` of an MoE model whose router statistics are wanted, or None.
    """

    layout: str = "expand"
    temperature: float = 1.0
    return_entropy: bool = False
    router: tuple[int, int] | None = None


@dataclass(eq=False)
class NodeContext:
    """One forward over a set of trie nodes (a :class:`~shared_prefix_logps.forward.node_call.NodeCall`).

    Attributes:
        call: the node call, on the model's device.
        sources: for each call in ``call.sources``, its prefix states: attention module -> (key, value), each
            (kv_heads, tokens of that call, head_dim). A layer's *prefix state* is what its descendants need of the
            nodes a call forwarded; for attention layers their post-RoPE keys and values.
        settings: the entry point's :class:`CallSettings` (layout, temperature, entropy, router).
        needs_grad: whether the caller expects gradients.
        head_spec: the model's :class:`~shared_prefix_logps.model.HeadSpec`.
        weight_grads: the entry point's :class:`~shared_prefix_logps.engine.weight_grads.WeightGrads` (head and
            embedding weight gradients added into one buffer across its backward passes), or None.
        keep_logits_bytes: the fused head keeps its logits for backward when they take at most this many bytes (0:
            it recomputes them; see ``kernels/fused_head.py``).
        routes: attention module -> RouteBox of its prefix state of this call's tokens, riding on its output (None
            where no later call attends over this one: ``call.keeps_states``); the model call releases them.
        route: RouteBox of the head's results (log-probs, then entropy when requested), one per head pair.
        masks: what the layouts build once per call (masks, kernel choices), keyed by kind and sliding window.
        finished: set once the forward has returned (later attention calls are checkpoint recomputations).
        non_finite: the call's :class:`~shared_prefix_logps.backends.non_finite.NonFiniteWatch` (how packed layouts
            keep a non-finite value in its row), or None to check every layer.
    """

    call: object
    sources: list
    settings: CallSettings
    needs_grad: bool
    head_spec: object
    weight_grads: object = None
    keep_logits_bytes: int = 0
    routes: dict = field(default_factory=dict)
    route: object = None
    masks: dict = field(default_factory=dict)
    finished: bool = False
    non_finite: object = None

    def ancestor_states(self, module) -> list[tuple[torch.Tensor, ...]]:
        """``module``'s prefix state of every source call, in the order of ``call.sources``."""
        try:
            return [source[module] for source in self.sources]
        except KeyError:
            raise ValueError(
                f"attention layer {type(module).__name__} was not seen while the ancestor nodes were forwarded; "
                "this model's layers cannot share a prefix"
            ) from None


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


class ContextHandle:
    """What travels as the ``shared_prefix_context`` model kwarg: an opaque holder of the node call's context.

    Wrappers traverse forward kwargs and rebuild what they recognise: FSDP2's input casting rebuilds dataclasses
    (``dataclasses.replace``), so a context passed directly would arrive as a copy and the states recorded into it
    would be lost. A plain object with no tensors and no dataclass fields passes through unchanged; copying it
    (``copy``/``deepcopy``) keeps the same context.
    """

    __slots__ = ("context",)

    def __init__(self, context):
        self.context = context

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def active_context() -> NodeContext | HeadCheckContext | None:
    """The context of the model call that is running, or None outside the library's calls."""
    if not _ANY_ACTIVE:
        return None
    return _ACTIVE.get()


def _count_active(step: int) -> None:
    global _ANY_ACTIVE, _active_count
    with _count_lock:
        _active_count += step
        _ANY_ACTIVE = _active_count > 0


@contextlib.contextmanager
def activated(context: NodeContext | HeadCheckContext):
    """Make ``context`` the active one for the duration of a model call."""
    token = _ACTIVE.set(context)
    _count_active(1)
    try:
        yield context
    finally:
        _count_active(-1)
        _ACTIVE.reset(token)
