"""``compute_logps_tree``: log-probs of rows of any shape, every prefix they share forwarded once."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.lockstep import Lockstep, call_lockstep
from ..inputs import check_options
from ..model import PreparedModel, prepare_model
from ..moe_router import RouterStats, router_spec
from ..output import LogpsOutput
from ..token_budget import DEFAULT_TOKEN_BUDGET
from . import merge
from .dense import dense_tree_logps
from .forward import forward_call
from .inputs import TreeRows, check_tree_rows
from .lockstep import one_token_zero
from .merge import merge_threshold, rows_trie
from .plan import CallPlanner, levels, scored_pairs
from .walk import TreeWalk


def compute_logps_tree(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    token_budget: int | None = None,
    return_router_stats: bool = False,
    merge_tiny_nodes: bool = True,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """Per-token log-probs of rows that share prefixes at any depth, each shared prefix forwarded once.

    The library finds the token trie of the rows (longest common prefixes between any rows, across prompts too).
    Each trie node's tokens are forwarded once, attending over its ancestors' keys/values and causally over its
    own; gradients reach every ancestor through those keys/values. With gradients, one forward per trie depth;
    without, a depth-first walk within ``token_budget``.

    Args:
        model: as for :func:`~shared_prefix_logps.compute_logps`.
        input_ids: (N, L) int64; each row's real tokens contiguous (left- or right-padded, as its mask says).
        attention_mask: (N, L) bool/0-1, True on real tokens. A token's position is the number of real tokens
            before it in its row.
        score_mask: (N, L) bool/0-1: the positions t whose ``log p(x_t | x_<t)`` is wanted; only on real tokens after
            a row's first; holes allowed.
        temperature, return_entropy: as for :func:`~shared_prefix_logps.compute_logps`.
        backend: ``"auto"``/``"expand"`` (nodes gather their ancestors' keys/values), ``"flex"`` (packed, one
            flex_attention call per layer over the ancestors' keys/values in place, a mask from the trie's structure;
            without gradients on CPU, as torch's flex has no CPU backward) or ``"dense"`` (every row through the
            model's own forward, the reference).
        token_budget: under ``torch.no_grad()``, the most keys a chunk of rows attends over (each new node counts its
            ancestors' tokens and its own); rows are scored depth-first in such chunks and each node's keys/values
            freed once no later row needs them, so peak memory does not grow with the number of rows. Default
            ``DEFAULT_TOKEN_BUDGET``. Ignored when gradients are enabled (one forward per trie depth).
        return_router_stats: MoE models with a router aux loss: also return each row's router statistics over its
            real tokens (``out.router``; ``out.router.aux_loss()`` equals the model's own ``aux_loss`` of the rows'
            dense forward), each shared token weighted by the number of rows that contain it. Not with ``dense``.
        merge_tiny_nodes: merge into their children the trie nodes whose sharing saves fewer tokens than a node
            call costs (:mod:`~shared_prefix_logps.tree.merge`); the results are the same either way.
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP, FSDP or DeepSpeed with
            several processes, processes whose tries differ make the same model calls: no-grad calls are joined,
            grad-enabled ones agree on the number of trie depths (:mod:`~shared_prefix_logps.tree.lockstep`).

    Returns:
        :class:`LogpsOutput` with (N, L) float32 ``logps`` (and ``entropy``), 0 where not scored, and ``mask`` =
        ``score_mask``. With gradients the zeros of a batch whose every row is empty (all padding) still come out of
        a forward of the model (one token), as ``backend="dense"``'s do: a loss built from them back-propagates and
        gives every parameter a zero gradient.

    Raises:
        ValueError: naming the argument: ``input_ids`` without columns, meta tensors (the inputs or the model's
            weights), masks of another shape, padding inside a row, scores on padding or on a row's first token.
    """
    check_options(temperature, backend, token_budget)
    merge_below = merge_threshold(merge_tiny_nodes)
    if return_router_stats and backend == "dense":
        raise ValueError("return_router_stats needs the shared path; the dense forward returns the model's aux_loss")
    prepared = prepare_model(model)
    router = router_spec(prepared.causal_lm) if return_router_stats else None
    rows = check_tree_rows(input_ids, attention_mask, score_mask, model=prepared)
    temperature = float(temperature)
    steps = call_lockstep(model, lockstep, prepared.device)
    if steps is not None and not torch.is_grad_enabled():
        with steps.forwards(prepared.outer):
            return _score(prepared, rows, temperature, return_entropy, backend, token_budget, router, merge_below)
    return _score(prepared, rows, temperature, return_entropy, backend, token_budget, router, merge_below, steps)


def _score(prepared, rows, temperature, return_entropy, backend, token_budget, router, merge_below, steps=None):
    """:func:`compute_logps_tree` on validated arguments; ``steps``: the grad-enabled agreement, if any."""
    if backend == "dense":
        logps, entropy = dense_tree_logps(prepared, rows, temperature=temperature, return_entropy=return_entropy)
        return LogpsOutput(logps, entropy, rows.score_mask)
    if backend == "flex":
        from ..api import resolve_attention_backend  # ..api reaches this module through tree/grouped.py

        resolve_attention_backend(backend, prepared.device)  # refuses flex where torch lacks it (or its backward)
    # auto is expand everywhere, CUDA included, until the flex layout of trees has run on a GPU.
    return score_tree_rows(
        prepared,
        rows,
        temperature=temperature,
        return_entropy=return_entropy,
        token_budget=token_budget,
        packed=backend == "flex",
        router=router,
        merge_below=merge_below,
        lockstep=steps,
    )


def score_tree_rows(
    prepared: PreparedModel,
    rows: TreeRows,
    *,
    temperature: float,
    return_entropy: bool,
    token_budget: int | None,
    packed: bool = False,
    router: tuple[int, int] | None = None,
    merge_below: int | None = None,
    lockstep: Lockstep | None = None,
) -> LogpsOutput:
    """The tree pass over validated ``rows`` (``packed``: the flex layout, else expand): one forward per trie depth
    with gradients, the depth-first walk within ``token_budget`` without; (N, L) outputs as
    :func:`compute_logps_tree` returns them. ``router``: ``(num_experts, top_k)`` to also return each row's router
    statistics over its real tokens (``out.router``). ``merge_below``: the tiny-node rule's threshold
    (:func:`~.merge.rows_trie`; 0 merges nothing; None: :data:`~.merge.MERGE_BELOW_SAVED_TOKENS`).
    ``lockstep``: with gradients, the processes agree on the number of trie depths first, and this one makes a
    one-token forward for each depth it lacks, whose zero joins the result (see :mod:`.lockstep`)."""
    if merge_below is None:
        merge_below = merge.MERGE_BELOW_SAVED_TOKENS
    trie = rows_trie(rows, merge_below)
    pairs = scored_pairs(trie, rows)
    logps = torch.zeros(rows.score_mask.shape, device=prepared.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    top_k = None if router is None else router[1]
    depths = levels(trie)
    if lockstep is not None and torch.is_grad_enabled():
        missing = lockstep.max(len(depths)) - len(depths)
        zeros = [zero for zero in (one_token_zero(prepared) for _ in range(missing)) if zero.requires_grad]
        if zeros:  # the caller's backward reaches these forwards too, as the other processes' reaches theirs
            padding = torch.stack(zeros).sum()
            logps = logps + padding
            entropy = None if entropy is None else entropy + padding
    if trie.num_nodes == 0 and torch.is_grad_enabled() and not logps.requires_grad:
        # Every row empty: the zeros still hang off one one-token forward of the model (as the dense forward's
        # do), so that a loss built from them back-propagates and gives every parameter a zero gradient.
        zero = one_token_zero(prepared)
        logps = logps + zero
        entropy = None if entropy is None else entropy + zero
    if trie.num_nodes == 0 or (pairs.target.numel() == 0 and not torch.is_grad_enabled() and router is None):
        out = LogpsOutput(logps, entropy, rows.score_mask)
        if router is not None:
            out.router = row_router_stats(trie, [], router[0], prepared.device)
        return out
    if not torch.is_grad_enabled():
        return _walk_without_grad(prepared, trie, rows, temperature, return_entropy, token_budget, packed, router)
    planner = CallPlanner(trie, pairs)
    stores, pair_ids, pair_logps, pair_entropy, node_router = [], [], [], [], []
    for nodes in depths:
        call = planner.plan(nodes)
        context = forward_call(
            prepared,
            call.to(prepared.device),
            [stores[source] for source in call.sources],
            temperature=temperature,
            return_entropy=return_entropy,
            packed=packed,
            router_top_k=top_k,
        )
        stores.append(context.kv)
        node_router.append((call.nodes, context.router))
        pair_ids.append(call.head_pairs)
        pair_logps.append(context.logps)
        pair_entropy.append(context.entropy)
    # Results are per call; put them in pair order, then one per scored position (row-major).
    order = torch.argsort(torch.cat(pair_ids)).to(prepared.device)
    of_scored = pairs.of_scored.to(prepared.device)
    logps = logps.masked_scatter(rows.score_mask, torch.cat(pair_logps)[order][of_scored])
    if return_entropy:
        entropy = entropy.masked_scatter(rows.score_mask, torch.cat(pair_entropy)[order][of_scored])
    out = LogpsOutput(logps, entropy, rows.score_mask)
    if router is not None:
        out.router = row_router_stats(trie, node_router, router[0], prepared.device)
    return out


def row_router_stats(trie, node_router: list, num_experts: int, device) -> RouterStats:
    """Each row's router statistics: the sums of the nodes on its path.

    Args:
        node_router: ``(nodes, (counts, probs, tokens))`` per node call, the statistics of each of its nodes. A
            shared node's sums go to every row through it, which weights its tokens by the number of rows that
            contain them, as the dense batch does (see :mod:`~shared_prefix_logps.moe_router`).
    """
    num_rows = trie.row_end.numel()
    membership = torch.zeros(num_rows, trie.num_nodes, device=device)
    for row in range(num_rows):
        membership[row, trie.path(row)] = 1.0
    sums = []
    for i in range(3):
        width = (num_experts,) if i < 2 else ()
        per_node = torch.zeros((trie.num_nodes, *width), device=device)
        if node_router:
            nodes = torch.tensor([n for ns, _ in node_router for n in ns], dtype=torch.long, device=device)
            per_node = per_node.index_copy(0, nodes, torch.cat([stats[i] for _, stats in node_router]))
        sums.append(membership @ per_node)
    return RouterStats(*sums, num_experts)


def _walk_without_grad(
    prepared, trie, rows, temperature, return_entropy, token_budget, packed, router=None
) -> LogpsOutput:
    """No-grad scoring depth-first, in chunks of rows within the token budget, each node call freed once no later
    row passes through it: peak memory is that of the widest chunk's paths, whatever the number of rows."""
    top_k = None if router is None else router[1]
    walk = TreeWalk(prepared, trie, rows, temperature, return_entropy, driver=None, packed=packed, router_top_k=top_k)
    logps = torch.zeros(rows.score_mask.shape, device=prepared.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    for chunk in walk.chunks(token_budget=token_budget or DEFAULT_TOKEN_BUDGET):
        out = walk.forward_chunk(chunk)
        logps[chunk] = out.logps
        if return_entropy:
            entropy[chunk] = out.entropy
        del out
        walk.finish_rows(chunk)
    out = LogpsOutput(logps, entropy, rows.score_mask)
    if router is not None:
        out.router = row_router_stats(trie, walk.node_router, router[0], prepared.device)
    return out
