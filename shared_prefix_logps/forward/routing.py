"""Route results that are computed inside a module out through that module's output, for wrappers' sake.

A node call computes results deep inside the model (each layer's keys/values of its tokens; the fused head's
log-probs) that the model's forward does not return. Handing them to the loss directly would make their
gradient bypass the module outputs, and wrappers act on module outputs: FSDP2 unshards a unit for backward when its
output receives gradient, DDP looks for unused parameters from the outputs, ZeRO-3 gathers on module hooks. Used
directly, the results reach the loss while their units stay sharded, and backward reads freed parameter storage.

So a result is *attached* to a tensor the module returns (a "carrier": the attention output, or the lm_head's
empty-vocabulary placeholder) and *released* from the model's final output after the forward:

    carrier = attach(carrier, box, results)      # inside the module: identity on the carrier
    ...model output derived from carrier...
    results = release(output_tensor, box)        # after the forward: the results, now downstream of the output

Backward reverses it: ``release`` stores the results' gradients in the box and sends a zero gradient into the
model's output; that gradient flows through every wrapped module's output, firing their backward hooks, until
``attach`` hands the stored gradients to the results' own graph. The values are never copied (released results
alias the originals) and the identity costs nothing.
"""

from __future__ import annotations

import torch


class RouteBox:
    """The results attached at one point and, in backward, their gradients.

    Attributes:
        results: the attached tensors (aliases are handed out by :func:`release`).
        grads: their gradients, set by the backward of :func:`release`, read by that of :func:`attach`.
    """

    __slots__ = ("results", "grads")

    def __init__(self):
        self.results: tuple[torch.Tensor, ...] = ()
        self.grads: tuple[torch.Tensor | None, ...] | None = None


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, box, *results):
        ctx.box = box
        box.results = results
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad_carrier):
        grads = ctx.box.grads
        if grads is None:  # the results were never released into the loss
            grads = (None,) * len(ctx.box.results)
        ctx.box.grads = None
        return (grad_carrier, None, *grads)


class _Release(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, *boxes):
        ctx.set_materialize_grads(False)
        ctx.boxes = boxes
        ctx.output_meta = (output.shape, output.dtype, output.device)
        ctx.sizes = [len(box.results) for box in boxes]
        # Aliases, not copies: autograd gives them this node as grad_fn while the originals keep theirs.
        return tuple(result.detach() for box in boxes for result in box.results)

    @staticmethod
    def backward(ctx, *grads):
        position = 0
        for box, size in zip(ctx.boxes, ctx.sizes):
            box.grads = grads[position : position + size]
            position += size
        # A defined (zero) gradient, so every module output on the way down receives one.
        shape, dtype, device = ctx.output_meta
        return (torch.zeros(shape, dtype=dtype, device=device), *([None] * len(ctx.boxes)))


# Both entry points run eagerly under torch.compile: a traced graph would evaluate the backward of _Attach at trace
# time, when the box holds no gradient yet, and bake in zero gradients for every result.
@torch.compiler.disable
def attach(carrier: torch.Tensor, box: RouteBox, *results: torch.Tensor) -> torch.Tensor:
    """Inside a module: ``carrier`` unchanged (a view), with ``results`` riding on it; see the module docstring."""
    if not torch.is_grad_enabled() or not any(r.requires_grad for r in results):
        box.results = results
        return carrier
    return _Attach.apply(carrier, box, *results)


@torch.compiler.disable
def release(output: torch.Tensor, boxes: list[RouteBox]) -> list[torch.Tensor]:
    """After the forward: every box's results, in order, their gradient routed through ``output`` (a tensor the
    outermost module returned, derived from every carrier)."""
    if not any(result.requires_grad for box in boxes for result in box.results) or not output.requires_grad:
        return [result for box in boxes for result in box.results]
    return list(_Release.apply(output, *boxes))
