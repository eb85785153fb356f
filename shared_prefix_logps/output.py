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
        router: MoE models, when requested (``return_router_stats=True``): each row's router statistics over its full
            row ``[prompt | completion]``, a :class:`~shared_prefix_logps.moe_router.RouterStats`;
            ``router.aux_loss(rows)`` is the model's own load-balancing ``aux_loss`` of those rows. None otherwise.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor
    router: object = None

    def detach(self) -> LogpsOutput:
        """The same output cut from the autograd graph."""
        return LogpsOutput(
            logps=self.logps.detach(),
            entropy=None if self.entropy is None else self.entropy.detach(),
            mask=self.mask,
            router=None if self.router is None else self.router.detach(),
        )


def result_zeros(*shape: int, device) -> torch.Tensor:
    """float32 zeros of ``shape`` on ``device``, to write row results into. The dtype is explicit: under
    ``torch.set_default_dtype(torch.float64)`` plain ``torch.zeros`` would make the outputs float64 and refuse the
    float32 results written into them."""
    return torch.zeros(*shape, dtype=torch.float32, device=device)
