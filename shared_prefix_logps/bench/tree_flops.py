"""Model-config FLOPs of each tree-benchmark method on a prefix-tree workload, counted as :mod:`.flops` counts them
(matmuls only: body per token, attention per visible (query, key) pair, head per scored token).

- ``dense``: every row's real tokens, causal attention over the row, the head on the scored positions.
- ``two_level``: each distinct prompt part once (causal), every completion token attending over its prompt and its
  own earlier tokens, the head on every completion token (the two-level trie scores them all).
- ``tree``: every trie token once, each node's tokens attending over their ancestors' and causally over their own,
  the head on the distinct scored pairs. This is also the floor (``unique``): no method forwards fewer tokens or
  scores fewer pairs.
"""

from __future__ import annotations

from ..engine.plan import rows_plan
from ..inputs import TreeRows
from .flops import Flops, ModelShape, forward_flops, step_flops, visible_pairs
from .tree_workloads import TreeWorkload


def _rows(workload: TreeWorkload) -> TreeRows:
    mask = workload.attention_mask.cpu().bool()
    first = (mask.long().cumsum(1) == 0).sum(1)  # columns before each row's first real token
    return TreeRows(workload.input_ids.cpu(), mask, workload.score_mask.cpu().bool(), first, mask.sum(1))


def method_flops(shape: ModelShape, workload: TreeWorkload, *, train: bool) -> dict[str, Flops]:
    """FLOPs of a step of each method (``dense``, ``two_level``, ``tree``, ``unique``); forward+backward with
    ``train``."""
    rows = _rows(workload)
    lengths = rows.lengths.tolist()
    split = workload.prompt_length.tolist()
    scored = int(rows.score_mask.sum())

    dense = forward_flops(
        shape,
        tokens=sum(lengths),
        attention_pairs=[sum(visible_pairs(0, n, w) for n in lengths) for w in shape.windows],
        scored_tokens=scored,
    )
    prompts = {
        tuple(rows.input_ids[i, rows.first_column[i] : rows.first_column[i] + p].tolist()) for i, p in enumerate(split)
    }
    prompt_lengths = [len(p) for p in prompts]
    two_level = forward_flops(
        shape,
        tokens=sum(prompt_lengths) + sum(n - p for n, p in zip(lengths, split)),
        attention_pairs=[
            sum(visible_pairs(0, p, w) for p in prompt_lengths)
            + sum(visible_pairs(p, n - p, w) for n, p in zip(lengths, split))
            for w in shape.windows
        ],
        scored_tokens=sum(n - p for n, p in zip(lengths, split)),
    )
    plan = rows_plan(rows, merge_below=0)
    trie = plan.trie
    nodes = list(zip(trie.node_start.tolist(), trie.node_length.tolist()))
    tree = forward_flops(
        shape,
        tokens=trie.num_tokens,
        attention_pairs=[sum(visible_pairs(start, n, w) for start, n in nodes) for w in shape.windows],
        scored_tokens=plan.pairs.target.numel(),
    )
    steps = {
        name: step_flops(f, train=train) for name, f in (("dense", dense), ("two_level", two_level), ("tree", tree))
    }
    return {**steps, "unique": steps["tree"]}
