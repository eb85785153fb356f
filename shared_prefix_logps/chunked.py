"""Forward and backward over chunks of generations, so peak memory does not grow with G.

The prompts go through Phase 1 once, with gradients. Each captured key/value is then cut from that graph into a
leaf; every chunk of completions runs Phase 2 on the leaves, its loss and its backward (gradients land on the
parameters and accumulate on the leaves) and frees its activations. Finally one backward sends the accumulated
key/value gradients through the prompt's graph. The result equals autograd of the sum of the chunk losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .api import resolve_backend
from .context import CaptureContext
from .inputs import check_options, group_batch
from .model_support import prepare_model
from .output import LogpsOutput, write_rows
from .phases import capture_prefix, score_rows


def chunked_backward(
    model: nn.Module,
    prompts,
    completions,
    loss_fn: Callable[[LogpsOutput, torch.Tensor], torch.Tensor],
    *,
    generations_per_chunk: int,
    prompt_mask: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> LogpsOutput:
    """Run forward and backward of ``loss_fn`` over chunks of generations; parameters' ``.grad`` accumulate.

    Afterwards every parameter's ``.grad`` has grown by the gradient of ``sum(loss_fn(chunk) for chunk)``, exactly
    as if one graph over all completions had been backpropagated, while only one chunk's activations were alive.
    That holds when no completion token is valid too: every parameter the forward uses then gets a zero ``.grad``
    (not None), so optimizers that step on zero gradients (Adam's momentum) step as they would on the one graph.

    Args:
        model, prompts, completions, prompt_mask, completion_mask, temperature, return_entropy, backend:
            as for :func:`~shared_prefix_logps.compute_logps` (``dense`` is not available here).
        loss_fn: ``loss_fn(chunk_out, rows) -> scalar tensor``. ``chunk_out`` is a :class:`LogpsOutput` of the
            chunk's rows (differentiable, (len(rows), C)); ``rows`` (len(rows),) int64 are their indices among the
            B*G completion rows. Normalize with global counts (e.g. total valid tokens of the whole batch), not with
            the chunk's own, if the sum of chunk losses is to be the batch loss.
        generations_per_chunk: each chunk holds this many generations of every prompt, i.e. rows
            ``g*G + j .. g*G + j + generations_per_chunk - 1`` for every prompt g; 1 <= it <= G.

    Returns:
        The detached :class:`LogpsOutput` of all rows, (B*G, C).

    Notes:
        Each chunk calls ``backward``, and the prompt one more; under DDP wrap the call in ``model.no_sync()`` except
        for the step that should synchronize, or gradients are all-reduced more than once.
    """
    check_options(temperature, backend)
    if backend == "dense":
        raise ValueError("chunked_backward shares the prompt between chunks; backend='dense' cannot")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not torch.is_grad_enabled():
        raise RuntimeError("chunked_backward runs backward passes; call it with gradients enabled")
    prepared = prepare_model(model)
    batch = group_batch(prompts, completions, prompt_mask, completion_mask, model=prepared)
    rows, length = batch.completion_ids.shape
    num_prompts = batch.prompt_ids.shape[0]
    generations = rows // num_prompts
    if isinstance(generations_per_chunk, bool) or not isinstance(generations_per_chunk, int):
        raise TypeError(f"generations_per_chunk must be an int, got {type(generations_per_chunk).__name__}")
    if not 1 <= generations_per_chunk <= generations:
        raise ValueError(f"generations_per_chunk must be in [1, G={generations}], got {generations_per_chunk}")
    backend = resolve_backend(backend, prepared.device)
    packed = backend == "flex"

    capture = capture_prefix(prepared, batch.prompt_ids, batch.prompt_mask, packed=packed)
    leaves = _detached_capture(capture)
    logps = torch.zeros(rows, length, device=batch.completion_ids.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    starts = torch.arange(num_prompts, device=logps.device) * generations
    # With no valid token anywhere, autograd of the summed losses still gives every parameter a zero gradient (and
    # optimizers such as Adam step on it): the chunks then run anyway so that backward reaches every parameter.
    score_empty = not batch.completion_mask.any()
    for first in range(0, generations, generations_per_chunk):
        offsets = torch.arange(first, min(first + generations_per_chunk, generations), device=logps.device)
        chunk_rows = (starts[:, None] + offsets[None, :]).reshape(-1)
        part = batch.select_rows(chunk_rows)
        chunk_out = _score_chunk(prepared, part, leaves, length, temperature, return_entropy, packed, score_empty)
        loss = loss_fn(chunk_out, chunk_rows)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a scalar tensor")
        if loss.requires_grad:
            loss.backward()
        detached = chunk_out.detach()
        write_rows(logps, entropy, chunk_rows, (detached.logps, detached.entropy))
        del chunk_out, loss
    _backward_through_prompt(capture, leaves)
    return LogpsOutput(logps, entropy, batch.completion_mask)


def _detached_capture(capture: CaptureContext | None) -> CaptureContext | None:
    """A copy of ``capture`` whose keys/values are leaves that collect the chunks' gradients."""
    if capture is None:
        return None
    leaves = CaptureContext(
        key_valid=capture.key_valid,
        positions=capture.positions,
        needs_grad=True,
        packed=capture.packed,
        segments=capture.segments,
    )
    for module, (key, value) in capture.kv.items():
        leaves.kv[module] = (
            key.detach().requires_grad_(key.requires_grad),
            value.detach().requires_grad_(value.requires_grad),
        )
    return leaves


def _score_chunk(prepared, part, leaves, length, temperature, return_entropy, packed, score_empty) -> LogpsOutput:
    """Phase 2 on one chunk; (rows, C) float32 outputs padded back to the batch's C.

    A chunk without a valid token gets plain zeros (no forward) unless ``score_empty``: then it is forwarded too and
    its zeros are connected to the model's graph (Phase 2 forwards at least one masked column per row for that).
    """
    chunk_rows = part.completion_ids.shape[0]
    logps = torch.zeros(chunk_rows, length, device=part.completion_ids.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    if score_empty or part.completion_mask.any():
        values = score_rows(
            prepared,
            part.with_one_column(),
            leaves,
            temperature=float(temperature),
            return_entropy=return_entropy,
            packed=packed,
        )
        values = tuple(None if v is None else v[:, :length] for v in values)  # completions without any column
        write_rows(logps, entropy, torch.arange(chunk_rows, device=logps.device), values)
    mask = torch.zeros(chunk_rows, length, dtype=torch.bool, device=logps.device)
    mask[:, : part.completion_mask.shape[1]] = part.completion_mask
    return LogpsOutput(logps, entropy, mask)


def _backward_through_prompt(capture: CaptureContext | None, leaves: CaptureContext | None) -> None:
    """Send the key/value gradients the chunks accumulated on the leaves back through Phase 1's graph."""
    if capture is None:
        return
    tensors, grads = [], []
    for module, pair in capture.kv.items():
        for original, leaf in zip(pair, leaves.kv[module]):
            if leaf.grad is not None and original.requires_grad:
                tensors.append(original)
                grads.append(leaf.grad)
    if tensors:
        torch.autograd.backward(tensors, grads)
