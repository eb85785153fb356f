"""flex_attention BlockMasks built from the structure of a packed batch, in work proportional to the visited blocks.

``create_block_mask`` evaluates the mask function at every (query, key) pair: at 8 prompts x 16 generations x 4k
completion tokens that is ~2.7e11 evaluations per mask. The packed layouts of this package are made of *segments*
(runs of consecutive tokens whose positions advance by one: a prompt's prefix, a completion row, a node of a prefix
tree) and *links* (query segment S sees key segment T: all of it, or causally when T is S's own tokens). Each link
covers a rectangle of the (query, key) plane cut by at most two diagonals (causality, the sliding window), so the
number of visible pairs it puts in any block has a closed form. The builder enumerates, link by link, only the
blocks a link touches and sums those counts per block: a block is *full* when every one of its pairs is visible,
*partial* otherwise. Only partial blocks run the mask function inside the attention kernel.

Memory: everything is proportional to the number of (link, block) pairs visited, except the index arrays of torch's
BlockMask format itself: ``kv_indices`` and ``full_kv_indices`` are (1, 1, Q_blocks, KV_blocks) int32 (and, for
backward, ``q_indices``/``full_q_indices`` (1, 1, KV_blocks, Q_blocks) int32), i.e. 4 bytes per block of the whole
(q_len x kv_len) plane for each of them. They are allocated zeroed and written only at visited entries (a row's
entries past its block count are never read by the kernels). At 1M queries x 1M keys that is 8192 x 8192 blocks:
256 MiB per array.

Trees of rows (a trie: each node's tokens see its ancestors' tokens and, causally, its own) fit the same input:
one key segment and one query segment per node, a causal link from a node to itself and a plain link to each
ancestor.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

#: Query and key block size of the masks built here (flex_attention's default sparse block size).
BLOCK_SIZE = 128


def placed(tensor: torch.Tensor) -> dict:
    """Where a new tensor built alongside ``tensor`` goes: ``tensor``'s device, named only off the host. Host tensors
    are made without naming a device, so the builder runs the same on host tensors (a node call's host copy, which
    makes the host wait for nothing) as on device ones, and a counter of host syncs can tell the two apart
    (``bench/dispatch_count.py``)."""
    return {"device": tensor.device} if tensor.device.type != "cpu" else {}


@dataclass(frozen=True)
class Segments:
    """Runs of consecutive tokens of one packed sequence, each with positions advancing by one per token.

    Attributes:
        start: (n,) int64, index in the packed sequence of each segment's first token.
        length: (n,) int64, number of tokens of each segment (0 allowed: the segment is ignored).
        position: (n,) int64, position (the RoPE / sliding-window position) of each segment's first token; token
            ``start + k`` has position ``position + k``.
    """

    start: torch.Tensor
    length: torch.Tensor
    position: torch.Tensor


@dataclass(frozen=True)
class Links:
    """Which key segments each query segment attends to.

    Attributes:
        query: (m,) int64, index of the query segment (into the query :class:`Segments`).
        key: (m,) int64, index of the key segment it sees (into the key :class:`Segments`).
        causal: (m,) bool. A causal link shows a key only to queries at the same or a later position (a segment
            attending to its own tokens); otherwise every key of the segment is visible (an ancestor's tokens).

    A (query segment, key segment) pair appears at most once. On top of the links, a sliding window hides keys whose
    position is ``window`` or more before the query's.
    """

    query: torch.Tensor
    key: torch.Tensor
    causal: torch.Tensor


def segments_of(owner: torch.Tensor, positions: torch.Tensor, count: int, *, offset: int = 0) -> Segments:
    """The :class:`Segments` of a packed run whose token ``i`` belongs to segment ``owner[i]``.

    Args:
        owner: (n,) int64, non-decreasing (each segment's tokens are consecutive), values in ``[0, count)``.
        positions: (n,) int64 position of each token; must advance by one along each segment.
        count: number of segments (segments owning no token get length 0).
        offset: index in the packed sequence of the run's first token (keys placed after other keys).

    Raises:
        ValueError: if the tokens of a segment are not consecutive or their positions do not advance by one: the
            structure-built mask would not describe the batch.
    """
    owner, positions = owner.long(), positions.long()
    if owner.numel() and count <= 0:
        raise ValueError("owner must be non-decreasing with values in [0, count): segments are runs of tokens")
    if owner.numel() == 0:
        empty = torch.zeros(count, dtype=torch.long, **placed(owner))
        return Segments(start=empty + offset, length=empty, position=empty.clone())
    # Both checks are read back in one host synchronization, after the work (out-of-range owners are clamped so the
    # work itself stays in bounds).
    misordered = (owner[1:] < owner[:-1]).any() | (owner.min() < 0) | (owner.max() >= count)
    owner_in_range = owner.clamp(0, max(count - 1, 0))
    length = torch.zeros(count, dtype=torch.long, **placed(owner)).index_add_(0, owner_in_range, torch.ones_like(owner))
    first = torch.cumsum(length, 0) - length
    # A segment's first token's position (0 for empty segments); no boolean indexing (a synchronization on CUDA).
    position = torch.where(length > 0, positions[first.clamp(max=owner.numel() - 1)], 0)
    along = torch.arange(owner.numel(), **placed(owner)) - first[owner_in_range]
    drifting = (positions != position[owner_in_range] + along).any()
    misordered, drifting = torch.stack([misordered, drifting]).tolist()
    if misordered:
        raise ValueError("owner must be non-decreasing with values in [0, count): segments are runs of tokens")
    if drifting:
        raise ValueError("positions must advance by one along each segment for a structure-built block mask")
    return Segments(start=first + offset, length=length, position=position)


def run_segments(ids: torch.Tensor, positions: torch.Tensor, *, offset: int = 0) -> tuple[Segments, torch.Tensor]:
    """The maximal runs of equal consecutive ``ids`` of a packed run as :class:`Segments`, and each run's id.

    For runs whose ids need not be sorted (a prefix tree's ancestor store: node calls one after another, each in
    depth-first order), where :func:`segments_of` wants non-decreasing owners.

    Args:
        ids: (n,) int64, the owner of each token (a trie node); tokens of one owner are consecutive.
        positions: (n,) int64, advancing by one along each run.
        offset: index in the packed sequence of the run's first token.

    Returns:
        The runs' segments and their ids, (runs,) int64.

    Raises:
        ValueError: if positions do not advance by one along a run.
    """
    ids = ids.long()
    if ids.numel() == 0:
        empty = ids.new_zeros(0)
        return Segments(start=empty, length=empty, position=empty), empty
    run = torch.cat([ids.new_zeros(1), torch.cumsum((ids[1:] != ids[:-1]).long(), 0)])
    count = int(run[-1]) + 1
    segments = segments_of(run, positions, count, offset=offset)
    return segments, ids[segments.start - offset]


def concat_segments(*parts: Segments) -> Segments:
    """The segments of several runs of one packed sequence, numbered one run after the other."""
    return Segments(
        start=torch.cat([p.start for p in parts]),
        length=torch.cat([p.length for p in parts]),
        position=torch.cat([p.position for p in parts]),
    )


def structured_block_mask(
    queries: Segments,
    keys: Segments,
    links: Links,
    *,
    q_len: int,
    kv_len: int,
    window: int | None,
    mask_mod,
    q_blocks: bool = True,
    device: torch.device | None = None,
):
    """The BlockMask of ``links`` over (``q_len``, ``kv_len``), built from the structure alone.

    ``mask_mod`` must compute the same visibility per pair (it runs only on the partial blocks, inside the kernel);
    every query or key outside the segments (padding) sees nothing. The result equals ``create_block_mask(mask_mod,
    None, None, q_len, kv_len)`` block for block, full blocks and partial blocks apart (row entries past a row's
    block count are zero instead of the remaining block indices; no kernel reads them).

    Args:
        queries / keys: the segments of the packed queries and keys.
        links: which key segments each query segment sees.
        q_len, kv_len: padded lengths, multiples of :data:`BLOCK_SIZE`.
        window: sliding window (a key is visible when ``q_pos - k_pos < window``) or None.
        mask_mod: flex mask function equal to the structure, for the partial blocks.
        q_blocks: also build the transposed indices backward needs (``q_num_blocks``/``q_indices``); torch
            versions whose BlockMask requires them get them regardless.
        device: where the BlockMask's index tensors go (None: where the segments are). Built from host segments, the
            indices reach the device by non-blocking copies: the host reads nothing of the device.
    """
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if value <= 0 or value % BLOCK_SIZE:
            raise ValueError(f"{name} must be a positive multiple of {BLOCK_SIZE}, got {value}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    num_q, num_kv = q_len // BLOCK_SIZE, kv_len // BLOCK_SIZE
    q_block, kv_block, visible = _visible_pairs_per_block(queries, keys, links, num_kv, q_len + kv_len, window)
    full = visible == BLOCK_SIZE * BLOCK_SIZE
    # Pairs come sorted by (q_block, kv_block): rows of the kv-side arrays in ascending block order. Partial and full
    # blocks are written from the same sorted pairs under a mask each (no boolean indexing: no host synchronization).
    parts = {
        "kv_num_blocks": None,
        "kv_indices": None,
        "full_kv_num_blocks": None,
        "full_kv_indices": None,
        "q_num_blocks": None,
        "q_indices": None,
        "full_q_num_blocks": None,
        "full_q_indices": None,
    }
    parts["kv_num_blocks"], parts["kv_indices"] = _ordered(q_block, kv_block, ~full, num_q, num_kv)
    parts["full_kv_num_blocks"], parts["full_kv_indices"] = _ordered(q_block, kv_block, full, num_q, num_kv)
    if q_blocks or not _q_blocks_optional():
        order = torch.argsort(kv_block * num_q + q_block)
        rows, cols, full_t = kv_block[order], q_block[order], full[order]
        parts["q_num_blocks"], parts["q_indices"] = _ordered(rows, cols, ~full_t, num_kv, num_q)
        parts["full_q_num_blocks"], parts["full_q_indices"] = _ordered(rows, cols, full_t, num_kv, num_q)
    from torch.nn.attention.flex_attention import BlockMask

    if device is not None:
        parts = {k: v if v is None else v.to(device, non_blocking=True) for k, v in parts.items()}
    return BlockMask(seq_lengths=(q_len, kv_len), BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=mask_mod, **parts)


@functools.cache
def _q_blocks_optional() -> bool:
    """Whether this torch's BlockMask accepts a mask without the transposed (backward) indices (``compute_q_blocks``
    of ``BlockMask.from_kv_blocks``; older versions assert they are given). The BlockMask constructor's other keyword
    arguments used here are the same from torch 2.5 to 2.13."""
    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def _ordered(rows: torch.Tensor, cols: torch.Tensor, keep: torch.Tensor, num_rows: int, num_cols: int):
    """torch's ordered block format of the (row, col) blocks where ``keep`` is True, given sorted by row then col:
    (1, 1, num_rows) int32 counts and (1, 1, num_rows, num_cols) int32 indices, each row's columns first, zeros after.

    Nothing is selected by a boolean mask (on CUDA that waits for the device to count): blocks not kept are written
    to a spare row past the last, which the result leaves out.
    """
    keep = keep.long()
    counts = torch.zeros(num_rows, dtype=torch.long, **placed(rows)).index_add_(0, rows, keep)
    kept_before = torch.cumsum(keep, 0) - keep  # kept blocks ahead of each block, all rows
    row_start = torch.cumsum(counts, 0) - counts
    rank = kept_before - row_start[rows]
    indices = torch.zeros(num_rows + 1, num_cols, dtype=torch.int32, **placed(rows))
    spare = torch.where(keep.bool(), rows, num_rows)
    indices[spare, torch.where(keep.bool(), rank, 0)] = cols.to(torch.int32)
    return counts.to(torch.int32)[None, None], indices[:num_rows][None, None]


def _visible_pairs_per_block(
    queries: Segments, keys: Segments, links: Links, num_kv: int, bound: int, window: int | None
):
    """(q_block, kv_block, visible) over the blocks that at least one pair of ``links`` makes visible, sorted by
    (q_block, kv_block): each block's indices and its number of visible (query, key) pairs, all (blocks,) int64.

    Each link is the rectangle [qa, qz] x [ka, kz] (inclusive token indices) cut to ``lo <= i - j <= hi``: causality
    and the window compare positions, and ``q_pos - k_pos = (i - j) + offset`` is fixed along a link. ``bound``
    exceeds every |i - j| and stands for "no limit".
    """
    qa, ql, qp = (t[links.query] for t in (queries.start, queries.length, queries.position))
    ka, kl, kp = (t[links.key] for t in (keys.start, keys.length, keys.position))
    qz, kz = qa + ql - 1, ka + kl - 1
    offset = (qp - qa) - (kp - ka)
    lo = torch.where(links.causal.bool(), -offset, torch.full_like(offset, -bound))
    hi = torch.full_like(offset, bound) if window is None or window >= bound else window - 1 - offset
    lo, hi = torch.maximum(lo, qa - kz), torch.minimum(hi, qz - ka)
    keep = (ql > 0) & (kl > 0) & (lo <= hi)

    # Every (link, query block) pair: the query rows of the block in the link, the keys any of them sees. Links that
    # see nothing expand to no block (no boolean selection: each expansion is one host synchronization, its size).
    link, q_block = _expand(qa // BLOCK_SIZE, qz // BLOCK_SIZE, keep)
    i0 = torch.maximum(qa[link], q_block * BLOCK_SIZE)
    i1 = torch.minimum(qz[link], q_block * BLOCK_SIZE + BLOCK_SIZE - 1)
    j0 = torch.maximum(ka[link], i0 - hi[link])
    j1 = torch.minimum(kz[link], i1 - lo[link])
    seen = j0 <= j1  # the band misses the block's rows only at a clipped corner

    # Every (link, query block, key block) triple; each holds at least one visible pair (the band is convex).
    row, kv_block = _expand(j0 // BLOCK_SIZE, j1 // BLOCK_SIZE, seen)
    link, q_block, i0, i1 = link[row], q_block[row], i0[row], i1[row]
    c0 = torch.maximum(ka[link], kv_block * BLOCK_SIZE)
    c1 = torch.minimum(kz[link], kv_block * BLOCK_SIZE + BLOCK_SIZE - 1)
    count = _pairs_at_most(i0, i1, c0, c1, hi[link]) - _pairs_at_most(i0, i1, c0, c1, lo[link] - 1)

    # Links do not overlap (a pair of segments is linked once), so the per-block sums are exact.
    block, inverse = torch.unique(q_block * num_kv + kv_block, sorted=True, return_inverse=True)
    visible = torch.zeros(block.numel(), dtype=torch.long, **placed(block)).index_add_(0, inverse, count)
    return block // num_kv, block % num_kv, visible


def _expand(first: torch.Tensor, last: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, value) for every integer ``value`` in ``[first[s], last[s]]`` of every ``s`` where ``keep[s]``:
    (total,) int64 each. One host synchronization: the total, read once and handed to ``repeat_interleave`` (which
    would otherwise read it, and check the counts, itself)."""
    span = torch.where(keep, last - first + 1, 0)
    ends = torch.cumsum(span, 0)
    total = int(ends[-1]) if span.numel() else 0
    source = torch.repeat_interleave(torch.arange(span.numel(), **placed(span)), span, output_size=total)
    step = torch.arange(total, **placed(span)) - (ends - span)[source]
    return source, first[source] + step


def _pairs_at_most(i0, i1, j0, j1, t):
    """Number of (i, j) in [i0, i1] x [j0, j1] (inclusive, elementwise) with ``i - j <= t``.

    Row ``i`` counts the ``j >= i - t``: ``clamp(j1 + 1 + t - i, 0, width)``; summed over ``i`` this is a sum of
    ``clamp(x, 0, width)`` over the consecutive integers ``x`` in ``[j1 + 1 + t - i1, j1 + 1 + t - i0]``.
    """
    width = j1 - j0 + 1
    top = j1 + 1 + t
    return _clamped_prefix_sum(top - i0, width) - _clamped_prefix_sum(top - i1 - 1, width)


def _clamped_prefix_sum(x, width):
    """``sum(clamp(y, 0, width) for y in range(0, x + 1))`` elementwise (0 for negative ``x``)."""
    x = torch.clamp(x, min=-1)
    inside = torch.minimum(x, width)
    return torch.where(x < 0, 0, inside * (inside + 1) // 2 + torch.clamp(x - width, min=0) * width)
