"""How an entry point that runs several backward passes per call (``chunked_backward``, ``chunked_backward_tree``)
runs them under each engine, and the checks every chunk's loss goes through.

A call makes one backward per chunk's loss (reaching the node calls' leaves) and one per node call (reaching the
parameters, once nothing later needs the call). Plain autograd accumulates them into ``.grad`` as one graph would;
the engines need more: DDP averages once after the last backward
(:class:`DDPBackward`), FSDP1 re-arms its backward hooks before a backward through an earlier forward
(:class:`FSDP1Backward`), DeepSpeed runs every backward through its engine (:class:`DeepSpeedBackward`).
:func:`backward_driver` picks the driver of a call; :func:`backward_chunk_loss` is the per-chunk step.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .ddp import average_gradients, find_ddp, reduced_parameters


def backward_chunk_loss(driver, loss, *, chunk_rows: torch.Tensor, has_valid: bool, logps_need_grad: bool) -> bool:
    """Back-propagate one chunk's ``loss`` (what ``loss_fn`` returned) through ``driver``; False if it had none.

    Args:
        driver: the call's driver (:func:`backward_driver`).
        loss: must be a scalar tensor (else TypeError).
        chunk_rows: (k,) int64 the chunk's rows, named in the error.
        has_valid: whether the chunk has a valid (scored) token.
        logps_need_grad: whether the chunk's log-probs require grad (the error then blames ``loss_fn``).

    A loss without grad is skipped only when the chunk has no valid token: with one, skipping its backward would leave
    those rows' gradient out unseen, so it raises :func:`loss_without_grad`'s error.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("loss_fn must return a scalar tensor")
    if loss.requires_grad:
        driver.loss(loss)
        return True
    if has_valid:
        raise loss_without_grad(chunk_rows, logps_need_grad)
    return False


def loss_without_grad(chunk_rows: torch.Tensor, logps_need_grad: bool) -> RuntimeError:
    """The error for a chunk with valid tokens whose loss does not require grad (``loss.backward()`` raises too)."""
    rows = chunk_rows.tolist()
    shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    cause = (
        "loss_fn detached it or returned a constant; build the loss from chunk_out's tensors"
        if logps_need_grad
        else "the chunk's log-probs carry no gradient (no parameter of the model requires grad)"
    )
    return RuntimeError(f"the loss of the chunk of rows [{shown}] has valid tokens but does not require grad: {cause}")


def backward_driver(model: nn.Module, entry: str = "chunked_backward", boundary_zero=None):
    """How this call runs its backward passes: plain autograd, re-armed for FSDP1, through a DeepSpeed engine, or
    locally then averaged once (a synchronizing call under DDP). ``entry`` is the calling entry point's name, for
    the errors; ``boundary_zero()`` makes the zero whose backward carries a DeepSpeed step's boundary (a one-token
    forward's)."""
    root = fsdp1_root(model)
    if root is not None:
        return FSDP1Backward(model, root.compute_device)
    deepspeed = sys.modules.get("deepspeed")
    engine_type = getattr(deepspeed, "DeepSpeedEngine", None) if deepspeed is not None else None
    if engine_type is not None and isinstance(model, engine_type):
        return DeepSpeedBackward(model, entry, boundary_zero)
    if any(hasattr(param, "ds_id") or hasattr(param, "_hp_mapping") for param in model.parameters()):
        raise ValueError(
            "the model's parameters are managed by a DeepSpeed engine; pass the engine itself (what "
            f"deepspeed.initialize returns) to {entry}, so that its backward passes go through "
            "engine.backward and ZeRO accumulates the chunks' gradients"
        )
    ddp = find_ddp(model)
    if ddp is not None and ddp.static_graph:
        # Its reducer replays the first iteration's one-backward-per-forward schedule and fails an internal assertion
        # on the chunks' backwards.
        raise ValueError(
            f"{entry} cannot serve a DistributedDataParallel model with static_graph=True (DDP then expects "
            f"one backward per forward; {entry} makes several): wrap it with static_graph=False "
            "(find_unused_parameters True or False both work)"
        )
    if ddp is not None and ddp.require_backward_grad_sync:
        return DDPBackward(ddp)
    return PlainBackward()


