"""Comparing the shared path's results with the trainer's own on the same batch (a plug-in's self-check)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SelfCheckError(RuntimeError):
    """The shared-prefix result differs from what the unpatched trainer computes on the same batch."""


@dataclass
class SelfCheck:
    """One comparison against the unpatched trainer.

    Attributes:
        what: which computation was compared (e.g. ``"logps (no grad)"``, ``"chunked loss"``).
        max_abs: largest absolute difference of the compared quantity (log-probs, or the loss gradient w.r.t. them).
        mean_abs: mean absolute difference over valid completion tokens.
        max_abs_entropy: largest absolute entropy difference, when entropies were compared.
        tolerance: ``(max_abs, mean_abs)`` bounds the check used.
        passed: whether both bounds held.
        detail: free text (shapes, the loss values compared ...).
    """

    what: str
    max_abs: float
    mean_abs: float
    max_abs_entropy: float | None
    tolerance: tuple[float, float]
    passed: bool
    detail: str = ""


def default_tolerance(compute_dtype: torch.dtype) -> tuple[float, float]:
    """``(max_abs, mean_abs)`` bounds for log-probs/entropies of the shared path against the trainer's own.

    In float32 the two differ only by summation order and by a trainer's ``arange`` positions (TRL) on left-padded rows
    (a uniform RoPE shift, 1e-6 level). In half precision every token's rounding differs (DESIGN: trl#6789), so only
    gross errors (a wrong temperature, softcap or prefix) are caught: those move the mean by far more than 0.05.
    """
    if compute_dtype in (torch.float32, torch.float64):
        return (1e-3, 1e-4)
    return (1.0, 0.05)


def compare(
    what: str,
    ours: torch.Tensor,
    reference: torch.Tensor,
    valid: torch.Tensor,
    tolerance: tuple[float, float],
    ours_entropy: torch.Tensor | None = None,
    reference_entropy: torch.Tensor | None = None,
    detail: str = "",
) -> SelfCheck:
    """Compare ``(N, C)`` tensors at the ``valid`` positions (and the entropies, with the same bounds)."""
    diff = (ours.detach().double() - reference.detach().double()).abs()
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    count = max(int(valid.sum()), 1)
    max_abs, mean_abs = float(diff.max()) if diff.numel() else 0.0, float(diff.sum()) / count
    passed = max_abs <= tolerance[0] and mean_abs <= tolerance[1]
    max_abs_entropy = None
    if ours_entropy is not None and reference_entropy is not None:
        ediff = (ours_entropy.detach().double() - reference_entropy.detach().double()).abs()
        ediff = torch.where(valid, ediff, torch.zeros_like(ediff))
        max_abs_entropy = float(ediff.max()) if ediff.numel() else 0.0
        passed = passed and max_abs_entropy <= tolerance[0] and float(ediff.sum()) / count <= tolerance[1]
    # NaN anywhere fails the check (comparisons with NaN are False)
    return SelfCheck(what, max_abs, mean_abs, max_abs_entropy, tolerance, bool(passed), detail)
