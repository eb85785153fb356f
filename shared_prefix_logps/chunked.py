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

from .backends.choice import packed_layout, resolve_attention_backend
from .batch_plan import placeholder_chunk, plan_generation_chunks
from .distributed.backward_driver import backward_chunk_loss, backward_driver
from .distributed.lockstep import call_lockstep, placeholder_prefix
from .forward.context import CaptureContext
from .inputs import as_int, check_options, group_batch
from .model import prepare_model
from .moe_router import RouterStats, router_spec
from .output import LogpsOutput, result_zeros, write_rows
from .phases import capture_prefix, score_rows, score_rows_routed


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
    return_router_stats: bool = False,
    lockstep: bool | None = None,
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
        return_router_stats: MoE models (as for :func:`~shared_prefix_logps.compute_logps`): ``chunk_out.router``
            holds the chunk rows' router statistics over their full rows, differentiable (the prompt's part through
            a leaf whose gradient goes back through the prompt with its keys/values'). The load-balancing loss is
            not a sum over chunks; a loss linear in ``chunk_out.router.probs`` is (e.g. ``(w * probs).sum()`` with
            ``w = num_experts * counts / N**2`` from the whole batch's counts, known beforehand: it has the aux
            loss's value and gradient, since its counts carry no gradient). Every chunk is forwarded then.
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP, FSDP or DeepSpeed with
            more than one process, the processes agree (two small all-reduces per call) on Phase 1 and on the number
            of chunks; every chunk is forwarded and back-propagated, a chunk without a valid token too (its loss adds
            zero), and a process with fewer chunks (a smaller G) or no prompt prefix makes one-token forwards and
            zero backwards in their place, so that every process makes the same forwards and backwards.

    Returns:
        The detached :class:`LogpsOutput` of all rows, (B*G, C) (with ``router`` when requested).

    Notes:
        Each chunk calls ``backward``, and the prompt one more. Under DDP pass the DDP-wrapped model and call as for
        one ``loss.backward()``: inside ``model.no_sync()`` every backward accumulates locally; outside it (the
        synchronizing micro-batch) the call runs its forwards and backwards as under ``no_sync`` and then averages
        every parameter's ``.grad`` over the processes once (``distributed.backward_driver.DDPBackward``), as DDP's
        synchronizing backward would: afterwards each process holds the ranks' average of the accumulated gradient, with
        ``find_unused_parameters`` on or off. DDP communication hooks are not applied to that average;
        ``static_graph=True`` is refused.

        Under FSDP2 and FSDP1 (``FullyShardedDataParallel``) each backward reduce-scatters what it produced (or,
        under ``no_sync``, accumulates locally) and the shards add up to the full gradient; under FSDP1 the prompt's
        backward is preceded by a one-token forward that re-arms FSDP1's backward hooks (``FSDP1Backward``).

        Pass a DeepSpeed engine itself (what ``deepspeed.initialize`` returns), then call ``engine.step()`` as after
        ``engine.backward(loss)``: every backward runs through ``engine.backward`` (scaled by its gradient
        accumulation steps), the chunks as non-boundary micro-steps so that ZeRO accumulates their gradients, the
        last one at the engine's own accumulation boundary. fp16 loss scaling is not supported there.
    """
    temperature, _ = check_options(temperature, backend)
    if backend == "dense":
        raise ValueError("chunked_backward shares the prompt between chunks; backend='dense' cannot")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not torch.is_grad_enabled():
        raise RuntimeError("chunked_backward runs backward passes; call it with gradients enabled")
    backward = backward_driver(model)  # its refusals come before the model is prepared (and its head checked)
    prepared = prepare_model(model)
    batch = group_batch(prompts, completions, prompt_mask, completion_mask, model=prepared)
    rows, length = batch.completion_ids.shape
    num_prompts = batch.prompt_ids.shape[0]
    generations = rows // num_prompts
    generations_per_chunk = as_int("generations_per_chunk", generations_per_chunk)
    if not 1 <= generations_per_chunk <= generations:
        raise ValueError(f"generations_per_chunk must be in [1, G={generations}], got {generations_per_chunk}")
    backend = resolve_attention_backend(backend, prepared.device)
    packed = packed_layout(backend)
    router = router_spec(prepared.causal_lm) if return_router_stats else None
    num_experts, top_k = router if router is not None else (0, None)
    plan = plan_generation_chunks(batch, generations_per_chunk, backend=backend, router=router)
    row_chunks = plan.row_chunks()

    steps = call_lockstep(model, lockstep, prepared.device)
    logps = result_zeros(rows, length, device=batch.completion_ids.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    # With no valid token anywhere, autograd of the summed losses still gives every parameter a zero gradient (and
    # optimizers such as Adam step on it): the chunks then run anyway so that backward reaches every parameter.
    # (Router statistics count the prompt tokens of rows without a valid completion token too: every chunk runs.)
    # In lockstep every chunk runs, so that each process forwards and back-propagates as often as the others.
    score_empty = not plan.has_valid or top_k is not None or steps is not None
    routed_rows, routed = [], []
    try:
        backward.begin()
        has_prefix = plan.has_prefix
        chunks = len(row_chunks)
        padding = None  # a placeholder Phase 1's zero (lockstep: another process has a prompt prefix, this one none)
        placeholder = None  # the chunk made in place of another process's (lockstep: it has more chunks)
        if steps is not None:
            any_prefix, chunks = steps.max_all([has_prefix, chunks])
            if chunks > len(row_chunks):
                placeholder = placeholder_chunk(batch)
            if any_prefix and not has_prefix:
                padding = placeholder_prefix(prepared, packed=packed, router_top_k=top_k)
        capture = capture_prefix(prepared, batch.prompt_ids, batch.prompt_mask, packed=packed, router_top_k=top_k)
        leaves = _detached_capture(capture)
        # Whether a backward through the prompt follows the chunks' (it is then the step's last backward).
        prompt_backward = capture is not None and any(t.requires_grad for t in _prompt_results(capture))
        if steps is not None:
            prompt_backward = steps.any(prompt_backward)
        for chunk in range(chunks):
            last = not prompt_backward and chunk == chunks - 1
            if chunk >= len(row_chunks):  # lockstep: another process has more chunks (a larger G)
                _backward_placeholder_chunk(backward, prepared, placeholder, leaves, packed, top_k, num_experts, last)
                continue
            part = row_chunks[chunk]
            chunk_rows = part.rows
            chunk_out = _score_chunk(
                prepared, part, leaves, length, temperature, return_entropy, packed, score_empty, top_k, num_experts
            )
            if top_k is not None:
                routed_rows.append(chunk_rows)
                routed.append(chunk_out.router.detach())
            loss = loss_fn(chunk_out, chunk_rows)
            ran = backward_chunk_loss(
                backward,
                loss,
                last=last,
                chunk_rows=chunk_rows,
                has_valid=part.has_valid,
                logps_need_grad=chunk_out.logps.requires_grad,
            )
            if not ran and steps is not None and chunk_out.logps.requires_grad:
                # lockstep: the other processes back-propagate this chunk; a zero from its forward stands in
                backward.loss(chunk_out.logps.sum() * 0.0, last=last)
            detached = chunk_out.detach()
            write_rows(logps, entropy, chunk_rows, (detached.logps, detached.entropy))
            del chunk_out, loss
        if prompt_backward and padding is not None:
            backward.tensors([padding], [torch.zeros_like(padding)])
        elif prompt_backward and capture is not None:
            _backward_through_prompt(backward, capture, leaves)
        backward.finish()
    finally:
        backward.close()
    out = LogpsOutput(logps, entropy, batch.completion_mask)
    if top_k is not None:
        order = torch.argsort(torch.cat(routed_rows))
        out.router = RouterStats(
            *(torch.cat([getattr(stats, name) for stats in routed])[order] for name in ("counts", "probs", "tokens")),
            num_experts,
        )
    return out


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
    if capture.router is not None:
        counts, probs, tokens = capture.router
        leaves.router = (counts, probs.detach().requires_grad_(probs.requires_grad), tokens)
    return leaves


def _prompt_results(capture: CaptureContext) -> list[torch.Tensor]:
    """What Phase 1 hands to the chunks, in a fixed order: every layer's key and value, then (when router statistics
    were requested) the prompts' summed router probabilities."""
    results = [tensor for pair in capture.kv.values() for tensor in pair]
    if capture.router is not None:
        results.append(capture.router[1])
    return results


