"""Public entry points: ``compute_logps`` and ``compute_logps_concatenated``."""

from __future__ import annotations

import torch
from torch import nn

from .backends import flash
from .backends.dense import dense_logps
from .backends.flex import backward_available, compiled_kernels_launch, flex_available
from .batch_plan import BatchPlan, plan_scoring
from .distributed.lockstep import Lockstep, call_lockstep, placeholder_prefix
from .inputs import GroupedBatch, check_options, group_batch, split_concatenated
from .model import PreparedModel, prepare_model
from .moe_router import RouterStats, router_spec
from .output import LogpsOutput, result_zeros, write_rows
from .phases import capture_prefix, score_rows, score_rows_routed
from .token_budget import DEFAULT_TOKEN_BUDGET, ScoringCosts
from .tree.grouped import score_grouped_as_tree


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

    Args:
        model: a transformers decoder-only causal LM of a supported family (docs/models.md), optionally
            wrapped by PEFT, DDP, FSDP or DeepSpeed. Called through its own forward, twice (prompts, then completions).
        prompts: (B, P) int64 ids, left-padded as described by ``prompt_mask``, or a list of B token-id lists.
        completions: (B*G, C) int64 ids, right-padded as described by ``completion_mask``, or a list of B*G
            token-id lists. Rows g*G .. g*G+G-1 continue prompt g; G = len(completions) // len(prompts).
        prompt_mask: (B, P) bool/0-1, True on real tokens; None means no padding (tensor input only).
        completion_mask: (B*G, C) bool/0-1, True on real tokens; None means no padding (tensor input only).
        temperature: logits are divided by it before the log-softmax.
        return_entropy: also return each position's entropy.
        backend: ``"auto"`` (``"flex"`` on CUDA where its Triton kernels launch, ``"expand"`` elsewhere),
            ``"expand"`` (each row gathers its prefix keys/values; SDPA), ``"flex"`` (packed, no padding, one
            flex_attention call per layer; backward on CUDA only), ``"flash"`` (packed, flash-attn's varlen
            kernels, the prefix attended in place; CUDA with flash-attn installed) or ``"dense"`` (the
            conventional full-row forward, for reference).
        token_budget: under ``torch.no_grad()``, the most tokens forwarded at once (prompts per Phase 1 chunk,
            completion rows per Phase 2 chunk; with ``expand`` a prompt and a row also count the bytes of their masks,
            gathered keys/values and explicit scores as hidden states' worth of tokens: ``token_budget.py``). Default
            ``DEFAULT_TOKEN_BUDGET``. Ignored when gradients are enabled.
        return_router_stats: MoE models that compute a router load-balancing loss (Mixtral, Qwen2-MoE, Qwen3-MoE,
            GPT-OSS): also return each row's router statistics (``out.router``; ``out.router.aux_loss()`` equals
            the model's own ``aux_loss`` of the full rows, differentiable). Not with ``backend="dense"``.
        lockstep: keep every process's model calls in step with the other processes' whatever their rows
            (:mod:`~shared_prefix_logps.distributed.lockstep`). None (default): when ``model`` is wrapped by DDP,
            FSDP or DeepSpeed in a process group of more than one process. Costs one small all-reduce per call with
            gradients (and a one-token forward where another process forwards its prompts and this one has none),
            one per forward plus one without (and a one-token forward per forward another process makes beyond
            this one's). False: the caller guarantees that every process makes the same calls with batches that
            forward alike. True: also for unwrapped models.

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
    plan = plan_call(
        prepared, batch, backend=backend, token_budget=token_budget, return_router_stats=return_router_stats
    )
    return run_plan(
        prepared,
        plan,
        temperature=temperature,
        return_entropy=return_entropy,
        token_budget=token_budget,
        lockstep=call_lockstep(model, lockstep, prepared.device),
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

    Rows whose prompt part is identical (ids and mask) share one prefix, whatever their order in the batch.

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
    plan = plan_call(
        prepared, batch, backend=backend, token_budget=token_budget, return_router_stats=return_router_stats
    )
    return run_plan(
        prepared,
        plan,
        temperature=temperature,
        return_entropy=return_entropy,
        token_budget=token_budget,
        lockstep=call_lockstep(model, lockstep, prepared.device),
    )


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device`` with the current grad mode.

    ``auto`` is ``flex`` on CUDA where its compiled kernels launch (a trial launch, ``kernels.launch_probe``) and
    ``expand`` elsewhere. ``flex`` needs those kernels to launch, and flex_attention's backward, which torch has on
    CUDA only, when gradients are enabled. ``flash`` needs flash-attn's kernels (CUDA, package installed).
    """
    if backend == "flash" and not flash.available(device):
        raise ValueError(flash.unavailable_reason(device))
    if backend == "auto":
        flex_runs = device.type == "cuda" and flex_available(device) and compiled_kernels_launch(device)
        return "flex" if flex_runs else "expand"
    if backend == "flex":
        if not flex_available(device):
            raise ValueError(f"backend='flex' needs torch's flex_attention on {device.type}")
        if not compiled_kernels_launch(device):
            from .kernels.launch_probe import cuda_launch_status

            raise ValueError(
                "backend='flex' compiles flex_attention into Triton kernels, which cannot launch here "
                f"({cuda_launch_status(device).reason}); use backend='expand'"
            )
        if torch.is_grad_enabled() and not backward_available(device):
            raise ValueError(
                "backend='flex' has no backward on CPU (torch's flex_attention); use backend='expand', or call "
                "under torch.no_grad() for scoring"
            )
    return backend


def packed_layout(backend: str) -> bool | str:
    """The ``packed`` argument of the phases for a concrete ``backend``: its name for the packed backends, else
    False (the padded layout)."""
    return backend if backend in ("flex", "flash") else False


def plan_call(
    prepared: PreparedModel,
    batch: GroupedBatch,
    *,
    backend: str,
    token_budget: int | None = None,
    return_router_stats: bool = False,
) -> BatchPlan:
    """The plan of a scoring call over a validated ``batch`` (:mod:`~shared_prefix_logps.batch_plan`), built once.

    Without gradients the work is split into prompt chunks (Phase 1) and completion chunks (Phase 2) of at most
    ``token_budget`` tokens each, so peak memory does not grow with the number of prompts or with G. With
    gradients everything runs as one graph (see :func:`~shared_prefix_logps.chunked_backward` for bounded memory).
    When distinct prompts share enough of a prefix among themselves (``tree/grouped.py``), the ``expand`` backend
    scores the rows as a prefix tree instead, each shared prompt prefix forwarded once.
    With ``return_router_stats`` every row is forwarded, even one without a valid completion token: its prompt's
    tokens are routed in the dense row all the same.
    """
    backend = resolve_attention_backend(backend, prepared.device)
    router = None
    if return_router_stats:
        if backend == "dense":
            raise ValueError(
                "return_router_stats needs the shared path; the dense forward returns the model's aux_loss"
            )
        router = router_spec(prepared.causal_lm)
    budget = None if torch.is_grad_enabled() else (token_budget or DEFAULT_TOKEN_BUDGET)
    costs = None
    if budget is not None and backend != "dense":
        costs = ScoringCosts.of(prepared.causal_lm, prepared.device, packed=packed_layout(backend))
    return plan_scoring(batch, backend=backend, budget=budget, costs=costs, router=router)


def run_plan(
    prepared: PreparedModel,
    plan: BatchPlan,
    *,
    temperature: float,
    return_entropy: bool,
    token_budget: int | None = None,
    lockstep: Lockstep | None = None,
) -> LogpsOutput:
    """Log-probs of the rows of ``plan`` (:func:`plan_call`), as (rows, C) tensors of the batch's C.

    ``token_budget`` bounds the tree pass's no-grad walk, when the plan takes it. With ``lockstep`` the call keeps in
    step with the other processes: without gradients its forwards are joined (:meth:`Lockstep.forwards`); with
    gradients it makes Phase 1 when any process does (a padding forward where this process has no prompt prefix),
    then Phase 2.
    """
    options = dict(temperature=float(temperature), return_entropy=return_entropy, token_budget=token_budget)
    if lockstep is not None and not torch.is_grad_enabled():
        with lockstep.forwards(prepared.outer):
            return _run_plan(prepared, plan, **options)
    return _run_plan(prepared, plan, **options, lockstep=lockstep)


def _run_plan(
    prepared: PreparedModel,
    plan: BatchPlan,
    *,
    temperature: float,
    return_entropy: bool,
    token_budget: int | None,
    lockstep: Lockstep | None = None,
) -> LogpsOutput:
    """:func:`run_plan`; with gradients and ``lockstep``, Phase 1 agreed between the processes."""
    batch = plan.batch
    mask = batch.completion_mask
    rows = mask.shape[0]
    if plan.tree_rows is not None:
        return score_grouped_as_tree(
            prepared,
            batch,
            plan.tree_rows,
            temperature=temperature,
            return_entropy=return_entropy,
            token_budget=token_budget,
        )
    if not plan.prompt_chunks:  # no valid token, no gradient: nothing to forward
        logps = result_zeros(*mask.shape, device=mask.device)
        return LogpsOutput(logps, torch.zeros_like(logps) if return_entropy else None, mask)
    # With gradient an all-masked batch still runs the model: its (zero) result must hang off the model's graph
    # through the model's own forward, as the dense path's does, so that a loss built from it back-propagates
    # (every parameter gets a zero gradient; DDP/FSDP see an ordinary forward and backward). Completions with no
    # column at all forward one masked column (plan.width); the result is cut back to the caller's width below.
    logps = result_zeros(rows, plan.width, device=mask.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    if plan.backend == "dense":
        chunk = plan.prompt_chunks[0].row_chunks[0]
        values = dense_logps(prepared, chunk.batch, temperature=temperature, return_entropy=return_entropy)
        write_rows(logps, entropy, chunk.rows, values)
        return _output(logps, entropy, mask)
    packed = packed_layout(plan.backend)
    num_experts, top_k = plan.router if plan.router is not None else (0, None)
    padding = None
    if lockstep is not None and torch.is_grad_enabled():
        # With gradients the call is Phase 1 (unless no prompt has a prefix) then Phase 2, and the backward runs
        # through both: where another process forwards prompts and this one has none, a placeholder Phase 1 takes
        # its place, and its zero joins the results so that the backward visits it as the others' visit Phase 1.
        if lockstep.any(plan.has_prefix) and not plan.has_prefix:
            padding = placeholder_prefix(prepared, packed=packed, router_top_k=top_k)
    routed_rows, routed = [], []
    options = dict(temperature=temperature, return_entropy=return_entropy, packed=packed)
    for prompts in plan.prompt_chunks:
        capture = capture_prefix(prepared, prompts.prompt_ids, prompts.prompt_mask, packed=packed, router_top_k=top_k)
        for chunk in prompts.row_chunks:
            if top_k is None:
                values = score_rows(prepared, chunk.batch, capture, **options)
            else:
                *values, stats = score_rows_routed(prepared, chunk.batch, capture, router_top_k=top_k, **options)
                routed_rows.append(chunk.rows)
                routed.append(stats)
            write_rows(logps, entropy, chunk.rows, values)
        del capture
    out = _output(logps, entropy, mask)
    if top_k is not None:
        out.router = _gather_router_stats(routed_rows, routed, num_experts)
    return out if padding is None else _joined(out, padding)


def _joined(out: LogpsOutput, zero: torch.Tensor) -> LogpsOutput:
    """``out`` with the 0-d ``zero`` added to every differentiable result: same values, and a backward from any of
    them also runs through ``zero``'s graph."""
    out.logps = out.logps + zero
    if out.entropy is not None:
        out.entropy = out.entropy + zero
    if out.router is not None:
        out.router.probs = out.router.probs + zero
    return out


def _gather_router_stats(row_chunks: list[torch.Tensor], stats: list[tuple], num_experts: int) -> RouterStats:
    """The per-row router statistics of every row, from chunks that cover each row exactly once (differentiably)."""
    order = torch.argsort(torch.cat(row_chunks))
    counts, probs, tokens = (torch.cat([chunk[i] for chunk in stats])[order] for i in range(3))
    return RouterStats(counts, probs, tokens, num_experts)


def _output(logps: torch.Tensor, entropy: torch.Tensor | None, mask: torch.Tensor) -> LogpsOutput:
    """The result at the caller's width ``mask.shape[1]`` (the computed tensors may have one extra masked column)."""
    width = mask.shape[1]
    if logps.shape[1] != width:
        logps = logps[:, :width]
        entropy = None if entropy is None else entropy[:, :width]
    return LogpsOutput(logps, entropy, mask)
