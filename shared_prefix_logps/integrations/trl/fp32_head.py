"""TRL's ``cast_lm_head_to_fp32`` under the shared path: the lm_head proxy computes in float32 outside autocast."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu")


def install_fp32_head(lm_head: nn.Module) -> bool:
    """Make the shared path's head compute in float32 outside autocast, as TRL's ``cast_lm_head_to_fp32`` head does.

    Must run after ``prepare_model`` installed its lm_head proxy: it wraps that proxy, casting the hidden states
    to float32 and disabling autocast around it. Outside a node call the proxy calls TRL's own float32 forward, which
    does the same, so ordinary forwards are unchanged. Returns False if the shim was already there.
    """
    if getattr(lm_head, "_trl_fp32_shim_previous", None) is not None:
        return False
    previous = lm_head.forward

    def forward(hidden_states, *args, **kwargs):
        device_type = hidden_states.device.type
        guard = (
            torch.autocast(device_type, enabled=False) if device_type in _AUTOCAST_DEVICES else contextlib.nullcontext()
        )
        with guard:
            return previous(hidden_states.float(), *args, **kwargs)

    lm_head._trl_fp32_shim_previous = previous
    lm_head.forward = forward
    return True


def remove_fp32_head(lm_head: nn.Module) -> None:
    """Undo :func:`install_fp32_head`."""
    previous = getattr(lm_head, "_trl_fp32_shim_previous", None)
    if previous is not None:
        lm_head.forward = previous
        del lm_head._trl_fp32_shim_previous
