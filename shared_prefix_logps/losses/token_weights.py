"""Per-token factors around the policy term: the importance ratio pi/pi_old that the policy terms read, the vLLM
importance-sampling correction, the KL penalty, and ``weight_tokens``, which applies the masks, the correction and
the KL to the policy loss in TRL's order.

All tensors are ``(B, C)`` (``B`` rows of the micro-batch, ``C`` its padded width) or ``(B, 1)`` per-row values, in
the loss dtype (that of ``per_token_logps``).
"""

from __future__ import annotations

import torch

__all__ = ["importance_ratio", "kl_penalty", "log_ratio", "vllm_importance_ratio", "weight_tokens"]


def log_ratio(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` log(pi / pi_old), differentiable through ``per_token_logps``, exactly 0 at padding.

    Padded positions may hold anything (0, NaN from a sampler, garbage): force their log-ratio to 0 so that exp()
    stays finite there, since 0 * inf would poison both the sum and its gradient.
    """
    return torch.where(valid, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))


def importance_ratio(log_ratio: torch.Tensor, maskf: torch.Tensor, level: str) -> torch.Tensor:
    """The importance ratio the policy terms clip or weight by.

    Args:
        log_ratio: ``(B, C)`` from :func:`log_ratio`.
        maskf: ``(B, C)`` float 0-1 loss mask.
        level: ``"token"``: ``(B, C)`` one ratio per token; ``"sequence"`` (GSPO): ``(B, 1)`` one ratio per row,
            ``exp`` of the mean log-ratio over its valid tokens (an empty row gets ratio 1).

    Returns:
        ``(B, C)`` or ``(B, 1)`` ratio, differentiable.
    """
    if level == "token":
        log_weight = log_ratio
    else:
        log_weight = (log_ratio.sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    return torch.exp(log_weight)


def vllm_importance_ratio(
    importance_sampling_ratio: torch.Tensor | None, valid: torch.Tensor, like: torch.Tensor
) -> torch.Tensor | None:
    """The vLLM truncated/masked importance-sampling correction ``pi_old / pi_sampler`` in the loss dtype.

    Args:
        importance_sampling_ratio: ``(B, C)`` token-level or ``(B, 1)`` sequence-level ratio, or None.
        valid: ``(B, C)`` bool loss mask.
        like: ``(B, C)`` tensor in the loss dtype (``per_token_logps``).

    Returns:
        The ratio in ``like``'s dtype; a token-level one is set to exactly 1 (neutral) at padding, whatever it held
        there (NaN from the sampler must not reach the loss). None when not given.
    """
    if importance_sampling_ratio is None:
        return None
    importance_sampling_ratio = importance_sampling_ratio.to(like.dtype)
    if importance_sampling_ratio.shape == valid.shape:  # token-level: neutral (1) at padding, whatever it held
        importance_sampling_ratio = torch.where(valid, importance_sampling_ratio, torch.ones_like(like))
    return importance_sampling_ratio


def kl_penalty(
    ref_per_token_logps: torch.Tensor,
    per_token_logps: torch.Tensor,
    valid: torch.Tensor,
    ratio: torch.Tensor,
    use_bias_correction_kl: bool,
) -> torch.Tensor:
    """``(B, C)`` per-token KL(pi || pi_ref), the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``.

    k3 is unbiased and always >= 0. With ``use_bias_correction_kl`` it is multiplied by the (differentiable)
    importance ratio ``ratio`` (``(B, C)`` or ``(B, 1)``), as TRL 1.16 does by default: the tokens were sampled from
    pi_old, not pi. Differentiable through ``per_token_logps``; 0 at padding (the difference is forced to 0 there).
    """
    ref_minus = torch.where(
        valid, ref_per_token_logps.to(per_token_logps.dtype) - per_token_logps, torch.zeros_like(per_token_logps)
    )
    per_token_kl = torch.exp(ref_minus) - ref_minus - 1.0  # k3: unbiased, always >= 0
    if use_bias_correction_kl:
        per_token_kl = per_token_kl * ratio
    return per_token_kl


def weight_tokens(
    per_token_loss: torch.Tensor,
    *,
    keep_rows: torch.Tensor | None,
    entropy_mask: torch.Tensor | None,
    importance_sampling_ratio: torch.Tensor | None,
    per_token_kl: torch.Tensor | None,
    beta: float,
) -> torch.Tensor:
    """The policy loss with TRL's masks and corrections applied, then the KL penalty added.

    The order is TRL's (off-policy mask, entropy mask, vLLM correction, then ``+ beta * KL``) and is kept as is, so
    that results match TRL's bit for bit where the arithmetic allows: the KL term is neither masked by the entropy
    mask nor scaled by the vLLM correction.

    Args:
        per_token_loss: ``(B, C)``, or ``(B, 1)`` at sequence level, from the policy term.
        keep_rows: bool keep mask from ``masks.off_policy_sequence_mask`` (``(B, 1)`` or ``(B, C)``), or None.
        entropy_mask: ``(B, C)`` bool high-entropy mask, or None.
        importance_sampling_ratio: prepared vLLM correction (``vllm_importance_ratio``), or None (also for loss types
            that fold it into their own weight).
        per_token_kl: ``(B, C)`` from :func:`kl_penalty`, or None when ``beta == 0``.
        beta: KL coefficient.

    Returns:
        ``(B, C)``, or ``(B, 1)`` when nothing per-token was mixed into a sequence-level loss.
    """
    dtype = per_token_loss.dtype
    if keep_rows is not None:
        per_token_loss = per_token_loss * keep_rows.to(dtype)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.to(dtype)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl
    return per_token_loss
