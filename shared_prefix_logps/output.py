"""The result type of every entry point."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogpsOutput:
    """Per-token log-probs of completion tokens.

    Attributes:
        logps: (rows, C) float32 log-probs of each completion token given everything before it; differentiable
            when gradients are enabled; 0.0 where ``mask`` is False.
        entropy: (rows, C) float32 entropy of each position's tempered next-token distribution (0.0 where masked),
            or None when it was not requested.
        mask: (rows, C) bool, True on valid completion tokens.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor

    def detach(self) -> LogpsOutput:
        """The same output cut from the autograd graph."""
        return LogpsOutput(
            logps=self.logps.detach(),
            entropy=None if self.entropy is None else self.entropy.detach(),
            mask=self.mask,
        )
