"""DistributedDataParallel under ``mode="chunked"``: forward the inner module, average gradients once per step.

``mode="logps"`` calls the DDP-wrapped model as TRL does: the phases' results leave through the model's outputs, so
DDP's reducer sees one ordinary graph per micro-batch and reduces the gradients itself (communication hooks and
overlap included; tests/test_trl_integration.py checks it reduces without help from here).

The chunked mode cannot: it calls the model several times with several backwards per micro-batch, and every extra
backward of a synchronizing step would all-reduce again. So its grad-enabled calls run ``ddp.module`` (DDP's reducer
is then not armed, its hooks do nothing), and at the accumulation boundary (``accelerator.sync_gradients``) the
accumulated gradients are averaged over processes, which is what DDP's synchronizing backward computes. The averaging
runs right after the micro-batch's backward (the chunked step's ``accelerator.backward`` hook), so ``training_step``
stays the trainer's own and clipping and the optimizer step see averaged gradients. Averaging is idempotent: if DDP
itself synchronized in that step (a micro-batch that fell back to TRL's path through DDP), averaging again leaves the
gradients unchanged.
Not reproduced in chunked mode: DDP communication hooks (e.g. gradient compression) and the overlap of all-reduce
with backward.
"""

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


def sync_bypassed_ddp(patch) -> None:
    """After a micro-batch's backward: if a grad-enabled call bypassed DDP since the last sync and this micro-batch
    ends the accumulation window, average the gradients now."""
    ddp = patch.bypassed_ddp
    if ddp is not None and patch.trainer.accelerator.sync_gradients:
        average_gradients([p for p in ddp.parameters() if p.requires_grad], ddp.process_group)
        patch.bypassed_ddp = None
