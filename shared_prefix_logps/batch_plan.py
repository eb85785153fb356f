"""The plan of one call: built once at the entry from the grouped batch, then read on the way down.

Everything a call does with its inputs is decided here, before the first forward: whether the rows are scored as a
prefix tree (deeper sharing, :mod:`~shared_prefix_logps.tree.grouped`), which prompts each Phase 1 forward takes
(scoring batches of a no-grad call, :mod:`~shared_prefix_logps.token_budget`), and which rows each Phase 2 forward
takes, already cut to their columns (scoring batches, or the generation chunks of ``chunked_backward``). The phases
forward a chunk's tensors as they are and the output writing puts its results at the chunk's rows: nothing goes back
to the inputs to select or trim them again while the model runs.

A :class:`GroupedBatch` is the one-level (depth-1) case of the sharing: prompts, and rows that continue them. When
distinct prompts share a prefix among themselves the plan holds the rows ``[prompt | completion]`` for the tree pass
instead, and the trie is built once, by that pass (the decision to take it needs none: ``prompt_tokens_saved``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import GroupedBatch
from .token_budget import ScoringCosts, plan_prompt_batches, plan_row_batches
from .tree.grouped import deeper_sharing_pays, grouped_tree_rows
from .tree.inputs import TreeRows


@dataclass(frozen=True)
class RowChunk:
    """The rows of one Phase 2 forward.

    Attributes:
        rows: (k,) int64, the chunk's rows among the call's completion rows: where its results are written.
        batch: the prompts of its :class:`PromptChunk` and these rows (``group_index`` into those prompts), the
            completions cut to the chunk's longest valid row and never narrower than one column (a masked one where
            no row of the chunk has a valid token, so that every row has a query to forward).
        has_valid: whether any completion token of the chunk is valid.
    """

    rows: torch.Tensor
    batch: GroupedBatch
    has_valid: bool


@dataclass(frozen=True)
class PromptChunk:
    """The prompts of one Phase 1 forward and the Phase 2 forwards that attend over their keys/values.

    Attributes:
        prompt_ids, prompt_mask: (k, P) int64 / bool, left-padded.
        row_chunks: the Phase 2 forwards over these prompts' rows, in order.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    row_chunks: tuple[RowChunk, ...]


@dataclass(frozen=True)
class BatchPlan:
    """What one call forwards, decided once.

    Attributes:
        batch: the call's grouped rows; results are (rows, C) for its C = ``batch.completion_ids.shape[1]``.
        prompt_chunks: the phases' forwards, in order (empty when nothing is forwarded: no valid token without
            gradients, or the tree pass).
        backend: the concrete attention backend the phases run (``expand``, ``flex``, ``flash`` or ``dense``).
        router: ``(num_experts, top_k)`` when router statistics are requested, else None.
        tree_rows: the rows ``[prompt | completion]`` when the tree pass scores them (deeper sharing), else None.
        width: the columns results are computed in, ``max(C, 1)``: a call whose completions have no column forwards
            one masked column; the output is cut back to C.
    """

    batch: GroupedBatch
    prompt_chunks: tuple[PromptChunk, ...]
    backend: str = "expand"
    router: tuple[int, int] | None = None
    tree_rows: TreeRows | None = None

    @property
    def width(self) -> int:
        return max(self.batch.completion_ids.shape[1], 1)

    @property
    def has_valid(self) -> bool:
        """Whether any completion token of the call is valid."""
        return bool(self.batch.completion_mask.any())

    @property
    def has_prefix(self) -> bool:
        """Whether some prompt has a token before its last (Phase 1 has something to forward)."""
        return bool(self.batch.prompt_mask[:, :-1].any())

    def row_chunks(self) -> list[RowChunk]:
        """Every Phase 2 forward of the call, in order."""
        return [chunk for prompts in self.prompt_chunks for chunk in prompts.row_chunks]


