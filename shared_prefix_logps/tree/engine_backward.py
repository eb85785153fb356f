"""``chunked_backward_tree``'s backward passes under a DeepSpeed engine.

The depth-first walk makes two kinds of backward: a chunk's loss, which reaches only the node calls' leaves (tensors
cut from the graphs that produced them, no parameter), and each node call's, which reaches the parameters. Only the
latter go through ``engine.backward`` (ZeRO gathers and reduces parameters and gradients in its hooks), as
non-boundary micro-steps that ZeRO accumulates; the step's boundary is carried by one more backward at the end, of a
one-token forward's zero, which adds nothing. The chunks' losses are divided by the engine's gradient accumulation
steps before their plain backward, so the leaves' gradients, and through them every node call's, are scaled once, as
``engine.backward`` scales a loss.
"""

from __future__ import annotations

import torch

from .lockstep import one_token_zero


class NodeCallsThroughEngine:
    """The backward driver of ``chunked_backward_tree`` under a DeepSpeed engine: wraps the engine's driver
    (``distributed.backward_driver.DeepSpeedBackward``: its ``loss(loss, last=..., scale=...)`` runs
    ``engine.backward`` at or off the accumulation boundary) with the same methods as the other drivers."""

    def __init__(self, driver, prepared):
        self.driver, self.prepared = driver, prepared
        self.accumulation = int(driver.engine.gradient_accumulation_steps())

    def begin(self) -> None:
        self.driver.begin()

    def loss(self, loss: torch.Tensor, *, last: bool) -> None:
        (loss / self.accumulation).backward()  # reaches the node calls' leaves only

    def tensors(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        surrogate = sum((tensor * grad).sum() for tensor, grad in zip(tensors, grads) if grad is not None)
        if not isinstance(surrogate, torch.Tensor):
            surrogate = sum(tensor.sum() * 0.0 for tensor in tensors)
        # sum(output * grad) has the gradients of autograd.backward(outputs, grads); already scaled (see the module)
        self.driver.loss(surrogate, last=False, scale=False)

    def finish(self) -> None:
        with torch.enable_grad():
            zero = one_token_zero(self.prepared)
        self.driver.loss(zero, last=True, scale=False)
        self.driver.finish()

    def close(self) -> None:
        self.driver.close()
