"""The two phases of a shared-prefix forward, both through the caller's outermost module.

Phase 1 forwards each prompt once, without its last token, and records every layer's post-RoPE keys/values.
Phase 2 forwards each completion row as ``[last prompt token, completion[:-1]]`` at positions that continue its
prompt; its queries attend over the group's recorded prefix and causally over the row itself, and the lm_head
proxy turns the valid queries' hidden states into log-probs of the completion tokens.

Both phases come in two layouts: ``padded`` (backend ``expand``: rows of the batch as they are) and ``packed``
(backend ``flex``: the real tokens of all rows back to back in one row, no padding processed).
"""

from __future__ import annotations

import torch

from .forward.context import CONTEXT_KWARG, CaptureContext, PhaseHandle, SharedContext, activated
from .forward.routing import release
from .inputs import GroupedBatch
from .model_support import PreparedModel, force_non_reentrant_checkpointing
from .output import scatter_valid


def capture_prefix(
    prepared: PreparedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, packed: bool = False
) -> CaptureContext | None:
    """Phase 1: forward ``prompt[:, :-1]`` of every prompt once and record each layer's keys/values.

    Args:
        prompt_ids, prompt_mask: (num_prompts, P) left-padded prompts.
        packed: use the packed layout (flex backend).

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
            packed=True,
            segments=segments[prefix_mask],
        )
        input_ids = prefix_ids[prefix_mask][None]
    else:
        context = CaptureContext(key_valid=prefix_mask, positions=positions, needs_grad=needs_grad)
        input_ids = prefix_ids
    output = _forward(prepared, input_ids, context.positions, context)
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
) -> SharedContext:
    """Phase 2: log-probs (and entropy) of every valid completion token; see :class:`SharedContext`.

    ``batch.group_index`` indexes the prompts of ``capture``. The returned context's ``logps``/``entropy`` are
    (num_valid,) float32 in row-major order of ``batch.completion_mask``.
    """
    rows, length = batch.completion_ids.shape
    group_index = batch.group_index
    last_prompt_token = batch.prompt_ids[group_index, -1]
    query_ids = torch.cat([last_prompt_token[:, None], batch.completion_ids[:, :-1]], dim=1)
    start = batch.prompt_lengths[group_index] - 1
    positions = start[:, None] + torch.arange(length, device=start.device)[None, :]
    valid = batch.completion_mask
    common = dict(
        capture=capture,
        group_index=group_index,
        head_targets=batch.completion_ids[valid],
        temperature=temperature,
        return_entropy=return_entropy,
        needs_grad=torch.is_grad_enabled(),
        head_spec=prepared.head,
    )
    if packed:
        forwarded = _packed_queries(valid)
        query_rows = torch.arange(rows, device=valid.device)[:, None].expand_as(valid)[forwarded]
        context = SharedContext(
            positions=positions[forwarded][None],
            query_valid=valid[forwarded][None],
            packed=True,
            query_rows=query_rows,
            **common,
        )
        input_ids = query_ids[forwarded][None]
    else:
        context = SharedContext(positions=positions, query_valid=valid, **common)
        input_ids = query_ids
    output = _forward(prepared, input_ids, context.positions, context)
    if context.route is None:
        raise ValueError(f"{type(prepared.causal_lm).__name__} did not call its lm_head inside its forward")
    released = release(output, [context.route])
    context.logps = released[0]
    context.entropy = released[1] if return_entropy else None
    return context


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


def _forward(prepared: PreparedModel, input_ids, position_ids, context) -> torch.Tensor:
    """One forward of the outermost module in a phase; returns the model's logits output (an empty-vocabulary
    tensor derived from every result the phase attached)."""
    with force_non_reentrant_checkpointing(prepared.causal_lm), activated(context):
        output = prepared.outer(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **{CONTEXT_KWARG: PhaseHandle(context)}
        )
    context.finished = True
    logits = output.logits if hasattr(output, "logits") else output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{type(prepared.outer).__name__} returned no logits tensor")
    return logits
