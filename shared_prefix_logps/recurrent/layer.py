"""One recurrent layer over the tokens of some nodes, each node starting from a given state, through the layer's own
forward and kernels."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from .cache import state_cache
from .spans import NodeSpans
from .state import RecurrentState

#: Names transformers versions give a recurrent layer's cache argument (5.24: ``cache``; 5.15-5.23: ``cache_params``).
_CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")


def cache_argument(forward: Callable) -> str:
    """The name under which ``forward`` (a recurrent layer's own forward) takes its cache."""
    parameters = inspect.signature(forward).parameters
    for name in _CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(
        f"{getattr(forward, '__qualname__', forward)} takes no cache argument ({', '.join(_CACHE_ARGUMENTS)})"
    )


def conv_kernel_size(mixer: nn.Module) -> int | None:
    """The kernel size of the layer's short convolution (None if it has none)."""
    size = getattr(mixer, "conv_kernel_size", None)
    if isinstance(size, int):
        return size
    for child in mixer.children():
        if isinstance(child, nn.Conv1d):
            return child.kernel_size[0]
    return None


def run_from_states(
    mixer: nn.Module,
    hidden_states: torch.Tensor,
    spans: NodeSpans,
    initial: RecurrentState | None = None,
    *,
    forward: Callable | None = None,
    keep_ends: bool = True,
) -> tuple[torch.Tensor, RecurrentState | None]:
    """Run recurrent layer ``mixer`` over each node's tokens, node ``n`` starting from row ``n`` of ``initial``.

    The nodes go through the layer's own forward (``forward``, default ``mixer.forward``: pass the original when the
    module's forward is wrapped), one call per distinct node length, each node's tokens gathered into an unpadded
    row; the state reaches the layer through its cache argument (:mod:`.cache`). So no padding is ever scanned: a
    left-padded prompt gives the unpadded prompt's state, a right-padded row ends where its tokens end, and packed
    nodes do not run into each other.

    Args:
        mixer: the recurrent layer (its ``layer_idx`` names its cache entry).
        hidden_states: (rows, columns, hidden) the layer's input, any float dtype.
        spans: where each of the N nodes' tokens sit in ``hidden_states``.
        initial: the N nodes' initial states (each child's parent's end state, :meth:`RecurrentState.select`);
            None when every node starts a row (zero rows of a given state are equivalent).
        keep_ends: False when no node has children (leaves): the end states are not returned, and a one-token node
            that starts from a state runs as two copies of its token, so the layer's chunked path runs instead of
            its one-token decode path (flash-linear-attention's ``fused_recurrent`` kernel has no backward, Mamba2's
            ``selective_state_update`` overwrites the state it read); the first copy's output is the token's own.

    Returns:
        (output, end): output (rows, columns, out_hidden) in the layer's output dtype, zero outside every span;
        end: the N nodes' states after their last token (None unless ``keep_ends``). Both differentiable with
        respect to the layer's parameters, ``hidden_states`` and ``initial``.
    """
    forward = mixer.forward if forward is None else forward
    argument = cache_argument(forward)
    kernel_size = conv_kernel_size(mixer)
    layer_idx = mixer.layer_idx
    rows, columns = hidden_states.shape[:2]
    _check(spans, initial, rows, columns)

    def segment(hidden: torch.Tensor, start: RecurrentState | None) -> tuple[torch.Tensor, RecurrentState]:
        cache, layer = state_cache(layer_idx, start, kernel_size)
        output = forward(hidden, **{argument: cache})
        return output, layer.end_state()

    widen_single = not keep_ends and initial is not None
    if spans.covers_rows(rows, columns) and not (widen_single and columns == 1):
        output, end = segment(hidden_states, initial)
        return output, end if keep_ends else None

    device = hidden_states.device
    row, start, length = spans.row, spans.start, spans.length
    order, rows_written, columns_written, values, ends = [], [], [], [], []
    for size in torch.unique(length).tolist():
        nodes = (length == size).nonzero().flatten()
        node_rows = row[nodes].to(device)[:, None]
        node_columns = (start[nodes][:, None] + torch.arange(size)).to(device)
        # A one-token leaf from a state: two copies of the token (see keep_ends); only the first one's output is used.
        read_columns = node_columns.expand(-1, 2) if size == 1 and widen_single else node_columns
        output, end = segment(
            hidden_states[node_rows, read_columns], None if initial is None else initial.select(nodes)
        )
        output = output[:, :size]
        order.append(nodes)
        rows_written.append(node_rows.expand(-1, size).reshape(-1))
        columns_written.append(node_columns.reshape(-1))
        values.append(output.reshape(-1, output.shape[-1]))
        ends.append(end)
    values = torch.cat(values)
    output = values.new_zeros((rows, columns, values.shape[-1])).index_put(
        (torch.cat(rows_written), torch.cat(columns_written)), values
    )
    if not keep_ends:
        return output, None
    # Back from length groups to node order.
    inverse = torch.argsort(torch.cat(order))
    return output, RecurrentState.cat(ends).select(inverse)


def _check(spans: NodeSpans, initial: RecurrentState | None, rows: int, columns: int) -> None:
    if spans.nodes == 0:
        raise ValueError("spans holds no node")
    if int(spans.row.max()) >= rows or int(spans.row.min()) < 0:
        raise ValueError(f"spans.row must index the {rows} rows of hidden_states")
    if int((spans.start + spans.length).max()) > columns:
        raise ValueError(f"a span runs past the {columns} columns of hidden_states")
    if initial is not None and initial.rows != spans.nodes:
        raise ValueError(f"initial holds {initial.rows} states for {spans.nodes} nodes")
