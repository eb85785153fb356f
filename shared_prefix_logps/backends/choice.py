"""Which layout a call's node calls run: ``backend=`` of the entry points resolved for the model's device and the grad
mode, before the first forward (``dense`` is not a layout: the entry points run the reference instead), from the
layout table (``layouts.py``)."""

from __future__ import annotations

import torch

from .layouts import LAYOUTS, layout, layout_module


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """The layout for ``backend`` on ``device`` with the current grad mode, at every depth of the trie.

    ``auto`` is the available layout of lowest ``auto_rank`` among those ``auto`` may take on ``device``'s type:
    ``flex`` on CUDA where its compiled kernels launch (a trial launch, ``kernels.launch_probe``), ``expand``
    elsewhere. An explicit layout that cannot run here (its module's ``unavailable``: ``flex`` needs its kernels to
    launch and, with gradients, flex_attention's backward, which torch has on CUDA only; ``flash`` needs flash-attn's
    kernels) raises a ValueError with the reason.
    """
    needs_grad = torch.is_grad_enabled()
    if backend == "auto":
        candidates = sorted((row for row in LAYOUTS if row.auto_rank is not None), key=lambda row: row.auto_rank)
        for row in candidates:
            if row.auto_devices is not None and device.type not in row.auto_devices:
                continue
            if layout_module(row.name).unavailable(device, needs_grad) is None:
                return row.name
        raise ValueError(f"backend='auto': no attention layout runs on {device.type}")
    reason = layout_module(layout(backend).name).unavailable(device, needs_grad)
    if reason is not None:
        raise ValueError(reason)
    return backend