def plan_scoring(
    batch: GroupedBatch,
    *,
    backend: str,
    budget: int | None,
    costs: ScoringCosts | None,
    router: tuple[int, int] | None = None,
) -> BatchPlan:
    """The plan of ``compute_logps``/``compute_logps_concatenated``.

    Args:
        batch: the validated, grouped inputs.
        backend: the concrete attention backend (``expand``, ``flex``, ``flash`` or ``dense``).
        budget: tokens per scoring batch (no-grad calls), or None for one Phase 1 and one Phase 2 forward.
        costs: what a prompt and a row count against ``budget`` (None when ``budget`` is).
        router: ``(num_experts, top_k)`` when router statistics are requested: every row is forwarded (its
            prompt's tokens are routed in the dense row whether or not it has a valid completion token) and the
            one-level path runs.

    Without gradients a call with no valid token forwards nothing. With gradients it forwards every row (its zero
    result then comes out of the model's graph, as the dense path's does); a chunk without a valid token is skipped
    otherwise.
    """
    routed = router is not None
    has_valid = bool(batch.completion_mask.any())
    if not has_valid and not torch.is_grad_enabled() and not routed:
        return BatchPlan(batch, (), backend, router)
    if backend == "expand" and has_valid and not routed and deeper_sharing_pays(batch):
        # Distinct prompts share a prefix (a common system prompt): the trie forwards it once, not once per prompt.
        return BatchPlan(batch, (), backend, router, tree_rows=grouped_tree_rows(batch))
    if backend == "dense":
        all_rows = torch.arange(batch.completion_ids.shape[0], device=batch.group_index.device)
        chunk = PromptChunk(batch.prompt_ids, batch.prompt_mask, (_row_chunk(batch, all_rows),))
        return BatchPlan(batch, (chunk,), backend, router)
    forward_empty = not has_valid or routed
    chunks = []
    for prompt_indices in plan_prompt_batches(batch.prompt_mask, budget, costs):
        sub, sub_rows = batch.select_prompts(prompt_indices)
        row_chunks = []
        for local_rows in plan_row_batches(sub.completion_mask, sub.prompt_mask, budget, costs):
            chunk = _row_chunk(sub, local_rows, rows=sub_rows[local_rows])
            if chunk.has_valid or forward_empty:
                row_chunks.append(chunk)
        chunks.append(PromptChunk(sub.prompt_ids, sub.prompt_mask, tuple(row_chunks)))
    return BatchPlan(batch, tuple(chunks), backend, router)


def plan_generation_chunks(
    batch: GroupedBatch, generations_per_chunk: int, *, backend: str, router: tuple[int, int] | None = None
) -> BatchPlan:
    """The plan of ``chunked_backward``: one Phase 1 forward of every prompt, then a chunk per
    ``generations_per_chunk`` generations of each prompt (rows ``g*G + j .. g*G + j + generations_per_chunk - 1`` for
    every prompt g). Every chunk is listed; the caller decides whether one without a valid token is forwarded."""
    rows = batch.completion_ids.shape[0]
    num_prompts = batch.prompt_ids.shape[0]
    generations = rows // num_prompts
    device = batch.group_index.device
    starts = torch.arange(num_prompts, device=device) * generations
    row_chunks = []
    for first in range(0, generations, generations_per_chunk):
        offsets = torch.arange(first, min(first + generations_per_chunk, generations), device=device)
        row_chunks.append(_row_chunk(batch, (starts[:, None] + offsets[None, :]).reshape(-1)))
    prompts = PromptChunk(batch.prompt_ids, batch.prompt_mask, tuple(row_chunks))
    return BatchPlan(batch, (prompts,), backend, router)


def placeholder_chunk(batch: GroupedBatch) -> RowChunk:
    """The rows of the first prompt, every completion token masked in one column: the chunk a process forwards (and
    back-propagates with weight zero) in place of one another process makes (lockstep)."""
    rows = (batch.group_index == 0).nonzero().squeeze(1)
    masked = GroupedBatch(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        completion_ids=batch.completion_ids.new_zeros(rows.numel(), 1),
        completion_mask=batch.completion_mask.new_zeros(rows.numel(), 1),
        group_index=batch.group_index[rows],
    )
    return RowChunk(rows, masked, False)


def _row_chunk(batch: GroupedBatch, local_rows: torch.Tensor, *, rows: torch.Tensor | None = None) -> RowChunk:
    """The chunk of ``batch``'s ``local_rows`` (``rows``: their indices in the call, ``local_rows`` by default)."""
    part = batch.select_rows(local_rows)
    return RowChunk(local_rows if rows is None else rows, part, bool(part.completion_mask.any()))
