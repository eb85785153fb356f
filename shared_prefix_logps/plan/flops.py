"""FLOPs of each method: the body's matmuls, attention and the head, forward and backward.

A matmul of (m, k) by (k, n) is 2 m k n FLOPs (``torch.utils.flop_counter`` counts the same); backward is twice
the forward (gradients of both operands). Per token and layer the body's projections and gated MLP cost
2 x (H (h d + g (d + dv)) + h dv H + 3 H I); in a mixture-of-experts layer I is the width of the token's top-k
experts and the shared ones, plus the router's H x E. Attention costs 2 x h x (d + dv) per (query, visible key)
pair; the counted pairs are what the kernels compute: full rows' causal SDPA is counted by ``FlopCounterMode`` as
the whole (T x T) square (it does not know about causality), the shared path's completions' node call as C x (P + C)
per row. ``dense`` forwards each row's real prompt tokens (no prompt pads) and C completion columns; ``trl`` padded
rows of P + C; the shared path each prompt's and each completion's real tokens once. The head is 2 x H x V per scored
token (the dense path computes C + 1 positions per row, TRL's CPU fallback every position).

A linear-attention hybrid's Gated DeltaNet layers cost per token (their projections, convolution and chunked
recurrence, ``dims.LinearAttention``); only its attention layers count (query, key) pairs.

These are the FLOPs each method executes; ``bench.flops`` counts the real work a method must do (causal pairs, the
real completion tokens), for the floors, a different quantity.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelDims
from .memory import keeps_logits
from .workload import Engine, Workload


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one step: ``parts`` maps body/attention/head to forward plus backward FLOPs."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        """FLOPs of all parts together."""
        return sum(self.parts.values())


def body_flops_per_token(dims: ModelDims) -> int:
    """Forward FLOPs of one token through one layer's projections and MLP, averaged over the layers: in a
    mixture-of-experts layer the router and the token's top-k experts (and the shared ones), not every expert; in a
    linear-attention hybrid's Gated DeltaNet layers their projections, convolution and recurrence (linear in the
    tokens, so counted per token like the projections)."""
    mlp = 3 * dims.hidden * dims.mlp_width + dims.hidden * dims.router_width
    recurrence = 0 if dims.linear is None else dims.linear_layers * dims.linear.recurrence_flops_per_token / dims.layers
    return round(2 * (dims.mixer_weights + mlp) + recurrence)


def attention_flops(dims: ModelDims, queries: int, keys: int) -> int:
    """Forward FLOPs of ``queries`` x ``keys`` scores and their weighted sum of values, over all heads."""
    return 2 * dims.heads * (dims.head_dim + dims.v_head_dim) * queries * keys


def count_flops(method: str, dims: ModelDims, w: Workload, *, device: str = "cpu") -> FlopCount:
    """Forward (and with ``train``, backward) FLOPs of ``method`` on ``w``, split into body, attention and head."""
    c, rows = w.completion_len, w.rows
    factor = 3 if w.train else 1
    if method == "dense":
        # Rows of their real prompt tokens and C completion columns (no prompt pads, ``bench.methods``); the
        # square counted per row at the mean real prompt length.
        tokens = w.dense_row_tokens
        width = w.real_prompt_tokens / w.prompts + c
        attention = round(rows * attention_flops(dims, 1, 1) * width * width)
        head_tokens = rows * (c + 1)
    elif method == "trl":
        width = w.prompt_len + c
        tokens = rows * width
        attention = rows * attention_flops(dims, width, width)
        head_tokens = rows * (width - 1) if device == "cpu" else w.scored
    else:
        # The two-level trie's node calls: each prompt's real tokens once, then each row's real completion tokens;
        # attention over each call's nodes padded to its longest (prompts causally, completions over their prompt).
        tokens = w.real_prompt_tokens + w.scored
        p = w.prompt_len
        attention = w.prompts * attention_flops(dims, p, p) + rows * attention_flops(dims, c, p + c)
        head_tokens = w.scored
    head = 2 * head_tokens * dims.hidden * dims.vocab
    if method == "chunked" and w.train and keeps_logits(dims, w, Engine(device=device), w.scored):
        head_factor = 3  # the chunked backward's head keeps its logits for backward where they fit
    elif method in ("expand", "flex", "chunked", "trl") and w.train:
        head_factor = 4  # fused heads recompute the chunk's logits in backward
    else:
        head_factor = factor
    return FlopCount(
        {
            "body": factor * tokens * dims.layers * body_flops_per_token(dims),
            "attention": factor * dims.attention_layers * attention,
            "head": head_factor * head,
        }
    )


def flop_floor(dims: ModelDims, w: Workload) -> int:
    """Forward FLOPs of the real tokens alone, each prompt once: body and causal attention (in the attention layers)
    of B x (P + G x C) tokens' worth, the head over the scored tokens; no method computes less."""
    prompt_tokens = w.prompt_tokens if w.prompt_tokens is not None else w.prompts * w.prompt_len
    tokens = prompt_tokens + w.scored
    mean_prompt = prompt_tokens / w.prompts
    mean_completion = w.scored / w.rows
    pairs = w.prompts * mean_prompt**2 / 2 + w.rows * mean_completion * (mean_prompt + mean_completion / 2)
    return int(
        tokens * dims.layers * body_flops_per_token(dims)
        + dims.attention_layers * attention_flops(dims, 1, 1) * pairs
        + 2 * w.scored * dims.hidden * dims.vocab
    )
