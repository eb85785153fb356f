"""TRL 1.16's ``GRPOTrainer._compute_loss`` for one micro-batch, transcribed from its source: the outside reference
the loss tests check ``grpo_loss`` against (kept out of the package: nothing in it runs this)."""

from __future__ import annotations

import math

import torch

from shared_prefix_logps.losses import Count, high_entropy_mask

_CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def trl_grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    max_completion_length: int | None = None,
    num_items_in_batch: Count | None = None,
    num_processes: int = 1,
    current_gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> torch.Tensor:
    """The loss TRL 1.16 ``GRPOTrainer._compute_loss`` returns for one micro-batch, written out from its source.

    Same math, same per-micro-batch normalizers (``/ current_gradient_accumulation_steps``, the micro-batch's own
    token count for ``bnpo``, its own row count for ``grpo``/``sapo``/``dr_grpo``/``luspo``, and
    ``num_items_in_batch / num_processes * GA / steps_per_generation`` for ``dapo``/``cispo``/``vespo``). With the
    defaults (one un-split batch, one process) it equals ``grpo_loss`` on the same inputs. Single process only: the
    entropy quantile is taken over this batch. Not covered: the MoE aux loss and the adaptive entropy controller.
    Deliberately *not* hardened against non-finite values at masked positions, to stay literal.

    Args mirror ``grpo_loss`` and TRL's attributes; ``num_items_in_batch`` is TRL's (global over the generation
    batch; default: this batch's valid tokens); ``top_entropy_quantile`` < 1 builds the mask from ``entropies``.
    Returns the 0-dim loss with gradient.
    """
    mask = completion_mask.to(per_token_logps.dtype)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if entropies is not None and top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(entropies, completion_mask, top_entropy_quantile)
    else:
        entropy_mask = None
    if off_policy_mask_threshold is not None:
        sampled = old_per_token_logps if sampling_per_token_logps is None else sampling_per_token_logps
        kl_seq = (torch.nan_to_num(sampled - per_token_logps.detach(), nan=0.0) * mask).sum(1, keepdim=True)
        kl_seq = kl_seq / mask.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_keep = ((advantages >= 0) | (kl_seq <= off_policy_mask_threshold)).to(mask.dtype)

    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        r = torch.exp(log_ratio)
    else:
        r = torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None])

    if beta != 0.0:
        d = ref_per_token_logps - per_token_logps
        kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            kl = kl * r

    if loss_type == "cispo":
        ptl = -torch.clamp(r, max=epsilon_high).detach() * advantages * per_token_logps
    elif loss_type in _CLIPPED_TYPES:
        r_clip = torch.clamp(r, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            r = torch.clamp(r, max=delta)
        ptl = -torch.min(r * advantages, r_clip * advantages)
    elif loss_type == "sapo":
        t = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        ptl = -(torch.sigmoid(t * (r - 1)) * 4 / t) * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            lo = math.log(1e-8)
            s = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            if importance_sampling_ratio is not None:
                s = s + torch.sum(torch.clamp(torch.log(importance_sampling_ratio), lo, 20.0), dim=-1, keepdim=True)
            lw = torch.clamp(s, lo, 20.0)
            pos = advantages >= 0
            k = torch.where(pos, vespo_k_pos, vespo_k_neg)
            lam = torch.where(pos, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * lw - lam * torch.exp(lw)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        ptl = -phi * advantages * per_token_logps
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    if off_policy_mask_threshold is not None:
        ptl = ptl * off_policy_keep
    if entropy_mask is not None:
        ptl = ptl * entropy_mask
    if importance_sampling_ratio is not None and loss_type != "vespo":
        ptl = ptl * importance_sampling_ratio
    if beta != 0.0:
        ptl = ptl + beta * kl

    ga = current_gradient_accumulation_steps if training else 1.0
    if loss_type in ("grpo", "sapo"):
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (ptl * mask).sum() / (ptl.size(0) * max_completion_length) / ga
    elif loss_type == "luspo":
        loss = (ptl * mask).sum(-1).mean() / ga
    else:  # dapo, cispo, vespo
        n = mask.sum() if num_items_in_batch is None else num_items_in_batch
        n = torch.as_tensor(n, dtype=mask.dtype, device=mask.device).clamp(min=1.0) / num_processes
        if training:
            n = n * current_gradient_accumulation_steps / steps_per_generation
        loss = (ptl * mask).sum() / n

    if entropy_coef != 0.0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * ((entropies * eff).sum() / eff.sum().clamp(min=1.0) / ga)
    return loss
