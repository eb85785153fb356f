"""Public entry points: ``compute_logps`` and ``compute_logps_concatenated``."""

from __future__ import annotations

import math

import torch
from torch import nn

from .dense import dense_logps
from .inputs import GroupedBatch, group_batch, split_concatenated
from .model_support import PreparedModel, prepare_model
from .output import LogpsOutput
from .phases import capture_prefix, score_completions

#: Backends of the completion attention. ``auto`` picks the best one available on the model's device.
BACKENDS = ("auto", "expand", "dense")


def compute_logps(
    model: nn.Module,
    prompts,
    completions,
    *,
    prompt_mask: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> LogpsOutput:
    """Per-token log-probs of G completions per prompt, each prompt forwarded once.

    The numbers equal those of the conventional forward of every ``[prompt | completion]`` row (the ``dense``
    backend); gradients flow into the prompt through the keys/values its completions share.

    Args:
        model: a transformers decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma2, Phi3), optionally
            wrapped by PEFT or DDP. Called through its own forward, twice (prompts, then completions).
        prompts: (B, P) int64 ids, left-padded as described by ``prompt_mask``, or a list of B token-id lists.
        completions: (B*G, C) int64 ids, right-padded as described by ``completion_mask``, or a list of B*G
            token-id lists. Rows g*G .. g*G+G-1 continue prompt g; G = len(completions) // len(prompts).
        prompt_mask: (B, P) bool/0-1, True on real tokens; None means no padding (tensor input only).
        completion_mask: (B*G, C) bool/0-1, True on real tokens; None means no padding (tensor input only).
        temperature: logits are divided by it before the log-softmax.
        return_entropy: also return each position's entropy.
        backend: ``"auto"`` (currently ``"expand"``), ``"expand"`` (each row gathers its prefix keys/values) or
            ``"dense"`` (the conventional full-row forward, for reference).

    Returns:
        :class:`LogpsOutput` with ``logps`` (B*G, C) float32 (0 where masked), ``entropy`` or None, and ``mask``.

    Raises:
        TypeError / ValueError: naming the offending argument, for malformed or inconsistent inputs.
        UnsupportedModelError: for models the shared path cannot serve.
    """
    _check_options(temperature, backend)
    prepared = prepare_model(model)
    batch = group_batch(
        prompts,
        completions,
        prompt_mask,
        completion_mask,
        device=prepared.device,
        input_vocab_size=prepared.input_vocab_size,
        output_vocab_size=prepared.output_vocab_size,
    )
    return run_batch(prepared, batch, temperature=temperature, return_entropy=return_entropy, backend=backend)


def compute_logps_concatenated(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> LogpsOutput:
    """The trainer-shaped entry: rows ``[left-padded prompt | right-padded completion]`` as TRL builds them.

    Rows whose prompt part is identical (ids and mask) share one prefix, whatever their order in the batch.

    Args:
        model: as for :func:`compute_logps`.
        input_ids: (N, L) int64.
        attention_mask: (N, L) bool/0-1; its first ``L - logits_to_keep`` columns are the left-padded prompt mask,
            the last ``logits_to_keep`` the right-padded completion mask.
        logits_to_keep: completion length C.
        temperature, return_entropy, backend: as for :func:`compute_logps`.

    Returns:
        :class:`LogpsOutput` with (N, C) tensors, row i for ``input_ids[i]``.
    """
    _check_options(temperature, backend)
    prepared = prepare_model(model)
    batch = split_concatenated(
        input_ids,
        attention_mask,
        logits_to_keep,
        device=prepared.device,
        input_vocab_size=prepared.input_vocab_size,
        output_vocab_size=prepared.output_vocab_size,
    )
    return run_batch(prepared, batch, temperature=temperature, return_entropy=return_entropy, backend=backend)


def _check_options(temperature, backend) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def run_batch(
    prepared: PreparedModel, batch: GroupedBatch, *, temperature: float, return_entropy: bool, backend: str
) -> LogpsOutput:
    """Log-probs of a validated batch with the chosen backend, padded back to the batch's completion length."""
    rows, length = batch.completion_ids.shape
    trimmed = batch.trimmed()
    kept = trimmed.completion_ids.shape[1]
    if kept == 0:
        zeros = torch.zeros(rows, length, device=batch.completion_ids.device)
        return LogpsOutput(zeros, zeros.clone() if return_entropy else None, batch.completion_mask)
    if backend == "dense":
        logps, entropy = dense_logps(prepared, trimmed, temperature=float(temperature), return_entropy=return_entropy)
    else:
        capture = capture_prefix(prepared, trimmed)
        scored = score_completions(
            prepared, trimmed, capture, temperature=float(temperature), return_entropy=return_entropy
        )
        logps = _scatter_valid(scored.logps, trimmed.completion_mask)
        entropy = _scatter_valid(scored.entropy, trimmed.completion_mask) if return_entropy else None
    if kept < length:
        pad = (0, length - kept)
        logps = torch.nn.functional.pad(logps, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return LogpsOutput(logps, entropy, batch.completion_mask)


def _scatter_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(num_valid,) values -> (rows, C) float32 with zeros where ``mask`` is False (differentiable)."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask, values)
