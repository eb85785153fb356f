"""compute_logps, compute_logps_concatenated and chunked_backward share deeper than the prompt when distinct prompts
share a prefix."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model
from support.trees import spy_tree_calls

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated
from shared_prefix_logps.engine import merge, sharing
from shared_prefix_logps.engine.trie import build_trie
from shared_prefix_logps.inputs import split_concatenated
from shared_prefix_logps.model import prepare_model

SYSTEM_LEN = 70  # above sharing.DEEPER_SHARING_MIN_TOKENS once two prompts share it


def _trainer_rows(num_prompts=3, generations=3, system_len=SYSTEM_LEN, seed=0):
    """TRL-shaped rows [left-padded prompt | right-padded completion]; every prompt starts with the same system
    prompt (or, with ``system_len=0``, prompts share nothing). Rows of a prompt are consecutive."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 101, (system_len,), generator=gen)
    prompts = [torch.cat([system, torch.randint(0, 101, (3 + p,), generator=gen)]) for p in range(num_prompts)]
    width, completion_len = max(len(p) for p in prompts), 5
    rows, masks = [], []
    for prompt in prompts:
        for g in range(generations):
            completion = torch.randint(0, 101, (completion_len,), generator=gen)
            real = completion_len - g % 3
            ids = torch.zeros(width + completion_len, dtype=torch.long)
            mask = torch.zeros(width + completion_len, dtype=torch.bool)
            ids[width - len(prompt) : width] = prompt
            mask[width - len(prompt) : width] = True
            ids[width : width + real] = completion[:real]
            mask[width : width + real] = True
            rows.append(ids)
            masks.append(mask)
    return torch.stack(rows), torch.stack(masks), completion_len


def _embedded_tokens(model, fn):
    counted = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counted.append(args[0].numel()))
    try:
        with torch.no_grad():
            fn()
    finally:
        handle.remove()
    return sum(counted)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_shared_system_prompt_matches_dense_and_embeds_fewer_tokens(family, monkeypatch):
    model = build_model(family)
    ids, mask, keep = _trainer_rows()
    assert sharing.deeper_sharing_pays(split_concatenated(ids, mask, keep, model=prepare_model(model)))
    tree = compute_logps_concatenated(model, ids, mask, keep, return_entropy=True)
    dense = compute_logps_concatenated(model, ids, mask, keep, return_entropy=True, backend="dense")
    assert torch.equal(tree.mask, dense.mask)
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() < 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err < 1e-4

    deeper = _embedded_tokens(model, lambda: compute_logps_concatenated(model, ids, mask, keep))
    monkeypatch.setattr(merge, "MERGE_BELOW_SAVED_TOKENS", 0)
    unmerged = _embedded_tokens(model, lambda: compute_logps_concatenated(model, ids, mask, keep))
    monkeypatch.setattr(sharing, "DEEPER_SHARING_MIN_TOKENS", 10**9)  # the two-level trie, as before
    two_level = _embedded_tokens(model, lambda: compute_logps_concatenated(model, ids, mask, keep))
    # The system prompt is embedded once instead of once per prompt.
    assert unmerged <= two_level - 2 * (SYSTEM_LEN - 1), (unmerged, two_level)
    # The tiny-node rule merges each prompt's own 3 + p tokens (saving 2 * (3 + p) < its threshold) into its 3
    # completions: they are embedded 3 times instead of once, and the system prompt still once.
    assert deeper == unmerged + sum(2 * (3 + p) for p in range(3)), (deeper, unmerged)
    assert deeper < two_level - (SYSTEM_LEN - 1), (deeper, two_level)


def test_compute_logps_shares_the_system_prompt_too():
    model = build_model("qwen2")
    ids, mask, keep = _trainer_rows(num_prompts=2, generations=2)
    width = ids.shape[1] - keep
    prompts, prompt_mask = ids[::2, :width], mask[::2, :width]
    completions, completion_mask = ids[:, width:], mask[:, width:]
    kwargs = dict(prompt_mask=prompt_mask, completion_mask=completion_mask, return_entropy=True)
    tree = compute_logps(model, prompts, completions, **kwargs)
    dense = compute_logps(model, prompts, completions, backend="dense", **kwargs)
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err < 1e-4


