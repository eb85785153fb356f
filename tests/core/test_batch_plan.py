"""The batch plan: every call derives its inputs once, before its first forward, and nothing climbs back to the
inputs while the model runs (one way down); the plan's chunks cover every row once; its deeper-sharing decision
counts what a trie over the prompts would, without building one."""

import pytest
import torch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated
from shared_prefix_logps.inputs import GroupedBatch, group_batch
from shared_prefix_logps.model import prepare_model
from shared_prefix_logps.tree.trie import build_trie

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _DataPath:
    """What a call does with its inputs, in order: ``derive`` for every grouped batch built or selected (a
    ``GroupedBatch`` constructed, or a selection method called) and ``forward`` for every forward of the model."""

    def __init__(self, monkeypatch, model):
        self.events = []
        constructor = GroupedBatch.__init__

        def counting_constructor(batch, *args, **kwargs):
            self.events.append("derive")
            constructor(batch, *args, **kwargs)

        monkeypatch.setattr(GroupedBatch, "__init__", counting_constructor)
        # A selection that returns its batch unchanged (no construction) is still a pass through the inputs.
        for name in ("with_one_column",):
            if hasattr(GroupedBatch, name):
                method = getattr(GroupedBatch, name)

                def counting_method(batch, *args, _method=method, **kwargs):
                    result = _method(batch, *args, **kwargs)
                    if result is batch:
                        self.events.append("derive")
                    return result

                monkeypatch.setattr(GroupedBatch, name, counting_method)
        model.register_forward_pre_hook(lambda module, args: self.events.append("forward"))

    def reset(self):
        self.events.clear()

    @property
    def derivations(self) -> int:
        return self.events.count("derive")

    @property
    def forwards(self) -> int:
        return self.events.count("forward")

    def mark_call(self):
        """A new call of an entry point begins."""
        self.events.append("call")

    @property
    def derivations_after_first_forward(self) -> int:
        """Derivations made by a call after its own first forward, summed over the calls."""
        total = 0
        for call in " ".join(self.events).split("call"):
            events = call.split()
            if "forward" in events:
                total += events[events.index("forward") :].count("derive")
        return total


def _trainer_step(model, prompts, pmask, comps, cmask, generations, between=lambda: None):
    """What a TRL chunked micro-batch makes: a no-grad scoring pass over the concatenated rows (entropy for the
    high-entropy mask), here within a budget small enough for several scoring batches, then chunked_backward one
    generation per chunk."""
    group = torch.arange(prompts.shape[0]).repeat_interleave(generations)
    ids = torch.cat([prompts[group], comps], 1)
    mask = torch.cat([pmask[group], cmask], 1)
    with torch.no_grad():
        compute_logps_concatenated(model, ids, mask, comps.shape[1], return_entropy=True, token_budget=40)
    between()
    chunked_backward(
        model,
        prompts,
        comps,
        lambda out, rows: out.logps.sum() + out.entropy.sum(),
        generations_per_chunk=1,
        prompt_mask=pmask,
        completion_mask=cmask,
        return_entropy=True,
    )


def test_inputs_are_derived_before_the_first_forward_only(monkeypatch):
    model = build_model("llama")
    prepare_model(model)
    path = _DataPath(monkeypatch, model)
    generations = 4
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=8, completion_len=5, seed=3)
    calls = {
        "chunked_backward": lambda: chunked_backward(
            model,
            prompts,
            comps,
            lambda out, rows: out.logps.sum(),
            generations_per_chunk=1,
            prompt_mask=pmask,
            completion_mask=cmask,
        ),
        "compute_logps within a token budget": lambda: _no_grad(
            compute_logps, model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, token_budget=40
        ),
        "compute_logps with gradients": lambda: compute_logps(
            model, prompts, comps, prompt_mask=pmask, completion_mask=cmask
        ),
        "trainer step": lambda: _trainer_step(model, prompts, pmask, comps, cmask, generations, path.mark_call),
    }
    for name, call in calls.items():
        path.reset()
        call()
        assert path.forwards >= 2, name  # Phase 1 then Phase 2 at least: the count below is about something
        assert path.derivations_after_first_forward == 0, (name, path.events)


def _no_grad(function, *args, **kwargs):
    with torch.no_grad():
        return function(*args, **kwargs)


