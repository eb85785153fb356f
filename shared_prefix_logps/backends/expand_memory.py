"""The memory the expand layout's attention takes beyond the model's own activations, term by term.

Per node of a node call with A ancestor tokens and L tokens of its own (a completion of C tokens under a prompt of P:
A = P, L = C), h query heads, g KV heads, d head size (2d: key plus value head size where they differ, as under
multi-head latent attention), s bytes per element of the model's dtype and ``pad16(n)`` = n rounded up to a multiple
of 16 (one layer at a time; with gradients the mask is shared by all layers and each layer's saved tensors add up):

    mask                 L x pad16(A + L) x s      none for a call without ancestors and window (causal SDPA); one
                                                   (1, 1, L, .) mask for all nodes of a call when they have as many
                                                   ancestor tokens and there is no window
    gathered K/V         2 x g x (A + L) x d x s   each node's ancestors' keys/values next to its own
    repeated K/V         2 x h x (A + L) x d x s   only when the chosen kernel rejects grouped heads
    explicit scores      h x L x (A + L) x (4 + 2s) softcap/sinks models: scores, float32 softmax, probabilities

The mask is quadratic and G-fold under padded prompts: P = 16k, G = 64, C = 1k, bf16 is 2.1 GiB per prompt. The
repeated K/V of one layer of Qwen2.5-7B (h = 28, g = 4, d = 128) at that shape is 15 GiB per prompt. No-grad chunks
of rows are sized by these terms (``engine/budget``); explicit scores over :data:`EXPLICIT_SCORES_BUDGET` bytes are
refused on the fused-kernel path (CUDA) with a message naming their size (``backend='flex'`` computes the same
attention without a score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the planner reads these sizes without it
    import torch


#: Masks are allocated with their last dim rounded up to a multiple of this many elements and handed to SDPA as a
#: slice: SDPA's memory-efficient kernel copies (pads) a mask whose row stride is not a multiple of 8 in every call,
#: and saves the copy for backward.
MASK_ALIGNMENT = 16

#: Most bytes the explicit attention scores of one layer (softcap or sinks models) may take on the fused-kernel
#: path before the call is refused.
EXPLICIT_SCORES_BUDGET = 4 * 2**30


def padded_width(length: int) -> int:
    """``length`` rounded up to a multiple of :data:`MASK_ALIGNMENT`."""
    return -(-length // MASK_ALIGNMENT) * MASK_ALIGNMENT


@dataclass(frozen=True)
class AttentionShape:
    """What the memory terms of a model depend on.

    Attributes:
        hidden_size, heads, kv_heads: from the model's config.
        head_dim, v_head_dim: sizes of a key and of a value head (they differ under multi-head latent attention).
        itemsize: bytes per element of the model's parameters (its activations' dtype).
        explicit_scores: whether its attention computes scores explicitly (attention softcap or sinks).
        sliding_window: the config's sliding window (None: none), which makes a mask necessary when it is shorter
            than the keys.
    """

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    itemsize: int
    explicit_scores: bool
    sliding_window: int | None = None

    @classmethod
    def of_model(cls, causal_lm: torch.nn.Module) -> AttentionShape:
        """The shape of a transformers causal LM (its text config for multimodal configs)."""
        config = causal_lm.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        v_head_dim = getattr(config, "v_head_dim", None) or head_dim
        if getattr(config, "qk_nope_head_dim", None) is not None:  # multi-head latent attention (DeepSeek)
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        explicit = getattr(config, "attn_logit_softcapping", None) is not None or config.model_type == "gpt_oss"
        return cls(
            hidden_size=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            itemsize=causal_lm.get_input_embeddings().weight.dtype.itemsize,
            explicit_scores=explicit,
            sliding_window=getattr(config, "sliding_window", None),
        )

    def windowed(self, keys: int) -> bool:
        """Whether the sliding window hides some of ``keys`` keys from a query (so a mask is needed)."""
        return self.sliding_window is not None and self.sliding_window < keys


def mask_bytes(queries: int, keys: int, itemsize: int) -> int:
    """Bytes of one additive mask of ``queries`` x ``keys``: its key dim is allocated rounded up to
    :data:`MASK_ALIGNMENT` (``backends.expand.empty_additive_mask``)."""
    return queries * padded_width(keys) * itemsize


def kv_bytes(shape: AttentionShape, heads: int, keys: int) -> int:
    """Bytes of the keys and values of ``heads`` heads over ``keys`` positions (one node, one layer)."""
    return heads * keys * (shape.head_dim + shape.v_head_dim) * shape.itemsize


def node_bytes(shape: AttentionShape, ancestors: int, length: int, *, masked: bool, repeats_kv: bool) -> int:
    """Bytes one node of ``length`` tokens under ``ancestors`` ancestor tokens adds to a layer of its node call beyond
    its hidden states (see the module docstring)."""
    keys = ancestors + length
    total = mask_bytes(length, keys, shape.itemsize) if masked else 0
    total += kv_bytes(shape, shape.kv_heads, keys)
    if repeats_kv:
        total += kv_bytes(shape, shape.heads, keys)
    if shape.explicit_scores:
        total += scores_bytes(shape.heads, length, keys, shape.itemsize)
    return total


def scores_bytes(heads: int, queries: int, keys: int, itemsize: int) -> int:
    """Bytes of one node's explicit attention: scores and probabilities in the model's dtype, float32 softmax."""
    return heads * queries * keys * (4 + 2 * itemsize)


def check_explicit_scores(query: torch.Tensor, keys: int) -> None:
    """Refuse explicit attention scores over :data:`EXPLICIT_SCORES_BUDGET` bytes.

    Args:
        query: (batch, heads, q_len, head_dim); keys: the key length.
    Raises:
        ValueError: naming the bytes the scores would take and what to do instead.
    """
    batch, heads, queries, _ = query.shape
    need = batch * scores_bytes(heads, queries, keys, query.element_size())
    if need > EXPLICIT_SCORES_BUDGET:
        raise ValueError(
            f"backend='expand' computes this model's attention scores explicitly (attention softcap or sinks): "
            f"{batch} rows x {heads} heads x {queries} queries x {keys} keys would take {need / 2**30:.1f} GiB per "
            f"layer, over expand_memory.EXPLICIT_SCORES_BUDGET ({EXPLICIT_SCORES_BUDGET / 2**30:.1f} GiB). Use "
            "backend='flex' (no score matrix), or fewer rows at once (chunked_backward's generations_per_chunk, "
            "token_budget), or raise the budget"
        )
