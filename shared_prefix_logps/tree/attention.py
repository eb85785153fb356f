"""Attention of a node call. The ``expand`` layout (here): each node one row of a padded batch, attending over its
ancestors' keys/values (gathered per node, as ``backends/expand`` gathers a prompt per completion row) and causally
over its own tokens. The model itself sees the nodes' tokens packed (no padding forwarded): queries, keys and values
are unpacked into rows here and the output packed back. The ``flex`` layout is in :mod:`.flex`."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..backends import expand
from ..backends.expand import masked_attention
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

    A call of nodes of one length without ancestors (the root call of a shared system prompt) and without a window
    shorter than its nodes runs causal SDPA without a mask, as ``backends/expand`` does for unpadded prompts. Other
    calls share one additive mask per call across layers (:func:`node_mask`, rows aligned). The SDPA kernel is
    chosen by ``backends/expand`` (through ``sdpa_kernels`` on the fused-kernel path).

    The gathered (S, kv_heads, A + Lmax, head_dim) copies are per node; on the fused-kernel path with gradients
    (CUDA, as ``backends/expand.gathered_attention``) they are not saved for backward, where every layer's would be
    held at once: the gather and the attention are recomputed in backward from the packed and stored keys/values.
    """
    call = context.call
    rows = call.pack_index
    index = call.ancestor_index
    ancestors = context.ancestor_kv(module)
    # Read once per call, not per layer (a device sync on CUDA).
    unpadded = cached(context, ("unpadded",), lambda: bool(call.pack_valid.all()))
    causal = ancestors is None and unpadded and expand.window_is_moot(window, rows.shape[1])
    # Nodes all unpadded, with as many ancestors each (a call of sibling completions under prompts of one length):
    # every node's mask row is the same, so one row serves them all instead of one per node.
    uniform = cached(context, ("uniform",), lambda: unpadded and bool(call.ancestor_valid.all()))
    mask = (
        None
        if causal
        else cached(
            context, ("tree", window, query.dtype), lambda: node_mask(call, window, query.dtype, shared=uniform)
        )
    )

    def unpack(tensor):  # (1, h, T, d) -> (S, h, Lmax, d), zeros past each node's end
        return only_valid(tensor[0][:, rows].transpose(0, 1), call.pack_valid)

    def ancestors_of(stored):  # (h, A_total, d) -> (S, h, A, d), zeros past each node's ancestors
        return only_valid(stored[:, index].transpose(0, 1), call.ancestor_valid)

    def attend(query, key, value, *store):
        keys, values = unpack(key), unpack(value)
        if store:
            keys = torch.cat([ancestors_of(store[0]), keys], dim=2)
            values = torch.cat([ancestors_of(store[1]), values], dim=2)
        output = masked_attention(unpack(query), keys, values, mask, is_causal=causal, **options)
        return output[call.pack_valid][None]  # (S, Lmax, heads, v_head_dim) -> (1, T, heads, v_head_dim)

    tensors = (query, key, value, *(ancestors or ()))
    if expand.on_fused_path(query.device) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    return attend(*tensors)


def only_valid(gathered: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``gathered`` (S, heads, L, d) with zeros where ``valid`` (S, L) is False.

    Slots past a node's end (or its ancestors') gather the call's (or the store's) token 0, another node's token. The
    mask hides them from every query, but attention multiplies a hidden value by its zero weight, and 0 x NaN is
    NaN: a non-finite state of one row would reach every node padded in the same call, and a padded query computing
    over NaN would send NaN into the gradients of its node's keys. Selecting zeros (not multiplying by a 0/1 mask,
    which keeps NaN) keeps a row's non-finite values in its row.
    """
    return torch.where(valid[:, None, :, None], gathered, gathered.new_zeros(()))


def node_mask(call, window, dtype: torch.dtype, *, shared: bool = False) -> torch.Tensor:
    """(S, 1, Lmax, A + Lmax) additive mask of ``dtype`` (0 or -inf), rows aligned: node queries over [their
    ancestors' tokens ; their own tokens causally]. With ``shared`` (every node unpadded with A ancestors, so their
    rows are equal: same ancestors' positions 0 .. A - 1 and own positions after them) the first node's row only,
    (1, 1, Lmax, A + Lmax), which broadcasts over the nodes.

    Written in place from each query's allowed key range (``backends/expand``'s helpers), never as a boolean mask of
    its full size. Padded query rows see their own slot too (a query with no visible key would give NaN that poisons
    gradients). Sliding windows compare positions: ancestor tokens come root first, so their positions increase
    along a node's row, and a node's own positions advance by one per token.
    """
    rows = slice(0, 1) if shared else slice(None)
    valid, ancestor_valid = call.pack_valid[rows], call.ancestor_valid[rows]
    count, width = valid.shape
    num_ancestors = ancestor_valid.shape[1]
    mask = expand.empty_additive_mask((count, 1, width, num_ancestors + width), dtype, valid.device)
    prefix, own = mask[..., :num_ancestors], mask[..., num_ancestors:]
    if num_ancestors:
        prefix.masked_fill_(~ancestor_valid[:, None, None, :], float("-inf"))
        if window is not None:
            # Padding past a node's ancestors is masked above; a position past every real one keeps the row sorted.
            key_positions = call.ancestor_positions[rows].masked_fill(~ancestor_valid, torch.iinfo(torch.long).max)
            first = expand.window_start(call.own_positions[rows], key_positions, window)
            expand.block_outside(prefix, first, torch.full_like(first[:, :1], num_ancestors - 1))
    expand.fill_own_causal(own, window)
    own.masked_fill_(~valid[:, None, None, :], float("-inf"))
    own.diagonal(dim1=-2, dim2=-1).fill_(0)
    return mask
