"""Which layout a call's node calls run: ``backend=`` of the entry points resolved for the model's device and the grad
mode, before the first forward (``dense`` is not a layout: the entry points run the reference instead)."""

from __future__ import annotations

import torch

from . import flash
from .flex import backward_available, compiled_kernels_launch, flex_available


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """The layout for ``backend`` on ``device`` with the current grad mode, at every depth of the trie.

    ``auto`` is ``flex`` on CUDA where its compiled kernels launch (a trial launch, ``kernels.launch_probe``) and
    ``expand`` elsewhere. ``flex`` needs those kernels to launch, and flex_attention's backward, which torch has on
    CUDA only, when gradients are enabled. ``flash`` needs flash-attn's kernels (CUDA, package installed).
    """
    if backend == "flash" and not flash.available(device):
        raise ValueError(flash.unavailable_reason(device))
    if backend == "auto":
        flex_runs = device.type == "cuda" and flex_available(device) and compiled_kernels_launch(device)
        return "flex" if flex_runs else "expand"
    if backend == "flex":
        if not flex_available(device):
            raise ValueError(f"backend='flex' needs torch's flex_attention on {device.type}")
        if not compiled_kernels_launch(device):
            from ..kernels.launch_probe import cuda_launch_status

            raise ValueError(
                "backend='flex' compiles flex_attention into Triton kernels, which cannot launch here "
                f"({cuda_launch_status(device).reason}); use backend='expand'"
            )
        if torch.is_grad_enabled() and not backward_available(device):
            raise ValueError(
                "backend='flex' has no backward on CPU (torch's flex_attention); use backend='expand', or call "
                "under torch.no_grad() for scoring"
            )
    return backend
