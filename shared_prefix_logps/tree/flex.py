"""Attention of a node call with the ``flex`` layout: no copies. The call's packed tokens attend over
``[every token of the ancestor store ; the call's own tokens]`` in one ``flex_attention`` call, under a mask built
from the trie's structure: with nodes numbered depth-first, key node k is an ancestor of (or is) query node q exactly
when ``k <= q < subtree_end[k]``; within a node, causally; sliding windows compare positions."""

from __future__ import annotations

import torch

from ..backends import flex as flex_backend
from ..forward.context import cached
from .context import TreeContext


def packed_tree_attention(module, query, key, value, context: TreeContext, window, options) -> torch.Tensor:
    """(1, T, heads, v_head_dim) for packed (1, heads, T, head_dim) queries and (1, kv_heads, T, head_dim) keys."""
    call = context.call
    n = query.shape[2]
    ancestors = context.ancestor_kv(module)
    if ancestors is not None:
        key = torch.cat([ancestors[0][None], key], dim=2)
        value = torch.cat([ancestors[1][None], value], dim=2)
    q_len = flex_backend._round_up(n, query.device)
    kv_len = flex_backend._round_up(key.shape[2], query.device)
    mask = cached(context, ("tree-flex", window), lambda: tree_block_mask(call, window, q_len, kv_len))
    return flex_backend._attend(query, key, value, mask, q_len, n, options, kv_len=kv_len)


def tree_block_mask(call, window, q_len: int, kv_len: int):
    """BlockMask of a node call's queries (padded to ``q_len``) over [store ; own tokens] (padded to ``kv_len``).

    Padded queries (node -2) see no key; padded keys (node -1, subtree end -1) are seen by no query.
    """
    pad = flex_backend._pad_ids
    node_end = call.node_end
    q_node = pad(call.query_node, q_len, -2)
    q_order = pad(call.query_order, q_len, 0)
    q_pos = pad(call.positions[0], q_len, 0)
    keys = torch.cat([call.store_node, call.query_node])
    k_node = pad(keys, kv_len, -1)
    k_end = pad(node_end[keys], kv_len, -1)
    k_order = pad(torch.cat([call.store_order, call.query_order]), kv_len, 0)
    k_pos = pad(torch.cat([call.store_positions, call.positions[0]]), kv_len, 0)
    q_node, q_order, q_pos, k_node, k_end, k_order, k_pos = flex_backend._distinct(
        q_node, q_order, q_pos, k_node, k_end, k_order, k_pos
    )
    device = q_node.device
    limit = torch.tensor(flex_backend.NO_WINDOW if window is None else int(window), device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        query_node, key_node = q_node[q_idx], k_node[kv_idx]
        ancestor = (key_node <= query_node) & (query_node < k_end[kv_idx])
        causal = (key_node != query_node) | (k_order[kv_idx] <= q_order[q_idx])
        return ancestor & causal & ((q_pos[q_idx] - k_pos[kv_idx]) < limit)

    backend = flex_backend._COMPILE_BACKENDS.get(device.type)
    with torch.no_grad():
        if backend is None:
            return flex_backend._mask_entry(mask_mod, q_len, kv_len, device)
        fn = flex_backend._compiled(flex_backend._mask_entry, backend, (str(device), "tree"))
        return flex_backend._run_compiled("create_block_mask", fn, mask_mod, q_len, kv_len, device)