def test_one_plan_per_call(monkeypatch):
    from shared_prefix_logps.batch_plan import BatchPlan

    built = []
    constructor = BatchPlan.__init__

    def counting_constructor(plan, *args, **kwargs):
        built.append(plan)
        constructor(plan, *args, **kwargs)

    monkeypatch.setattr(BatchPlan, "__init__", counting_constructor)
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=8, completion_len=5, seed=3)
    _trainer_step(model, prompts, pmask, comps, cmask, 4)
    assert len(built) == 2  # the scoring pass and chunked_backward, one each
    scoring, chunked = built
    assert len(scoring.row_chunks()) > 1  # several scoring batches, all decided up front
    assert len(chunked.prompt_chunks) == 1 and len(chunked.row_chunks()) == 4


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("budget", [None, 30, 10**6])
def test_plan_chunks_cover_every_row_once_cut_to_their_valid_columns(grad, budget):
    from shared_prefix_logps.api import plan_call

    model = build_model("qwen2")
    prepared = prepare_model(model)
    prompts, pmask, comps, cmask = make_batch(4, 3, prompt_len=7, completion_len=6, seed=5)
    cmask[1] = False  # a row without a valid token
    batch = group_batch(prompts, comps, pmask, cmask, model=prepared)
    with torch.set_grad_enabled(grad):
        plan = plan_call(prepared, batch, backend="expand", token_budget=budget)
    assert plan.tree_rows is None
    rows = torch.cat([chunk.rows for chunk in plan.row_chunks()])
    # Every row with a valid token is in a chunk; with gradients every row is (a chunk of rows without a valid token
    # is not forwarded without gradients).
    must = range(comps.shape[0]) if grad else cmask.any(1).nonzero().squeeze(1).tolist()
    assert set(must) <= set(rows.tolist()) and not cmask.any(1).all()
    assert rows.numel() == rows.unique().numel()
    if grad or budget != 30:
        assert len(plan.prompt_chunks) == 1 and len(plan.row_chunks()) == 1
    else:
        assert len(plan.prompt_chunks) > 1 and len(plan.row_chunks()) > len(plan.prompt_chunks)
    for prompts_chunk in plan.prompt_chunks:
        for chunk in prompts_chunk.row_chunks:
            part = chunk.batch
            assert torch.equal(part.completion_ids, batch.completion_ids[chunk.rows, : part.completion_ids.shape[1]])
            assert part.completion_mask.shape[1] == max(int(cmask[chunk.rows].sum(1).max()), 1)
            assert torch.equal(
                prompts_chunk.prompt_ids[part.group_index], batch.prompt_ids[batch.group_index[chunk.rows]]
            )
            assert chunk.has_valid == bool(cmask[chunk.rows].any())


def test_completions_without_columns_forward_one_masked_column():
    from shared_prefix_logps.api import plan_call

    model = build_model("llama")
    prepared = prepare_model(model)
    prompts, pmask, _, _ = make_batch(2, 2, prompt_len=5, completion_len=3)
    batch = group_batch(prompts, torch.zeros(4, 0, dtype=torch.long), pmask, None, model=prepared)
    plan = plan_call(prepared, batch, backend="expand")
    (chunk,) = plan.row_chunks()
    assert plan.width == 1 and chunk.batch.completion_ids.shape == (4, 1) and not chunk.batch.completion_mask.any()
    out = compute_logps(model, prompts, torch.zeros(4, 0, dtype=torch.long), prompt_mask=pmask)
    assert out.logps.shape == (4, 0) and out.logps.requires_grad


def test_tokens_saved_equal_a_trie_over_the_prompts():
    """The deeper-sharing decision counts the prompt tokens a trie over the distinct prompts saves without building
    the trie (sorted neighbours' common prefixes); the tree pass builds the only trie of the call."""
    from shared_prefix_logps.tree.grouped import prompt_tokens_saved

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


def _system_prompt_rows(system_len, num_prompts=3, generations=2, completion_len=4, seed=0):
    """Rows ``[left-padded prompt | completion]`` whose prompts start with one system prompt of ``system_len`` tokens
    (``0``: prompts that share nothing)."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 101, (system_len,), generator=gen)
    prompts = [torch.cat([system, torch.randint(0, 101, (3 + p,), generator=gen)]) for p in range(num_prompts)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(num_prompts * generations, width + completion_len, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(ids.shape[0]):
        prompt = prompts[row // generations]
        ids[row, width - len(prompt) : width] = prompt
        ids[row, width:] = torch.randint(0, 101, (completion_len,), generator=gen)
        mask[row, width - len(prompt) :] = True
    return ids, mask, completion_len


@pytest.mark.parametrize("system_len", [0, 80], ids=["one-level", "tree"])
def test_a_call_builds_at_most_one_trie(monkeypatch, system_len):
    """The decision for deeper sharing builds no trie; the tree pass, when taken, builds the call's only one."""
    import shared_prefix_logps.tree.api as tree_api
    import shared_prefix_logps.tree.grouped as grouped
    import shared_prefix_logps.tree.merge as merge

    built = []
    for module in (tree_api, grouped, merge):
        if hasattr(module, "build_trie"):
            original = module.build_trie
            monkeypatch.setattr(module, "build_trie", lambda *args, _f=original: built.append(1) or _f(*args))
    model = build_model("llama")
    ids, mask, keep = _system_prompt_rows(system_len)
    with torch.no_grad():
        out = compute_logps_concatenated(model, ids, mask, keep)
        dense = compute_logps_concatenated(model, ids, mask, keep, backend="dense")
    assert (out.logps - dense.logps).abs().max().item() < 1e-5
    assert len(built) == (1 if system_len else 0)