def _score_chunk(
    prepared, part, leaves, length, temperature, return_entropy, packed, score_empty, top_k=None, num_experts=0
) -> LogpsOutput:
    """Phase 2 on one :class:`~shared_prefix_logps.batch_plan.RowChunk` ``part``; (rows, C) float32 outputs padded
    back to the batch's C = ``length``.

    A chunk without a valid token gets plain zeros (no forward) unless ``score_empty``: then it is forwarded too and
    its zeros are connected to the model's graph (the plan gives every chunk at least one masked column for that).
    With ``top_k`` (router statistics) the output carries the chunk rows' :class:`RouterStats`.
    """
    batch = part.batch
    chunk_rows = batch.completion_ids.shape[0]
    logps = result_zeros(chunk_rows, length, device=batch.completion_ids.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    stats = None
    if score_empty or part.has_valid:
        options = dict(temperature=float(temperature), return_entropy=return_entropy, packed=packed)
        if top_k is None:
            values = score_rows(prepared, batch, leaves, **options)
        else:
            *values, stats = score_rows_routed(prepared, batch, leaves, router_top_k=top_k, **options)
        values = tuple(None if v is None else v[:, :length] for v in values)  # completions without any column
        write_rows(logps, entropy, torch.arange(chunk_rows, device=logps.device), values)
    width = min(batch.completion_mask.shape[1], length)
    mask = torch.zeros(chunk_rows, length, dtype=torch.bool, device=logps.device)
    mask[:, :width] = batch.completion_mask[:, :width]
    router = None if stats is None else RouterStats(*stats, num_experts)
    return LogpsOutput(logps, entropy, mask, router)


def _backward_placeholder_chunk(backward, prepared, chunk, leaves, packed, top_k, num_experts, last: bool) -> None:
    """A chunk's forward and backward in place of one another process makes (lockstep): ``chunk``
    (:func:`~shared_prefix_logps.batch_plan.placeholder_chunk`) forwarded and back-propagated with weight zero."""
    out = _score_chunk(prepared, chunk, leaves, 1, 1.0, False, packed, True, top_k, num_experts)
    if out.logps.requires_grad:
        backward.loss(out.logps.sum() * 0.0, last=last)


def _backward_through_prompt(backward, capture: CaptureContext, leaves: CaptureContext) -> None:
    """Send the gradients the chunks accumulated on the leaves (keys/values, router probabilities) back through
    Phase 1's graph."""
    tensors, grads = [], []
    for original, leaf in zip(_prompt_results(capture), _prompt_results(leaves)):
        if original.requires_grad:
            tensors.append(original)
            grads.append(leaf.grad)
    backward.tensors(tensors, grads)
