"""The parameter gradients of a chunked call accumulated across its backward passes without an addition per parameter
per pass.

A chunked call makes a backward pass per node call (and per chunk's loss). Through plain autograd each pass builds
every parameter's gradient afresh and ``AccumulateGrad`` adds it into ``.grad``: one addition kernel per parameter per
pass (1,348 at four chunks of a 28-layer Qwen2), each a launch on a GPU, where the host's launches, not the kernels,
set the pace of a step. Here:

- **linear layers** (every ``nn.Linear`` whose weight is trained: the projections and MLPs, LoRA's adapters): their
  backward multiplies the weight's gradient straight into ``.grad`` (a matrix product that accumulates, ``addmm_``;
  the bias's, ``addmv_``), the first pass assigning it. The product a plain backward computes anyway is the addition
  too: no extra kernel, no transient gradient.
- **the other small parameters** (norm weights, ...): set aside before each pass and added back after it in one
  ``_foreach_add_`` (their transient copy is a few kilobytes).
- **the head and embedding weights** go to their buffers (``weight_grads.py``); larger parameters of other kinds (a
  mixture of experts' stacked weights) keep autograd's own accumulation.

Only where the parameters are plain tensors that the call's backward passes reach directly (plain autograd, or DDP
during its local accumulation), outside autocast, in a model that is not compiled, and with no gradient hooks on the
parameters (which the direct accumulation would bypass): :func:`grad_accumulation` says when.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.backward_driver import DDPBackward, PlainBackward
from ..distributed.lockstep import collective_wrapper
from .weight_grads import compiled_model

#: Parameters of other kinds than linear layers' up to this many elements are set aside and added back per pass; larger
#: ones keep autograd's own accumulation (their transient copy would not be small).
SMALL_PARAMETER = 1 << 20


class GradAccumulation:
    """The accumulation of one chunked call (see the module).

    Args:
        linears: the ``nn.Linear`` modules whose backward multiplies into ``.grad``.
        small: the other small parameters that require grad, added back per pass in one operation.
    """

    def __init__(self, linears: list[nn.Linear], small: list[nn.Parameter]):
        self.linears, self.small = linears, small
        self.ones: dict = {}  # (rows, dtype, device) -> a ones vector, for the biases' accumulating products

    @contextlib.contextmanager
    def installed(self):
        """Within the block, the linear layers' forwards build the accumulating backward (activation checkpointing
        recomputes through the same forward)."""
        for module in self.linears:
            module.forward = _AccumulatingForward(module, self)
        try:
            yield self
        finally:
            for module in self.linears:
                if isinstance(module.__dict__.get("forward"), _AccumulatingForward):
                    del module.forward

    def around(self, backward):
        """``backward`` (a driver's ``loss`` or ``tensors``) with the small parameters' gradients set aside before it
        and added back after it in one ``_foreach_add_``."""

        def run(*args):
            kept = [p.grad for p in self.small]
            for p in self.small:
                p.grad = None
            try:
                backward(*args)
            finally:
                into, add = [], []
                for p, old in zip(self.small, kept):
                    if old is not None and p.grad is not None:
                        into.append(old)
                        add.append(p.grad)
                    if old is not None:
                        p.grad = old
                if into:
                    torch._foreach_add_(into, add)

        return run

    def ones_vector(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        key = (rows, like.dtype, like.device)
        if key not in self.ones:
            self.ones[key] = like.new_ones(rows)
        return self.ones[key]


class AccumulatingDriver:
    """A backward driver whose loss and tensor backward passes go through :meth:`GradAccumulation.around`; everything
    else is the wrapped driver's."""

    def __init__(self, driver, accumulation: GradAccumulation):
        self.driver = driver
        self.loss = accumulation.around(driver.loss)
        self.tensors = accumulation.around(driver.tensors)

    def __getattr__(self, name):
        return getattr(self.driver, name)


class _AccumulatingForward:
    """A linear layer's forward during a chunked call: the layer's own output, with a backward that multiplies the
    weight's and bias's gradients into their ``.grad``. An object, not a closure, so a deep copy of the model made
    during the call keeps working."""

    def __init__(self, module: nn.Linear, owner: GradAccumulation):
        self.module, self.owner = module, owner

    def __call__(self, x):
        module = self.module
        if not torch.is_grad_enabled():
            return F.linear(x, module.weight, module.bias)
        return _LinearIntoGrad.apply(x, module.weight, module.bias, self.owner)


class _LinearIntoGrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; backward returns ``x``'s gradient and adds ``weight``'s and ``bias``'s into their
    ``.grad`` (assigns them at the first pass), returning none for them."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner):
        # The parameters themselves are kept, not saved: a saved tensor comes back as a copy under activation
        # checkpointing (recomputed), whose ``.grad`` is not the parameter's.
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.owner = weight, bias, owner
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = (rows @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if weight.requires_grad:
            inputs = x.reshape(-1, x.shape[-1])
            if weight.grad is None:
                weight.grad = (rows.t() @ inputs).to(weight.dtype)
            else:
                weight.grad.addmm_(rows.t(), inputs)
        bias = ctx.bias
        if bias is not None and bias.requires_grad:
            if bias.grad is None:
                bias.grad = rows.sum(0).to(bias.dtype)
            else:
                bias.grad.addmv_(rows.t(), ctx.owner.ones_vector(rows.shape[0], rows))
        return grad_x, None, None, None


def grad_accumulation(prepared, driver, skip: set[int] = frozenset()) -> GradAccumulation | None:
    """The accumulation of a chunked call whose backward passes run through ``driver``, or None where gradients must
    take autograd's own way (see the module). ``skip``: ids of parameters accumulated elsewhere (the head and embedding
    weights' buffers)."""
    if type(driver) not in (PlainBackward, DDPBackward):
        return None
    outer = prepared.outer
    if collective_wrapper(outer) not in (None, "DistributedDataParallel") or compiled_model(outer):
        return None
    device = prepared.device
    if torch.is_autocast_enabled(device.type):
        return None
    params = [p for p in outer.parameters() if p.requires_grad]
    if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        return None
    head = prepared.head.lm_head
    linears = [
        module
        for module in outer.modules()
        if type(module) is nn.Linear
        and module is not head
        and isinstance(module.weight, nn.Parameter)
        and module.weight.requires_grad
        and id(module.weight) not in skip
        and "forward" not in module.__dict__  # a forward a wrapper installed is kept
    ]
    covered = {id(m.weight) for m in linears} | {id(m.bias) for m in linears if m.bias is not None} | set(skip)
    small = [p for p in params if id(p) not in covered and p.numel() <= SMALL_PARAMETER]
    if not linears and not small:
        return None
    return GradAccumulation(linears, list({id(p): p for p in small}.values()))
