"""GRPO-family policy losses on per-token log-probs, normalized by *global* counts.

Every loss type of TRL 1.16's ``GRPOTrainer._compute_loss`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``,
``sapo``, ``luspo``, ``vespo``) is computed here from tensors alone, with the same argument names as TRL's quantities.

Why a separate implementation: TRL normalizes several loss types per micro-batch (a per-sequence mean then a batch
mean, or a token mean over the micro-batch), then divides by the number of accumulation steps. That makes the
gradient depend on how the batch was cut into micro-batches (verl#906, transformers#34191, trl#3231). Here every
normalizer is a count taken over the *whole* optimizer step (all micro-batches, all accumulation steps, all
processes) and passed in, so that

    sum over micro-batches of grpo_loss(micro-batch, global counts)  ==  grpo_loss(full batch)

for the loss value and its gradient, whatever the split (rows of a batch never interact in these losses: importance
ratios, clipping, KL, sequence means and VESPO's weights are all per row).

Global-normalized variants (``S`` = sum over the local micro-batch, ``N_tok`` = ``num_items_in_batch``,
``N_seq`` = ``num_sequences_in_batch``, ``L`` = ``max_completion_length``, ``l_i`` = valid tokens of row ``i``,
``B`` = rows of the micro-batch, ``GA`` = accumulation steps, ``W`` = processes, ``SPG`` = steps_per_generation):

=================  ==================================  ===============================================================
loss type          this module (per micro-batch)       TRL 1.16 ``_compute_loss`` (per micro-batch)
=================  ==================================  ===============================================================
dapo/cispo/vespo   ``S_i,t loss_it / N_tok``           ``S_i,t loss_it / (N_gen / W * GA / SPG)``, ``N_gen`` = tokens
                                                       of the generation batch: global already when ``SPG == GA``
bnpo               ``S_i,t loss_it / N_tok`` (= dapo)  ``S_i,t loss_it / (tokens of the micro-batch) / GA``
grpo, sapo         ``S_i (S_t loss_it / l_i) / N_seq`` ``mean_i (S_t loss_it / l_i) / GA``
dr_grpo            ``S_i,t loss_it / (N_seq * L)``     ``S_i,t loss_it / (B * L) / GA``
luspo              ``S_i,t loss_it / N_seq``           ``mean_i (S_t loss_it) / GA``
=================  ==================================  ===============================================================

On one un-split batch (GA = 1, one process, counts = that batch's counts) both columns are equal (the tests check it
against a transcription of TRL's formula); the TRL plug-in's ``micro_batch_counts`` gives the counts under which
``grpo_loss`` reproduces TRL's loss of one micro-batch exactly (e.g. to split that micro-batch into chunks). ``bnpo``
differs from ``dapo`` in TRL only by being normalized per micro-batch; made global, it *is* ``dapo``.

Distributed data parallel (DDP, FSDP, DeepSpeed) *averages* gradients over processes. Pass ``num_processes`` = the
world size and the loss is multiplied by it, so that the averaged gradient is the gradient of the global loss (TRL
does the same by dividing ``num_items_in_batch`` by ``accelerator.num_processes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "LOSS_TYPES",
    "LossOutput",
    "global_sequence_count",
    "global_token_count",
    "grpo_loss",
    "high_entropy_mask",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# PPO-style clipped surrogate min(r * A, clip(r) * A)
_CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Normalizer families of the global variants (see the module docstring)
_PER_SEQUENCE_MEAN = ("grpo", "sapo")
_PER_TOKEN = ("bnpo", "dapo", "cispo", "vespo")

Count = torch.Tensor | int | float


# ---------------------------------------------------------------------------------------------------------------------
# Global counts
# ---------------------------------------------------------------------------------------------------------------------


def _all_reduce_sum(value: torch.Tensor, process_group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=process_group)
    return value


def _as_mask_list(completion_mask: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    masks = [completion_mask] if isinstance(completion_mask, torch.Tensor) else list(completion_mask)
    if not masks:
        raise ValueError("expected at least one completion mask")
    return masks


def global_token_count(completion_mask: torch.Tensor | Sequence[torch.Tensor], *, process_group=None) -> torch.Tensor:
    """Number of valid (loss) tokens over the whole optimizer step: all micro-batches, all processes.

    Args:
        completion_mask: ``(B, C)`` bool/int/float 0-1 loss mask of one micro-batch, or a sequence of such masks
            (the micro-batches of one accumulation window on this process; widths may differ). In TRL terms this
            is ``completion_mask * tool_mask`` (tool-output tokens carry no loss).
        process_group: group to all-reduce over when ``torch.distributed`` is initialized (default: the world).

    Returns:
        0-dim int64 tensor on the first mask's device, identical on every process. It is the ``num_items_in_batch``
        of ``grpo_loss``. Every process must call this collectively (same number of calls, same order). With NCCL
        the masks must be on the GPU.
    """
    masks = _as_mask_list(completion_mask)
    total = torch.zeros((), dtype=torch.int64, device=masks[0].device)
    for mask in masks:
        total += (mask != 0).sum().to(device=total.device)
    return _all_reduce_sum(total, process_group)


def global_sequence_count(
    completion_mask: torch.Tensor | Sequence[torch.Tensor], *, process_group=None
) -> torch.Tensor:
    """Number of rows (completions) over the whole optimizer step: all micro-batches, all processes.

    Rows whose mask is all zero still count, as in TRL (``mask.sum(-1).clamp(min=1)`` then a mean over all rows).

    Args:
        completion_mask: ``(B, C)`` mask of one micro-batch, or a sequence of them (only ``size(0)`` is read).
        process_group: group to all-reduce over when ``torch.distributed`` is initialized.

    Returns:
        0-dim int64 tensor, the ``num_sequences_in_batch`` of ``grpo_loss``.
    """
    masks = _as_mask_list(completion_mask)
    total = torch.tensor(sum(int(m.size(0)) for m in masks), dtype=torch.int64, device=masks[0].device)
    return _all_reduce_sum(total, process_group)


def high_entropy_mask(
    entropies: torch.Tensor, completion_mask: torch.Tensor, top_entropy_quantile: float, *, process_group=None
) -> torch.Tensor:
    """Keep the top-``top_entropy_quantile`` fraction of valid tokens by entropy (TRL's ``top_entropy_quantile``).

    The threshold is the ``1 - top_entropy_quantile`` quantile (linear interpolation, ``torch.quantile``) of the
    entropies of all valid tokens, gathered over ``process_group`` when ``torch.distributed`` is initialized, as in
    TRL's ``GRPOTrainer.get_high_entropy_mask``. TRL evaluates it per micro-batch (across processes), so its mask
    depends on the micro-batch split; to stay split-invariant compute it once over the whole accumulation window
    (e.g. pass the concatenated entropies) and slice the result.

    Args:
        entropies: ``(B, C)`` float per-token entropies (any float dtype; read without gradient).
        completion_mask: ``(B, C)`` 0-1 loss mask.
        top_entropy_quantile: ``rho`` in [0, 1]; 1.0 keeps every valid token.

    Returns:
        ``(B, C)`` bool mask, False on padding. ``torch.quantile`` limits the gathered size to 2**24 tokens.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    valid = completion_mask != 0
    values = entropies.detach()[valid].float()
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(process_group)
        sizes = [torch.zeros((), dtype=torch.int64, device=values.device) for _ in range(world)]
        dist.all_gather(
            sizes, torch.tensor(values.numel(), dtype=torch.int64, device=values.device), group=process_group
        )
        longest = max(int(s) for s in sizes)
        padded = values.new_zeros(longest)
        padded[: values.numel()] = values
        parts = [values.new_zeros(longest) for _ in range(world)]
        dist.all_gather(parts, padded, group=process_group)
        values = torch.cat([p[: int(s)] for p, s in zip(parts, sizes, strict=True)])
    if values.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    # Compare in the entropies' own dtype (TRL compares float64 entropies against the float32 quantile promoted)
    return (entropies.detach() >= threshold.to(entropies.dtype)) & valid


# ---------------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class LossOutput:
    """Result of ``grpo_loss``.

    ``loss`` carries the gradient; everything else is detached. Metrics are means over this call's (micro-batch's)
    valid tokens; ``num_tokens`` / ``num_sequences`` let callers combine them over micro-batches and processes.
    Sequence-level quantities (``importance_sampling_level="sequence"``, VESPO's weights) are means over rows.

    Attributes:
        loss: 0-dim, dtype of ``per_token_logps``: the term to call ``backward`` on.
        policy_loss: ``loss`` before the entropy bonus (TRL's ``policy_loss`` metric), detached.
        num_tokens: 0-dim int64, valid tokens in this call.
        num_sequences: rows in this call.
        kl: mean per-token KL(pi || pi_ref) (k3 estimator, after the optional importance-ratio correction),
            None when ``beta == 0``.
        entropy: mean entropy over valid tokens, None when ``entropies`` was not given.
        clip_ratio_low / clip_ratio_high / clip_ratio_region: fraction of tokens whose ratio left the trust region on
            the side that cuts the gradient (ratio < 1 - eps_low with A < 0, ratio > 1 + eps_high with A > 0, either).
            Clipped loss types only.
        cispo_clip_ratio: fraction with ratio > epsilon_high and A > 0 (``cispo`` only).
        phi_seq_mean: mean VESPO gamma weight (``vespo`` only).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    num_tokens: torch.Tensor
    num_sequences: int
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    clip_ratio_low: torch.Tensor | None = None
    clip_ratio_high: torch.Tensor | None = None
    clip_ratio_region: torch.Tensor | None = None
    cispo_clip_ratio: torch.Tensor | None = None
    phi_seq_mean: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """The metrics under TRL 1.16's metric names (``kl``, ``clip_ratio/low_mean`` ...), as Python floats."""
        names = {
            "policy_loss": self.policy_loss,
            "kl": self.kl,
            "entropy": self.entropy,
            "clip_ratio/low_mean": self.clip_ratio_low,
            "clip_ratio/high_mean": self.clip_ratio_high,
            "clip_ratio/region_mean": self.clip_ratio_region,
            "cispo_clip_ratio": self.cispo_clip_ratio,
            "vespo/phi_seq_mean": self.phi_seq_mean,
        }
        return {k: float(v) for k, v in names.items() if v is not None}


def _vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    maskf: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's per-sequence gamma weight phi(w) = exp(lambda) * w**k * exp(-lambda * w), w the sequence ratio.

    ``w`` = exp(sum_t log(pi/pi_old)) (a product over tokens, not a mean), times the vLLM importance ratio when
    given; logs clamped to [log 1e-8, 20] as TRL does. Computed without gradient: phi only rescales the
    REINFORCE-style term ``-phi * A * logp``. Returns ``(B, 1)``.
    """
    with torch.no_grad():
        floor = math.log(1e-8)
        seq_log_w = (log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)
        if importance_sampling_ratio is not None:
            # Clamp the log, not the ratio: a ratio of exactly 0 (masked by vLLM IS) must give log = floor, not -inf.
            # TRL sums over all positions; its ratio is exactly 1 at padding (log 0). Summing over valid tokens only
            # gives the same number there and keeps the weight independent of how wide the micro-batch is padded.
            is_log = torch.log(importance_sampling_ratio.to(maskf.dtype)).clamp(floor, 20.0)
            if is_log.size(-1) == maskf.size(-1):
                is_log = is_log * maskf
            seq_log_w = seq_log_w + is_log.sum(-1, keepdim=True)
        log_w = seq_log_w.clamp(floor, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _masked_mean(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens of a ``(B, C)`` tensor, or over rows of a ``(B, 1)`` sequence-level one."""
    x = x.detach().to(maskf.dtype)
    if x.size(-1) == 1:  # TRL's rule: a width-1 tensor is one value per sequence, averaged over rows
        return x.mean() if x.numel() else x.new_zeros(())
    return torch.where(maskf != 0, x, torch.zeros_like(x)).sum() / maskf.sum().clamp(min=1.0)


def _count(value: Count | None, fallback: torch.Tensor) -> torch.Tensor | float:
    if value is None:
        return fallback
    if isinstance(value, torch.Tensor):
        return value.detach()
    return float(value)


def grpo_loss(
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
    num_items_in_batch: Count | None = None,
    num_sequences_in_batch: Count | None = None,
    max_completion_length: int | None = None,
    num_processes: int = 1,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_entropy_items_in_batch: Count | None = None,
    off_policy_mask_threshold: float | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> LossOutput:
    """GRPO-family loss of one micro-batch, normalized by global counts (see the module docstring for formulas).

    Shapes: ``B`` rows (completions) of this micro-batch, ``C`` completion positions (this micro-batch's padded
    width). Log-prob tensors are float (float32 or float64; the loss has ``per_token_logps``' dtype).

    Args:
        per_token_logps: ``(B, C)`` log pi_theta(token), differentiable. Values at masked positions are ignored.
        old_per_token_logps: ``(B, C)`` log-probs of the policy that sampled (TRL's ``old_per_token_logps``), no
            gradient; None means on-policy (``per_token_logps.detach()``, as TRL does when it skips them).
        advantages: ``(B,)`` or ``(B, C)`` float, no gradient.
        completion_mask: ``(B, C)`` 0-1 (bool/int/float) loss mask: right-padded completion mask, times TRL's
            ``tool_mask`` in multi-turn runs. Masks come from attention masks, never from token ids.
        loss_type: one of ``LOSS_TYPES`` (TRL ``loss_type``).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (TRL ``epsilon`` and
            ``epsilon_high``); for ``cispo`` ``epsilon_high`` is the cap on the ratio itself (epsilon_max, e.g. 5).
        delta: INTELLECT-2 two-sided clipping: the unclipped ratio is also capped at ``delta`` (TRL ``delta``).
        beta: KL coefficient. Needs ``ref_per_token_logps`` ``(B, C)`` when non-zero.
        use_bias_correction_kl: multiply the k3 KL estimate ``exp(ref - logp) - (ref - logp) - 1`` by the
            (differentiable) importance ratio, as TRL 1.16 does by default.
        num_items_in_batch: global number of valid tokens in the optimizer step (``global_token_count`` over all
            micro-batches of the accumulation window and all processes). Normalizer of ``dapo``/``bnpo``/``cispo``/
            ``vespo``. Default: this micro-batch's count (= the un-split full batch). TRL's own
            ``num_items_in_batch`` spans a generation batch; when ``steps_per_generation == gradient_accumulation_
            steps`` (TRL's default) the two are the same number.
        num_sequences_in_batch: global number of rows in the optimizer step (``global_sequence_count``). Normalizer
            of ``grpo``/``sapo``/``dr_grpo``/``luspo``. Default: ``B``.
        max_completion_length: TRL's ``max_completion_length``; required by ``dr_grpo``.
        num_processes: world size when the gradients are averaged over processes (DDP/FSDP/DeepSpeed), else 1.
            The loss is multiplied by it so that the averaged gradient is the global gradient.
        importance_sampling_level: ``"token"`` (one ratio per token) or ``"sequence"`` (GSPO: one ratio per row,
            ``exp`` of the mean token log-ratio).
        importance_sampling_ratio: ``(B, C)`` or ``(B, 1)`` vLLM truncated/masked importance-sampling correction
            ``pi_old / pi_sampler`` (TRL ``inputs["importance_sampling_ratio"]``), no gradient. Multiplies the per-token
            policy loss; for ``vespo`` it enters the gamma weight instead.
        entropy_mask: ``(B, C)`` bool, keep only these tokens in the policy term (``high_entropy_mask``). The KL term
            is not masked by it (as in TRL).
        entropies: ``(B, C)`` per-token entropies, for the ``entropy`` metric and the entropy bonus.
        entropy_coef: entropy bonus coefficient: ``loss -= entropy_coef * mean entropy`` over valid tokens (over
            ``entropy_mask`` tokens when given). Differentiable through ``entropies``.
        num_entropy_items_in_batch: global count of the tokens the bonus averages over; defaults to
            ``num_items_in_batch`` without ``entropy_mask``, required with it (count the mask globally).
        off_policy_mask_threshold: DeepSeek-V3.2 off-policy sequence masking: drop rows with A < 0 whose mean
            ``sampling_logp - logp`` exceeds the threshold. ``sampling_per_token_logps`` ``(B, C)`` defaults to
            ``old_per_token_logps``.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures for A > 0 and A <= 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO gamma-weight parameters (A >= 0 / A < 0).

    Returns:
        ``LossOutput``; ``loss`` summed over all micro-batches (and averaged over processes with
        ``num_processes`` set) equals the loss of the whole batch, and so do the gradients.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(
            f"per_token_logps {tuple(per_token_logps.shape)} and completion_mask {tuple(completion_mask.shape)} "
            "must both be (B, C)"
        )
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    if entropy_coef != 0.0 and entropies is None:
        raise ValueError("entropy_coef != 0 needs entropies")

    logps = per_token_logps
    valid = completion_mask != 0
    maskf = valid.to(logps.dtype)
    old = logps.detach() if old_per_token_logps is None else old_per_token_logps.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    if importance_sampling_ratio is not None:
        importance_sampling_ratio = importance_sampling_ratio.to(logps.dtype)
        if importance_sampling_ratio.shape == valid.shape:  # token-level: neutral (1) at padding, whatever it held
            importance_sampling_ratio = torch.where(valid, importance_sampling_ratio, torch.ones_like(logps))

    # Padded positions may hold anything (0, NaN from a sampler, garbage): force their log-ratio to 0 so that
    # exp() stays finite there, since 0 * inf would poison both the sum and its gradient.
    log_ratio = torch.where(valid, logps - old, torch.zeros_like(logps))
    if importance_sampling_level == "token":
        log_weight = log_ratio
    else:
        log_weight = (log_ratio.sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    ratio = torch.exp(log_weight)  # (B, C) or (B, 1)

    per_token_kl = None
    if beta != 0.0:
        ref_minus = torch.where(valid, ref_per_token_logps.to(logps.dtype) - logps, torch.zeros_like(logps))
        per_token_kl = torch.exp(ref_minus) - ref_minus - 1.0  # k3: unbiased, always >= 0
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio

    out_metrics: dict[str, torch.Tensor] = {}
    if loss_type in _CLIPPED_TYPES:
        clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:
            ratio = ratio.clamp(max=delta)
        per_token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
        low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        out_metrics["clip_ratio_low"] = _masked_mean(low.to(logps.dtype), maskf)
        out_metrics["clip_ratio_high"] = _masked_mean(high.to(logps.dtype), maskf)
        out_metrics["clip_ratio_region"] = _masked_mean((low | high).to(logps.dtype), maskf)
    elif loss_type == "cispo":
        # Clip the (detached) importance weight, keep the REINFORCE gradient through logp for every token
        per_token_loss = -ratio.clamp(max=epsilon_high).detach() * advantages * logps
        hit = (ratio > epsilon_high) & (advantages > 0)
        out_metrics["cispo_clip_ratio"] = _masked_mean(hit.to(logps.dtype), maskf)
    elif loss_type == "sapo":
        tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg).to(logps.dtype)
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        per_token_loss = -gate * advantages
    else:  # vespo
        phi = _vespo_weights(
            advantages,
            log_ratio,
            maskf,
            importance_sampling_ratio,
            vespo_k_pos,
            vespo_lambda_pos,
            vespo_k_neg,
            vespo_lambda_neg,
        )
        per_token_loss = -phi * advantages * logps
        out_metrics["phi_seq_mean"] = _masked_mean(phi, maskf)

    if off_policy_mask_threshold is not None:
        sampled = old if sampling_per_token_logps is None else sampling_per_token_logps.to(logps.dtype)
        drift = torch.nan_to_num(sampled - logps.detach(), nan=0.0) * maskf
        mean_drift = drift.sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
        keep = (advantages >= 0) | (mean_drift <= off_policy_mask_threshold)
        per_token_loss = per_token_loss * keep.to(logps.dtype)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.to(logps.dtype)
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl

    # Aggregate. per_token_loss is (B, C) or, at sequence level with nothing per-token mixed in, (B, 1): broadcast
    # against the mask first so that every loss type sums over valid tokens only.
    masked = torch.where(valid, per_token_loss.expand_as(logps), torch.zeros_like(logps))
    num_tokens = valid.sum()
    n_tok = _count(num_items_in_batch, num_tokens)
    n_seq = _count(num_sequences_in_batch, torch.tensor(logps.size(0), device=logps.device))
    if loss_type in _PER_TOKEN:
        total, denom = masked.sum(), n_tok
    elif loss_type in _PER_SEQUENCE_MEAN:
        total, denom = (masked.sum(-1) / maskf.sum(-1).clamp(min=1.0)).sum(), n_seq
    elif loss_type == "dr_grpo":
        total, denom = masked.sum(), n_seq * max_completion_length
    else:  # luspo: each row weighted by its length, mean over rows
        total, denom = masked.sum(), n_seq
    if isinstance(denom, torch.Tensor):
        denom = denom.to(device=logps.device, dtype=logps.dtype).clamp(min=1.0)
    else:
        denom = max(float(denom), 1.0)
    loss = total * num_processes / denom
    policy_loss = loss.detach()

    entropy_metric = None
    if entropies is not None:
        entropy_metric = _masked_mean(entropies, maskf)
        if entropy_coef != 0.0:
            bonus_mask = maskf if entropy_mask is None else maskf * entropy_mask.to(logps.dtype)
            if num_entropy_items_in_batch is None:
                if entropy_mask is not None and num_items_in_batch is not None:
                    raise ValueError("with entropy_mask and num_items_in_batch, also pass num_entropy_items_in_batch")
                n_ent = n_tok if entropy_mask is None else bonus_mask.sum()
            else:
                n_ent = _count(num_entropy_items_in_batch, num_tokens)
            if isinstance(n_ent, torch.Tensor):
                n_ent = n_ent.to(device=logps.device, dtype=logps.dtype).clamp(min=1.0)
            else:
                n_ent = max(float(n_ent), 1.0)
            ent_sum = torch.where(bonus_mask != 0, entropies.to(logps.dtype), torch.zeros_like(logps)).sum()
            loss = loss - entropy_coef * ent_sum * num_processes / n_ent

    return LossOutput(
        loss=loss,
        policy_loss=policy_loss,
        num_tokens=num_tokens,
        num_sequences=int(logps.size(0)),
        kl=None if per_token_kl is None else _masked_mean(per_token_kl, maskf),
        entropy=entropy_metric,
        **out_metrics,
    )
