"""The GRPO-family loss of one micro-batch, composed of named steps:

1. inputs in the loss dtype, the importance ratio and the vLLM correction (``token_weights``);
2. the KL penalty (``token_weights.kl_penalty``), when ``beta != 0``;
3. the policy term of the loss type (``policy_terms.POLICY_TERMS``);
4. masks and corrections on it, then the KL added (``masks``, ``token_weights.weight_tokens``);
5. the sum over valid tokens divided by the loss type's global normalizer (``aggregation``);
6. the entropy bonus (``entropy_bonus``).

``grpo_loss_with_options`` takes the static settings as one ``GRPOLossOptions`` (what trainers build once from their
config); ``grpo_loss`` takes them as keyword arguments and builds that object.
"""

from __future__ import annotations

import torch

from .aggregation import aggregate
from .counts import Count, resolve_count
from .entropy_bonus import entropy_bonus
from .masks import off_policy_sequence_mask
from .options import GRPOLossOptions
from .output import LossOutput, masked_mean
from .policy_terms import POLICY_TERMS, PolicyInputs
from .token_weights import importance_ratio, kl_penalty, log_ratio, vllm_importance_ratio, weight_tokens

__all__ = ["grpo_loss", "grpo_loss_with_options"]


def _check_tensors(
    options: GRPOLossOptions,
    per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None,
    entropies: torch.Tensor | None,
    entropy_mask: torch.Tensor | None,
    num_items_in_batch: Count | None,
    num_entropy_items_in_batch: Count | None,
) -> None:
    """The checks that need the call's tensors (the options checked themselves on construction)."""
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(
            f"per_token_logps {tuple(per_token_logps.shape)} and completion_mask {tuple(completion_mask.shape)} "
            "must both be (B, C)"
        )
    if options.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps")
    if options.entropy_coef != 0.0 and entropies is None:
        raise ValueError("entropy_coef != 0 needs entropies")
    # The bonus's default count with a mask is the micro-batch's own: right for an un-split batch only, and a global
    # num_items_in_batch says the batch is split.
    if (
        options.entropy_coef != 0.0
        and entropy_mask is not None
        and num_items_in_batch is not None
        and num_entropy_items_in_batch is None
    ):
        raise ValueError("with entropy_mask and num_items_in_batch, also pass num_entropy_items_in_batch")


