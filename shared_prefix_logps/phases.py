"""The two phases of a shared-prefix forward, both through the caller's outermost module.

Phase 1 forwards each prompt once, without its last token, and records every layer's post-RoPE keys/values.
Phase 2 forwards each completion row as ``[last prompt token, completion[:-1]]`` at positions that continue its
prompt; its queries attend over the group's recorded prefix and causally over the row itself, and the lm_head
proxy turns the valid queries' hidden states into log-probs of the completion tokens.

Both phases come in two layouts: ``padded`` (backend ``expand``: rows of the batch as they are) and ``packed``
(backends ``flex`` and ``flash``: the real tokens of all rows back to back in one row, no padding processed); a
``packed`` argument names the packed backend (True means ``flex``) and the contexts carry it.

With ``router_top_k`` set (MoE models, for the router aux loss) both phases also return the model's router logits
(``output_router_logits=True``: they leave through the model's own output, as in its dense forward) and sum their
statistics per prompt (Phase 1) and per row (Phase 2, :mod:`~shared_prefix_logps.moe_router`). Phase 2 then forwards
each row's last completion token too: the dense row routes it, although no log-prob needs its output.
"""

from __future__ import annotations

import torch

from .forward.context import CONTEXT_KWARG, CaptureContext, PhaseHandle, SharedContext, activated
from .forward.routing import release
from .inputs import GroupedBatch
from .model import PreparedModel
from .model.compiled import graph_breaks_allowed
from .model.installation import force_non_reentrant_checkpointing
from .moe_router import token_sums
from .output import scatter_valid


def capture_prefix(
    prepared: PreparedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    packed: bool = False,
    router_top_k: int | None = None,
) -> CaptureContext | None:
    """Phase 1: forward ``prompt[:, :-1]`` of every prompt once and record each layer's keys/values.

    Args:
        prompt_ids, prompt_mask: (num_prompts, P) left-padded prompts.
        packed: use the packed layout: False, or the packed backend's name ("flex" or "flash"; True: flex).
        router_top_k: also sum the router statistics of each prompt's prefix tokens into ``context.router``.

    Returns None when every prompt has a single token (no prefix to share).
    """
    prefix_ids = prompt_ids[:, :-1]
    prefix_mask = prompt_mask[:, :-1]
    # Leading columns that are padding in every prompt hold no key.
    lead = int((~prefix_mask).all(0).sum().item()) if prefix_mask.shape[1] else 0
    prefix_ids, prefix_mask = prefix_ids[:, lead:], prefix_mask[:, lead:]
    if prefix_ids.shape[1] == 0:
        return None
    positions = (prefix_mask.long().cumsum(1) - 1).clamp(min=0)
    needs_grad = torch.is_grad_enabled()
    if packed:
        segments = torch.arange(prefix_ids.shape[0], device=prefix_ids.device)[:, None].expand_as(prefix_ids)
        context = CaptureContext(
            key_valid=prefix_mask[prefix_mask][None],
            positions=positions[prefix_mask][None],
            needs_grad=needs_grad,
            packed=packed,
            segments=segments[prefix_mask],
        )
        input_ids = prefix_ids[prefix_mask][None]
    else:
        context = CaptureContext(key_valid=prefix_mask, positions=positions, needs_grad=needs_grad)
        input_ids = prefix_ids
    output, router_logits = forward_phase(
        prepared, input_ids, context.positions, context, router=router_top_k is not None
    )
    if router_top_k is not None:
        owners = context.segments if packed else None
        context.router = _router_sums(router_logits, prefix_mask, owners, prefix_ids.shape[0], router_top_k)
    if not context.routes:
        raise ValueError(f"{type(prepared.causal_lm).__name__} ran no attention layer through the shared-prefix path")
    modules = list(context.routes)
    released = release(output, [context.routes[module] for module in modules])
    context.kv = {module: (released[2 * i], released[2 * i + 1]) for i, module in enumerate(modules)}
    return context


def score_completions(
    prepared: PreparedModel,
    batch: GroupedBatch,
    capture: CaptureContext | None,
    *,
    temperature: float,
    return_entropy: bool,
    packed: bool = False,
    router_top_k: int | None = None,
) -> SharedContext:
    """Phase 2: log-probs (and entropy) of every valid completion token; see :class:`SharedContext`.

    ``batch.group_index`` indexes the prompts of ``capture``. The returned context's ``logps``/``entropy`` are
    (num_valid,) float32 in row-major order of ``batch.completion_mask``. With ``router_top_k`` the rows are
    forwarded one token longer (their last completion token, attended to by nothing and scored by nothing) and
    ``context.router`` holds each row's router statistics over its last prompt token and its completion tokens.
    """
    rows = batch.completion_ids.shape[0]
    group_index = batch.group_index
    last_prompt_token = batch.prompt_ids[group_index, -1]
    valid = batch.completion_mask
    # Query i holds the token before completion token i; with routing, one more query holds the last one.
    following = batch.completion_ids if router_top_k is not None else batch.completion_ids[:, :-1]
    query_ids = torch.cat([last_prompt_token[:, None], following], dim=1)
    length = query_ids.shape[1]
    start = batch.prompt_lengths[group_index] - 1
    positions = start[:, None] + torch.arange(length, device=start.device)[None, :]
    routed = None
    if router_top_k is not None:
        # Scored: the queries before valid completion tokens; routed: every real token of the dense row.
        routed = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1)
        valid = torch.cat([valid, torch.zeros_like(valid[:, :1])], dim=1)
    common = dict(
        capture=capture,
        group_index=group_index,
        head_targets=batch.completion_ids[batch.completion_mask],
        temperature=temperature,
        return_entropy=return_entropy,
        needs_grad=torch.is_grad_enabled(),
        head_spec=prepared.head,
    )
    if packed:
        forwarded = _packed_queries(valid) if routed is None else routed
        query_rows = torch.arange(rows, device=valid.device)[:, None].expand_as(valid)[forwarded]
        context = SharedContext(
            positions=positions[forwarded][None],
            query_valid=valid[forwarded][None],
            packed=packed,
            query_rows=query_rows,
            **common,
        )
        input_ids = query_ids[forwarded][None]
    else:
        context = SharedContext(positions=positions, query_valid=valid, **common)
        input_ids = query_ids
    output, router_logits = forward_phase(prepared, input_ids, context.positions, context, router=routed is not None)
    if context.route is None:
        raise ValueError(f"{type(prepared.causal_lm).__name__} did not call its lm_head inside its forward")
    released = release(output, [context.route])
    context.logps = released[0]
    context.entropy = released[1] if return_entropy else None
    if routed is not None:
        owners = context.query_rows if packed else None
        context.router = _router_sums(router_logits, routed, owners, rows, router_top_k)
    return context


