"""The recurrent layers' part of a node call of a linear-attention hybrid: where the call's nodes sit in its packed
input, the state each node starts from, and which nodes hand their end state on.

A recurrent layer's prefix state is its state at a node's end (``recurrent/``): it summarises every ancestor, so a
node needs its *parent's* end state only, whatever its depth. The parent went through an earlier call, which kept
one end state per node it forwarded (``CallOutputs.ends``); the call's initial states are those rows, gathered per
node (``RecurrentState.select``: in backward each parent row collects the gradients of all its children, which then
flow back through the parent's call once, as the keys/values of attention layers do). Top-level nodes start from
the state before a row's first token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..recurrent import NodeSpans, RecurrentCall, RecurrentState
from .trie import PrefixTrie


def recurrent_call(
    trie: PrefixTrie,
    nodes: torch.Tensor,
    node_call: torch.Tensor,
    node_slot: torch.Tensor,
    ends_of: Callable[[int], dict[nn.Module, RecurrentState]],
) -> RecurrentCall:
    """The recurrent part of the node call over ``nodes``.

    Args:
        trie: the plan's trie.
        nodes: (S,) int64 CPU, the call's nodes (one depth, in the call's packed order).
        node_call: (num_nodes,) int64, the call that forwarded each node (-1: none yet); node_slot: (num_nodes,)
            int64, each node's index among its call's nodes.
        ends_of: ``ends_of(call_id)``: recurrent layer -> the end states of that earlier call's nodes (one row per
            node, in its order), differentiable (through leaves in the chunked backwards).

    Returns:
        A :class:`~shared_prefix_logps.recurrent.RecurrentCall`: the nodes packed back to back, each starting from its
        parent's end state (none for top-level nodes), keeping its own end state where it has children.
    """
    spans = NodeSpans.packed(trie.node_length[nodes])
    keeps = trie.subtree_end[nodes] > nodes + 1
    parents = trie.parent[nodes]
    if bool((parents < 0).all()):
        return RecurrentCall(spans, None, keep_ends=keeps)
    if bool((parents < 0).any()):
        raise RuntimeError("a node call mixes top-level nodes with nodes that have a parent")
    parent_calls = node_call[parents]
    if bool((parent_calls < 0).any()):
        raise RuntimeError("a node call was planned before its nodes' parents were forwarded")
    calls = torch.unique(parent_calls).tolist()
    states = [_kept_ends(ends_of, call) for call in calls]
    index = node_slot[parents]
    if len(calls) == 1:
        merged = states[0]
    else:
        # The parents' calls' states one after the other; each node's row is its call's offset + its parent's slot.
        sizes = torch.tensor([next(iter(state.values())).rows for state in states])
        offsets = torch.zeros(int(max(calls)) + 1, dtype=torch.long)
        offsets[calls] = torch.cumsum(sizes, 0) - sizes
        index = offsets[parent_calls] + index
        merged = {module: RecurrentState.cat([state[module] for state in states]) for module in states[0]}
    initial = {module: state.select(index) for module, state in merged.items()}
    return RecurrentCall(spans, initial, keep_ends=keeps)


def _kept_ends(ends_of, call: int) -> dict[nn.Module, RecurrentState]:
    ends = ends_of(call)
    if not ends:
        raise RuntimeError(f"node call {call} kept no recurrent end states although a later call continues its nodes")
    return ends
