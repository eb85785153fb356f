"""The methods the tree benchmark puts side by side on a prefix-tree workload (:mod:`.tree_workloads`).

- ``dense``: every row in full through the model's own forward, causal, no pads (rows of one length and one
  scored layout forwarded together, cut to that length), the head over the scored positions only; in micro-batches
  of at most ``dense_tokens`` tokens, each with its own backward when training (gradient accumulation).
- ``two_level``: the two-level trie of ``compute_logps`` (score) and ``chunked_backward`` (train): each distinct
  prompt part forwarded once, every completion in full, deeper sharing switched off
  (:func:`~shared_prefix_logps.engine.sharing.two_level_trie_only`). It scores every completion token (tool spans too);
  the unscored ones are dropped afterwards.
- ``tree``: ``compute_logps_tree`` (score) and ``chunked_backward_tree`` (train): every trie token forwarded once.
  The tiny-node rule is off here (``merge_tiny_nodes=False``), so that the tokens forwarded are the trie's, the
  floor the records count; the rule's own trade is measured by ``python -m shared_prefix_logps.bench.node_cost``.

Every step returns the detached (N, L) float32 log-probs at the workload's scored positions, 0 elsewhere; training
steps back-propagate the sum of those log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import chunked_backward, chunked_backward_tree, compute_logps, compute_logps_tree
from ..engine.sharing import two_level_trie_only
from .tree_workloads import TreeWorkload

#: Default most tokens of one dense micro-batch (rows of one length): whole rows, at least one.
DEFAULT_DENSE_TOKENS = 8192


@dataclass(frozen=True)
class TwoLevelLayout:
    """The workload as a GRPO batch: ``prompts`` (B, P) left-padded, ``completions`` (B*G, C) right-padded (the
    tokens after each row's ``prompt_length``), bool masks, and ``completion_score`` (B*G, C) bool, the scored
    completion tokens. Row ``i`` of the workload is completion row ``i``."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    completions: torch.Tensor
    completion_mask: torch.Tensor
    completion_score: torch.Tensor

    @property
    def generations(self) -> int:
        return self.completions.shape[0] // self.prompts.shape[0]

    @classmethod
    def of(cls, workload: TreeWorkload) -> TwoLevelLayout:
        """Rows with the same prompt part must be consecutive, ``G`` of them per prompt (ValueError otherwise)."""
        lengths = workload.attention_mask.sum(1).tolist()
        split = workload.prompt_length.tolist()
        if any(not workload.attention_mask[i, :n].all() for i, n in enumerate(lengths)):
            raise ValueError("workload: rows must be right-padded (real tokens first)")
        prompts: list[list[int]] = []
        for i, p in enumerate(split):
            prompt = workload.input_ids[i, :p].tolist()
            if not prompts or prompts[-1] != prompt:
                prompts.append(prompt)
        rows = len(split)
        if rows % len(prompts):
            raise ValueError(f"workload: {rows} rows over {len(prompts)} prompts is not G rows per prompt")
        width_p = max(len(p) for p in prompts)
        width_c = max(n - p for n, p in zip(lengths, split))
        prompt_ids = torch.zeros(len(prompts), width_p, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids, dtype=torch.bool)
        for b, prompt in enumerate(prompts):
            prompt_ids[b, width_p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[b, width_p - len(prompt) :] = True
        completions = torch.zeros(rows, width_c, dtype=torch.long)
        completion_mask = torch.zeros_like(completions, dtype=torch.bool)
        completion_score = torch.zeros_like(completion_mask)
        g = rows // len(prompts)
        for i, (n, p) in enumerate(zip(lengths, split)):
            if workload.input_ids[i, :p].tolist() != prompts[i // g]:
                raise ValueError(f"workload: row {i} does not continue prompt {i // g}; G={g} rows per prompt needed")
            completions[i, : n - p] = workload.input_ids[i, p:n]
            completion_mask[i, : n - p] = True
            completion_score[i, : n - p] = workload.score_mask[i, p:n]
        if any(workload.score_mask[i, :p].any() for i, p in enumerate(split)):
            raise ValueError("workload: a scored token inside a row's prompt part; the two-level trie scores none")
        return cls(prompt_ids, prompt_mask, completions, completion_mask, completion_score)

    def to_rows(self, logps: torch.Tensor, workload: TreeWorkload) -> torch.Tensor:
        """(B*G, C) completion log-probs as the workload's (N, L), 0 where not scored."""
        out = torch.zeros(workload.score_mask.shape, dtype=torch.float32, device=logps.device)
        split = workload.prompt_length.tolist()
        for i, p in enumerate(split):
            n = int(self.completion_mask[i].sum())
            out[i, p : p + n] = logps[i, :n]
        return out.masked_fill(~workload.score_mask.to(out.device), 0.0)


@dataclass(frozen=True)
class TreeCase:
    """A workload on a device, in the layouts the methods take; ``chunk_rows`` rows per backward chunk of the
    chunked methods (``two_level``: ``chunk_rows / B`` generations of every prompt).

    Every method trains within the same activation budget: dense back-propagates once per ``dense_tokens`` tokens of
    full rows, and a chunk of the chunked methods holds as many rows as fit in ``dense_tokens`` tokens of the longest
    row (one at least), so no method is timed with more backward passes than the memory it is given requires."""

    workload: TreeWorkload
    two_level: TwoLevelLayout
    dense_tokens: int
    chunk_rows: int

    @classmethod
    def of(cls, workload: TreeWorkload, device, *, dense_tokens: int = DEFAULT_DENSE_TOKENS) -> TreeCase:
        if isinstance(dense_tokens, bool) or not isinstance(dense_tokens, int) or dense_tokens < 1:
            raise ValueError(f"dense_tokens must be a positive int, got {dense_tokens!r}")
        layout = TwoLevelLayout.of(workload)
        moved = TreeWorkload(
            workload.name,
            workload.input_ids.to(device),
            workload.attention_mask.to(device),
            workload.score_mask.to(device),
            workload.prompt_length,
        )
        layout = TwoLevelLayout(*(t.to(device) for t in vars(layout).values()))
        longest = int(workload.attention_mask.sum(1).max())
        prompts = layout.prompts.shape[0]
        # Whole generations of every prompt per chunk (the two-level method's unit), as many as fit in the budget.
        chunk_rows = prompts * max(1, min(layout.generations, dense_tokens // max(1, longest * prompts)))
        return cls(moved, layout, dense_tokens, chunk_rows)

    def dense_groups(self) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """``(rows, length, scored columns)`` per dense micro-batch: rows of one real length and one scored layout,
        at most ``dense_tokens`` tokens together (one row at least)."""
        w = self.workload
        lengths = w.attention_mask.sum(1).tolist()
        groups: dict[tuple, list[int]] = {}
        for row, n in enumerate(lengths):
            groups.setdefault((n, w.score_mask[row, :n].cpu().numpy().tobytes()), []).append(row)
        batches = []
        for (n, _), rows in groups.items():
            columns = w.score_mask[rows[0], :n].nonzero().squeeze(1)
            index = torch.tensor(rows, dtype=torch.long, device=w.input_ids.device)
            for part in index.split(max(1, self.dense_tokens // max(n, 1))):
                batches.append((part, n, columns))
        return batches


Step = Callable[[torch.nn.Module, TreeCase, bool], torch.Tensor]


#: Config fields that change the logits after the head (softcaps, scales): a model with one of them set runs its own
#: forward whole, head included, per micro-batch.
_LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _head_apart(model) -> bool:
    """Whether the model's logits are its ``lm_head`` of its decoder's last hidden states, nothing else."""
    config = model.config
    return (
        hasattr(model, "model")
        and model.get_output_embeddings() is not None
        and not any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_MODIFIERS)
    )


def _dense(model, case: TreeCase, train: bool) -> torch.Tensor:
    """Every row through the model in micro-batches of rows of one length, each micro-batch's decoder forward on its
    own; per ``dense_tokens`` tokens of micro-batches, the head once on their scored positions and (with ``train``)
    one backward, as a trainer accumulates within its memory. A head and backward per micro-batch would build the
    full-vocabulary head and embedding weight gradients (545 MB at Qwen2.5's vocabulary) once per row length: work
    that the FLOP floor does not count, and that made dense slower than its FLOPs on rows of many lengths."""
    w = case.workload
    out = torch.zeros(w.score_mask.shape, dtype=torch.float32, device=w.input_ids.device)
    head_apart = _head_apart(model)
    pending, pending_tokens = [], 0  # (rows, columns, hidden states or log-probs, targets)

    def flush():
        if not pending:
            return
        if head_apart:
            hidden = torch.cat([h.reshape(-1, h.shape[-1]) for _, _, h, _ in pending])
            targets = torch.cat([t.reshape(-1) for _, _, _, t in pending])
            logits = model.get_output_embeddings()(hidden).float()
            flat = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
            parts = flat.split([t.numel() for _, _, _, t in pending])
            logps = [part.view(t.shape) for part, (_, _, _, t) in zip(parts, pending)]
        else:
            logps = [lp for _, _, lp, _ in pending]
        if train:
            torch.stack([lp.sum() for lp in logps]).sum().backward()
        for (rows, columns, _, _), lp in zip(pending, logps):
            out[rows[:, None], columns[None, :]] = lp.detach()
        pending.clear()

    for rows, length, columns in case.dense_groups():
        if columns.numel() == 0:
            continue  # nothing scored: no log-prob and no gradient
        ids = w.input_ids[rows, :length]
        if pending and pending_tokens + ids.numel() > case.dense_tokens:
            with torch.set_grad_enabled(train):
                flush()
            pending_tokens = 0
        targets = ids[:, columns]
        with torch.set_grad_enabled(train):
            # No attention mask: the rows are cut to their real tokens, so attention is plain causal. The head runs
            # on the hidden states that predict the scored tokens only.
            if head_apart:
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, columns - 1]
                pending.append((rows, columns, hidden, targets))
            else:
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=columns - 1).logits.float()
                logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
                pending.append((rows, columns, logps, targets))
        pending_tokens += ids.numel()
    with torch.set_grad_enabled(train):
        flush()
    return out


def _two_level(model, case: TreeCase, train: bool) -> torch.Tensor:
    layout = case.two_level
    with two_level_trie_only():
        if not train:
            with torch.no_grad():
                out = compute_logps(
                    model,
                    layout.prompts,
                    layout.completions,
                    prompt_mask=layout.prompt_mask,
                    completion_mask=layout.completion_mask,
                )
            return layout.to_rows(out.logps, case.workload)
        score = layout.completion_score
        out = chunked_backward(
            model,
            layout.prompts,
            layout.completions,
            lambda chunk, rows: (chunk.logps * score[rows]).sum(),
            generations_per_chunk=max(1, case.chunk_rows // layout.prompts.shape[0]),
            prompt_mask=layout.prompt_mask,
            completion_mask=layout.completion_mask,
        )
    return layout.to_rows(out.logps, case.workload)


def _tree(model, case: TreeCase, train: bool) -> torch.Tensor:
    w = case.workload
    if not train:
        with torch.no_grad():
            return compute_logps_tree(model, w.input_ids, w.attention_mask, w.score_mask, merge_tiny_nodes=False).logps
    out = chunked_backward_tree(
        model,
        w.input_ids,
        w.attention_mask,
        w.score_mask,
        lambda chunk, rows: chunk.logps.sum(),
        rows_per_chunk=case.chunk_rows,
        merge_tiny_nodes=False,
    )
    return out.logps


#: name -> step. Each returns the detached (N, L) float32 log-probs at the scored positions.
TREE_METHODS: dict[str, Step] = {"dense": _dense, "two_level": _two_level, "tree": _tree}
