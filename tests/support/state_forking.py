"""A model-level harness for state forking before the node-call engine serves hybrids: prompts, then children
continuing them, through the model's own forward.

Recurrent layers go through :mod:`shared_prefix_logps.recurrent` (installed wrappers, a RecurrentCall per forward);
attention layers continue through the model's own ``DynamicCache`` (its keys/values forked per child with
``index_select``, so their gradient also flows back into the prompt). The reference is each full row through the
model's own forward.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from shared_prefix_logps.recurrent import RECURRENT_CALL_KWARG, NodeSpans, RecurrentCall, RecurrentState


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(rows, columns) int64 positions of a left-padded mask: 0, 1, ... over the real tokens (0 on padding)."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_nodes(model, input_ids, attention_mask, position_ids, spans, cache, initial=None, *, keep_ends=True):
    """One forward of some nodes: returns (logits, end states per recurrent layer; empty unless ``keep_ends``)."""
    call = RecurrentCall(spans, initial, keep_ends=keep_ends)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{_cache_kwarg(model): cache, RECURRENT_CALL_KWARG: call},
    )
    return output.logits, call.release(output.logits)


def fork_cache(model, cache: DynamicCache, parent: torch.Tensor, *, detach: bool = False) -> DynamicCache:
    """A cache whose attention layers hold row ``parent[i]``'s keys/values for row i (leaves when ``detach``)."""
    forked = DynamicCache(config=model.config)
    for source, target in zip(cache.layers, forked.layers):
        keys = getattr(source, "keys", None)
        if keys is None or not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            continue  # a recurrent layer's entry: its state travels in the RecurrentCall
        keys, values = keys.index_select(0, parent), source.values.index_select(0, parent)
        if detach:
            keys, values = keys.detach().requires_grad_(), values.detach().requires_grad_()
        target.update(keys, values)
    return forked


def attention_leaves(cache: DynamicCache) -> list[torch.Tensor]:
    """The keys/values tensors a cache's attention layers hold."""
    tensors = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            tensors += [keys, layer.values]
    return tensors


def select_states(ends: dict, parent: torch.Tensor) -> dict:
    return {module: state.select(parent) for module, state in ends.items()}


def detach_states(ends: dict) -> dict[object, RecurrentState]:
    return {module: state.detached() for module, state in ends.items()}


def logprob_loss(logits: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A weighted sum of log-softmax over the real positions: every position and vocabulary entry weighted
    differently, so a gradient routed to the wrong place shows."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    return (logps * weight * mask[..., None]).sum()


def spans_of(mask: torch.Tensor) -> NodeSpans:
    return NodeSpans.from_mask(mask)
