"""One recurrent layer over the tokens of some nodes, each node starting from a given state, through the layer's own
forward and kernels."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .cache import state_cache
from .spans import NodeSpans
from .state import RecurrentState

#: Names transformers versions give a recurrent layer's cache argument (5.24: ``cache``; 5.15-5.23: ``cache_params``).
_CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")


def _wrapped_functions(function: Callable, depth: int = 3):
    """``function``, then the functions its closure holds, recursively (``depth`` levels): what a decorator that does
    not set ``__wrapped__`` wraps (transformers 5.15's ``force_accelerate_hooks`` takes ``*args, **kwargs``)."""
    yield function
    if depth == 0:
        return
    for cell in getattr(function, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(inner):
            yield from _wrapped_functions(inner, depth - 1)


def cache_argument(forward: Callable) -> str:
    """The name under which ``forward`` (a recurrent layer's own forward, possibly under a decorator that hides its
    signature) takes its cache."""
    for function in _wrapped_functions(forward):
        parameters = inspect.signature(function).parameters
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
    keep_ends: bool | torch.Tensor = True,
    layouts: dict | None = None,
) -> tuple[torch.Tensor, RecurrentState | None]:
    """Run recurrent layer ``mixer`` over each node's tokens, node ``n`` starting from row ``n`` of ``initial``.

    The nodes go through the layer's own forward (``forward``, default ``mixer.forward``: pass the original when the
    module's forward is wrapped); the state reaches the layer through its cache argument (:mod:`.cache`). A Gated
    DeltaNet layer runs every node in one call, right-padded with steps made the identity (:func:`_run_padded`);
    other layers run one call per distinct node length, each node's tokens gathered into an unpadded row. Either way
    a left-padded prompt gives the unpadded prompt's state, a right-padded row ends where its tokens end, and packed
    nodes do not run into each other.

    Args:
        mixer: the recurrent layer (its ``layer_idx`` names its cache entry).
        hidden_states: (rows, columns, hidden) the layer's input, any float dtype.
        spans: where each of the N nodes' tokens sit in ``hidden_states``.
        initial: the N nodes' initial states (each child's parent's end state, :meth:`RecurrentState.select`);
            None when every node starts a row (zero rows of a given state are equivalent).
        keep_ends: whether each node hands its end state on (it has children): one bool for every node, or (N,) bool
            per node. A one-token node that keeps no end state and starts from a state runs as two copies of its
            token, so the layer's chunked path runs instead of its one-token decode path (flash-linear-attention's
            ``fused_recurrent`` kernel has no backward, Mamba2's ``selective_state_update`` overwrites the state it
            read); the first copy's output is the token's own. A one-token node that keeps its end state from a
            state takes the decode path (the caller decides where that back-propagates, see
            :class:`~.served.RecurrentPart`).
        layouts: a dict the caller keeps for all layers of one call with the same ``spans``: the padded layout's
            index tensors are moved to the device once per call, not once per layer.

    Returns:
        (output, end): output (rows, columns, out_hidden) in the layer's output dtype, zero outside every span;
        end: the N nodes' states after their last token, None when no node keeps its end state; the rows of nodes
        that keep none hold their state where they ran as themselves and zeros where they ran as two copies. Both
        differentiable with respect to the layer's parameters, ``hidden_states`` and ``initial``.
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

    keeps = _per_node(keep_ends, spans.nodes)
    records = bool(keeps.any())
    # One-token nodes from a state that hand nothing on: two copies of their token (see keep_ends).
    widened = (~keeps) & (spans.length == 1) if initial is not None else torch.zeros_like(keeps)
    if spans.covers_rows(rows, columns) and not bool(widened.any()):
        output, end = segment(hidden_states, initial)
        return output, end if records else None
    gates = identity_gates(mixer)
    if gates:
        key = (hidden_states.device, initial is not None)
        layout = (layouts or {}).get(key) or PaddedLayout.of(spans, hidden_states.device, from_state=key[1])
        if layouts is not None:
            layouts[key] = layout
        return _run_padded(mixer, forward, argument, kernel_size, gates, hidden_states, layout, initial, records)

    device = hidden_states.device
    row, start, length = spans.row, spans.start, spans.length
    order, rows_written, columns_written, values, ends = [], [], [], [], []
    # One layer call per (length, widened) group of nodes.
    group_key = length * 2 + widened.long()
    for key in torch.unique(group_key).tolist():
        size, widen = key // 2, bool(key % 2)
        nodes = (group_key == key).nonzero().flatten()
        node_rows = row[nodes].to(device)[:, None]
        node_columns = (start[nodes][:, None] + torch.arange(size)).to(device)
        read_columns = node_columns.expand(-1, 2) if widen else node_columns
        output, end = segment(
            hidden_states[node_rows, read_columns], None if initial is None else initial.select(nodes)
        )
        output = output[:, :size]  # a widened node's first copy
        order.append(nodes)
        rows_written.append(node_rows.expand(-1, size).reshape(-1))
        columns_written.append(node_columns.reshape(-1))
        values.append(output.reshape(-1, output.shape[-1]))
        ends.append(end.zeros(nodes.numel()) if widen else end)
    values = torch.cat(values)
    output = values.new_zeros((rows, columns, values.shape[-1])).index_put(
        (torch.cat(rows_written), torch.cat(columns_written)), values
    )
    if not records:
        return output, None
    # Back from length groups to node order.
    inverse = torch.argsort(torch.cat(order))
    return output, RecurrentState.cat(ends).select(inverse)


#: A Gated DeltaNet layer's projections whose outputs set each step's decay and write strength (Qwen3.5: ``a`` and
#: ``b``; Qwen3-Next: both in one). Where they are -inf a step is the identity: its decay ``exp(-A * softplus(-inf))``
#: is 1 and its write strength ``sigmoid(-inf)`` is 0, so padded steps after a node's last token leave its state as
#: it was, in the layer's own kernels (which pad their chunks the same way).
GATE_PROJECTIONS = ("in_proj_a", "in_proj_b", "in_proj_ba")


def identity_gates(mixer: nn.Module) -> list[nn.Module]:
    """The modules of :data:`GATE_PROJECTIONS` in ``mixer`` (empty for a layer of another kind)."""
    return [getattr(mixer, name) for name in GATE_PROJECTIONS if isinstance(getattr(mixer, name, None), nn.Module)]


@dataclass(frozen=True)
class PaddedLayout:
    """Where a call's nodes sit when they run right-padded in one batch, on the device (made on the host, moved once).

    Attributes:
        node_rows, columns: (N, 1) and (N, width) int64, the input row and column each padded step reads (a padded
            step reads its node's last token).
        padding: (N, width) bool, the padded steps.
        lengths: (N,) int64, each node's real tokens.
        flat: (T,) int64, each real token's index in the flattened (N x width) batch; rows, positions: (T,) int64,
            its row and column in the layer's input.
    """

    node_rows: torch.Tensor
    columns: torch.Tensor
    padding: torch.Tensor
    lengths: torch.Tensor
    flat: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def of(spans: NodeSpans, device, *, from_state: bool) -> PaddedLayout:
        """The layout of ``spans``, padded to the longest node (to two steps at least when the nodes start from a
        state, so none takes the one-token decode path)."""
        length = spans.length
        width = max(int(length.max()), 2 if from_state else 1)
        steps = torch.arange(width)
        real = steps[None, :] < length[:, None]
        node, step = real.nonzero(as_tuple=True)  # on the host: each real token's node and its index in it
        host = dict(
            node_rows=spans.row[:, None],
            columns=spans.start[:, None] + torch.minimum(steps[None, :], length[:, None] - 1),
            padding=~real,
            lengths=length,
            flat=node * width + step,
            rows=spans.row[node],
            positions=spans.start[node] + step,
        )
        return PaddedLayout(**{name: t.to(device, non_blocking=True) for name, t in host.items()})


def _run_padded(mixer, forward, argument, kernel_size, gates, hidden_states, layout: PaddedLayout, initial, records):
    """Every node in one call of the layer: right-padded to the longest (:class:`PaddedLayout`), the padded steps made
    the identity (:data:`GATE_PROJECTIONS`), each node's convolution window taken at its last real token
    (:func:`~.cache.state_cache`'s ``lengths``). So a call's kernels do not grow with its number of distinct node
    lengths; the padded tokens are computed and dropped."""
    padded = hidden_states[layout.node_rows, layout.columns]

    def identity_steps(module, args, output):
        return output.masked_fill(layout.padding[..., None], float("-inf"))

    handles = [gate.register_forward_hook(identity_steps) for gate in gates]
    try:
        cache, layer = state_cache(mixer.layer_idx, initial, kernel_size, lengths=layout.lengths)
        output = forward(padded, **{argument: cache})
    finally:
        for handle in handles:
            handle.remove()
    values = output.reshape(-1, output.shape[-1])[layout.flat]
    rows, columns = hidden_states.shape[:2]
    result = values.new_zeros((rows, columns, values.shape[-1])).index_put((layout.rows, layout.positions), values)
    return result, layer.end_state() if records else None


def _per_node(keep_ends: bool | torch.Tensor, nodes: int) -> torch.Tensor:
    """``keep_ends`` as (nodes,) bool on the CPU."""
    if isinstance(keep_ends, bool):
        return torch.full((nodes,), keep_ends, dtype=torch.bool)
    keeps = keep_ends.detach().to("cpu", torch.bool).reshape(-1)
    if keeps.numel() != nodes:
        raise ValueError(f"keep_ends holds {keeps.numel()} entries for {nodes} nodes")
    return keeps


def _check(spans: NodeSpans, initial: RecurrentState | None, rows: int, columns: int) -> None:
    if spans.nodes == 0:
        raise ValueError("spans holds no node")
    if int(spans.row.max()) >= rows or int(spans.row.min()) < 0:
        raise ValueError(f"spans.row must index the {rows} rows of hidden_states")
    if int((spans.start + spans.length).max()) > columns:
        raise ValueError(f"a span runs past the {columns} columns of hidden_states")
    if initial is not None and initial.rows != spans.nodes:
        raise ValueError(f"initial holds {initial.rows} states for {spans.nodes} nodes")
