"""The training entry points: ``chunked_backward`` (a grouped batch, in chunks of generations) and
``chunked_backward_tree`` (rows of any shape, in chunks of rows), forward and backward chunk by chunk so that peak
memory does not grow with the number of rows.

Both build a plan, choose the order of its chunks and run it with ``engine/run.py``'s ``train_plan`` (the walk with
leaves: each chunk forwards the node calls its rows need, its loss is back-propagated onto the calls' leaves, and each
node call back-propagates once every row below it is done). They differ only in the order of their plan's chunks. The
result equals autograd of the sum of the chunk losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .backends.choice import resolve_attention_backend
from .distributed.backward_driver import backward_driver
from .distributed.lockstep import call_lockstep
from .engine import merge
from .engine.budget import DEFAULT_TOKEN_BUDGET
from .engine.model_call import one_token_zero
from .engine.plan import generation_chunks, one_token_forks, rows_plan
from .engine.run import grouped_call_plan, train_plan
from .forward.context import CallSettings
from .inputs import GroupedBatch, as_int, check_options, check_tree_rows, group_batch
from .model import prepare_model
from .model.dropout import warn_if_dropout_shared
from .moe_router import router_spec
from .output import LogpsOutput


def chunked_backward(
    model: nn.Module,
    prompts,
    completions,
    loss_fn: Callable[[LogpsOutput, torch.Tensor], torch.Tensor],
    *,
    generations_per_chunk: int | str = "auto",
    token_budget: int | None = None,
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
    With dropout active (the model in training mode), a prompt's dropout draw is shared by all its completions, in
    every chunk, where full rows draw one per row: the call runs and warns as
    :func:`~shared_prefix_logps.compute_logps` does (:class:`~shared_prefix_logps.SharedDropoutWarning`).

    Args:
        model, prompts, completions, prompt_mask, completion_mask, temperature, return_entropy, backend:
            as for :func:`~shared_prefix_logps.compute_logps` (``dense`` is not available here).
        loss_fn: ``loss_fn(chunk_out, rows) -> scalar tensor``. ``chunk_out`` is a :class:`LogpsOutput` of the
            chunk's rows (differentiable, (len(rows), C)); ``rows`` (len(rows),) int64 are their indices among the
            B*G completion rows. Normalize with global counts (e.g. total valid tokens of the whole batch), not with
            the chunk's own, if the sum of chunk losses is to be the batch loss.
        generations_per_chunk: each chunk holds this many generations of every prompt, i.e. rows
            ``g*G + j .. g*G + j + generations_per_chunk - 1`` for every prompt g; 1 <= it <= G. ``"auto"`` (default):
            the most whose tokens fit ``token_budget`` (:func:`auto_generations_per_chunk`), so the fewest chunks,
            one when everything fits (then the whole step is one forward and one backward of the model with a
            layout that serves calls of several depths, ``flex``).
        token_budget: with ``generations_per_chunk="auto"``, the most tokens a chunk may hold alive at once: the
            prompts' and the chunk's completions' real tokens. Default ``DEFAULT_TOKEN_BUDGET`` (32768).
        return_router_stats: MoE models (as for :func:`~shared_prefix_logps.compute_logps`): ``chunk_out.router``
            holds the chunk rows' router statistics over their full rows, differentiable (the prompt's part through
            a leaf whose gradient goes back through the prompt's node call with its keys/values'). The
            load-balancing loss is not a sum over chunks; a loss linear in ``chunk_out.router.probs`` is (e.g.
            ``(w * probs).sum()`` with ``w = num_experts * counts / N**2`` from the whole batch's counts, known
            beforehand: it has the aux loss's value and gradient, since its counts carry no gradient).
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP, FSDP or DeepSpeed with
            more than one process, every node forward and backward is agreed with the other processes first (a small
            all-reduce each), and a process with fewer (a smaller G, a shallower trie) makes one-token forwards and
            zero backwards in their place, so that every process makes the same forwards and backwards
            (:mod:`~shared_prefix_logps.engine.lockstep`).

    Returns:
        The detached :class:`LogpsOutput` of all rows, (B*G, C) (with ``router`` when requested).

    The prompts share every prefix they share (a system prompt common to all prompts is forwarded once per call, as
    ``compute_logps`` does, :mod:`~shared_prefix_logps.engine.sharing`); each chunk forwards its completions over the
    prompts' node calls, which stay alive, collecting the chunks' gradients on their leaves, until every chunk is done
    and then back-propagate once (:mod:`~shared_prefix_logps.engine.walk`).

    Notes:
        Each chunk calls ``backward`` for its loss, and each node call once more. Under DDP pass the DDP-wrapped
        model and call as for one ``loss.backward()``: inside ``model.no_sync()`` every backward accumulates
        locally; outside it (the synchronizing micro-batch) the call runs its forwards and backwards as under
        ``no_sync`` and then averages
        every parameter's ``.grad`` over the processes once (``distributed.backward_driver.DDPBackward``), as DDP's
        synchronizing backward would: afterwards each process holds the ranks' average of the accumulated gradient, with
        ``find_unused_parameters`` on or off. DDP communication hooks are not applied to that average;
        ``static_graph=True`` is refused.

        Under FSDP2 and FSDP1 (``FullyShardedDataParallel``) each backward reduce-scatters what it produced (or,
        under ``no_sync``, accumulates locally) and the shards add up to the full gradient; under FSDP1 each node
        call's backward is preceded by a one-token forward that re-arms FSDP1's backward hooks (``FSDP1Backward``).

        Pass a DeepSpeed engine itself (what ``deepspeed.initialize`` returns), then call ``engine.step()`` as after
        ``engine.backward(loss)``: every node call's backward runs through ``engine.backward`` as a non-boundary
        micro-step so that ZeRO accumulates their gradients, and the call ends at the engine's own accumulation
        boundary (``DeepSpeedBackward``); losses are scaled by its gradient accumulation steps. fp16 loss scaling is
        not supported there.
    """
    temperature, token_budget = check_options(temperature, backend, token_budget)
    if backend == "dense":
        raise ValueError("chunked_backward shares the prompt between chunks; backend='dense' cannot")
    _check_loss_fn(loss_fn, "chunked_backward")
    prepared = None
    # The driver's refusals come before the model is prepared (and its head checked).
    driver = backward_driver(model, "chunked_backward", boundary_zero=lambda: one_token_zero(prepared))
    prepared = prepare_model(model)
    batch = group_batch(prompts, completions, prompt_mask, completion_mask, model=prepared)
    num_prompts = batch.prompt_ids.shape[0]
    generations = batch.completion_ids.shape[0] // num_prompts
    if isinstance(generations_per_chunk, str) and generations_per_chunk == "auto":
        budget = token_budget or DEFAULT_TOKEN_BUDGET
        generations_per_chunk = auto_generations_per_chunk(batch, generations, budget)
    elif isinstance(generations_per_chunk, str):
        raise ValueError(
            f"generations_per_chunk must be an int in [1, G={generations}] or 'auto', got {generations_per_chunk!r}"
        )
    elif token_budget is not None:
        raise ValueError("token_budget sizes the chunks of generations_per_chunk='auto'; pass one or the other")
    generations_per_chunk = as_int("generations_per_chunk", generations_per_chunk)
    if not 1 <= generations_per_chunk <= generations:
        raise ValueError(f"generations_per_chunk must be in [1, G={generations}], got {generations_per_chunk}")
    layout = resolve_attention_backend(backend, prepared.device)
    router = router_spec(prepared.causal_lm) if return_router_stats else None
    steps = call_lockstep(model, lockstep, prepared.device)
    plan = grouped_call_plan(batch, prepared, steps)
    plan = plan.ordered(generation_chunks(num_prompts, generations, generations_per_chunk))
    settings = CallSettings(layout, float(temperature), return_entropy, router)
    warn_if_dropout_shared(model, "chunked_backward")
    return train_plan(prepared, plan, settings, loss_fn, driver=driver, steps=steps)


