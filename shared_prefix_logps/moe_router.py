"""The MoE router load-balancing loss of full rows ``[prompt | completion]``, from node calls.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, Qwen3.5-MoE, Qwen3-Next) return, with
``output_router_logits=True``, ``aux_loss = load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)``: over every (MoE layer, real token) pair of the batch,

    aux = num_experts * sum_e f_e * P_e,   f_e = count_e / N,   P_e = prob_e / N,

with ``count_e`` the number of top-k picks of expert e (from the softmax of the router logits; no gradient),
``prob_e`` the sum of the router probabilities of e, and N the number of (layer, token) pairs. It is a product of
sums over tokens, so it is not additive over rows, but its two sums are: :class:`RouterStats` keeps them per row,
and the loss of any set of rows is formed from the rows' sums. In the shared path a trie node's tokens run once and
belong to every row through the node: each row's statistics are the sums of the nodes on its path
(:func:`path_sums`), which weights a shared token by the number of rows that contain it, as the dense batch (where it
runs once per row) does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError

#: Model types whose causal LM computes ``aux_loss`` with ``load_balancing_loss_func`` (same formula in
#: transformers 4.56 and 5.x; each is tested against the model's own ``aux_loss``). GLM4-MoE and DeepSeek-V3 return
#: router logits but no aux loss.
AUX_LOSS_MODEL_TYPES = frozenset(
    {
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_oss",
        # linear-attention hybrids (recurrent/): every layer's router, Gated DeltaNet and attention layers alike
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_next",
    }
)


@dataclass
class RouterStats:
    """Per-row sums of the router statistics over the real tokens of each full row and every MoE layer.

    Attributes:
        counts: (rows, E) float32 top-k picks of each expert; no gradient (top-k has none).
        probs: (rows, E) float32 router probabilities of each expert; differentiable when gradients are enabled.
        tokens: (rows,) float32 (MoE layer, real token) pairs of each row.
        num_experts: E as the model's loss uses it.
    """

    counts: torch.Tensor
    probs: torch.Tensor
    tokens: torch.Tensor
    num_experts: int

    def aux_loss(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model's load-balancing loss of ``rows`` (all rows by default) as one batch: 0-dim float32,
        differentiable through ``probs``. Equals the model's own ``aux_loss`` of a forward of those full rows."""
        counts, probs, tokens = (self.counts, self.probs, self.tokens)
        if rows is not None:
            counts, probs, tokens = counts[rows], probs[rows], tokens[rows]
        total = tokens.sum()
        return (counts.sum(0) / total * (probs.sum(0) / total)).sum() * self.num_experts

    def select(self, rows: torch.Tensor) -> RouterStats:
        """The statistics of ``rows`` ((n,) int64 indices or a (rows,) bool mask) only, in that order."""
        return RouterStats(self.counts[rows], self.probs[rows], self.tokens[rows], self.num_experts)

    def detach(self) -> RouterStats:
        """The same statistics with ``probs`` detached from the graph."""
        return RouterStats(self.counts, self.probs.detach(), self.tokens, self.num_experts)


def router_spec(causal_lm) -> tuple[int, int]:
    """(num_experts, top_k) the model's own aux loss uses; refuses models that compute none."""
    model_type = getattr(causal_lm.config, "model_type", None)
    if model_type not in AUX_LOSS_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(causal_lm).__name__}) computes no router aux loss (its forward returns "
            f"none); router statistics are supported for {', '.join(sorted(AUX_LOSS_MODEL_TYPES))}"
        )
    return int(causal_lm.num_experts), int(causal_lm.num_experts_per_tok)