def grpo_loss_with_options(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    options: GRPOLossOptions,
    *,
    ref_per_token_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    num_items_in_batch: Count | None = None,
    num_sequences_in_batch: Count | None = None,
    num_entropy_items_in_batch: Count | None = None,
) -> LossOutput:
    """GRPO-family loss of one micro-batch under ``options``, normalized by global counts.

    Equal, bit for bit, to ``grpo_loss`` with the same settings as keyword arguments; see ``grpo_loss`` for every
    argument. Shapes: ``B`` rows (completions) of this micro-batch, ``C`` its padded width; the loss has
    ``per_token_logps``' dtype (float32 or float64), every other float input is cast to it.

    Args:
        per_token_logps: ``(B, C)`` log pi_theta(token), differentiable.
        old_per_token_logps: ``(B, C)`` sampling-policy log-probs, or None (on-policy).
        advantages: ``(B,)`` or ``(B, C)``.
        completion_mask: ``(B, C)`` 0-1 loss mask.
        options: the static settings.
        ref_per_token_logps: ``(B, C)``, needed when ``options.beta != 0``.
        importance_sampling_ratio: ``(B, C)`` or ``(B, 1)`` vLLM correction, or None.
        sampling_per_token_logps: ``(B, C)`` for the off-policy mask (default ``old_per_token_logps``).
        entropy_mask: ``(B, C)`` bool high-entropy mask, or None.
        entropies: ``(B, C)``, for the ``entropy`` metric and the bonus (needed when ``options.entropy_coef != 0``).
        num_items_in_batch, num_sequences_in_batch, num_entropy_items_in_batch: the global counts (0-dim tensors or
            numbers); None: this micro-batch's own.

    Returns:
        ``LossOutput``.
    """
    if not isinstance(options, GRPOLossOptions):
        raise TypeError(f"options must be a GRPOLossOptions, got {type(options).__name__}")
    _check_tensors(
        options,
        per_token_logps,
        completion_mask,
        ref_per_token_logps,
        entropies,
        entropy_mask,
        num_items_in_batch,
        num_entropy_items_in_batch,
    )

    # 1. Everything in the dtype of the differentiable log-probs; masks as bool (selection) and float (sums).
    logps = per_token_logps
    valid = completion_mask != 0
    maskf = valid.to(logps.dtype)
    old = logps.detach() if old_per_token_logps is None else old_per_token_logps.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1): one advantage per row, broadcast over its tokens
    advantages = advantages.to(logps.dtype)
    is_ratio = vllm_importance_ratio(importance_sampling_ratio, valid, logps)
    token_log_ratio = log_ratio(logps, old, valid)
    ratio = importance_ratio(token_log_ratio, maskf, options.importance_sampling_level)  # (B, C) or (B, 1)

    # 2. KL from the ratio before the policy term sees it (delta's cap is the clipped surrogate's own business).
    per_token_kl = None
    if options.beta != 0.0:
        per_token_kl = kl_penalty(ref_per_token_logps, logps, valid, ratio, options.use_bias_correction_kl)

    # 3. Policy term
    term = POLICY_TERMS[options.loss_type](
        PolicyInputs(
            per_token_logps=logps,
            log_ratio=token_log_ratio,
            ratio=ratio,
            advantages=advantages,
            maskf=maskf,
            importance_sampling_ratio=is_ratio,
        ),
        options,
    )

    # 4. Masks, vLLM correction, KL
    keep_rows = None
    if options.off_policy_mask_threshold is not None:
        sampled = old if sampling_per_token_logps is None else sampling_per_token_logps.to(logps.dtype)
        keep_rows = off_policy_sequence_mask(logps, sampled, advantages, maskf, options.off_policy_mask_threshold)
    per_token_loss = weight_tokens(
        term.per_token_loss,
        keep_rows=keep_rows,
        entropy_mask=entropy_mask,
        importance_sampling_ratio=None if term.applies_importance_sampling_ratio else is_ratio,
        per_token_kl=per_token_kl,
        beta=options.beta,
    )

    # 5. Sum and global normalizer; without counts, this micro-batch's own (= the un-split batch's).
    num_tokens = valid.sum()
    n_tok = resolve_count(num_items_in_batch, num_tokens)
    n_seq = resolve_count(num_sequences_in_batch, torch.tensor(logps.size(0), device=logps.device))
    loss = aggregate(per_token_loss, valid, maskf, n_tok, n_seq, options)
    policy_loss = loss.detach()

    # 6. Entropy metric and bonus
    entropy_metric = None
    if entropies is not None:
        entropy_metric = masked_mean(entropies, maskf)
        if options.entropy_coef != 0.0:
            loss = loss - entropy_bonus(
                entropies,
                maskf,
                entropy_mask,
                entropy_coef=options.entropy_coef,
                num_processes=options.num_processes,
                num_items=n_tok,
                num_entropy_items_in_batch=num_entropy_items_in_batch,
            )

    return LossOutput(
        loss=loss,
        policy_loss=policy_loss,
        num_tokens=num_tokens,
        num_sequences=int(logps.size(0)),
        kl=None if per_token_kl is None else masked_mean(per_token_kl, maskf),
        entropy=entropy_metric,
        **term.metrics,
    )


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
    """GRPO-family loss of one micro-batch, normalized by global counts (formulas: ``losses.aggregation``).

    Builds a ``GRPOLossOptions`` from the settings and calls ``grpo_loss_with_options``; trainers that call the loss
    many times with the same settings build the options once and call that directly.

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
    options = GRPOLossOptions(
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        max_completion_length=max_completion_length,
        num_processes=num_processes,
        importance_sampling_level=importance_sampling_level,
        entropy_coef=entropy_coef,
        off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    return grpo_loss_with_options(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        options,
        ref_per_token_logps=ref_per_token_logps,
        importance_sampling_ratio=importance_sampling_ratio,
        sampling_per_token_logps=sampling_per_token_logps,
        entropy_mask=entropy_mask,
        entropies=entropies,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
        num_entropy_items_in_batch=num_entropy_items_in_batch,
    )
