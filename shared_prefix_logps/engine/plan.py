"""The plan of one call, decided once at the entry before the first forward: the trie of its rows, the scored pairs,
where each result goes, and the order of its node calls.

Every entry point builds a :class:`Plan` and hands it to the walk (:mod:`.walk`), which forwards, for each chunk of
rows in the plan's order, the nodes on the chunk's paths that no earlier chunk forwarded, one node call per depth.
The entry points differ only in the order the plan states:

- with gradients (``compute_logps*`` under grad): all rows in one chunk, so one node call per trie depth;
- without (scoring): chunks of rows in depth-first order within the token budget (:mod:`.budget`);
- ``chunked_backward``: chunks of generations, the same generations of every prompt in each (prompt calls stay alive
  until every row below them is done); ``chunked_backward_tree``: ``rows_per_chunk`` rows in depth-first order.

A grouped batch (prompts and their completions) is a two-level trie built directly (:func:`~.trie.grouped_trie`), or,
when distinct prompts share enough (:mod:`.sharing`), the trie searched from its rows; rows of any shape (the tree
entry points) get the searched trie. Tiny nodes are merged into their children there (:mod:`.merge`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..inputs import GroupedBatch, TreeRows
from ..model import PreparedModel
from .call_planner import ScoredPairs, scored_pairs
from .merge import rows_trie
from .sharing import grouped_rows
from .trie import PrefixTrie, grouped_trie


@dataclass(frozen=True)
class Plan:
    """What one call forwards, and in which order.

    Attributes:
        trie: the rows' trie.
        pairs: the scored pairs; ``pairs.of_scored`` follows ``score_mask`` in row-major order.
        score_mask: (rows, width) bool on the host: the output's scored positions (the completion tokens of a grouped
            batch, (rows, C); a tree call's score mask, (N, L)).
        output_mask: ``score_mask`` on the model's device: the output's mask, where the results are scattered.
        chunks: (k,) int64 CPU row indices per chunk, in order; every row once (empty until an order is chosen).
    """

    trie: PrefixTrie
    pairs: ScoredPairs
    score_mask: torch.Tensor
    output_mask: torch.Tensor
    chunks: tuple[torch.Tensor, ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.score_mask.shape[0])

    def ordered(self, chunks) -> Plan:
        """The plan with its rows taken in ``chunks``."""
        return replace(self, chunks=tuple(chunks))

    def depth_first_rows(self) -> torch.Tensor:
        """(rows,) int64: the rows in the depth-first order of the node each ends at (rows that share the most come
        together), empty rows last."""
        ends = self.trie.row_end.clone()
        ends[ends < 0] = self.trie.num_nodes
        return torch.argsort(ends, stable=True)

    def in_one_chunk(self) -> Plan:
        """Every row in one chunk: one node call per trie depth (a call with gradients builds one graph)."""
        return self.ordered([torch.arange(self.num_rows)])

    def in_chunks_of(self, rows_per_chunk: int) -> Plan:
        """``rows_per_chunk`` rows per chunk in depth-first order (``chunked_backward_tree``)."""
        return self.ordered(self.depth_first_rows().split(rows_per_chunk))


def grouped_plan(batch: GroupedBatch, *, deeper: bool, merge_below: int, one_token_forks: bool = True) -> Plan:
    """The plan (without an order) of a grouped batch: its two-level trie, or with ``deeper`` the trie searched from its
    rows ``[prompt | completion]`` with the tiny-node rule's ``merge_below`` (and ``one_token_forks``, see
    :func:`one_token_forks`; the two-level trie has no node between a parent and children). Results are (rows, C)."""
    mask = batch.completion_mask
    row, column = mask.nonzero(as_tuple=True)
    target = batch.completion_ids[row, column]
    prompt_length = batch.prompt_mask.sum(1)[batch.group_index]
    if deeper:
        trie = rows_trie(grouped_rows(batch), merge_below, one_token_forks=one_token_forks)
    else:
        trie = grouped_trie(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.group_index
        )
    return Plan(trie, scored_pairs(trie, row, prompt_length[row] + column, target), mask, batch.output_mask)


def rows_plan(rows: TreeRows, merge_below: int, *, one_token_forks: bool = True) -> Plan:
    """The plan (without an order) of the tree entry points' rows: their searched trie with the tiny-node rule's
    ``merge_below`` (0: none), and without ``one_token_forks`` no one-token node between a parent and children
    (:func:`one_token_forks`). Results are (N, L)."""
    trie = rows_trie(rows, merge_below, one_token_forks=one_token_forks)
    row, column = rows.score_mask.nonzero(as_tuple=True)
    target = rows.input_ids[row, column]
    pairs = scored_pairs(trie, row, column - rows.first_column[row], target)
    return Plan(trie, pairs, rows.score_mask, rows.output_mask)


def one_token_forks(prepared: PreparedModel) -> bool:
    """Whether the plan may keep one-token nodes between a parent and children for ``prepared`` in the current grad
    mode. A linear-attention hybrid runs such a node's recurrent layers from its parent's state through their
    one-token decode path, which back-propagates into that state only where ``prepared.recurrent.one_token_backward``
    says so; elsewhere, with gradients, the plan merges those nodes into their children
    (:func:`~.merge.split_one_token_forks`)."""
    recurrent = prepared.recurrent
    return recurrent is None or recurrent.one_token_backward or not torch.is_grad_enabled()


def generation_chunks(num_prompts: int, generations: int, per_chunk: int) -> list[torch.Tensor]:
    """``chunked_backward``'s chunks of completion rows: ``per_chunk`` generations of every prompt each (rows
    ``g*G + j .. g*G + j + per_chunk - 1`` for every prompt g), prompt by prompt."""
    starts = torch.arange(num_prompts) * generations
    chunks = []
    for first in range(0, generations, per_chunk):
        offsets = torch.arange(first, min(first + per_chunk, generations))
        chunks.append((starts[:, None] + offsets[None, :]).reshape(-1))
    return chunks
