"""Module-level helpers a plug-in wraps the trainer's model with: mixed-precision forwards, dropout detection (the
core's, ``model/dropout.py``, which the entry points warn with), temporary eval mode."""

from __future__ import annotations

from torch import nn

from ...distributed.lockstep import eval_mode
from ...model.dropout import dropout_active

__all__ = ["AutocastForward", "dropout_active", "eval_mode"]


class AutocastForward(nn.Module):
    """Runs the wrapped model's forward under ``autocast()`` (accelerate's mixed-precision context), nothing else.

    Trainers on accelerate (TRL) run the model's forward inside ``accelerator.autocast()`` and its backward outside.
    Wrapping the model (instead of the whole call) keeps that split when forward and backward interleave (chunked
    backward). To ``shared_prefix_logps`` it looks like a DDP wrapper (a ``module`` child, no ``config``): the causal LM
    is found inside, and every call still goes through the wrapped module's own forward.
    """

    def __init__(self, module: nn.Module, autocast):
        super().__init__()
        self.module = module
        self._autocast = autocast

    def forward(self, *args, **kwargs):
        with self._autocast():
            return self.module(*args, **kwargs)