def _router_sums(router_logits, forwarded: torch.Tensor, packed_owners, num_owners: int, top_k: int):
    """Router statistics per owner (prompt in Phase 1, row in Phase 2) of the tokens a phase forwarded.

    Args:
        router_logits: the forward's router logits, one row per token of its (flattened) input.
        forwarded: (owners, L) bool, the tokens forwarded in the unpacked layout, in row-major order.
        packed_owners: in the packed layout, (tokens,) int64 the owner of each input token; None when unpacked.
    """
    if packed_owners is not None:
        return token_sums(
            router_logits,
            torch.arange(packed_owners.numel(), device=packed_owners.device),
            packed_owners,
            num_owners,
            top_k,
        )
    token_index = forwarded.reshape(-1).nonzero().squeeze(1)
    owner = torch.div(token_index, forwarded.shape[1], rounding_mode="floor")
    return token_sums(router_logits, token_index, owner, num_owners, top_k)


def score_rows(
    prepared: PreparedModel,
    batch: GroupedBatch,
    capture: CaptureContext | None,
    *,
    temperature: float,
    return_entropy: bool,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`score_completions` laid out per row: (rows, C) float32 log-probs and entropy (or None), zeros where
    ``batch.completion_mask`` is False; differentiable."""
    scored = score_completions(
        prepared, batch, capture, temperature=temperature, return_entropy=return_entropy, packed=packed
    )
    mask = batch.completion_mask
    return scatter_valid(scored.logps, mask), scatter_valid(scored.entropy, mask) if return_entropy else None


def score_rows_routed(
    prepared: PreparedModel,
    batch: GroupedBatch,
    capture: CaptureContext | None,
    *,
    temperature: float,
    return_entropy: bool,
    packed: bool = False,
    router_top_k: int,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """:func:`score_rows` plus each row's router statistics over its full row ``[prompt | completion]``:
    ``(counts, probs, tokens)``, (rows, E), (rows, E), (rows,) float32, the prompt's prefix sums (``capture.router``,
    added to every row of the prompt) plus the row's own Phase 2 sums."""
    scored = score_completions(
        prepared,
        batch,
        capture,
        temperature=temperature,
        return_entropy=return_entropy,
        packed=packed,
        router_top_k=router_top_k,
    )
    mask = batch.completion_mask
    counts, probs, tokens = scored.router
    if capture is not None:
        prompt_counts, prompt_probs, prompt_tokens = capture.router
        rows = batch.group_index
        counts, probs, tokens = counts + prompt_counts[rows], probs + prompt_probs[rows], tokens + prompt_tokens[rows]
    entropy = scatter_valid(scored.entropy, mask) if return_entropy else None
    return scatter_valid(scored.logps, mask), entropy, (counts, probs, tokens)


def _packed_queries(valid: torch.Tensor) -> torch.Tensor:
    """(rows, C) bool: the query tokens the packed layout forwards, i.e. the valid ones.

    With no valid token at all (every completion masked, scored with gradient) the first position of the first row
    is forwarded as a placeholder: a forward needs a token, and the empty result must still come out of the model's
    forward. Its ``query_valid`` entry is False, so the head computes nothing for it.
    """
    if bool(valid.any()):
        return valid
    placeholder = torch.zeros_like(valid)
    placeholder[0, 0] = True
    return placeholder


def forward_phase(prepared: PreparedModel, input_ids, position_ids, context, *, router: bool = False):
    """One forward of the outermost module in a phase.

    Returns the model's logits output (an empty-vocabulary tensor derived from every result the phase attached) and,
    with ``router``, its ``router_logits`` output (one (tokens, E) tensor per MoE layer), else None.
    """
    extra = {"output_router_logits": True} if router else {}
    with (
        force_non_reentrant_checkpointing(prepared.causal_lm),
        activated(context),
        graph_breaks_allowed(prepared.outer),
    ):
        output = prepared.outer(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            **extra,
            **{CONTEXT_KWARG: PhaseHandle(context)},
        )
    context.finished = True
    logits = output.logits if hasattr(output, "logits") else output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{type(prepared.outer).__name__} returned no logits tensor")
    return logits, getattr(output, "router_logits", None) if router else None
