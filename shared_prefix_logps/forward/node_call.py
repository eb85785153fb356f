"""A node call: one forward of the model over the packed tokens of some trie nodes of one depth, each of whose
ancestors went through an earlier call; what the layouts (``backends/``) and the node call's context read.

Its input is the nodes' tokens packed back to back (no padding forwarded); the layouts read what they need from it:
``expand`` a row per node over its ancestors' keys/values gathered from the earlier calls that hold them, ``flex``
the ancestor store and the trie's structure, ``flash`` the ancestors of each level. The engine's call planner
(``engine/call_planner.py``) builds them; :func:`single_node_call` is the call of one node without ancestors (the
head check's plain causal forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass(frozen=True)
class FlashLevel:
    """The ancestors of one level of a node call's nodes, for the ``flash`` layout: the call's packed queries (every
    one has an ancestor at each level above its depth) in runs that share their ancestor at this level.

    Attributes:
        query_counts: (runs,) int64 queries per run, in packed order.
        key_tokens: (keys,) int64 index into the call's ancestor store of each run's ancestor tokens, run after run.
        key_counts: (runs,) int64 tokens of each run's ancestor.
    """

    query_counts: torch.Tensor
    key_tokens: torch.Tensor
    key_counts: torch.Tensor


@dataclass(frozen=True)
class NodeCall:
    """One forward over ``nodes``; (S = len(nodes), Lmax = longest node, T = their tokens, A = most ancestor tokens
    of a node, A_total = tokens of the ancestor store).

    Attributes:
        nodes: (S,) int64 trie nodes, in depth-first order: of one depth, or, for a layout that serves it, of several
            (a node's ancestors in the call come before it, and it attends over them as over the store's).
        input_ids: (1, T) int64 packed tokens; positions: (1, T) int64 their positions in the rows.
        pack_index: the padded layouts: (S, Lmax) int64, index into the T packed tokens of each node's i-th token (0
            past its end); pack_valid: (S, Lmax) bool, True on real node tokens.
        sources: earlier calls whose keys/values hold the ancestors, in the order their tokens are concatenated
            into the ancestor store.
        head_index: (p,) int64, the packed token of each pair this call scores; head_pairs: (p,) their pair ids;
            head_targets: (p,) their target ids.
        query_node / query_order: (T,) int64, each packed token's node and its index inside that node.
        query_slot: (T,) int64, each packed token's node's index among ``nodes`` (its row in the padded layouts).
        ancestor_index: ``expand``: (S, A) int64, index into the ancestor store of each ancestor token (0 past the
            end; a node's ancestor tokens sit at positions 0 .. node start - 1); ancestor_valid: (S, A) bool.
        store_node / store_order / store_positions: (A_total,) int64, the node, index in the node and position of
            every token of the ancestor store (what ``flex`` builds its mask from).
        node_end: (num_nodes,) int64, the trie's ``subtree_end``: node k is an ancestor of (or is) node q exactly
            when ``k <= q < node_end[k]``.
        levels: ``flash``: a :class:`FlashLevel` per ancestor level, top level first.
        keeps_states: whether a later call attends over this one (some node has children): only then does the call
            record its layers' prefix states.
        same_ancestors: every node has as many ancestor tokens (decided on the host when the call is planned, so no
            layer reads it from the device).
        host: the call as planned on the host, for a call moved to a device (:meth:`to`): what a layout builds once
            per call from the structure (flex's block mask) is read there, without making the host wait.
    """

    nodes: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    sources: list[int]
    head_index: torch.Tensor
    head_pairs: torch.Tensor
    head_targets: torch.Tensor
    query_node: torch.Tensor
    query_order: torch.Tensor
    query_slot: torch.Tensor
    store_node: torch.Tensor
    store_order: torch.Tensor
    store_positions: torch.Tensor
    node_end: torch.Tensor
    pack_index: torch.Tensor | None = None
    pack_valid: torch.Tensor | None = None
    ancestor_index: torch.Tensor | None = None
    ancestor_valid: torch.Tensor | None = None
    levels: tuple[FlashLevel, ...] | None = None
    keeps_states: bool = True
    same_ancestors: bool = True
    host: NodeCall | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device) -> NodeCall:
        """The call with every tensor on ``device``, through one host-to-device copy (see :func:`to_device`); the
        planner keeps its CPU copies."""
        device = torch.device(device)
        tensors = {
            f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        }
        for i, level in enumerate(self.levels or ()):
            tensors.update({f"level{i}.{f.name}": getattr(level, f.name) for f in fields(level)})
        moved = to_device(tensors, device)
        values = {f.name: moved.get(f.name, getattr(self, f.name)) for f in fields(self)}
        values["host"] = self if self.input_ids.device.type == "cpu" else self.host
        if self.levels is not None:
            values["levels"] = tuple(
                FlashLevel(*(moved[f"level{i}.{f.name}"] for f in fields(FlashLevel))) for i in range(len(self.levels))
            )
        return NodeCall(**values)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` (int64 or bool, planned on the host) on ``device``, through one host-to-device copy.

    Copied one by one, a node call's index tensors were as many copies from pageable memory, each of which the host
    waits for. They are packed into one int64 buffer (page-locked when the target is CUDA, so the copy runs
    asynchronously), copied once and cut apart on the device (bool fields come back as bool). Tensors already on
    ``device`` are returned as they are; tensors on other devices than the host are copied one by one.
    """
    moving = {k: v for k, v in tensors.items() if v.device != device}
    if not moving:
        return dict(tensors)
    if any(v.device.type != "cpu" for v in moving.values()):
        return {k: v.to(device) for k, v in tensors.items()}
    buffer, layout = pack(moving, pin=device.type == "cuda")
    return {**tensors, **unpack(buffer.to(device, non_blocking=True), layout)}


def pack(tensors: dict[str, torch.Tensor], *, pin: bool = False) -> tuple[torch.Tensor, list]:
    """Host ``tensors`` (integers or bool) flattened into one int64 buffer (page-locked with ``pin``), and the
    layout :func:`unpack` cuts it apart by: (name, shape, dtype) per tensor, in order."""
    flat = [v.reshape(-1).long() for v in tensors.values()]
    buffer = torch.empty(sum(t.numel() for t in flat), dtype=torch.long, pin_memory=pin)
    torch.cat(flat, out=buffer)
    return buffer, [(name, value.shape, value.dtype) for name, value in tensors.items()]


def unpack(buffer: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack` packed into ``buffer`` (on any device): views of it, bool fields as bool."""
    out, start = {}, 0
    for name, shape, dtype in layout:
        count = shape.numel()
        part = buffer[start : start + count].view(shape)
        out[name] = part.bool() if dtype == torch.bool else part.to(dtype)
        start += count
    return out


def single_node_call(input_ids: torch.Tensor) -> NodeCall:
    """The ``expand`` call of one node without ancestors holding ``input_ids`` (1, n) (on their device), scoring
    nothing: what a plain causal forward through the shared-prefix attention is (the head check's)."""
    n = input_ids.shape[1]
    device = input_ids.device
    inner = torch.arange(n, device=device)
    empty = inner[:0]
    return NodeCall(
        nodes=torch.zeros(1, dtype=torch.long, device=device),
        input_ids=input_ids,
        positions=inner[None],
        pack_index=inner[None],
        pack_valid=torch.ones(1, n, dtype=torch.bool, device=device),
        sources=[],
        head_index=empty,
        head_pairs=empty,
        head_targets=empty,
        query_node=torch.zeros_like(inner),
        query_order=inner,
        query_slot=torch.zeros_like(inner),
        store_node=empty,
        store_order=empty,
        store_positions=empty,
        node_end=torch.ones(1, dtype=torch.long, device=device),
        ancestor_index=empty[None],
        ancestor_valid=torch.ones(1, 0, dtype=torch.bool, device=device),
        keeps_states=False,
    )
