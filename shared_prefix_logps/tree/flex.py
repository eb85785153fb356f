"""Attention of a node call with the ``flex`` layout: no copies. The call's packed tokens attend over
``[every token of the ancestor store ; the call's own tokens]`` in one ``flex_attention`` call, under a BlockMask
built from the trie's structure (``backends/flex_blocks``): one key segment per node run of the store and of the
call, a link from each of the call's nodes to each of its ancestors in the store and a causal link to itself. With
nodes numbered depth-first, key node k is an ancestor of (or is) query node q exactly when
``k <= q < subtree_end[k]``; the mask function, which runs inside the kernel on the partial blocks only, tests that,
causality within a node and sliding windows by positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends import flex as flex_backend
from ..backends.flex_blocks import Links, Segments, concat_segments, run_segments, structured_block_mask
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
    q_len = flex_backend.padded_length(n, query.device)
    kv_len = flex_backend.padded_length(key.shape[2], query.device)

    def build():
        q_blocks = bool(context.needs_grad or torch.is_grad_enabled())  # read before no_grad below
        with torch.no_grad():
            return tree_block_mask(call, window, q_len, kv_len, q_blocks=q_blocks)

    mask = cached(context, ("tree-flex", window), build)
    return flex_backend.packed_attention(query, key, value, mask, q_len, n, options, kv_len=kv_len)


def tree_block_mask(call, window, q_len: int, kv_len: int, *, q_blocks: bool = True):
    """BlockMask of a node call's queries (padded to ``q_len``) over [store ; own tokens] (padded to ``kv_len``),
    built from the trie's structure in work proportional to its blocks; ``q_blocks``: also the indices backward
    reads.

    Padded queries (node -2) see no key; padded keys (node -1, subtree end -1) are seen by no query.
    """
    node_end = call.node_end
    store_len = call.store_node.numel()
    own, own_nodes = run_segments(call.query_node, call.positions[0])
    store, store_nodes = run_segments(call.store_node, call.store_positions)
    own_keys = Segments(start=own.start + store_len, length=own.length, position=own.position)
    # Node-level pairs (call nodes x store runs): the store's runs that are ancestors of each of the call's nodes.
    query_seg, key_seg = (
        (store_nodes[None, :] <= own_nodes[:, None]) & (own_nodes[:, None] < node_end[store_nodes][None, :])
    ).nonzero(as_tuple=True)
    every = torch.arange(own_nodes.numel(), device=own_nodes.device)
    links = Links(
        query=torch.cat([query_seg, every]),
        key=torch.cat([key_seg, every + store_nodes.numel()]),
        causal=torch.cat([torch.zeros_like(query_seg, dtype=torch.bool), torch.ones_like(every, dtype=torch.bool)]),
    )
    keys = torch.cat([call.store_node, call.query_node])
    mask_mod = _tree_mask_mod(
        _pad(call.query_node, q_len, -2),
        _pad(call.query_order, q_len, 0),
        _pad(call.positions[0], q_len, 0),
        _pad(keys, kv_len, -1),
        _pad(node_end[keys], kv_len, -1),
        _pad(torch.cat([call.store_order, call.query_order]), kv_len, 0),
        _pad(torch.cat([call.store_positions, call.positions[0]]), kv_len, 0),
        window,
    )
    return structured_block_mask(
        own,
        concat_segments(store, own_keys),
        links,
        q_len=q_len,
        kv_len=kv_len,
        window=window,
        mask_mod=mask_mod,
        q_blocks=q_blocks,
    )


def _tree_mask_mod(q_node, q_order, q_pos, k_node, k_end, k_order, k_pos, window):
    """The mask function of queries (q_*, each (q_len,) int64) over keys (k_*, (kv_len,) int64): the key's node is
    an ancestor of the query's or is it (then causally by ``order``), within the sliding window by positions.

    The seven tensors are distinct objects (a compiled function guards on aliasing), and ``window`` travels as a
    tensor so that windowed and unwindowed layers share one graph."""
    # Filled on the device, not copied from the host (a pageable copy the host waits for).
    limit = torch.full((), flex_backend.NO_WINDOW if window is None else int(window), device=q_node.device)

    def mask_mod(b, h, q_idx, kv_idx):
        query_node, key_node = q_node[q_idx], k_node[kv_idx]
        ancestor = (key_node <= query_node) & (query_node < k_end[kv_idx])
        causal = (key_node != query_node) | (k_order[kv_idx] <= q_order[q_idx])
        return ancestor & causal & ((q_pos[q_idx] - k_pos[kv_idx]) < limit)

    return mask_mod


def _pad(ids: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """(length,) int64: ``ids`` followed by ``fill``; always a new tensor."""
    return F.pad(ids.long(), (0, length - ids.shape[0]), value=fill).clone()