@pytest.mark.parametrize("generations_per_chunk", [1, 3])
def test_chunked_backward_embeds_a_200_token_system_prompt_once(generations_per_chunk, monkeypatch):
    """A training step on prompts behind one 200-token system prompt embeds each token of the rows' trie once (the
    system prompt once, not once per prompt; no prompt node re-forwarded for a later chunk), exact against dense.
    (The trie's own count: the tiny-node rule would merge each prompt's own 3-5 tokens into its rows.)"""
    monkeypatch.setattr(merge, "MERGE_BELOW_SAVED_TOKENS", 0)
    model = build_model("qwen2")
    ids, mask, keep = _trainer_rows(num_prompts=3, generations=3, system_len=200)
    width = ids.shape[1] - keep
    prompts, prompt_mask = ids[::3, :width], mask[::3, :width]
    completions, completion_mask = ids[:, width:], mask[:, width:]
    weights = torch.randn(completions.shape, generator=torch.Generator().manual_seed(2))
    kwargs = dict(prompt_mask=prompt_mask, completion_mask=completion_mask)
    dense = compute_logps(model, prompts, completions, backend="dense", **kwargs)
    expected = parameter_grads(model, (dense.logps * weights).sum())
    counted = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counted.append(args[0].numel()))
    try:
        out = chunked_backward(
            model,
            prompts,
            completions,
            lambda chunk, rows: (chunk.logps * weights[rows]).sum(),
            generations_per_chunk=generations_per_chunk,
            **kwargs,
        )
    finally:
        handle.remove()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert (out.logps - dense.logps).abs().max().item() < 1e-5
    assert max_relative_grad_error(grads, expected) < 1e-4
    # The trie of the rows' real tokens: the system prompt, each prompt's own tokens, each completion.
    real = [row[m] for row, m in zip(ids, mask)]
    lengths = torch.tensor([len(r) for r in real])
    trie = build_trie(torch.nn.utils.rnn.pad_sequence(real, batch_first=True), lengths)
    assert sum(counted) <= trie.num_tokens + trie.num_nodes, (sum(counted), trie.num_tokens, trie.num_nodes)
    assert sum(counted) < int(mask.sum()) - 2 * 200  # the system prompt once, not once per prompt


def test_prompts_that_share_little_take_the_two_level_trie(monkeypatch):
    model = build_model("llama")
    ids, mask, keep = _trainer_rows(system_len=0)
    assert sharing.prompt_tokens_saved(split_concatenated(ids, mask, keep, model=prepare_model(model))) == 0

    deeper = spy_tree_calls(monkeypatch)
    out = compute_logps_concatenated(model, ids, mask, keep)
    assert deeper == []  # the two-level trie
    dense = compute_logps_concatenated(model, ids, mask, keep, backend="dense")
    assert (out.logps - dense.logps).abs().max().item() < 1e-5


def test_tokens_saved_counts_the_shared_prompt_prefix():
    model = build_model("llama")
    prompts = torch.tensor([[0, 1, 2, 3, 4], [5, 1, 2, 3, 9], [0, 0, 7, 8, 6]])
    prompt_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    from shared_prefix_logps.inputs import group_batch

    batch = group_batch(prompts, torch.ones(3, 2, dtype=torch.long), prompt_mask, None, model=prepare_model(model))
    # [1 2 3 4] and [5 1 2 3 9] share nothing at the start (5 vs 1); [7 8 6] neither: nothing saved.
    assert sharing.prompt_tokens_saved(batch) == 0
    prompts[1] = torch.tensor([1, 2, 3, 5, 9])
    batch = group_batch(prompts, torch.ones(3, 2, dtype=torch.long), prompt_mask, None, model=prepare_model(model))
    assert sharing.prompt_tokens_saved(batch) == 3  # [1 2 3] once for two prompts


def test_with_gradients_and_several_processes_without_agreement_the_two_level_trie_serves(monkeypatch):
    """A call with gradients whose processes agree on nothing themselves (a trainer plug-in keeps them in step, or
    lockstep=False) must make the same two forwards on every process (FSDP matches collectives by order): the
    two-level trie does, a deeper one makes one per trie depth. With the call's own agreement (lockstep), or without
    gradients (joined), the deeper trie may serve."""
    import torch.distributed as dist

    from shared_prefix_logps.engine.run import two_forwards_only

    model = build_model("llama")
    ids, mask, keep = _trainer_rows()
    batch = split_concatenated(ids, mask, keep, model=prepare_model(model))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert two_forwards_only(None) and not two_forwards_only(object())
    assert not sharing.deeper_sharing_pays(batch, two_forwards=two_forwards_only(None))
    with torch.no_grad():
        assert not two_forwards_only(None)
    deeper = spy_tree_calls(monkeypatch)
    compute_logps_concatenated(model, ids, mask, keep, lockstep=False)
    assert deeper == []


def test_a_small_share_of_the_tokens_takes_the_two_level_trie():
    """Prompts that share a 70-token system prompt but carry long completions: the trie saves 140 tokens, under a
    fifth of what two-level sharing forwards, where the searched trie measured slower."""
    model = build_model("llama")
    ids, mask, keep = _trainer_rows()
    long_completions = torch.ones(ids.shape[0], 100, dtype=torch.long)
    batch = split_concatenated(
        torch.cat([ids[:, :-keep], long_completions], 1),
        torch.cat([mask[:, :-keep], torch.ones_like(long_completions, dtype=torch.bool)], 1),
        100,
        model=prepare_model(model),
    )
    assert sharing.prompt_tokens_saved(batch) == 2 * SYSTEM_LEN
    assert not sharing.deeper_sharing_pays(batch)
