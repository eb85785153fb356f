"""Per-row response results laid out as verl's ``forward_step`` returns them, and read back.

verl's ``model_output["log_probs"]`` (and ``"entropy"``) is a jagged tensor over every sequence's valid tokens, prompt
included: position t holds the value for predicting token t + 1. Its loss functions read only the response slice
(``no_padding_2_padding``: positions ``prompt_len - 1 .. prompt_len + response_len - 2`` of each sequence). The shared
path computes only that slice; everything else is 0.
"""

from __future__ import annotations

import torch

from .batch import VerlRows


def to_sequences(values: torch.Tensor, rows: VerlRows) -> torch.Tensor:
    """(N, R) float32 values (0 where the response is masked) -> jagged (N, j) float32 over whole sequences.

    Differentiable: the gradient of each jagged position flows to the (N, R) value it came from.
    """
    valid = rows.response_mask
    flat = values.new_zeros(int(rows.offsets[-1]))
    flat = flat.index_put((rows.response_positions()[valid],), values[valid])
    return torch.nested.nested_tensor_from_jagged(flat, rows.offsets)


def from_sequences(nested: torch.Tensor, rows: VerlRows) -> torch.Tensor:
    """The inverse for reading verl's own result: jagged (N, j) -> (N, R) float64, 0 where the response is masked."""
    valid = rows.response_mask
    flat = nested.values().double()
    out = torch.zeros(valid.shape, dtype=flat.dtype, device=flat.device)
    out[valid] = flat[rows.response_positions()[valid]]
    return out


def scatter_rows(total: torch.Tensor | None, part: torch.Tensor, indices: torch.Tensor | None, rows: int):
    """``total`` (rows, R) with ``part`` written at ``indices`` (None: ``part`` is every row), out of place."""
    if indices is None:
        return part
    if total is None:
        total = part.new_zeros((rows, part.shape[1]))
    return total.index_put((indices,), part)
