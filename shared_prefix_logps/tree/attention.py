"""Attention of a node call. The ``expand`` layout (here): each node one row of a padded batch, attending over its
ancestors' keys/values (gathered per node, as ``backends/expand`` gathers a prompt per completion row) and causally
over its own tokens. The model itself sees the nodes' tokens packed (no padding forwarded): queries, keys and values
are unpacked into rows here and the output packed back. The ``flex`` layout is in :mod:`.flex`."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..backends import expand
from ..backends.expand import _window_ok, additive_mask, masked_attention
from ..forward.context import cached
from ..forward.routing import RouteBox, attach
from .context import TreeContext
from .flex import packed_tree_attention


def tree_attention(module, query, key, value, context: TreeContext, window, options) -> torch.Tensor:
    """transformers-layout attention output (1, T, heads, v_head_dim) of a node call.

    Args:
        query: (1, heads, T, head_dim); key/value: (1, kv_heads, T, head_dim), post-RoPE, packed.
    """
    if not context.finished and module in context.routes:
        raise ValueError(
            f"attention module {type(module).__name__} ran twice in one forward (the same layer object appears more "
            "than once in the model's layers); the shared-prefix path records keys/values per layer and cannot "
            "serve repeated layers"
        )
    if context.packed:
        output = packed_tree_attention(module, query, key, value, context, window, options)
    else:
        output = _expanded_tree_attention(module, query, key, value, context, window, options)
    if context.finished:
        # An activation-checkpoint recomputation in backward: the recorded keys/values are already in the graph.
        return output
    box = context.routes[module] = RouteBox()
    return attach(output, box, key[0], value[0])


def _expanded_tree_attention(module, query, key, value, context: TreeContext, window, options) -> torch.Tensor:
    """The ``expand`` layout: nodes as rows of a padded batch, ancestors' keys/values gathered per node.

    The gathered (S, kv_heads, A + Lmax, head_dim) copies are per node; on the fused-kernel path with gradients
    (CUDA, as ``backends/expand.gathered_attention``) they are not saved for backward, where every layer's would be
    held at once: the gather and the attention are recomputed in backward from the packed and stored keys/values.
    """
    call = context.call
    rows = call.pack_index
    index = call.ancestor_index
    mask = cached(context, ("tree", window, query.dtype), lambda: additive_mask(node_mask(call, window), query.dtype))

    def unpack(tensor):  # (1, h, T, d) -> (S, h, Lmax, d)
        return tensor[0][:, rows].transpose(0, 1)

    def attend(query, key, value, *store):
        keys, values = unpack(key), unpack(value)
        if store:
            keys = torch.cat([store[0][:, index].transpose(0, 1), keys], dim=2)
            values = torch.cat([store[1][:, index].transpose(0, 1), values], dim=2)
        output = masked_attention(unpack(query), keys, values, mask, **options)  # (S, Lmax, heads, v_head_dim)
        return output[call.pack_valid][None]

    ancestors = context.ancestor_kv(module)
    tensors = (query, key, value, *(ancestors or ()))
    if expand._fused_path(query) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    return attend(*tensors)


def node_mask(call, window) -> torch.Tensor:
    """(S, 1, Lmax, A + Lmax) bool: node queries over [their ancestors' tokens ; their own tokens causally].

    Padded query rows see their own slot only (a query with no visible key would give NaN that poisons gradients).
    Sliding windows compare positions in the rows, not indices.
    """
    valid = call.pack_valid
    width = valid.shape[1]
    inner = torch.arange(width, device=valid.device)
    own = (inner[:, None] >= inner[None, :])[None] & valid[:, None, :]
    positions = call.own_positions
    if window is not None:
        own = own & _window_ok(positions[:, :, None], positions[:, None, :], window)
    own = own | torch.eye(width, dtype=torch.bool, device=valid.device)[None]
    ancestors = call.ancestor_valid[:, None, :].expand(-1, width, -1)
    if window is not None:
        ancestors = ancestors & _window_ok(positions[:, :, None], call.ancestor_positions[:, None, :], window)
    return torch.cat([ancestors, own], dim=-1)[:, None]
