"""TRL's trainer under DDP, FSDP and DeepSpeed ZeRO-3.

DDP. ``mode="logps"`` calls the DDP-wrapped model as TRL does: the node calls' results leave through the model's
outputs, so DDP's reducer sees one ordinary graph per micro-batch and reduces the gradients itself (communication hooks
and overlap included; tests/integrations/trl/test_trl_integration.py checks it reduces without help from here).

The chunked mode cannot: it calls the model several times with several backwards per micro-batch, and every extra
backward of a synchronizing step would all-reduce again. So its grad-enabled calls run ``ddp.module`` (DDP's reducer is
then not armed, its hooks do nothing), and at the accumulation boundary (``accelerator.sync_gradients``) the accumulated
gradients are averaged over processes, which is what DDP's synchronizing backward computes. The averaging runs right
after the micro-batch's backward (``ChunkedStep.backward``, installed as ``accelerator.backward``), so ``training_step``
stays the trainer's own and clipping and the optimizer step see averaged gradients. Averaging is idempotent: if DDP
itself synchronized in that step (a micro-batch that fell back to TRL's path through DDP), averaging again leaves the
gradients unchanged. Not reproduced in chunked mode: DDP communication hooks (e.g. gradient compression) and the overlap
of all-reduce with backward.

FSDP. Both modes call the sharded model; FSDP gathers and reduce-scatters as usual, and the processes are kept making
the same model calls whatever their rows (:mod:`..common.lockstep`): fallbacks agreed, no-grad forwards joined, a
chunked micro-batch run as one ``chunked_backward`` of a shape all processes share
(:func:`..common.rows.padded_groups`).

DeepSpeed ZeRO-3 (``mode="logps"``). The engine is called as TRL calls it, under the same lockstep: every forward
gathers each submodule's parameters, so the processes must also call the same submodules in the same order; a join's
padding forwards are of the kind they pad (:meth:`..common.lockstep.Lockstep.forwards`, ``LogpsPatch.self_check``).
"""

from __future__ import annotations

from ..common.lockstep import Lockstep, make_lockstep, zero_stage

__all__ = ["Lockstep", "make_lockstep", "zero_stage"]
