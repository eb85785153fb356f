"""Which layout a call's node calls run: ``backend=`` of the entry points resolved for the model's device and the grad
mode, before the first forward (``dense`` is not a layout: the entry points run the reference instead)."""

from __future__ import annotations

import torch

from . import flash
from .flex import backward_available, flex_available


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """The layout for ``backend`` on ``device`` with the current grad mode, at every depth of the trie.

    ``auto`` is ``flex`` on CUDA and ``expand`` elsewhere. ``flex`` needs flex_attention's backward, which torch has
    on CUDA only, when gradients are enabled. ``flash`` needs flash-attn's kernels (CUDA, package installed).
    """
    if backend == "flash" and not flash.available(device):
        raise ValueError(flash.unavailable_reason(device))
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available(device) else "expand"
    if backend == "flex":
        if not flex_available(device):
            raise ValueError(f"backend='flex' needs torch's flex_attention on {device.type}")
        if torch.is_grad_enabled() and not backward_available(device):
            raise ValueError(
                "backend='flex' has no backward on CPU (torch's flex_attention); use backend='expand', or call "
                "under torch.no_grad() for scoring"
            )
    return backend