def token_sums(router_logits, token_index: torch.Tensor, owner: torch.Tensor, owners: int, top_k: int):
    """Sum the router statistics of selected tokens per owner (prompt or row), over every MoE layer.

    Args:
        router_logits: the model's ``router_logits`` output: one (tokens, E) tensor per MoE layer, tokens in the
            forward's flattened (batch, sequence) order.
        token_index: (n,) int64 flattened indices of the real tokens to count (padding is left out by index, not
            multiplied by zero: a padded position's logits may be anything).
        owner: (n,) int64 owner of each of those tokens, in [0, owners).
        owners: number of owners.
        top_k: experts picked per token.

    Returns:
        counts (owners, E) float32 without gradient, probs (owners, E) float32 (differentiable), tokens (owners,)
        float32: the (layer, token) pairs counted per owner.
    """
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise ValueError("the model returned no router logits although output_router_logits=True was passed")
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    counts = torch.zeros(owners, num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(owners, num_experts, dtype=torch.float32, device=device)
    token_index, owner = token_index.to(device), owner.to(device)
    for layer_logits in router_logits:
        # As the model's loss: softmax in the logits' dtype, top-k of the probabilities, float32 sums.
        weights = torch.softmax(layer_logits.index_select(0, token_index), dim=-1)
        _, picked = torch.topk(weights, top_k, dim=-1)
        with torch.no_grad():
            hits = torch.zeros(owner.numel(), num_experts, dtype=torch.float32, device=device).scatter_add_(
                1, picked, torch.ones(picked.shape, dtype=torch.float32, device=device)
            )
            counts.index_add_(0, owner, hits)
        probs = probs.index_add(0, owner, weights.float())
    tokens = torch.bincount(owner, minlength=owners).float() * len(router_logits)
    return counts, probs, tokens


def path_sums(paths: torch.Tensor, stats: list, num_nodes: int, num_experts: int) -> RouterStats:
    """Each row's router statistics: the sums of the nodes on its path.

    Args:
        paths: (rows, depth) int64, each row's nodes (-1 past its end).
        stats: ``(nodes, counts, probs, tokens)`` per node call, the statistics of each of its nodes: (S,) int64,
            (S, E), (S, E) (differentiable), (S,) float32. A shared node's sums go to every row through it, which
            weights its tokens by the number of rows that contain them, as the dense batch does.
        num_nodes: nodes of the trie; num_experts: E as the model's loss uses it.
    """
    device = stats[0][1].device if stats else paths.device
    sums = []
    for i in range(1, 4):
        width = (num_experts,) if i < 3 else ()
        per_node = torch.zeros((num_nodes, *width), dtype=torch.float32, device=device)
        if stats:
            nodes = torch.cat([entry[0] for entry in stats]).to(device)
            per_node = per_node.index_copy(0, nodes, torch.cat([entry[i] for entry in stats]))
        valid = (paths >= 0).to(device)
        gathered = per_node[paths.clamp(min=0).to(device)]
        sums.append((gathered * valid.view(*valid.shape, *(1,) * len(width))).sum(1))
    return RouterStats(*sums, num_experts)


def in_row_order(
    parts: list[torch.Tensor], stats: list[RouterStats], num_experts: int, *, rows: int, device
) -> RouterStats:
    """Statistics computed per part of the rows put back in row order.

    Args:
        parts: (k_i,) int64 row indices of each part; together they hold every row of ``range(rows)`` once.
        stats: each part's :class:`RouterStats`, its rows in the order of ``parts[i]``.
        num_experts: E as the model's loss uses it; rows: how many rows there are; device: where the result lives.

    Returns:
        (rows, E), (rows, E), (rows,) statistics (zeros when there is no part); ``probs`` differentiable where the
        parts' are.
    """
    if not stats:
        zeros = torch.zeros(rows, num_experts, dtype=torch.float32, device=device)
        return RouterStats(zeros, zeros.clone(), torch.zeros(rows, dtype=torch.float32, device=device), num_experts)
    order = torch.argsort(torch.cat([part.to(device) for part in parts]))
    fields = (torch.cat([getattr(part, name) for part in stats])[order] for name in ("counts", "probs", "tokens"))
    return RouterStats(*fields, num_experts)
