"""DistributedDataParallel helpers for plug-ins whose several backwards per micro-batch must not each all-reduce:
the core's (:mod:`shared_prefix_logps.distributed.ddp`), plus the module inside the wrapper."""

from __future__ import annotations

from torch import nn

from ...distributed.ddp import average_gradients

__all__ = ["average_gradients", "unwrap_ddp"]


def unwrap_ddp(model: nn.Module) -> tuple[nn.Module, nn.parallel.DistributedDataParallel | None]:
    """``(module inside DDP, the DDP wrapper)`` or ``(model, None)``."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, model
    return model, None
