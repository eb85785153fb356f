"""Tiny random linear-attention hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), built from configs (nothing downloaded).

Three layers: Gated DeltaNet, gated full attention, Gated DeltaNet, so a recurrent layer reads what an attention layer
wrote. Value heads outnumber key heads (grouped value attention, as in the released models), the convolution kernel is
4 (the released size) and MoE variants route 2 of 4 experts plus the shared expert.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 101

#: model_type of each tiny model's config (the text-only causal LMs; the composite Qwen3.5 configs are ``qwen3_5`` and
#: ``qwen3_5_moe``).
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

#: The recurrent layers' chunk size: transformers' Gated DeltaNet layers call their chunked kernel with its default.
GDN_CHUNK_SIZE = 64

CONV_KERNEL = 4

#: transformers' default (and the released configs'). The float32 Gated DeltaNet kernel solves a triangular system
#: per chunk whose rounding grows with the projections' scale: at 0.1 the model's own dense forward already moves
#: its log-probs by up to 7e-6 between a row batched with left padding and the same row alone, at 0.02 by 1e-6
#: (the float32 floor of a log-softmax over this vocabulary).
INITIALIZER_RANGE = 0.02


#: The causal LM class (its name in transformers) of each of :data:`HYBRID_FAMILIES`.
_MODEL_CLASS_NAMES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


def hybrid_model_class(family: str):
    """The causal LM class of ``family`` (looked up when asked: transformers imports a family's modules on first
    use)."""
    return getattr(transformers, _MODEL_CLASS_NAMES[family])


def hybrid_config(family: str, *, layer_types=("linear_attention", "full_attention", "linear_attention"), **overrides):
    """The config of a tiny model of ``family`` (one of :data:`HYBRID_FAMILIES`): widths of 32, a layer per entry of
    ``layer_types``, value heads outnumbering key heads, convolution kernel 4, MoE variants routing 2 of 4 experts
    plus the shared expert; ``overrides`` (the vocabulary, tying, special tokens, ...) on top."""
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=CONV_KERNEL,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=list(layer_types),
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if family == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig(**fields, **overrides)
    if family == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig(**fields, **moe, **overrides)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**fields, **moe, **overrides)
    raise ValueError(f"unknown hybrid family {family!r}")


def draw_moderate_decays(model) -> None:
    """Each Gated DeltaNet value head's decay rate A drawn in [0.01, 1] (see :func:`build_hybrid`), in layer order
    from the global generator."""
    with torch.no_grad():
        for mixer in recurrent_layers(model):
            mixer.A_log.copy_(torch.empty_like(mixer.A_log).uniform_(0.01, 1.0).log())


def build_hybrid(family: str, *, dtype=torch.float32, seed: int = 0, decay: str = "moderate"):
    """A 3-layer model of ``family`` (one of :data:`HYBRID_FAMILIES`) in eval mode.

    ``decay``: ``"moderate"`` draws each value head's decay rate A in [0.01, 1]; ``"default"`` keeps the model's own
    initialisation (A in [0.01, 16]). With large A the per-chunk cumulative decays reach -1000 and the float32 torch
    kernel (transformers computes the recurrence in float32 whatever the model dtype) rounds the decay parameters'
    gradients (A_log, dt_bias) at ~1e-4 relative: the model's own dense forward moves that much when its rows are
    shifted by masked padding. Moderate decays keep that noise near 1e-6, below the tests' tolerance.
    """
    config = hybrid_config(family, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=INITIALIZER_RANGE)
    cls = hybrid_model_class(family)
    torch.manual_seed(seed)
    model = cls(config)
    if decay == "moderate":
        draw_moderate_decays(model)
    elif decay != "default":
        raise ValueError(f"decay must be 'moderate' or 'default', got {decay!r}")
    if dtype == torch.float64 and family != "qwen3_5_text":
        # transformers' grouped-matmul experts take no float64; the eager loop computes the same routing.
        model.set_experts_implementation("eager")
    return model.to(dtype).eval()


def recurrent_layers(model) -> list:
    """The Gated DeltaNet layers of a tiny hybrid, in layer order."""
    return [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]


def hybrid_batch(generations: int, *, seed: int = 0):
    """A grouped batch for the hybrids' entry points: (prompts (3, 11), prompt_mask, completions (3G, 7),
    completion_mask). Prompts left-padded to true lengths 11, 1 (one token) and 3 (shorter than the convolution
    kernel); completions right-padded to random lengths 1..7, one empty when G > 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([11, 1, CONV_KERNEL - 1])
    width = int(lengths.max())
    prompt_mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    prompts = torch.randint(3, VOCAB, (3, width), generator=gen).masked_fill(~prompt_mask, 0)
    rows = 3 * generations
    completion_lengths = torch.randint(1, 8, (rows,), generator=gen)
    completion_lengths[0] = 7
    if generations > 1:
        completion_lengths[1] = 0
    completion_mask = torch.arange(7)[None, :] < completion_lengths[:, None]
    completions = torch.randint(3, VOCAB, (rows, 7), generator=gen).masked_fill(~completion_mask, 0)
    return prompts, prompt_mask, completions, completion_mask


def hybrid_tree_rows(seed: int = 0) -> list[list[int]]:
    """Token-id rows of a trie of depth 3 whose forks fall inside and at the boundaries of the recurrence's chunks.

    Roots of 60 and 64 tokens (a row also ends at the first). Below the first, middle nodes of 4 tokens (ending at
    64) and 7, each with two leaves (one of 66 tokens, crossing the next chunk boundary); below the second, a
    one-token middle node (starting at 64, a row ends at it) with leaves of 2 and 67 tokens, and a middle node of 5
    with a one-token leaf. Siblings start with distinct tokens, so the trie is as described."""
    gen = torch.Generator().manual_seed(seed)

    def run(n: int, first: int) -> list[int]:
        return [first] + torch.randint(3, VOCAB, (n - 1,), generator=gen).tolist()

    r0, r1 = run(60, 3), run(GDN_CHUNK_SIZE, 4)
    m0, m1, m2, m3 = run(4, 5), run(7, 6), run(1, 7), run(5, 8)
    return [
        r0 + m0 + run(3, 9),
        r0 + m0 + run(1, 10),
        r0,
        r0 + m1 + run(9, 11),
        r0 + m1 + run(66, 12),
        r1 + m2 + run(2, 13),
        r1 + m2,
        r1 + m2 + run(GDN_CHUNK_SIZE + 3, 14),
        r1 + m3 + run(1, 15),
    ]
