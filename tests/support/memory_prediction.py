"""Predicted peak memory of one ``compute_logps`` / ``chunked_backward`` call, from shapes: what the GPU peak-memory
test bounds the measured peak by (times a margin), and a CPU test checks against live tensor bytes.

All sizes are bytes of tensors the call allocates (parameters and inputs already exist). Terms, for one prompt
length ``P`` (Phase 1 forwards ``P - 1`` tokens per prompt), ``rows = prompts * G`` completions of length ``C``,
``b`` bytes per activation element, ``L`` layers, ``nh`` query heads, ``nkv`` key/value heads of size ``hd``:

- ``activations per token and layer`` (:func:`activation_bytes_per_token_layer`): what autograd saves in one decoder
  layer of a Llama/Qwen2-style model per token: two RMSNorms in float32 (input upcast and normalized copy) plus their
  output, q/k/v, the rotated q/k, the attention output (SDPA's and the contiguous copy o_proj reads), SDPA's float32
  log-sum-exp, and the MLP's gate, up, activation and product.
- ``phase1_saved`` / ``phase2_saved``: those bytes over Phase 1's and the in-flight completions' tokens (with
  gradients only; one layer's worth as a transient without).
- ``captured_kv``: the prompts' keys and values of every layer, ``L * prompts * (P-1) * nkv * hd * 2 * b``
  (``chunked_backward`` also holds their gradients).
- ``expand`` masks: additive, in ``b``, allocated with the key dimension rounded up to a multiple of 16 (so SDPA's
  kernels take them without a per-layer copy): Phase 1 ``prompts * (P-1) * align16(P-1) * b``, Phase 2
  ``rows * C * align16(P-1+C) * b``, written in place from each query's first and last allowed key (two int64 per
  query as temporaries). Unpadded prompts without a window (``padded_prompts=False``) run Phase 1 causally without
  a mask, and Phase 2's mask is one row's ``C * align16(P-1+C) * b`` broadcast over the rows.
- ``expand`` gathered keys/values: a transient per layer of ``rows * nkv * (P-1+C) * hd * 2 * b``, plus the same over
  ``nh`` heads when grouped-query heads are repeated for the kernel (``gqa_repeat``); backward recomputes them one
  layer at a time and holds their gradients too (twice the forward transient).
- ``flex`` packed keys/values: each layer's ``[prefixes ; completions]`` keys and values in one tensor,
  ``(prompts * (P-1) + rows * C) * nkv * hd * 2 * b``, saved by flex for backward in every layer (with gradients) or
  one layer's transient (without).
- ``head``: one row chunk of logits of the fused head, ``head_rows * V * b``, plus ``head_stats_bytes`` per logit of
  float32 temporaries when the torch implementation computes the statistics (the Triton kernels need none); the
  completion tokens' hidden states gathered for the head; with gradients the float32 (V, H) weight-gradient
  accumulator, its cast to ``b``, and the hidden states' gradient.
- ``parameter gradients``: ``param_bytes`` once for ``.grad`` and once for a gradient in flight before it is added.

The peak is the persistent terms plus the largest transient of the moments that follow each other: building a mask,
a layer's forward without gradients, the head (end of forward and start of backward), a layer's attention backward.
Scoring without gradients is predicted for all rows at once, an upper bound when the token budget splits them.
"""

from __future__ import annotations

from dataclasses import dataclass


def align16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-style decoder the prediction needs; ``dtype_bytes`` of its activations."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    param_bytes: int

    @classmethod
    def of(cls, model) -> ModelShape:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # tied weights once
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            dtype_bytes=next(model.parameters()).element_size(),
            param_bytes=sum(params.values()),
        )


def activation_bytes_per_token_layer(s: ModelShape) -> int:
    """Bytes autograd saves per token in one decoder layer (see the module docstring for the list)."""
    b, q, kv = s.dtype_bytes, s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * s.hidden * (4 + 4 + b)
    attention = (q + 2 * kv) * b + (q + kv) * b + 2 * q * b + s.heads * 4
    mlp = 4 * s.intermediate * b
    return norms + attention + mlp


def predicted_peak_bytes(
    s: ModelShape,
    *,
    backend: str,
    mode: str,
    prompts: int,
    generations: int,
    prompt_len: int,
    completion_len: int,
    head_rows: int,
    generations_per_chunk: int | None = None,
    gqa_repeat: bool = True,
    head_stats_bytes: int = 0,
    padded_prompts: bool = True,
) -> dict[str, int]:
    """The terms of the predicted peak and their ``"peak"``, in bytes.

    Args:
        backend: ``"expand"`` or ``"flex"``; mode: ``"score"`` (no grad), ``"train"`` (one backward) or
            ``"chunked"`` (``chunked_backward`` with ``generations_per_chunk``).
        head_rows: rows per chunk of the fused head (``default_chunk_size`` of the rows it scores at once).
        gqa_repeat: whether expand repeats grouped-query key/value heads for its attention kernel.
        head_stats_bytes: float32 temporary bytes per logit of the head's statistics (0 for Triton, 8 for torch).
        padded_prompts: whether any prompt is left-padded (expand then needs a Phase 1 mask and a mask per row).
    """
    if backend not in ("expand", "flex") or mode not in ("score", "train", "chunked"):
        raise ValueError(f"unknown backend/mode {backend!r}/{mode!r}")
    b, L = s.dtype_bytes, s.layers
    grad = mode != "score"
    per_token = activation_bytes_per_token_layer(s)
    prefix = prompt_len - 1
    keys = prefix + completion_len
    rows = prompts * (generations_per_chunk if mode == "chunked" else generations)
    tokens2 = rows * completion_len
    kv_bytes = s.kv_heads * s.head_dim * 2 * b  # one token's keys and values in one layer

    persistent = {
        "captured_kv": L * prompts * prefix * kv_bytes * (2 if mode == "chunked" else 1),
        "phase1_saved": prompts * prefix * L * per_token if grad else 0,
        "phase2_saved": tokens2 * L * per_token if grad else 0,
        "parameter_grads": 2 * s.param_bytes if grad else 0,
    }
    transients = {
        "head": head_rows * s.vocab * (b + head_stats_bytes) + tokens2 * s.hidden * b,
        "layer_forward": 0 if grad else tokens2 * per_token,
    }
    if grad:
        transients["head"] += s.vocab * s.hidden * (4 + b) + tokens2 * s.hidden * b
    if backend == "expand":
        mask_rows = rows if padded_prompts else 1
        persistent["phase1_mask"] = prompts * prefix * align16(prefix) * b if padded_prompts else 0
        persistent["phase2_mask"] = mask_rows * completion_len * align16(keys) * b
        transients["phase1_mask_build"] = 2 * 8 * prompts * prefix if padded_prompts else 0
        transients["phase2_mask_build"] = 2 * 8 * mask_rows * completion_len
        gathered = rows * keys * kv_bytes * (1 + (s.heads // s.kv_heads if gqa_repeat else 0))
        if grad:
            transients["gathered_kv"] = 2 * gathered
        else:  # without gradients the copies are made inside the layer's forward
            transients["layer_forward"] += gathered
    else:
        packed = (prompts * prefix + tokens2) * kv_bytes
        if grad:
            persistent["packed_kv"] = L * packed
        else:
            transients["layer_forward"] += packed
    terms = {**persistent, **transients}
    terms["peak"] = sum(persistent.values()) + max(transients.values())
    return terms
