"""The plan: every call builds one (one trie, decided before its first forward) and nothing climbs back to the inputs
while the model runs; its chunks cover every row once in the order its entry point states; no-grad chunks fit the
token budget with the expand layout's memory terms; the deeper-sharing decision counts what a trie over the prompts
would save without building one."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, chunked_backward_tree, compute_logps, compute_logps_concatenated
from shared_prefix_logps.backends import expand, expand_memory
from shared_prefix_logps.bench.memory import LiveTensorBytes
from shared_prefix_logps.engine import merge
from shared_prefix_logps.engine import plan as plan_module
from shared_prefix_logps.engine.budget import NodeCosts, budgeted_chunks
from shared_prefix_logps.engine.plan import generation_chunks, grouped_plan
from shared_prefix_logps.engine.sharing import prompt_tokens_saved
from shared_prefix_logps.engine.trie import build_trie
from shared_prefix_logps.inputs import GroupedBatch, group_batch
from shared_prefix_logps.model import prepare_model


class _Events:
    """What calls do, in order: ``derive`` for every grouped batch built, ``plan`` for every plan, ``trie`` for every
    trie built, ``forward`` for every forward of the model; ``call`` where a new entry-point call begins."""

    def __init__(self, monkeypatch, model):
        self.events = []

        def counting(kind, function):
            def counted(*args, **kwargs):
                self.events.append(kind)
                return function(*args, **kwargs)

            return counted

        constructor = GroupedBatch.__init__
        monkeypatch.setattr(GroupedBatch, "__init__", counting("derive", constructor))
        monkeypatch.setattr(plan_module.Plan, "__init__", counting("plan", plan_module.Plan.__init__))
        # A trie is searched (build_trie, then the tiny-node rule's merge of that trie) or built directly.
        for module, name in ((merge, "build_trie"), (plan_module, "grouped_trie")):
            monkeypatch.setattr(module, name, counting("trie", getattr(module, name)))
        model.register_forward_pre_hook(lambda module, args: self.events.append("forward"))

    def of_calls(self) -> list[list[str]]:
        return [call.split() for call in " ".join(self.events).split("call") if call.strip()]


def _entry_calls(model, prompts, pmask, comps, cmask):
    group = torch.arange(prompts.shape[0]).repeat_interleave(comps.shape[0] // prompts.shape[0])
    rows, rows_mask = torch.cat([prompts[group], comps], 1), torch.cat([pmask[group], cmask], 1)
    score = torch.cat([torch.zeros_like(pmask[group]), cmask], 1)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    return {
        "compute_logps within a token budget": lambda: _no_grad(
            compute_logps, model, prompts, comps, token_budget=40, **kwargs
        ),
        "compute_logps with gradients": lambda: compute_logps(model, prompts, comps, **kwargs),
        "compute_logps_concatenated": lambda: _no_grad(
            compute_logps_concatenated, model, rows, rows_mask, comps.shape[1], return_entropy=True, token_budget=40
        ),
        "chunked_backward": lambda: chunked_backward(
            model, prompts, comps, lambda out, r: out.logps.sum(), generations_per_chunk=1, **kwargs
        ),
        "chunked_backward_tree": lambda: chunked_backward_tree(
            model, rows, rows_mask, score, lambda out, r: out.logps.sum(), rows_per_chunk=2
        ),
    }


def _no_grad(function, *args, **kwargs):
    with torch.no_grad():
        return function(*args, **kwargs)


def test_every_call_builds_one_plan_and_one_trie_before_its_first_forward(monkeypatch):
    model = build_model("llama")
    prepare_model(model)
    events = _Events(monkeypatch, model)
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=8, completion_len=5, seed=3)
    for name, call in _entry_calls(model, prompts, pmask, comps, cmask).items():
        events.events = ["call"]
        call()
        (made,) = events.of_calls()
        assert made.count("forward") >= 2, name  # the prompts' node call then the completions': the rest counts
        first = made.index("forward")
        # Ordering the chunks makes plans of the same trie; no trie and no input after the first forward.
        assert made.count("trie") == 1 and "trie" not in made[first:], (name, made)
        assert "derive" not in made[first:] and "plan" not in made[first:], (name, made)
        assert made.count("derive") <= 1, (name, made)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("token_budget", [None, 30, 10**6])
def test_scoring_chunks_cover_every_scored_row_once(monkeypatch, grad, token_budget):
    model = build_model("qwen2")
    prompts, pmask, comps, cmask = make_batch(4, 3, prompt_len=7, completion_len=6, seed=5)
    cmask[1] = False  # a row without a scored token
    comps = comps.masked_fill(~cmask, 0)
    seen = []
    original = plan_module.Plan.ordered
    monkeypatch.setattr(
        plan_module.Plan, "ordered", lambda plan, chunks: seen.append(list(chunks)) or original(plan, chunks)
    )
    with torch.set_grad_enabled(grad):
        out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, token_budget=token_budget)
    dense = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    assert (out.logps - dense.logps).abs().max().item() < 1e-5
    (chunks,) = seen
    rows = torch.cat(chunks)
    assert rows.numel() == rows.unique().numel()
    if grad:  # one chunk of every row: one node call per trie depth, one graph
        assert len(chunks) == 1 and torch.equal(rows, torch.arange(comps.shape[0]))
    else:  # a row without a scored position needs no forward
        assert set(rows.tolist()) == set(cmask.any(1).nonzero().squeeze(1).tolist())
        assert (len(chunks) > 1) == (token_budget == 30)


def test_chunked_backward_takes_generations_of_every_prompt_per_chunk():
    assert [c.tolist() for c in generation_chunks(3, 4, 3)] == [[0, 1, 2, 4, 5, 6, 8, 9, 10], [3, 7, 11]]
    assert [c.tolist() for c in generation_chunks(2, 2, 1)] == [[0, 2], [1, 3]]


def test_completions_without_columns():
    model = build_model("llama")
    prompts, pmask, _, _ = make_batch(2, 2, prompt_len=5, completion_len=3)
    empty = torch.zeros(4, 0, dtype=torch.long)
    out = compute_logps(model, prompts, empty, prompt_mask=pmask)
    assert out.logps.shape == (4, 0) and out.logps.requires_grad  # hangs off the prompts' node call
    with torch.no_grad():
        assert compute_logps(model, prompts, empty, prompt_mask=pmask).logps.shape == (4, 0)


def _peak_scoring_bytes(model, batch, budget):
    prompts, pmask, comps, cmask = batch
    tracker = LiveTensorBytes()
    with torch.no_grad(), tracker:
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, token_budget=budget)
    return tracker.peak


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_a_budget_of_a_few_rows_tokens_keeps_the_peak_of_one_at_a_time(family):
    """Long prompts, short completions: the masks, the gathered keys/values and (Gemma2) the explicit scores outweigh a
    node's tokens several times, so a budget of 4 rows' tokens holds one row's memory; counting tokens alone, it held
    4 rows and both prompts (2.1x the peak for Gemma2, 2.5x for Llama)."""
    model = build_model(family, layers=2)
    prompt_len, completion_len = 96, 8
    batch = make_batch(2, 8, prompt_len, completion_len, seed=3)
    one_at_a_time = _peak_scoring_bytes(model, batch, 1)
    planned = _peak_scoring_bytes(model, batch, 4 * (prompt_len + completion_len))
    assert planned <= 1.1 * one_at_a_time, (planned, one_at_a_time)


def test_every_chunk_fits_its_calls_memory_terms():
    """Each chunk's node calls fit the budget, every node counted at its call's largest ancestors and length (what the
    padded layout allocates), each with its mask, gathered keys/values and explicit scores in hidden states' bytes."""
    model = build_model("gemma2")  # explicit scores, sliding window: every term counts
    prepared = prepare_model(model)
    shape = expand_memory.AttentionShape.of_model(model)
    costs = NodeCosts.of(model, torch.device("cpu"), "expand")
    token_bytes = shape.hidden_size * shape.itemsize
    prompts, pmask, comps, cmask = make_batch(3, 5, 40, 12, seed=1)
    plan = grouped_plan(group_batch(prompts, comps, pmask, cmask, model=prepared), deeper=False, merge_below=0)
    trie, budget = plan.trie, 2000

    def node_tokens(ancestors, length):
        masked = ancestors > 0 or shape.windowed(length)
        return length + -(
            -expand_memory.node_bytes(shape, ancestors, length, masked=masked, repeats_kv=False) // token_bytes
        )

    chunks = budgeted_chunks(trie, plan.depth_first_rows(), budget, costs)
    seen = set()
    for chunk in chunks:
        new = sorted({int(n) for n in trie.row_path[chunk].reshape(-1) if n >= 0} - seen)
        used = 0
        for depth in {int(trie.depth[n]) for n in new}:
            nodes = [n for n in new if int(trie.depth[n]) == depth]
            ancestors = max(int(trie.node_start[n]) for n in nodes)
            used += len(nodes) * node_tokens(ancestors, max(int(trie.node_length[n]) for n in nodes))
        assert len(chunk) == 1 or used <= budget, (chunk, used)
        seen.update(new)
    assert len(chunks) > 3 and sorted(torch.cat(chunks).tolist()) == list(range(comps.shape[0]))


