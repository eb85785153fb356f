"""The entry points' model calls kept in step across processes whose plans differ.

How many node calls a process makes, and when they back-propagate, follow its own plan: with gradients one forward
per trie depth; in a chunked backward a forward per new depth of each chunk and a backward per node call once nothing
later needs it; without gradients as many forwards as the token budget cuts. Under DDP, FSDP1/FSDP2 and ZeRO-3 the
forwards and backwards run collectives matched by order (see :mod:`shared_prefix_logps.distributed.lockstep`), so
processes with different plans would pair one's forward with another's backward, or one's last call with nothing.

- No-grad calls are joined (``Lockstep.forwards``): a process that is done makes one-token forwards while another
  still forwards.
- Grad-enabled scoring agrees on the number of node calls (:func:`agreed_depth_padding`); a process with fewer makes
  one-token forwards whose zero joins its result, so that the caller's single backward visits the model's units as
  often on every process and adds exactly zero to every gradient.
- The chunked backwards agree before every model call (:class:`CallAgreement`): each process announces whether its
  next call is a forward or a backward, and every process makes a call of the agreed kind, its own or a placeholder,
  forwards first. A placeholder forward is a one-token forward whose output is dropped. A backward, real or
  placeholder, is preceded by a one-token forward: a placeholder backward goes through that forward's zero, a real
  one through the node call's graph alone, the one-token forward's output dropped. Each backward then goes through
  the graph of exactly one forward on every process: FSDP2 reduce-scatters a unit's gradient once per forward graph a
  backward goes through, so a backward through two graphs on one process and one on another would pair the first's
  second reduce-scatter with the next collective of the other. (The FSDP1 driver re-arms its units with one more
  one-token forward before each backward, the same on every process.) A process that is done answers until no
  process makes a call.
"""

from __future__ import annotations

import torch

from ..distributed.lockstep import Lockstep
from .model_call import one_token_zero

#: What a process announces before a model call of a chunked backward (larger first: forwards go first).
DONE, BACKWARD, FORWARD = 0, 1, 2


def agreed_depth_padding(lockstep: Lockstep, prepared, calls: int) -> torch.Tensor | None:
    """With gradients: agree on the most model forwards any process makes (``calls`` here: its node calls, or the
    placeholder forward of a walk whose rows are all empty, :meth:`~.walk.Walk.forwards_in_one_chunk`) and make a
    one-token forward for each this process lacks; their summed zero (None when there is none, or it carries no
    gradient), which the caller adds to its results so that its backward goes through them too."""
    missing = lockstep.max(calls) - calls
    zeros = [zero for zero in (one_token_zero(prepared) for _ in range(missing)) if zero.requires_grad]
    return torch.stack(zeros).sum() if zeros else None


class CallAgreement:
    """Keeps a chunked backward's forwards and backwards in step with the other processes' (see the module).

    ``driver`` runs the backward passes (``distributed.backward_driver.backward_driver``'s); ``steps`` the
    processes' agreement.
    """

    def __init__(self, steps: Lockstep, prepared, driver):
        self.steps, self.prepared, self.driver = steps, prepared, driver
        self.placeholders = 0  # placeholder calls this process made (for tests and diagnostics)

    def before_forward(self) -> None:
        """Call before each of this process's node forwards: returns once every process makes a forward now."""
        self._until(FORWARD)

    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """This process's backward of ``tensors`` with ``grads`` (all from one node call's graph), in step with the
        others' backwards."""
        self._until(BACKWARD)
        self._backward(tensors, grads)

    def finish(self) -> None:
        """Once this process has made its last call: answer the other processes' calls until none is left."""
        self._until(DONE)

    def _until(self, mine: int) -> None:
        while True:
            agreed = self.steps.max(mine)
            if agreed == mine:
                return
            self._placeholder(agreed)

    def _placeholder(self, kind: int) -> None:
        self.placeholders += 1
        if kind == BACKWARD:
            self._backward([], [])
        else:
            with torch.enable_grad():
                one_token_zero(self.prepared)

    def _backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        with torch.enable_grad():
            zero = one_token_zero(self.prepared)
        if not tensors and zero.requires_grad:  # a placeholder, or a call none of whose outputs received gradient
            tensors, grads = [zero], [torch.zeros_like(zero)]
        del zero  # a real backward goes through its call's graph alone
        if tensors:
            self.driver.tensors(tensors, grads)
