"""FSDP (and any engine whose forwards are collectives) under a trainer plug-in: every process makes the same
wrapped-model calls, whatever its rows.

FSDP gathers each unit's parameters in every forward and reduce-scatters its gradients in every backward, through
collectives that the processes match by order. A trainer's own log-prob calls keep the processes in step: how many
forwards they make depends on batch sizes only, which all processes share. The shared path's calls depend on the
process's own rows: no-grad scoring splits its work by distinct prompts and prompt width and skips what is all masked,
chunked mode runs one ``chunked_backward`` per group size present in the micro-batch, a self-check waits for a batch
with a valid token. A process that forwards once more than another pairs its gathers with the other's next collectives:
a hang, or a "collective mismatch" error, or worse. Under FSDP the plug-in therefore (:class:`Lockstep`):

- agrees on fallbacks: when any process cannot take the shared path for a call or micro-batch, all of them fall back;
- joins no-grad work (:meth:`Lockstep.forwards`): in a no-grad call, or a self-check, each process announces every
  forward, and a process that is done makes a one-token forward (output dropped) for each forward another process
  announces. Under FSDP a no-grad forward goes through every unit in the same order whatever its input, so only the
  number of forwards has to match. DeepSpeed ZeRO-3 gathers per *submodule*, on each submodule's forward hook, so
  there the padding forward must also call the same submodules in the same order as the forward it pairs with: a
  block's forwards are all of one kind, and the padding forward is of that kind (``pad``);
- runs a chunked micro-batch as one ``chunked_backward`` call of a shape every process agrees on
  (:func:`~.rows.padded_groups`): groups padded with masked rows to the largest group size G of any process, plus a
  two-token placeholder prompt whose G one-token rows give every chunk a valid token, so that the prompts' node call,
  every chunk's forward and backward, and the backward through the prompts run on every process. Padding and placeholder
  rows add exactly zero to the loss and to every gradient.

:class:`Lockstep` is the core's (:mod:`shared_prefix_logps.distributed.lockstep`): the core entry points called inside
a join make no agreement of their own. Calls made alike on every process (a chunked micro-batch of agreed shape, a
grad-enabled call) keep the core's own agreement, a few integers all-reduced per call.

The gradients themselves are FSDP's: under ``no_sync`` (accelerate's ``set_requires_gradient_sync(False)`` between
accumulation boundaries) each backward accumulates locally; at the boundary each backward reduce-scatters its part,
and the sharded gradients sum to the full one.
"""

from __future__ import annotations

import torch.distributed as dist

from ...distributed.lockstep import Lockstep

__all__ = ["Lockstep", "make_lockstep", "zero_stage"]


def make_lockstep(trainer) -> Lockstep | None:
    """A :class:`Lockstep` when an accelerate-based trainer's (TRL's, ms-swift's) models are sharded so that every
    forward is a collective: FSDP (accelerate's ``DistributedType.FSDP``) or DeepSpeed ZeRO-3 (each submodule's forward
    gathers its partitioned parameters); else None (DDP, ZeRO-0/1/2: forwards are local, only the backward's reduction
    is collective)."""
    from accelerate.utils import DistributedType

    if not dist.is_initialized():
        return None
    kind = trainer.accelerator.distributed_type
    if kind == DistributedType.FSDP or (kind == DistributedType.DEEPSPEED and zero_stage(trainer) == 3):
        return Lockstep(trainer.accelerator.device)
    return None


def zero_stage(trainer) -> int | None:
    """The DeepSpeed ZeRO stage of the trainer's accelerator, or None without DeepSpeed."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return getattr(plugin, "zero_stage", None)
