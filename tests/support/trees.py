"""Random batches of rows that form prefix trees, for the tree entry points' tests."""

from __future__ import annotations

import torch

from .tiny_models import VOCAB


def random_tree_rows(seed: int, *, depth: int, branching: int, max_segment: int = 4) -> list[list[int]]:
    """Token-id lists forming a trie of up to ``depth`` levels below a shared system prompt, up to ``branching``
    children per node, segments of 1..``max_segment`` tokens (one-token nodes included). Some rows end inside the
    tree (a row that is a prefix of others), one row is duplicated, one row shares nothing with the rest."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def tokens(count):
        return torch.randint(0, VOCAB, (count,), generator=gen).tolist()

    rows: list[list[int]] = []

    def grow(prefix: list[int], level: int) -> None:
        path = prefix + tokens(randint(1, max_segment))
        if level == depth:
            rows.append(path)
            return
        if randint(0, 3) == 0:
            rows.append(path)  # ends here although the subtree goes on
        for _ in range(randint(1, branching)):
            grow(path, level + 1)

    system = tokens(randint(2, 6))
    for _ in range(randint(1, 2)):  # prompts that share only the system prompt
        grow(system, 1)
    rows.append(list(rows[randint(0, len(rows) - 1)]))  # a duplicate
    rows.append(tokens(randint(2, 5)))  # shares nothing
    return rows


def pad_rows(rows: list[list[int]], seed: int, *, hole_rate: float = 0.3, extra: int = 1):
    """(ids, attention_mask, score_mask), each (N, L): rows left- or right-padded at random (both kinds present),
    score masks with random holes, never on a row's first real token, at least one scored position."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(r) for r in rows) + extra
    num = len(rows)
    ids = torch.zeros(num, width, dtype=torch.long)
    mask = torch.zeros(num, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        left = i % 2 == 0 if num > 1 else True
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = True
    score = mask & (torch.rand(num, width, generator=gen) >= hole_rate)
    first = mask.long().argmax(1)
    score[torch.arange(num), first] = False
    if not score.any():
        score[0, mask[0].nonzero()[-1]] = True
    return ids, mask, score


def planned_node_calls(rows: list[list[int]], *, rows_per_chunk: int, layout: str = "expand"):
    """(trie, calls): the node calls the walk plans for ``rows`` (each a token-id list, every position scored) taken
    ``rows_per_chunk`` at a time in depth-first order, in planning order, with ``layout``'s fields. Later chunks'
    calls attend over several earlier calls, so their ancestor stores hold nodes out of depth-first order."""
    from shared_prefix_logps.engine.call_planner import CallPlanner
    from shared_prefix_logps.engine.plan import rows_plan
    from shared_prefix_logps.inputs import TreeRows

    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    real = torch.arange(width)[None, :] < lengths[:, None]
    score = real.clone()
    score[:, 0] = False
    plan = rows_plan(TreeRows(ids, real, score, torch.zeros(len(rows), dtype=torch.long), lengths), merge_below=0)
    trie = plan.trie
    planner = CallPlanner(trie, plan.pairs, layout)
    planned: set[int] = set()
    calls = []
    for chunk in plan.in_chunks_of(rows_per_chunk).chunks:
        new = sorted({node for row in chunk.tolist() for node in trie.path(row)} - planned)
        for depth in sorted({int(trie.depth[node]) for node in new}):
            calls.append(planner.plan([node for node in new if int(trie.depth[node]) == depth]))
        planned.update(new)
    return trie, calls


def token_visibility(trie, call, window) -> torch.Tensor:
    """(T, A_total + T) bool: which of [the call's ancestor store ; its own tokens] each of its T packed tokens may
    see, from the trie's parent links: the key's node is an ancestor of the query's node, or is it and the key comes
    no later; and the query's position is less than ``window`` past the key's."""
    sees = torch.zeros(trie.num_nodes, trie.num_nodes, dtype=torch.bool)
    for node in range(trie.num_nodes):
        sees[node, trie.ancestors(node)] = True
    key_node = torch.cat([call.store_node, call.query_node])
    key_order = torch.cat([call.store_order, call.query_order])
    key_pos = torch.cat([call.store_positions, call.positions[0]])
    q_node, q_order, q_pos = call.query_node[:, None], call.query_order[:, None], call.positions[0][:, None]
    ancestor = sees[q_node, key_node[None, :]]
    itself = (q_node == key_node[None, :]) & (key_order[None, :] <= q_order)
    near = torch.ones_like(ancestor) if window is None else (q_pos - key_pos[None, :]) < window
    return (ancestor | itself) & near


def star_batch(leaves: int, seed: int = 0):
    """(ids, attention_mask, score_mask), unpadded: a 24-token system prompt, 4 prompts of 8 tokens below it, and
    ``leaves`` rows of 8 more tokens below those, so every path is 40 tokens long whatever the number of leaves."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 101, (24,), generator=gen)
    rows = []
    for _ in range(4):
        prompt = torch.randint(0, 101, (8,), generator=gen)
        for _ in range(leaves // 4):
            rows.append(torch.cat([system, prompt, torch.randint(0, 101, (8,), generator=gen)]))
    ids = torch.stack(rows)
    mask = torch.ones_like(ids, dtype=torch.bool)
    score = mask.clone()
    score[:, 0] = False
    return ids, mask, score


def spy_searched_plans(on_call, setattr=setattr) -> None:
    """Call ``on_call(batch)`` for every grouped call (``compute_logps``, ``compute_logps_concatenated``,
    ``chunked_backward``) whose plan takes the trie searched from its rows (deeper sharing) instead of the two-level
    one; ``setattr`` installs the spy (``monkeypatch.setattr`` in a test, plain ``setattr`` in a spawned process)."""
    from shared_prefix_logps.engine import run

    original = run.grouped_plan

    def spy(batch, *, deeper, **options):
        if deeper:
            on_call(batch)
        return original(batch, deeper=deeper, **options)

    setattr(run, "grouped_plan", spy)


def spy_tree_calls(monkeypatch) -> list[int]:
    """A list that grows by the number of rows of every grouped call that takes the searched trie
    (:func:`spy_searched_plans`)."""
    calls = []
    spy_searched_plans(lambda batch: calls.append(int(batch.completion_ids.shape[0])), monkeypatch.setattr)
    return calls


def pad_alternating(rows: list[list[int]], *, hole: bool = True):
    """(ids, mask, score) of ``rows``: (N, longest + 1) int64 / bool / bool, even rows right-padded and odd rows
    left-padded, every real position scored but each row's first and (with ``hole``) column 3."""
    width = max(len(r) for r in rows) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if i % 2 else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = True
    score = mask.clone()
    score[torch.arange(len(rows)), mask.long().argmax(1)] = False
    if hole:
        score[:, 3] = False
    return ids, mask, score


def grouped_batch_calls(prompts: int, prefix: int, generations: int, completion: int, layout: str = "flex"):
    """The two node calls (prompts, then completions) of a grouped batch of ``prompts`` prompts of ``prefix`` tokens
    with ``generations`` completions of ``completion`` tokens each, planned for ``layout`` on the host; nothing
    scored (the calls' masks are what the tests build)."""
    from shared_prefix_logps.engine.call_planner import CallPlanner, ScoredPairs
    from shared_prefix_logps.engine.trie import grouped_trie, levels

    rows = prompts * generations
    trie = grouped_trie(
        torch.zeros(prompts, prefix, dtype=torch.long),
        torch.ones(prompts, prefix, dtype=torch.bool),
        torch.zeros(rows, completion, dtype=torch.long),
        torch.ones(rows, completion, dtype=torch.bool),
        torch.arange(prompts).repeat_interleave(generations),
    )
    planner = CallPlanner(trie, ScoredPairs(*(torch.zeros(0, dtype=torch.long),) * 3), layout)
    prompts_call, completions_call = (planner.plan(nodes) for nodes in levels(trie))
    return prompts_call, completions_call
