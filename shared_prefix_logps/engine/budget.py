"""The token budget of no-grad calls: the most a chunk of rows may forward at once.

A token of budget is one forwarded token, and also the bytes of one hidden state (``hidden_size`` elements of the
model's dtype): memory a node call takes beyond its tokens' activations counts as that many bytes' worth of tokens.
With the ``expand`` layout those are the terms of :mod:`~shared_prefix_logps.backends.expand_memory` (the additive
masks, each node's gathered ancestor keys/values, KV heads repeated for a kernel without grouped-query support,
explicit attention scores), which grow with a node's ancestors and, for the masks and scores, with their product
with its own length; counting its tokens alone would let them outgrow any budget. The packed ``flex`` and ``flash``
layouts copy nothing per node. A chunk of rows counts the node calls it makes: the nodes it forwards that no earlier
chunk did (nodes an earlier chunk forwarded stay alive for the rows that still need them), each call's nodes padded
to the call's largest as the ``expand`` layout allocates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends import layouts
from ..backends.expand import on_fused_path, repeats_kv_heads
from ..backends.expand_memory import AttentionShape, mask_bytes, node_bytes
from .trie import PrefixTrie

#: Default most tokens forwarded at once when scoring without gradients.
DEFAULT_TOKEN_BUDGET = 32768


@dataclass(frozen=True)
class NodeCosts:
    """What a node counts against the budget, in tokens.

    Attributes:
        shape: the model's attention shape, or None for the packed layouts (tokens only).
        repeats_kv: whether the memory terms include KV heads repeated per query head; None: as the SDPA kernel the
            expand layout will choose for each call's shape on ``device`` decides (the fused-kernel path with grouped
            heads: a kernel that takes grouped heads natively holds no copy, ``backends.expand.repeats_kv_heads``).
        device, dtype: where and in which dtype the calls run (read when ``repeats_kv`` is None).
    """

    shape: AttentionShape | None
    repeats_kv: bool | None = False
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    decided: dict = field(default_factory=dict, compare=False)  # (queries, keys, masked) -> repeats

    @classmethod
    def of(cls, causal_lm: torch.nn.Module, device: torch.device, layout: str) -> NodeCosts:
        """The costs of ``causal_lm``'s nodes on ``device`` with ``layout``."""
        if not layouts.layout(layout).padded:
            return cls(None)
        shape = AttentionShape.of_model(causal_lm)
        if not on_fused_path(device) or shape.kv_heads == shape.heads:
            return cls(shape, repeats_kv=False)
        dtype = causal_lm.get_input_embeddings().weight.dtype
        return cls(shape, repeats_kv=True if shape.explicit_scores else None, device=device, dtype=dtype)

    def node_tokens(self, ancestors: int, length: int, *, own_mask: bool = True) -> int:
        """What a node with ``ancestors`` ancestor tokens and ``length`` of its own counts: its tokens plus, with the
        padded ``expand`` layout, its memory terms in tokens (its mask row only with ``own_mask``: nodes of a call
        that have as many ancestors share one)."""
        if self.shape is None:
            return length
        # A node without ancestors and window runs causal SDPA without a mask; the mask is counted otherwise.
        masked = ancestors > 0 or self.shape.windowed(length)
        repeats = self._repeats(length, ancestors + length, masked)
        extra = node_bytes(self.shape, ancestors, length, masked=masked and own_mask, repeats_kv=repeats)
        return length + self._tokens(extra)

    def _tokens(self, nbytes: int) -> int:
        return -(-nbytes // (self.shape.hidden_size * self.shape.itemsize))

    def _repeats(self, queries: int, keys: int, masked: bool) -> bool:
        if self.repeats_kv is not None:
            return self.repeats_kv
        key = (queries, keys, masked)
        if key not in self.decided:
            self.decided[key] = repeats_kv_heads(self.shape, self.device, self.dtype, queries, keys, masked=masked)
        return self.decided[key]

    def calls_tokens(self, calls: dict) -> int:
        """What the node calls of a chunk count: ``calls`` maps each depth to (nodes, fewest and most ancestor tokens,
        longest node, tokens) of its new nodes. The padded layout allocates every node of a call at the call's largest
        ancestors and length, and one mask row for all when every node has as many ancestors and no window hides a
        key; the packed ones forward the tokens alone."""
        if self.shape is None:
            return sum(tokens for *_, tokens in calls.values())
        total = 0
        for count, fewest, most, length, _ in calls.values():
            shared = fewest == most and not self.shape.windowed(most + length)
            total += count * self.node_tokens(most, length, own_mask=not shared)
            if shared and most > 0:
                total += self._tokens(mask_bytes(length, most + length, self.shape.itemsize))
        return total


def budgeted_chunks(trie: PrefixTrie, order: torch.Tensor, budget: int, costs: NodeCosts) -> list[torch.Tensor]:
    """Rows in ``order`` cut into chunks whose new nodes' calls fit ``budget`` (:meth:`NodeCosts.calls_tokens`; at
    least one row per chunk)."""
    depth, start, length = trie.depth.tolist(), trie.node_start.tolist(), trie.node_length.tolist()

    def grown(calls: dict, nodes: list[int]) -> dict:
        calls = dict(calls)
        for node in nodes:
            ancestors, own = start[node], length[node]
            count, fewest, most, longest, tokens = calls.get(depth[node], (0, ancestors, 0, 0, 0))
            calls[depth[node]] = (
                count + 1,
                min(fewest, ancestors),
                max(most, ancestors),
                max(longest, own),
                tokens + own,
            )
        return calls

    chunks, current, seen, calls = [], [], set(), {}
    for row, path in zip(order.tolist(), trie.row_path[order].tolist()):
        new = [node for node in path if node >= 0 and node not in seen]
        with_row = grown(calls, new)
        if current and costs.calls_tokens(with_row) > budget:
            chunks.append(torch.tensor(current, dtype=torch.long))
            current, with_row = [], grown({}, new)
        current.append(row)
        seen.update(new)
        calls = with_row
    if current:
        chunks.append(torch.tensor(current, dtype=torch.long))
    return chunks
