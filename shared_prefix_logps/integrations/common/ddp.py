"""DistributedDataParallel helpers: the module inside the wrapper, and the gradient averaging DDP does at a
synchronizing backward, for plug-ins whose several backwards per micro-batch must not each all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def unwrap_ddp(model: nn.Module) -> tuple[nn.Module, nn.parallel.DistributedDataParallel | None]:
    """``(module inside DDP, the DDP wrapper)`` or ``(model, None)``."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, model
    return model, None


def average_gradients(parameters: list[nn.Parameter], process_group=None, bucket_bytes: int = 25 * 2**20) -> None:
    """All-reduce-average ``.grad`` over processes, as DDP does at a synchronizing backward.

    Every process passes the same parameters in the same order; a missing gradient counts as zeros (and becomes a
    zero tensor), so processes never disagree on the number of collectives.
    """
    world = dist.get_world_size(process_group)
    grads = []
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        grads.append(parameter.grad)
    bucket, size = [], 0
    for grad in grads + [None]:
        flush = grad is None or (bucket and (size >= bucket_bytes or grad.dtype != bucket[0].dtype))
        if flush and bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world)
            dist.all_reduce(flat, group=process_group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0
        if grad is not None:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
