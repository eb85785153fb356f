"""Model-config FLOPs of a log-prob workload: the body, attention and head of a decoder-only model, forward and
backward, for the dense full-row forward and for the least work the shared-prefix path could do.

Matmuls only, as ``torch.utils.flop_counter.FlopCounterMode`` counts them (2 FLOPs per multiply-add; norms, RoPE,
softmax and elementwise work are left out):

- body: per token and layer the query/key/value/output projections and the gated MLP (three matrices); in a
  mixture-of-experts layer the router and the MLPs of the token's top-k experts and of the shared ones (the experts
  laid out as ``plan.dims`` reads them from the config);
- attention: per (query, key) pair and layer ``q·k`` and ``p·v`` over every query head, ``4 · heads · head_dim``;
  a pair counts only where the key is visible (causal, within the layer's sliding window), the least any kernel
  must compute;
- head: ``2 · hidden · vocab`` per scored token;
- a linear-attention hybrid's Gated DeltaNet layers (Qwen3.5, Qwen3-Next): per token their projections, the
  depthwise convolution and the chunked recurrence's matmuls (``plan.dims.LinearAttention``); they attend over no
  (query, key) pairs, and the attention layers' query projection also yields the output gate.

Backward is twice forward for every matmul (the gradients of both operands), which is also what autograd of the
matmuls (eager or math attention) executes; attention kernels that recompute the scores in backward do more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Flops:
    """FLOPs of one piece of work, split by where they are spent (Python ints, exact)."""

    body: int = 0
    attention: int = 0
    head: int = 0

    @property
    def total(self) -> int:
        return self.body + self.attention + self.head

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.body + other.body, self.attention + other.attention, self.head + other.head)

    def scaled(self, factor: int) -> Flops:
        return Flops(self.body * factor, self.attention * factor, self.head * factor)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that its FLOPs depend on; ``windows`` holds each layer's sliding window
    (None: full causal attention).

    ``intermediate``: the dense MLP's width (0 for a model whose every layer is routed, which has none).

    ``routed`` (mixture-of-experts models; None for dense ones): per layer, (the gated-MLP width one token goes
    through: the dense ``intermediate``, or its top-k experts' and the shared ones', and the router's experts, 0 in
    a dense layer).

    ``linear`` (linear-attention hybrids; None otherwise): the Gated DeltaNet layers (``plan.dims.LinearAttention``,
    their indices among the layers); ``attention_gate``: the attention layers' query projection is twice as wide.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    windows: tuple[int | None, ...]
    routed: tuple[tuple[int, int], ...] | None = None
    linear: object = None
    attention_gate: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """The shape of a transformers decoder config (Llama, Qwen2/3, Mistral, Gemma2/3, Phi3, OLMo2 style: gated
        MLP, grouped-query attention; the mixture-of-experts families ``plan`` knows with their routed experts).

        Raises:
            ValueError: a mixture-of-experts config of a family whose experts are not laid out here.
        """
        missing = [
            name
            for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if not isinstance(getattr(config, name, None), int)
        ]
        if missing:
            raise TypeError(f"config: needs integer {', '.join(missing)} (a decoder-only transformers config)")
        heads = config.num_attention_heads
        layers = config.num_hidden_layers
        routed = _routed_widths(config, layers)
        # The dense MLP's width, which a family whose every layer is routed (Qwen3.5-MoE) does not have.
        intermediate = getattr(config, "intermediate_size", None)
        if (routed is None or any(experts == 0 for _, experts in routed)) and not isinstance(intermediate, int):
            raise TypeError("config: needs integer intermediate_size (the width of its dense MLP layers)")
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        else:
            windows = (window,) * layers
        from ..plan.dims import LINEAR_ATTENTION_MODEL_TYPES, linear_from_config

        fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        return cls(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=intermediate or 0,
            vocab=config.vocab_size,
            windows=windows,
            routed=routed,
            linear=linear_from_config(fields, "config"),
            attention_gate=fields.get("model_type") in LINEAR_ATTENTION_MODEL_TYPES
            and bool(fields.get("attn_output_gate", True)),
        )

    @property
    def layers(self) -> int:
        return len(self.windows)

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a Gated DeltaNet layer (no attention pairs)."""
        return self.linear is not None and layer in self.linear.layers

    @property
    def body_per_token(self) -> int:
        """Forward FLOPs of one token through every layer's projections and MLP (a MoE layer's router and the
        token's experts; a Gated DeltaNet layer's projections, convolution and recurrence)."""
        attention_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        query_width = attention_width * (2 if self.attention_gate else 1)
        linear = sum(self.is_linear(layer) for layer in range(self.layers))
        attention = 2 * self.hidden * (query_width + attention_width + 2 * kv_width) * (self.layers - linear)
        if linear:
            attention += linear * (2 * self.linear.weights(self.hidden) + self.linear.recurrence_flops_per_token)
        routed = self.routed or ((self.intermediate, 0),) * self.layers
        return attention + sum(2 * self.hidden * (3 * width + experts) for width, experts in routed)

    @property
    def attention_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair in one layer: ``q·k`` and ``p·v`` over every query head."""
        return 4 * self.heads * self.head_dim

    @property
    def head_per_token(self) -> int:
        return 2 * self.hidden * self.vocab


def _routed_widths(config, layers: int) -> tuple[tuple[int, int], ...] | None:
    """:attr:`ModelShape.routed` of a transformers config (None for a dense one)."""
    from ..plan.dims import experts_from_config

    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    experts = experts_from_config(fields, name="config")
    if experts is None:
        return None
    routed = set(experts.layers)
    return tuple(
        (experts.active_intermediate, experts.count) if i in routed else (getattr(config, "intermediate_size", 0), 0)
        for i in range(layers)
    )


def visible_pairs(start: int, queries: int, window: int | None = None) -> int:
    """Causal (query, key) pairs of ``queries`` consecutive queries at positions ``start ..``: query ``q`` sees the
    keys at positions ``0 .. q``, or the last ``window`` of them."""
    if start < 0 or queries < 0:
        raise ValueError(f"start and queries must be >= 0, got {start} and {queries}")
    end = start + queries  # queries at positions start .. end - 1 see (q + 1) keys, capped at the window
    if window is None or end <= window:
        return queries * start + queries * (queries + 1) // 2
    if window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    below = max(0, min(end, window) - start)  # queries before the cap: positions start .. window - 1
    return below * start + below * (below + 1) // 2 + (queries - below) * window


def forward_flops(shape: ModelShape, *, tokens: int, attention_pairs: Sequence[int], scored_tokens: int) -> Flops:
    """Forward FLOPs of ``tokens`` through the body, ``attention_pairs[layer]`` (query, key) pairs per attention
    layer, and the head over ``scored_tokens``."""
    if len(attention_pairs) != shape.layers:
        raise ValueError(f"attention_pairs: one count per layer ({shape.layers}), got {len(attention_pairs)}")
    return Flops(
        body=tokens * shape.body_per_token,
        # A hybrid's Gated DeltaNet layers attend over no pairs, whatever the caller counted for them.
        attention=sum(n for layer, n in enumerate(attention_pairs) if not shape.is_linear(layer))
        * shape.attention_per_pair,
        head=scored_tokens * shape.head_per_token,
    )


def backward_flops(forward: Flops) -> Flops:
    """The backward of ``forward``: per matmul the gradients of both operands, twice its forward FLOPs."""
    return forward.scaled(2)


def step_flops(forward: Flops, *, train: bool) -> Flops:
    """The FLOPs of a step: the forward, plus with ``train`` its backward."""
    return forward + backward_flops(forward) if train else forward


@dataclass(frozen=True)
class Workload:
    """Real token counts of a GRPO batch: ``prompt_lengths`` (B,) of the distinct prompts and
    ``completion_lengths`` (B·G,), rows ``g·G .. g·G+G-1`` continuing prompt ``g``."""

    prompt_lengths: tuple[int, ...]
    completion_lengths: tuple[int, ...]

    def __post_init__(self):
        if not self.prompt_lengths or len(self.completion_lengths) % len(self.prompt_lengths):
            raise ValueError(
                f"completion_lengths: {len(self.completion_lengths)} rows is not a multiple of "
                f"{len(self.prompt_lengths)} prompts"
            )
        if min(self.prompt_lengths) < 1 or min(self.completion_lengths, default=0) < 0:
            raise ValueError("prompt_lengths must be >= 1 and completion_lengths >= 0")

    @classmethod
    def from_masks(cls, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Workload:
        """From the bool masks of a batch: (B, P) prompts and (B·G, C) completions."""
        return cls(tuple(prompt_mask.sum(1).tolist()), tuple(completion_mask.sum(1).tolist()))

    @property
    def generations(self) -> int:
        return len(self.completion_lengths) // len(self.prompt_lengths)

    def rows(self):
        """(prompt length, completion length) of every row."""
        g = self.generations
        return [(self.prompt_lengths[i // g], c) for i, c in enumerate(self.completion_lengths)]

    @property
    def prompt_tokens(self) -> int:
        """Real tokens of the distinct prompts."""
        return sum(self.prompt_lengths)

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion_lengths)

    @property
    def dense_tokens(self) -> int:
        """Real tokens of the full ``[prompt | completion]`` rows: every prompt G times."""
        return sum(p + c for p, c in self.rows())

    @property
    def shared_tokens(self) -> int:
        """Real tokens when each prompt is forwarded once: the prompts plus every completion token."""
        return self.prompt_tokens + self.completion_tokens


def dense_flops(shape: ModelShape, workload: Workload, *, train: bool) -> Flops:
    """The dense method's work on real tokens: every ``[prompt | completion]`` row through the body with causal
    attention, the head over the completion tokens."""
    rows = workload.rows()
    pairs = [
        0 if shape.is_linear(layer) else sum(visible_pairs(0, p + c, window) for p, c in rows)
        for layer, window in enumerate(shape.windows)
    ]
    forward = forward_flops(
        shape, tokens=workload.dense_tokens, attention_pairs=pairs, scored_tokens=workload.completion_tokens
    )
    return step_flops(forward, train=train)


def shared_floor_flops(shape: ModelShape, workload: Workload, *, train: bool) -> Flops:
    """The least work of the shared path: each prompt through the body once, every completion token attending over
    its prompt and its own earlier tokens, the head over the completion tokens."""
    pairs = [
        0
        if shape.is_linear(layer)
        else sum(visible_pairs(0, p, window) for p in workload.prompt_lengths)
        + sum(visible_pairs(p, c, window) for p, c in workload.rows())
        for layer, window in enumerate(shape.windows)
    ]
    forward = forward_flops(
        shape, tokens=workload.shared_tokens, attention_pairs=pairs, scored_tokens=workload.completion_tokens
    )
    return step_flops(forward, train=train)


def flop_floor(shape: ModelShape, workload: Workload, *, train: bool) -> float:
    """The FLOP floor: the shared path's least FLOPs over the dense method's, forward+backward with ``train``.
    No method can be faster than dense by more than its inverse at equal efficiency."""
    return shared_floor_flops(shape, workload, train=train).total / dense_flops(shape, workload, train=train).total
