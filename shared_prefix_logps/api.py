"""The scoring entry points: ``compute_logps`` and ``compute_logps_concatenated`` (a grouped batch: prompts and the
completions that continue them) and ``compute_logps_tree`` (rows of any shape). Each validates its inputs, prepares
the model, builds the call's plan (``engine/plan.py``) and runs it (``engine/run.py``), or the dense reference."""

from __future__ import annotations

import torch
from torch import nn

from .backends.choice import resolve_attention_backend
from .distributed.lockstep import call_lockstep
from .engine import merge
from .engine.dense import dense_logps
from .engine.plan import one_token_forks, rows_plan
from .engine.run import grouped_call_plan, score_plan
from .engine.sharing import grouped_rows
from .forward.context import CallSettings
from .inputs import GroupedBatch, check_options, check_tree_rows, group_batch, split_concatenated
from .model import prepare_model
from .model.dropout import warn_if_dropout_shared
from .moe_router import router_spec
from .output import LogpsOutput


def compute_logps(
    model: nn.Module,
    prompts,
    completions,
    *,
    prompt_mask: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    token_budget: int | None = None,
    return_router_stats: bool = False,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """Per-token log-probs of G completions per prompt, each prompt forwarded once.

    The numbers equal those of the conventional forward of every ``[prompt | completion]`` row (the ``dense``
    backend); gradients flow into the prompt through the keys/values its completions share.

    With dropout active (the model in training mode with dropout, attention dropout or MoE router jitter), a prompt
    is forwarded once, so its dropout draw is shared by its G completions where full rows draw one per row: the call
    runs and warns with :class:`~shared_prefix_logps.SharedDropoutWarning`. Call ``model.eval()`` (or set the dropout
    to 0) for the dense path's numbers; ``backend="dense"`` draws per row and does not warn.

    Args:
        model: a transformers decoder-only causal LM of a supported family (docs/models.md), optionally
            wrapped by PEFT, DDP, FSDP or DeepSpeed. Called through its own forward, once per node call.
        prompts: (B, P) int64 ids, left-padded as described by ``prompt_mask``, or a list of B token-id lists.
        completions: (B*G, C) int64 ids, right-padded as described by ``completion_mask``, or a list of B*G
            token-id lists. Rows g*G .. g*G+G-1 continue prompt g; G = len(completions) // len(prompts).
        prompt_mask: (B, P) bool/0-1, True on real tokens; None means no padding (tensor input only).
        completion_mask: (B*G, C) bool/0-1, True on real tokens; None means no padding (tensor input only).
        temperature: logits are divided by it before the log-softmax.
        return_entropy: also return each position's entropy.
        backend: the layout of every node call (:mod:`~shared_prefix_logps.backends`): ``"auto"`` (``"flex"`` on
            CUDA where its Triton kernels launch, ``"expand"`` elsewhere), ``"expand"`` (each node gathers its
            ancestors' keys/values; SDPA), ``"flex"`` (packed, no padding, one flex_attention call per layer; backward
            on CUDA only), ``"flash"`` (packed, flash-attn's varlen kernels, ancestors attended in place; CUDA with
            flash-attn installed) or ``"dense"`` (the conventional full-row forward, for reference).
        token_budget: under ``torch.no_grad()``, the most tokens a chunk of rows forwards at once (with ``expand`` a
            node also counts the bytes of its mask, gathered keys/values and explicit scores as hidden states' worth
            of tokens: ``engine/budget.py``). Default ``DEFAULT_TOKEN_BUDGET``. Ignored when gradients are enabled.
        return_router_stats: MoE models that compute a router load-balancing loss (Mixtral, Qwen2-MoE, Qwen3-MoE,
            GPT-OSS): also return each row's router statistics (``out.router``; ``out.router.aux_loss()`` equals
            the model's own ``aux_loss`` of the full rows, differentiable). Not with ``backend="dense"``.
        lockstep: keep every process's model calls in step with the other processes' whatever their rows
            (:mod:`~shared_prefix_logps.engine.lockstep`). None (default): when ``model`` is wrapped by DDP, FSDP or
            DeepSpeed in a process group of more than one process. Costs one small all-reduce per call with
            gradients (and a one-token forward per node call another process makes beyond this one's), one per
            forward plus one without (and a one-token forward per forward another process makes beyond this one's).
            False: the caller guarantees that every process makes the same calls with batches that forward alike
            (with gradients and several processes the two-level trie is then used: two node calls, or one when no
            completion has a token). True: also for unwrapped models.

    Returns:
        :class:`LogpsOutput` with ``logps`` (B*G, C) float32 (0 where masked), ``entropy`` or None, ``mask``, and
        ``router`` (or None).

    Raises:
        TypeError / ValueError: naming the offending argument, for malformed or inconsistent inputs.
        UnsupportedModelError: for models the shared path cannot serve.
    """
    temperature, token_budget = check_options(temperature, backend, token_budget)
    prepared = prepare_model(model)
    batch = group_batch(prompts, completions, prompt_mask, completion_mask, model=prepared)
    if backend != "dense":
        warn_if_dropout_shared(model, "compute_logps")
    return score_grouped(
        model, prepared, batch, temperature, return_entropy, backend, token_budget, return_router_stats, lockstep
    )


def compute_logps_concatenated(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    token_budget: int | None = None,
    return_router_stats: bool = False,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """The trainer-shaped entry: rows ``[left-padded prompt | right-padded completion]`` as TRL builds them.

    Rows whose prompt part is identical (ids and mask) share one prefix, whatever their order in the batch; with
    dropout active they share its dropout draw too, and the call warns as :func:`compute_logps` does
    (:class:`~shared_prefix_logps.SharedDropoutWarning`).

    Args:
        model: as for :func:`compute_logps`.
        input_ids: (N, L) int64.
        attention_mask: (N, L) bool/0-1; its first ``L - logits_to_keep`` columns are the left-padded prompt mask,
            the last ``logits_to_keep`` the right-padded completion mask.
        logits_to_keep: completion length C.
        temperature, return_entropy, backend, token_budget, return_router_stats, lockstep: as for
            :func:`compute_logps`.

    Returns:
        :class:`LogpsOutput` with (N, C) tensors, row i for ``input_ids[i]``.
    """
    temperature, token_budget = check_options(temperature, backend, token_budget)
    prepared = prepare_model(model)
    batch = split_concatenated(input_ids, attention_mask, logits_to_keep, model=prepared)
    if backend != "dense":
        warn_if_dropout_shared(model, "compute_logps_concatenated")
    return score_grouped(
        model, prepared, batch, temperature, return_entropy, backend, token_budget, return_router_stats, lockstep
    )


def compute_logps_tree(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    token_budget: int | None = None,
    return_router_stats: bool = False,
    merge_tiny_nodes: bool = True,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """Per-token log-probs of rows that share prefixes at any depth, each shared prefix forwarded once.

    The library finds the token trie of the rows (longest common prefixes between any rows, across prompts too).
    Each trie node's tokens are forwarded once, attending over its ancestors' keys/values and causally over its
    own; gradients reach every ancestor through those keys/values. With gradients, one forward per trie depth;
    without, a depth-first walk within ``token_budget``. With dropout active, a node's dropout draw is shared by every
    row through it, and the call warns as :func:`~shared_prefix_logps.compute_logps` does
    (:class:`~shared_prefix_logps.SharedDropoutWarning`).

    Args:
        model: as for :func:`~shared_prefix_logps.compute_logps`.
        input_ids: (N, L) int64; each row's real tokens contiguous (left- or right-padded, as its mask says).
        attention_mask: (N, L) bool/0-1, True on real tokens. A token's position is the number of real tokens
            before it in its row.
        score_mask: (N, L) bool/0-1: the positions t whose ``log p(x_t | x_<t)`` is wanted; only on real tokens after
            a row's first; holes allowed.
        temperature, return_entropy: as for :func:`~shared_prefix_logps.compute_logps`.
        backend: as for :func:`~shared_prefix_logps.compute_logps` (``"flex"`` without gradients on CPU, as torch's
            flex has no CPU backward).
        token_budget: as for :func:`~shared_prefix_logps.compute_logps`: rows are scored depth-first in chunks within
            it and each node call freed once no later row needs it, so peak memory does not grow with the number of
            rows. Ignored when gradients are enabled (one forward per trie depth).
        return_router_stats: MoE models with a router aux loss: also return each row's router statistics over its
            real tokens (``out.router``; ``out.router.aux_loss()`` equals the model's own ``aux_loss`` of the rows'
            dense forward), each shared token weighted by the number of rows that contain it. Not with ``dense``.
        merge_tiny_nodes: merge into their children the trie nodes whose sharing saves fewer tokens than a node
            call costs (:mod:`~shared_prefix_logps.engine.merge`); the results are the same either way.
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP, FSDP or DeepSpeed with
            several processes, processes whose tries differ make the same model calls: no-grad calls are joined,
            grad-enabled ones agree on the number of trie depths (:mod:`~shared_prefix_logps.engine.lockstep`).

    Returns:
        :class:`LogpsOutput` with (N, L) float32 ``logps`` (and ``entropy``), 0 where not scored, and ``mask`` =
        ``score_mask``. With gradients the zeros of a batch whose every row is empty (all padding) still come out of
        a forward of the model (one token), as ``backend="dense"``'s do: a loss built from them back-propagates and
        gives every parameter a zero gradient.

    Raises:
        ValueError: naming the argument: ``input_ids`` without columns, meta tensors (the inputs or the model's
            weights), masks of another shape, padding inside a row, scores on padding or on a row's first token.
    """
    temperature, token_budget = check_options(temperature, backend, token_budget)
    merge_below = merge.merge_threshold(merge_tiny_nodes)
    _check_router_backend(return_router_stats, backend)
    prepared = prepare_model(model)
    rows = check_tree_rows(input_ids, attention_mask, score_mask, model=prepared)
    if backend == "dense":
        logps, entropy = dense_logps(prepared, rows, temperature=temperature, return_entropy=return_entropy)
        return LogpsOutput(logps, entropy, rows.output_mask)
    warn_if_dropout_shared(model, "compute_logps_tree")
    settings = CallSettings(
        layout=resolve_attention_backend(backend, prepared.device),
        temperature=temperature,
        return_entropy=return_entropy,
        router=router_spec(prepared.causal_lm) if return_router_stats else None,
    )
    return score_plan(
        prepared,
        rows_plan(rows, merge_below, one_token_forks=one_token_forks(prepared)),
        settings,
        token_budget=token_budget,
        lockstep=call_lockstep(model, lockstep, prepared.device),
    )


def score_grouped(
    model, prepared, batch: GroupedBatch, temperature, return_entropy, backend, token_budget, router_stats, lockstep
) -> LogpsOutput:
    """``compute_logps``/``compute_logps_concatenated`` on a validated grouped batch: (rows, C) results."""
    _check_router_backend(router_stats, backend)
    if backend == "dense":
        width = batch.prompt_ids.shape[1]
        logps, entropy = dense_logps(
            prepared, grouped_rows(batch), temperature=temperature, return_entropy=return_entropy
        )
        return LogpsOutput(logps[:, width:], None if entropy is None else entropy[:, width:], batch.output_mask)
    steps = call_lockstep(model, lockstep, prepared.device)
    plan = grouped_call_plan(batch, prepared, steps)
    settings = CallSettings(
        layout=resolve_attention_backend(backend, prepared.device),
        temperature=temperature,
        return_entropy=return_entropy,
        router=router_spec(prepared.causal_lm) if router_stats else None,
    )
    return score_plan(prepared, plan, settings, token_budget=token_budget, lockstep=steps)


def _check_router_backend(router_stats: bool, backend: str) -> None:
    if router_stats and backend == "dense":
        raise ValueError("return_router_stats needs the shared path; the dense forward returns the model's aux_loss")
