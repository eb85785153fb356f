"""The context of one node call (see :mod:`.plan`): the prefix-tree kind of phase context, passed to the attention
function as the ``shared_prefix_context`` model kwarg and read by the lm_head proxy."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import NodeCall


@dataclass(eq=False)
class TreeContext:
    """One forward over a set of trie nodes.

    Attributes:
        call: the :class:`~.plan.NodeCall` on the model's device.
        sources: for each call in ``call.sources``, its keys/values: attention module -> (key, value), each
            (kv_heads, tokens of that call, head_dim).
        needs_grad: whether the caller expects gradients.
        head_spec: the model's :class:`~shared_prefix_logps.model.HeadSpec`.
        temperature, return_entropy: as for the entry points.
        packed: attend with the ``flex`` layout (one flex_attention call over the whole ancestor store) instead of
            ``expand`` (ancestors gathered per node).
        routes: attention module -> RouteBox of its (key, value) of this call's tokens, riding on its output.
        kv: filled after the forward: attention module -> (key, value), (kv_heads, T, head_dim).
        route: RouteBox of the head's results; logps / entropy: (p,) float32 after the forward, one per head pair.
        masks: attention masks built once per call, keyed by kind, window and dtype.
        finished: set once the forward has returned (later attention calls are checkpoint recomputations).
        router: when router statistics were requested, ``(counts, probs, tokens)`` of each of the call's nodes,
            (S, E), (S, E), (S,) float32 (see :mod:`~shared_prefix_logps.moe_router`).
    """

    call: NodeCall
    sources: list
    needs_grad: bool
    head_spec: object
    temperature: float
    return_entropy: bool
    packed: bool = False
    routes: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)
    route: object = None
    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)
    finished: bool = False
    router: tuple | None = None

    @property
    def head_index(self) -> torch.Tensor:
        return self.call.head_index

    @property
    def head_targets(self) -> torch.Tensor:
        return self.call.head_targets

    def ancestor_kv(self, module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key, value) of every source call's tokens for ``module``, concatenated: (kv_heads, A_total, head_dim);
        None when the call's nodes have no ancestors."""
        if not self.sources:
            return None
        try:
            pairs = [source[module] for source in self.sources]
        except KeyError:
            raise ValueError(
                f"attention layer {type(module).__name__} was not seen while the ancestor nodes were forwarded; "
                "this model's layers cannot share a prefix"
            ) from None
        if len(pairs) == 1:
            return pairs[0]
        return torch.cat([k for k, _ in pairs], dim=1), torch.cat([v for _, v in pairs], dim=1)
