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
  two-token placeholder prompt whose G one-token rows give every chunk a valid token, so that Phase 1, every chunk's
  forward and backward, and the backward through the prompts run on every process. Padding and placeholder rows add
  exactly zero to the loss and to every gradient.

The gradients themselves are FSDP's: under ``no_sync`` (accelerate's ``set_requires_gradient_sync(False)`` between
accumulation boundaries) each backward accumulates locally; at the boundary each backward reduce-scatters its part,
and the sharded gradients sum to the full one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .modules import eval_mode


class Lockstep:
    """Agreement between processes over the default process group, on ``device`` (the accelerator's)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.padding_forwards = 0  # one-token forwards made to keep in step (this process)

    def max(self, value: int) -> int:
        """The largest ``value`` of any process."""
        tensor = torch.tensor([int(value)], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process."""
        return self.max(int(bool(flag))) > 0

    @contextlib.contextmanager
    def forwards(self, model: nn.Module, pad: Callable[[], object] | None = None):
        """Keep the block's no-grad forwards of ``model`` in step with the other processes' (a join).

        Before each forward of ``model`` in the block, the process announces it (an all-reduce); a process that has left
        the block keeps answering announcements, making a one-token forward (no gradient, eval mode, output dropped) for
        each forward another process makes, until no process forwards any more. Every process must enter the block at
        the same point; in it, ``model`` may be forwarded only without gradient, and no other collective may run (the
        trainer's metric gathers stay outside). If the block raises, the error propagates without the join.

        ``pad`` makes one padding forward of ``model`` (it runs without gradient, in eval mode; its result is dropped);
        by default a one-token ``model(input_ids=...)``, which calls the same submodules, in the same order, as a
        plain forward or a shared-prefix phase (the lm_head included). A block whose forwards call the model another
        way (TRL's fused head, which reads the lm_head's weight without calling the lm_head) must pass a ``pad`` that
        does the same: under ZeRO-3 a forward that skips a submodule skips that submodule's parameter gather, and the
        processes' gathers would pair up wrongly.
        """

        def announce(module, args):
            self.max(1)

        # Before FSDP's own pre-forward hook, which gathers the root's parameters
        handle = model.register_forward_pre_hook(announce, prepend=True)
        try:
            yield
        finally:
            handle.remove()
        pad = pad if pad is not None else self._one_token_forward(model)
        while self.max(0):
            with torch.no_grad(), eval_mode(model):
                pad()
            self.padding_forwards += 1

    def _one_token_forward(self, model: nn.Module) -> Callable[[], object]:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return lambda: model(input_ids=ids, use_cache=False)
