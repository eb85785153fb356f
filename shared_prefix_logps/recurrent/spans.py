"""Where each node's tokens sit in the input of a recurrent layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NodeSpans:
    """N nodes, each a contiguous run of tokens of one row of a (rows, length, hidden) layer input.

    One node per row covers padded rows (left or right padding: the span skips the padding); several nodes per row
    cover tokens packed back to back (a node call's (1, T) layout). Tokens outside every span are not read, and the
    layer's output is zero there.

    Attributes:
        row: (N,) int64, the row holding each node's tokens.
        start: (N,) int64, index of each node's first token in its row.
        length: (N,) int64, tokens per node (at least 1).
    """

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor

    def __post_init__(self):
        shapes = {self.row.shape, self.start.shape, self.length.shape}
        if len(shapes) != 1 or self.row.dim() != 1:
            raise ValueError(f"row, start and length must be 1-D of one size, got shapes {sorted(shapes)}")
        if self.length.numel() and int(self.length.min()) < 1:
            raise ValueError("every node needs at least one token (length >= 1)")
        if self.start.numel() and int(self.start.min()) < 0:
            raise ValueError("start must be >= 0")

    @property
    def nodes(self) -> int:
        return self.row.numel()

    @staticmethod
    def from_mask(mask: torch.Tensor) -> NodeSpans:
        """One node per row of a (rows, length) bool/0-1 mask whose True entries are contiguous in each row (left-
        or right-padded rows); every row needs at least one True entry."""
        mask = mask.bool().cpu()
        if mask.dim() != 2:
            raise ValueError(f"mask must be 2-D (rows, length), got shape {tuple(mask.shape)}")
        length = mask.sum(1)
        if bool((length == 0).any()):
            raise ValueError("every row of mask needs at least one real token")
        start = mask.int().argmax(1)
        end = start + length
        columns = torch.arange(mask.shape[1])
        contiguous = ((columns >= start[:, None]) & (columns < end[:, None])) == mask
        if not bool(contiguous.all()):
            raise ValueError("mask must hold each row's real tokens in one contiguous run (left or right padding)")
        return NodeSpans(row=torch.arange(mask.shape[0]), start=start, length=length)

    @staticmethod
    def packed(length: torch.Tensor) -> NodeSpans:
        """Nodes of ``length`` ((N,) int64) tokens packed back to back in one row, as a node call lays them out."""
        length = length.cpu().long()
        start = torch.cumsum(length, 0) - length
        return NodeSpans(row=torch.zeros_like(length), start=start, length=length)

    def covers_rows(self, rows: int, columns: int) -> bool:
        """Whether the nodes are exactly the ``rows`` full rows of ``columns`` tokens, in row order (no padding,
        nothing packed): the layer input is then the nodes' tokens as they are."""
        return (
            self.nodes == rows
            and bool((self.row.cpu() == torch.arange(rows)).all())
            and bool((self.start == 0).all())
            and bool((self.length == columns).all())
        )
