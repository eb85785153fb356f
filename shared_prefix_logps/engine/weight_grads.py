"""The head and embedding weight gradients of a chunked call, added into one float32 buffer per parameter across the
call's backward passes and handed to each parameter once, at the end.

A chunked call makes a backward per chunk and per node call. Through plain autograd each of them builds the full
(vocabulary x hidden) gradient of the head's weight afresh (the fused head's float32 accumulator, then its cast) and,
for the input embedding, a dense (vocabulary x hidden) gradient from a few rows, and then adds each to ``.grad``: at
Qwen2.5's vocabulary 545 MB written and read several times per backward, which made one generation per chunk cost 1.5x
the time of a single backward (1.04x once accumulated in one buffer, measured on CPU). Here the fused head adds its
weight's gradient into the buffer (``linear_logps(weight_grad=...)``), the embedding's backward adds its rows
(``index_add_``), and :meth:`WeightGrads.deliver` hands each buffer to its parameter through autograd once
(``AccumulateGrad`` and its hooks run as for any backward).

Only where the parameters are plain tensors that the call's backward passes reach directly (no wrapper hooks that
shard, gather or reduce gradients: plain autograd, or DDP during its local accumulation): :func:`weight_grads` says
when.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..distributed.backward_driver import DDPBackward, PlainBackward
from ..distributed.lockstep import collective_wrapper
from ..forward.head_weights import effective_head


class WeightGrads:
    """The float32 gradient buffers of one call (created at first use), keyed by parameter.

    Attributes:
        head_weight: the lm_head's weight parameter, when the fused head multiplies by it unchanged, else None.
        embedding: the input embedding module (a plain ``nn.Embedding``) whose weight's gradient goes to a buffer, or
            None.
    """

    def __init__(self, head_weight: nn.Parameter | None, embedding: nn.Embedding | None):
        self.head_weight, self.embedding = head_weight, embedding
        self.buffers: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def buffer(self, parameter: torch.Tensor) -> torch.Tensor | None:
        """``parameter``'s buffer (float32, zeros at first), or None when its gradient does not go to one."""
        if parameter is not self.head_weight and (self.embedding is None or parameter is not self.embedding.weight):
            return None
        if id(parameter) not in self.buffers:
            zeros = torch.zeros(parameter.shape, dtype=torch.float32, device=parameter.device)
            self.buffers[id(parameter)] = (parameter, zeros)
        return self.buffers[id(parameter)][1]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients go to buffers."""
        found = [self.head_weight] if self.head_weight is not None else []
        if self.embedding is not None and all(p is not self.embedding.weight for p in found):
            found.append(self.embedding.weight)
        return found

    def embedding_hook(self):
        """Context manager: during a node call's forward, the input embedding's output routes its gradient into the
        embedding weight's buffer instead of autograd's dense gradient."""
        if self.embedding is None:
            return contextlib.nullcontext()
        embedding, buffer = self.embedding, self.buffer(self.embedding.weight)

        def route(module, args, output):
            return _EmbeddingGradIntoBuffer.apply(output, args[0], buffer, module.padding_idx)

        return _registered(embedding.register_forward_hook(route))

    def deliver(self) -> None:
        """Hand each buffer to its parameter, through the parameter's ``AccumulateGrad`` (hooks included)."""
        for parameter, buffer in self.buffers.values():
            torch.autograd.backward([parameter], [buffer.to(parameter.dtype)])
        self.buffers.clear()


@contextlib.contextmanager
def _registered(handle):
    try:
        yield
    finally:
        handle.remove()


class _EmbeddingGradIntoBuffer(torch.autograd.Function):
    """The embedding's output unchanged; its gradient added into the buffer at its ids' rows (a padding id's row
    gets none, as ``nn.Embedding`` gives it none), and none sent through the embedding's own backward."""

    @staticmethod
    def forward(ctx, output, ids, buffer, padding_idx):
        ctx.save_for_backward(ids)
        ctx.buffer, ctx.padding_idx = buffer, padding_idx
        return output.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        rows = grad.reshape(flat.numel(), -1).float()
        if ctx.padding_idx is not None:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        ctx.buffer.index_add_(0, flat, rows)
        return None, None, None, None


def weight_grads(prepared, driver) -> WeightGrads | None:
    """The buffers of a chunked call whose backward passes run through ``driver``, or None where gradients must take
    autograd's own way (a sharded or engine-managed model, a compiled model, nothing of the head or embedding
    trained)."""
    if type(driver) not in (PlainBackward, DDPBackward) or compiled_model(prepared.outer):
        return None
    # FSDP and ZeRO swap sharded parameters for gathered ones in each forward and reduce their gradients in hooks:
    # only a plain model, or DDP's local accumulation, hands its parameters to the head and embedding as they are.
    if collective_wrapper(prepared.outer) not in (None, "DistributedDataParallel"):
        return None
    lm_head = prepared.head.lm_head
    head = getattr(lm_head, "weight", None)
    with torch.no_grad():
        weight, _ = effective_head(lm_head)
    if not (isinstance(head, nn.Parameter) and head.requires_grad and weight is head):
        head = None
    embedding = prepared.causal_lm.get_input_embeddings()
    plain = type(embedding) is nn.Embedding and embedding.max_norm is None and not embedding.scale_grad_by_freq
    if not (plain and not embedding.sparse and embedding.weight.requires_grad) or embedding._forward_hooks:
        embedding = None
    if head is None and embedding is None:
        return None
    return WeightGrads(head, embedding)


def compiled_model(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is compiled (a forward hook added for one call would recompile it)."""
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule"
        for module in model.modules()
    )
