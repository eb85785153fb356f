"""Random forwards in training mode (dropout, attention dropout, MoE router jitter), and the warning the entry points
give when one is active.

A shared prefix is forwarded once, so whatever a random forward draws on its tokens (a dropout mask on its hidden
states or keys/values, its attention dropout, a router's jitter) is drawn once and shared by every row that continues
it: a prompt's by its G completions. Full rows draw it once per row. Each row still sees a valid draw (its log-probs
are a sample of the same random forward), but the rows of a prefix are no longer independent samples, so results and
gradients differ from the dense path's, and their variance across a group is lower. The entry points accept such a
call (the trainer plug-ins run the shared path in training mode and compare with their trainer in eval mode,
``integrations/common/modules.py``) and say so with a :class:`~shared_prefix_logps.errors.SharedDropoutWarning`.
"""

from __future__ import annotations

import warnings

from torch import nn

from ..errors import SharedDropoutWarning


def dropout_source(model: nn.Module) -> str | None:
    """What makes a forward of ``model`` in its current mode random, or None: the first module in training mode that
    is a dropout module with ``p > 0``, has a config with ``attention_dropout > 0`` (transformers' attention functions
    apply it in training mode), or an MoE block with router ``jitter_noise > 0`` (Mixtral, PhiMoE)."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        where = f"{type(module).__name__} at {name or 'the model'}"
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{where} with p={module.p}"
        config = getattr(module, "config", None)
        rate = float(getattr(config, "attention_dropout", 0.0) or 0.0) if config is not None else 0.0
        if rate > 0:
            return f"attention_dropout={rate} in the config of {where}"
        jitter = getattr(module, "jitter_noise", 0.0)
        if isinstance(jitter, (int, float)) and jitter > 0:
            return f"router jitter_noise={jitter} of {where}"
    return None


def dropout_active(model: nn.Module) -> bool:
    """Whether a forward of ``model`` in its current mode is random (:func:`dropout_source`)."""
    return dropout_source(model) is not None


def warn_if_dropout_shared(model: nn.Module, entry: str) -> None:
    """Warn (:class:`~shared_prefix_logps.errors.SharedDropoutWarning`) when a forward of ``model`` is random: the
    shared-prefix path of ``entry`` (the entry point's name) shares each prefix's draw with the rows that continue it.
    The warning points at the entry point's caller (Python shows it once per calling line by default)."""
    source = dropout_source(model)
    if source is None:
        return
    warnings.warn(
        f"{entry}: dropout is active ({source}; the model is in training mode). Each shared prefix is forwarded once, "
        "so its dropout is drawn once and shared by every row that continues it (a prompt's by its G completions), "
        "where full rows would draw it per row: log-probs and gradients are then not those of independent rows. "
        "Call model.eval() or set the dropout to 0 for the dense path's numbers; filter SharedDropoutWarning to "
        "accept the shared draw.",
        SharedDropoutWarning,
        stacklevel=3,
    )
