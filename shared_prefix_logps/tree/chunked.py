"""``chunked_backward_tree``: forward and backward over chunks of rows, walking the trie depth-first, so that peak
memory does not grow with the number of leaves.

Each chunk of rows runs forward over the nodes it needs, its loss is back-propagated onto the node calls' leaves, and
each node call back-propagates once its subtree is done (:mod:`.walk`). So at most the calls on the current chunk's
paths are alive: one root-to-leaf path with ``rows_per_chunk=1``. The result equals autograd of the sum of chunk
losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..api import resolve_attention_backend
from ..distributed.backward_driver import DeepSpeedBackward, backward_chunk_loss, backward_driver
from ..inputs import as_int, check_options
from ..model import prepare_model
from ..output import LogpsOutput
from .engine_backward import NodeCallsThroughEngine
from .inputs import check_tree_rows
from .lockstep import call_agreement
from .merge import merge_threshold, rows_trie
from .walk import TreeWalk


def chunked_backward_tree(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    loss_fn: Callable[[LogpsOutput, torch.Tensor], torch.Tensor],
    *,
    rows_per_chunk: int = 1,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    merge_tiny_nodes: bool = True,
    lockstep: bool | None = None,
) -> LogpsOutput:
    """Run forward and backward of ``loss_fn`` over chunks of rows of a prefix tree; parameters' ``.grad``
    accumulate the gradient of ``sum(loss_fn(chunk) for chunk)``, as one graph over all rows would give.

    Args:
        model, input_ids, attention_mask, score_mask, temperature, return_entropy, merge_tiny_nodes: as for
            :func:`~shared_prefix_logps.compute_logps_tree`.
        loss_fn: ``loss_fn(chunk_out, rows) -> scalar tensor``; ``chunk_out`` a differentiable :class:`LogpsOutput`
            of the chunk's rows, (len(rows), L); ``rows`` (len(rows),) int64 their indices in ``input_ids``.
            Normalize with global counts if the sum of chunk losses is to be the batch loss.
        rows_per_chunk: rows per chunk, taken in the depth-first order of the trie (rows that share the most come
            together); memory holds the paths of one chunk's rows.
        backend: ``"auto"``/``"expand"`` or ``"flex"`` (CUDA only: torch's flex_attention has no CPU backward).
        lockstep: as for :func:`~shared_prefix_logps.compute_logps`: by default, under DDP or FSDP with several
            processes, every node forward and backward is agreed with the other processes first, so that processes
            with different tries make the same model calls (:mod:`~shared_prefix_logps.tree.lockstep`).

    Returns:
        The detached :class:`LogpsOutput` of all rows, (N, L). When every row is empty (all padding), each chunk's
        zeros still come out of a forward of the model (one token), as with :func:`compute_logps_tree`: ``loss_fn``
        gets them with a graph, and every parameter's ``.grad`` gets zeros.

    Raises:
        ValueError: bad rows, named as for :func:`~shared_prefix_logps.compute_logps_tree`.

    Notes:
        Every chunk calls backward, and every node call once more; under DDP wrap the call in ``no_sync()`` except for
        the step that synchronizes. Pass a DeepSpeed engine itself (what ``deepspeed.initialize`` returns): node calls
        back-propagate through ``engine.backward``, and the call ends at the engine's accumulation boundary, as one
        ``engine.backward`` would.
    """
    check_options(temperature, backend)
    if backend not in ("auto", "expand", "flex"):
        raise ValueError(f"chunked_backward_tree supports backend 'auto', 'expand' or 'flex', got {backend!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    merge_below = merge_threshold(merge_tiny_nodes)
    rows_per_chunk = as_int("rows_per_chunk", rows_per_chunk)
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be at least 1, got {rows_per_chunk}")
    if not torch.is_grad_enabled():
        raise RuntimeError("chunked_backward_tree runs backward passes; call it with gradients enabled")
    driver = backward_driver(model, "chunked_backward_tree")
    prepared = prepare_model(model)
    if isinstance(driver, DeepSpeedBackward):
        driver = NodeCallsThroughEngine(driver, prepared)
    if backend == "flex":
        resolve_attention_backend(backend, prepared.device)  # flex_attention's backward exists on CUDA only
    rows = check_tree_rows(input_ids, attention_mask, score_mask, model=prepared)
    trie = rows_trie(rows, merge_below)
    agreement = call_agreement(model, lockstep, prepared, driver)
    packed = backend == "flex"
    walk = TreeWalk(prepared, trie, rows, float(temperature), return_entropy, driver, packed, agreement=agreement)
    num_rows, length = rows.score_mask.shape
    logps = torch.zeros(num_rows, length, device=prepared.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    try:
        driver.begin()  # under DDP: every backward local, the gradients averaged once by driver.finish()
        for chunk in walk.chunks(rows_per_chunk=rows_per_chunk):
            chunk_out = walk.forward_chunk(chunk)
            loss = loss_fn(chunk_out, chunk.to(prepared.device))
            backward_chunk_loss(
                driver,
                loss,
                last=False,
                chunk_rows=chunk,
                has_valid=bool(chunk_out.mask.any()),
                logps_need_grad=chunk_out.logps.requires_grad,
            )
            logps[chunk] = chunk_out.logps.detach()
            if return_entropy:
                entropy[chunk] = chunk_out.entropy.detach()
            del chunk_out, loss
            walk.finish_rows(chunk)
        if agreement is not None:
            agreement.finish()
        driver.finish()
    finally:
        driver.close()
    return LogpsOutput(logps, entropy, rows.score_mask)