def test_fused_path_counts_repeated_heads_and_packed_layouts_tokens_only(monkeypatch):
    model = build_model("llama")  # 4 query heads over 2 KV heads, no window
    prompts, pmask, comps, cmask = make_batch(2, 3, 40, 12)
    batch = group_batch(prompts, comps, pmask, cmask, model=prepare_model(model))
    trie = grouped_plan(batch, deeper=False, merge_below=0).trie
    nodes = list(zip(trie.node_start.tolist(), trie.node_length.tolist()))
    cpu = NodeCosts.of(model, torch.device("cpu"), "expand")
    assert not cpu.repeats_kv
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    fused = NodeCosts.of(model, torch.device("cpu"), "expand")
    # Decided per call shape by the kernel expand will choose: no fused kernel takes a CPU call, so the math kernel
    # would, and it repeats the heads itself (enable_gqa): the repeated keys/values count.
    assert fused.repeats_kv is None
    assert all(fused.node_tokens(a, n) > cpu.node_tokens(a, n) > n for a, n in nodes)
    for layout in ("flex", "flash"):
        assert all(NodeCosts.of(model, torch.device("cpu"), layout).node_tokens(a, n) == n for a, n in nodes)


def test_tokens_saved_equal_a_trie_over_the_prompts():
    """The deeper-sharing decision counts the prompt tokens a trie over the distinct prompts saves without building
    the trie (sorted neighbours' common prefixes)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        num, width, vocab = (int(torch.randint(1, high, (1,), generator=gen)) for high in (7, 7, 4))
        lengths = torch.randint(1, width + 1, (num,), generator=gen)
        mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
        ids = torch.randint(0, vocab, (num, width), generator=gen).masked_fill(~mask, 0)
        batch = GroupedBatch(
            ids, mask, torch.zeros(num, 1, dtype=torch.long), torch.ones(num, 1, dtype=torch.bool), torch.arange(num)
        )
        inner = torch.arange(width)
        columns = ((width - lengths)[:, None] + inner[None, :]).clamp(max=width - 1)
        justified = ids.gather(1, columns).masked_fill(inner[None, :] >= lengths[:, None], 0)
        expected = int(lengths.sum()) - build_trie(justified, lengths).num_tokens
        assert prompt_tokens_saved(batch) == expected, (ids, mask)
