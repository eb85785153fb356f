"""DistributedDataParallel: the wrapper inside a model, and the gradient averaging DDP does at a synchronizing
backward, for calls whose several backward passes must not each all-reduce (``chunked_backward``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper among ``model`` and its submodules (a plug-in may wrap DDP in a module of
    its own), or None."""
    return next((m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)), None)


def reduced_parameters(ddp: nn.parallel.DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP all-reduces, in the same order on every process: those of ``ddp.module`` that require grad
    and are not among its ``parameters_to_ignore`` (each shared parameter once)."""
    ignored = ddp.parameters_to_ignore
    return [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]


def average_gradients(parameters: list[nn.Parameter], process_group=None, bucket_bytes: int = 25 * 2**20) -> None:
    """All-reduce-average ``.grad`` over processes, as DDP does at a synchronizing backward.

    Every process passes the same parameters in the same order; a missing gradient counts as zeros (and becomes a
    zero tensor), so processes never disagree on the number of collectives. Gradients are flattened into buckets of
    about ``bucket_bytes`` of one dtype each: one all-reduce per bucket.
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
