"""How no-grad scoring cuts a batch into *scoring batches* whose forwards stay within a token budget.

(Not to be confused with the *generation chunks* of ``chunked_backward`` or the fused head's *row chunks*.)

A token of budget is one forwarded token, and also the bytes of one hidden state (``hidden_size`` elements of the
model's dtype): memory a phase takes beyond its tokens' activations counts as that many bytes' worth of tokens. With
the ``expand`` backend those are the terms of :mod:`~shared_prefix_logps.backends.expand_memory` (the additive masks,
each row's gathered prompt keys/values, KV heads repeated for a kernel without grouped-query support, explicit
attention scores), which grow with the prompt length and, for the masks and scores, with its square; counting the
prompt's tokens alone would let them outgrow any budget. The packed ``flex`` backend copies nothing per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends.expand import on_fused_path, repeats_kv_heads
from .backends.expand_memory import AttentionShape, prompt_bytes, row_bytes

#: Default most tokens forwarded at once when scoring without gradients.
DEFAULT_TOKEN_BUDGET = 32768


@dataclass(frozen=True)
class ScoringCosts:
    """What a prompt (Phase 1) and a completion row (Phase 2) count against the budget, in tokens.

    Attributes:
        shape: the model's attention shape, or None for the packed layout (tokens only).
        repeats_kv: whether the memory terms include repeated KV heads; None: as the SDPA kernel the expand backend
            will choose for each phase's call shape on ``device`` decides (the fused-kernel path with grouped heads:
            a kernel that takes grouped heads natively holds no copy, :func:`~.backends.expand.repeats_kv_heads`).
        device, dtype: where and in which dtype the calls run (read when ``repeats_kv`` is None).
    """

    shape: AttentionShape | None
    repeats_kv: bool | None = False
    device: torch.device | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, causal_lm: torch.nn.Module, device: torch.device, *, packed: bool) -> ScoringCosts:
        """The costs of ``causal_lm`` on ``device`` with the packed (flex) or padded (expand) layout."""
        if packed:
            return cls(None)
        shape = AttentionShape.of_model(causal_lm)
        if not on_fused_path(device) or shape.kv_heads == shape.heads:
            return cls(shape, repeats_kv=False)
        dtype = causal_lm.get_input_embeddings().weight.dtype
        return cls(shape, repeats_kv=True if shape.explicit_scores else None, device=device, dtype=dtype)

    def _repeats(self, queries: int, keys: int, *, masked: bool) -> bool:
        if self.repeats_kv is not None:
            return self.repeats_kv
        return repeats_kv_heads(self.shape, self.device, self.dtype, queries, keys, masked=masked)

    def prompt_tokens(self, prompt_mask: torch.Tensor) -> int:
        """Tokens of one prompt of a Phase 1 batch of ``prompt_mask`` (num_prompts, P) bool."""
        width = prompt_mask.shape[1]
        if self.shape is None:
            return width
        prefix_len = max(width - 1, 0)
        # An unpadded batch without a window runs causal SDPA without a mask; the mask is counted otherwise.
        masked = not bool(prompt_mask.all()) or self.shape.windowed(prefix_len)
        repeats = self._repeats(prefix_len, prefix_len, masked=masked) if prefix_len else False
        extra = prompt_bytes(self.shape, prefix_len, masked=masked, repeats_kv=repeats)
        return width + self._tokens(extra)

    def row_tokens(self, prompt_mask: torch.Tensor, completion_width: int) -> int:
        """Tokens of one completion row of width ``completion_width`` over prompts of ``prompt_mask``."""
        if self.shape is None:
            return completion_width
        prefix_len = max(prompt_mask.shape[1] - 1, 0)
        # Without padding or a window one (1, 1, C, L + C) mask serves every row: not counted per row.
        masked = not bool(prompt_mask.all()) or self.shape.windowed(prefix_len + completion_width)
        # Every Phase 2 call has a mask (the rows' own causal part at least), counted per row or not.
        keys = prefix_len + completion_width
        repeats = self._repeats(completion_width, keys, masked=True) if completion_width else False
        extra = row_bytes(self.shape, prefix_len, completion_width, masked=masked, repeats_kv=repeats)
        return completion_width + self._tokens(extra)

    def _tokens(self, nbytes: int) -> int:
        per_token = self.shape.hidden_size * self.shape.itemsize
        return -(-nbytes // per_token)


def plan_prompt_batches(
    prompt_mask: torch.Tensor, budget: int | None, costs: ScoringCosts | None
) -> list[torch.Tensor]:
    """Consecutive prompt indices per Phase 1 scoring batch: each batch's prompts' tokens (``costs``) fit in
    ``budget``.

    Args:
        prompt_mask: (num_prompts, P) bool.
        budget: tokens per scoring batch, or None for a single batch.
        costs: what a prompt counts (:class:`ScoringCosts`); may be None when ``budget`` is.
    Returns:
        list of (k,) int64 index tensors covering every prompt once, in order.
    """
    num_prompts = prompt_mask.shape[0]
    per_batch = num_prompts if budget is None else max(1, budget // max(costs.prompt_tokens(prompt_mask), 1))
    return list(torch.arange(num_prompts, device=prompt_mask.device).split(per_batch))


def plan_row_batches(
    completion_mask: torch.Tensor, prompt_mask: torch.Tensor, budget: int | None, costs: ScoringCosts | None
) -> list[torch.Tensor]:
    """Row indices per Phase 2 scoring batch: the rows' tokens (``costs``) fit in ``budget``.

    Args:
        completion_mask: (rows, C) bool.
        prompt_mask: (num_prompts, P) bool of the prompts the rows continue.
        budget: tokens per scoring batch, or None for a single batch.
        costs: what a row counts (:class:`ScoringCosts`); may be None when ``budget`` is.
    """
    rows, width = completion_mask.shape
    per_batch = rows if budget is None else max(1, budget // max(costs.row_tokens(prompt_mask, width), 1))
    return list(torch.arange(rows, device=completion_mask.device).split(per_batch))