def chunked_backward_tree(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    loss_fn: Callable[[LogpsOutput, torch.Tensor], torch.Tensor],
    *,
    rows_per_chunk: int = 1,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    merge_tiny_nodes: bool = True,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """Run forward and backward of ``loss_fn`` over chunks of rows of a prefix tree; parameters' ``.grad``
    accumulate the gradient of ``sum(loss_fn(chunk) for chunk)``, as one graph over all rows would give.

    With dropout active, a node's dropout draw is shared by every row through it, and the call warns as
    :func:`~shared_prefix_logps.compute_logps` does (:class:`~shared_prefix_logps.SharedDropoutWarning`).

    Args:
        model, input_ids, attention_mask, score_mask, temperature, return_entropy, merge_tiny_nodes: as for
            :func:`~shared_prefix_logps.compute_logps_tree`.
        loss_fn: ``loss_fn(chunk_out, rows) -> scalar tensor``; ``chunk_out`` a differentiable :class:`LogpsOutput`
            of the chunk's rows, (len(rows), L); ``rows`` (len(rows),) int64 their indices in ``input_ids``.
            Normalize with global counts if the sum of chunk losses is to be the batch loss.
        rows_per_chunk: rows per chunk, taken in the depth-first order of the trie (rows that share the most come
            together); memory holds the paths of one chunk's rows.
        backend: as for :func:`~shared_prefix_logps.chunked_backward`.
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP or FSDP with several
            processes, every node forward and backward is agreed with the other processes first, so that processes
            with different tries make the same model calls (:mod:`~shared_prefix_logps.engine.lockstep`).

    Returns:
        The detached :class:`LogpsOutput` of all rows, (N, L). When every row is empty (all padding), each chunk's
        zeros still come out of a forward of the model (one token), as with :func:`compute_logps_tree`: ``loss_fn``
        gets them with a graph, and every parameter's ``.grad`` gets zeros.

    Raises:
        ValueError: bad rows, named as for :func:`~shared_prefix_logps.compute_logps_tree`.

    Notes:
        As for :func:`~shared_prefix_logps.chunked_backward`: every chunk calls backward, and every node call once
        more; DDP, FSDP and DeepSpeed engines are served the same way.
    """
    temperature, _ = check_options(temperature, backend)
    if backend == "dense":
        raise ValueError("chunked_backward_tree shares prefixes between chunks; backend='dense' cannot")
    _check_loss_fn(loss_fn, "chunked_backward_tree")
    merge_below = merge.merge_threshold(merge_tiny_nodes)
    rows_per_chunk = as_int("rows_per_chunk", rows_per_chunk)
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be at least 1, got {rows_per_chunk}")
    prepared = None
    driver = backward_driver(model, "chunked_backward_tree", boundary_zero=lambda: one_token_zero(prepared))
    prepared = prepare_model(model)
    layout = resolve_attention_backend(backend, prepared.device)
    rows = check_tree_rows(input_ids, attention_mask, score_mask, model=prepared)
    plan = rows_plan(rows, merge_below, one_token_forks=one_token_forks(prepared)).in_chunks_of(rows_per_chunk)
    steps = call_lockstep(model, lockstep, prepared.device)
    settings = CallSettings(layout, float(temperature), return_entropy)
    warn_if_dropout_shared(model, "chunked_backward_tree")
    return train_plan(prepared, plan, settings, loss_fn, driver=driver, steps=steps)


def auto_generations_per_chunk(batch: GroupedBatch, generations: int, budget: int) -> int:
    """The most generations per chunk (1..G) whose chunks keep at most ``budget`` tokens alive at once: every prompt's
    real tokens (the prompts' node call stays alive through every chunk) and the largest chunk's completion tokens. At
    least 1, whatever the budget."""
    prompt_tokens = int(batch.prompt_mask.sum())
    per_generation = batch.completion_mask.sum(1).view(-1, generations).sum(0)  # (G,) tokens of each generation index
    before = torch.cat([per_generation.new_zeros(1), torch.cumsum(per_generation, 0)])  # (G + 1,) prefix sums
    for per_chunk in range(generations, 1, -1):
        starts = torch.arange(0, generations, per_chunk)
        largest = int((before[(starts + per_chunk).clamp(max=generations)] - before[starts]).max())
        if prompt_tokens + largest <= budget:
            return per_chunk
    return 1


def _check_loss_fn(loss_fn, entry: str) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not torch.is_grad_enabled():
        raise RuntimeError(f"{entry} runs backward passes; call it with gradients enabled")
