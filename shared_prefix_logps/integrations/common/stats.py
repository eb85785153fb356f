"""What a trainer plug-in did (:class:`PatchStats`) and its once-per-message warnings (:class:`WarnOnce`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .self_check import SelfCheck


@dataclass
class PatchStats:
    """What the patch did so far (cumulative over calls).

    Attributes:
        shared_calls: log-prob calls served by the shared-prefix path.
        fallback_calls: calls handed to the original method; ``fallback_reasons`` counts them per reason.
        rows: completion rows scored by the shared path.
        distinct_prompts: prompts forwarded (rows with identical prompts count once per call).
        tokens_forwarded: real (unpadded) tokens the two-level trie forwards: each distinct prompt once plus every
            completion token. An upper bound: calls whose distinct prompts share a prefix among themselves (a common
            system prompt) take the searched trie, which forwards that prefix once.
        dense_tokens: real tokens the original method forwards for the same calls (every row in full).
        chunked_steps: micro-batches whose backward ran through ``chunked_backward``.
        chunked_calls: ``chunked_backward`` calls (one per group size present in a micro-batch).
        self_checks: every comparison made against the unpatched trainer.
        trivial_self_checks: self-checks postponed because the batch would have compared nothing, per check and
            reason (no valid completion token; chunked mode: a loss gradient that is exactly zero, e.g. every
            advantage 0). Each check runs on the first batch where it is not trivial.
        max_loss_discrepancy: chunked mode: the largest ``|sum of chunk losses - the trainer's loss on the same
        log-probs|``
            relative to ``max(1, |loss|)``, over all chunked steps.
    """

    shared_calls: int = 0
    fallback_calls: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    distinct_prompts: int = 0
    tokens_forwarded: int = 0
    dense_tokens: int = 0
    chunked_steps: int = 0
    chunked_calls: int = 0
    self_checks: list[SelfCheck] = field(default_factory=list)
    trivial_self_checks: dict[str, int] = field(default_factory=dict)
    max_loss_discrepancy: float = 0.0

    def count_fallback(self, reason: str, *, log_prob_call: bool = True) -> None:
        """One more log-prob call (or, with ``log_prob_call=False``, a chunked micro-batch) that went to the trainer's
        own path for ``reason``."""
        if log_prob_call:
            self.fallback_calls += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def count_trivial_check(self, what: str) -> None:
        """One more self-check ``what`` postponed because its batch would have compared nothing."""
        self.trivial_self_checks[what] = self.trivial_self_checks.get(what, 0) + 1

    def record_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> None:
        """Count rows, distinct prompts and real tokens of one trainer-shaped batch ``(N, P + C)``."""
        split = input_ids.shape[1] - logits_to_keep
        valid = attention_mask.bool()
        prompt_valid = valid[:, :split]
        distinct = torch.unique(input_ids[:, :split].masked_fill(~prompt_valid, -1), dim=0)
        self.rows += int(input_ids.shape[0])
        self.distinct_prompts += int(distinct.shape[0])
        self.tokens_forwarded += int((distinct >= 0).sum()) + int(valid[:, split:].sum())
        self.dense_tokens += int(valid.sum())

    def summary(self) -> str:
        """A few human-readable lines."""
        saved = 1.0 - self.tokens_forwarded / self.dense_tokens if self.dense_tokens else 0.0
        lines = [
            f"shared-prefix calls: {self.shared_calls} ({self.rows} rows, {self.distinct_prompts} distinct prompts), "
            f"fallbacks: {self.fallback_calls} {self.fallback_reasons or ''}".rstrip(),
            f"real tokens forwarded: at most {self.tokens_forwarded} instead of {self.dense_tokens} ({saved:.0%} "
            "fewer; a prefix common to several prompts, forwarded once, saves more)",
        ]
        if self.chunked_steps:
            lines.append(
                f"chunked backward: {self.chunked_steps} micro-batches, {self.chunked_calls} chunked_backward calls, "
                f"max |loss - trainer loss| = {self.max_loss_discrepancy:.2e}"
            )
        for what, count in self.trivial_self_checks.items():
            lines.append(f"self-check {what}: postponed on {count} trivial micro-batch(es)")
        for check in self.self_checks:
            entropy = "" if check.max_abs_entropy is None else f", entropy max|diff| {check.max_abs_entropy:.2e}"
            lines.append(
                f"self-check {check.what}: {'passed' if check.passed else 'FAILED'} (max|diff| {check.max_abs:.2e}, "
                f"mean|diff| {check.mean_abs:.2e}{entropy}; tolerance {check.tolerance}) {check.detail}".rstrip()
            )
        return "\n".join(lines)


class WarnOnce:
    """Emit each distinct message once per patch (fallbacks happen every step; one warning is enough)."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, message: str, category=UserWarning) -> None:
        if message not in self.seen:
            self.seen.add(message)
            warnings.warn(message, category, stacklevel=3)