class PlainBackward:
    """Backward passes of one call with autograd; also under DDP's ``no_sync`` (each accumulates locally)."""

    def begin(self) -> None:
        """Before the call's first forward."""

    def loss(self, loss: torch.Tensor) -> None:
        loss.backward()

    def tensors(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        pairs = [(tensor, grad) for tensor, grad in zip(tensors, grads) if grad is not None]
        if pairs:
            torch.autograd.backward(*zip(*pairs))

    def finish(self) -> None:
        """After the call's last backward."""

    def close(self) -> None:
        """Always, last (also when the call raised)."""


class DDPBackward(PlainBackward):
    """Backward passes of one synchronizing call under DDP (not inside ``no_sync``).

    DDP's reducer expects one backward per forward: each grad-enabled forward outside ``no_sync`` arms it (and, with
    ``find_unused_parameters``, marks the parameters that forward's output does not reach as ready), and the backward
    that follows all-reduces the buckets as their gradients become ready and writes the averages into ``.grad``. A
    chunked call's forwards and backwards (the prompts' node call, then a forward and a backward per chunk, then the
    backward through the prompts' graph) would average partial gradients several times, each overwritten by the next
    (0.74-0.96 relative error seen), with buckets left waiting. So the whole call runs as under ``no_sync()`` (forwards
    do not arm the reducer, backwards accumulate locally) and, after the last backward, every parameter's accumulated
    ``.grad`` is averaged over the process group once (:func:`~shared_prefix_logps.distributed.ddp.average_gradients`):
    what DDP's synchronizing backward computes, gradients accumulated under earlier ``no_sync`` micro-batches included.
    As after DDP's own synchronizing step, the next forward broadcasts the module's buffers.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel):
        self.ddp = ddp

    def begin(self) -> None:
        self.ddp.require_backward_grad_sync = False  # what no_sync() sets

    def finish(self) -> None:
        average_gradients(reduced_parameters(self.ddp), self.ddp.process_group)
        self.ddp.require_forward_param_sync = True

    def close(self) -> None:
        self.ddp.require_backward_grad_sync = True


class DeepSpeedBackward:
    """Backward passes of one call under a DeepSpeed engine.

    ``loss.backward()`` alone would bypass the engine: ZeRO-2 reduces each backward's gradients at the accumulation
    boundary and the next one overwrites them, and ZeRO-3 leaves gradients it cannot clear. A chunked call makes two
    kinds of backward: a chunk's loss, which reaches only the node calls' leaves (tensors cut from the graphs that
    produced them, no parameter), and each node call's, which reaches the parameters. Only the latter go through
    ``engine.backward`` (ZeRO gathers and reduces parameters and gradients in its hooks), as non-boundary micro-steps
    that ZeRO accumulates, each as the scalar ``sum(output * grad)`` (the gradients of ``autograd.backward(outputs,
    grads)``); the step's boundary is carried by one more backward at the end, of a one-token forward's zero
    (``boundary_zero()``), which adds nothing, so that ``engine.step()`` then updates as after one
    ``engine.backward``. The chunks' losses are divided by the engine's gradient accumulation steps before their plain
    backward, so the leaves' gradients, and through them every node call's, are scaled once, as ``engine.backward``
    scales a loss.
    """

    def __init__(self, engine, entry: str = "chunked_backward", boundary_zero=None):
        self.entry = entry
        if engine.fp16_enabled():
            raise NotImplementedError(
                f"{entry} under a DeepSpeed engine with fp16 (dynamic loss scaling) is not supported; use bf16 or fp32"
            )
        self.engine = engine
        self.boundary_zero = boundary_zero
        self.accumulation = int(engine.gradient_accumulation_steps())
        # Unmanaged accumulation (DeepSpeed >= 0.19): backward only accumulates; step() reduces.
        self.managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        self.override = getattr(engine, "_is_gradient_accumulation_boundary", None)
        self.boundary = engine.is_gradient_accumulation_boundary()

    def begin(self) -> None:
        pass

    def loss(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()  # reaches the node calls' leaves only

    def tensors(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        surrogate = sum((tensor * grad).sum() for tensor, grad in zip(tensors, grads) if grad is not None)
        if not isinstance(surrogate, torch.Tensor):
            surrogate = sum(tensor.sum() * 0.0 for tensor in tensors)
        self._engine_backward(surrogate, boundary=False)

    def finish(self) -> None:
        with torch.enable_grad():
            zero = self.boundary_zero()
        self._engine_backward(zero, boundary=True)

    def _engine_backward(self, loss: torch.Tensor, *, boundary: bool) -> None:
        if self.managed:
            self.engine.set_gradient_accumulation_boundary(self.boundary if boundary else False)
        self.engine.backward(loss, scale_wrt_gas=False)  # already scaled (see the class)

    def close(self) -> None:
        if self.managed:
            self.engine.set_gradient_accumulation_boundary(self.override)


def fsdp1_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP1 ``FullyShardedDataParallel`` unit in ``model``, or None."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return next((module for module in model.modules() if isinstance(module, FullyShardedDataParallel)), None)


class FSDP1Backward(PlainBackward):
    """Backward passes of one call under FSDP1 (``FullyShardedDataParallel``).

    A node call's backward runs after later forwards (its descendants', the chunks'), and FSDP1 arms a unit's
    backward in the *latest* forward and disarms it at the end of every backward (the root's final callback clears each
    unit's "unshard before backward" flag and removes the reduce-scatter hook from its flat parameter's
    ``AccumulateGrad``). Run as is, such a backward meets sharded units: its pre-backward hooks fire but unshard
    nothing, and the layers' saved weights (views of the freed unsharded flat parameters) are read from freed storage
    (a segfault on CPU/gloo), with no reduce-scatter of the call's gradient.

    So right before each, one grad-enabled one-token forward of the outer module re-arms every unit exactly as a
    forward does (flags set, hooks registered on the same ``AccumulateGrad`` nodes the call's graph leads to); its
    output is dropped and never backpropagated, so it adds nothing to any gradient. The call's backward is then an
    ordinary FSDP1 backward: each unit unshards in its pre-backward hook, reduce-scatters (or, under ``no_sync``,
    accumulates) and reshards after its gradient is complete. Every backward reduce-scatters its own gradient and
    FSDP1 adds the shards, so the step's gradient is the sum over the node calls, as without sharding.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model  # the outermost module, whose forward the node calls go through
        self.device = device  # FSDP1's compute device

    def tensors(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        self._rearm()
        super().tensors(tensors, grads)

    def _rearm(self) -> None:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.enable_grad():
            self.model(input_ids=ids, use_cache=False)
