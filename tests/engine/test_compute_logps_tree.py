"""compute_logps_tree equals the dense forward of every row on random tries: log-probs, entropy, every gradient."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.engine.merge import MERGE_BELOW_SAVED_TOKENS, merge_tiny_nodes
from shared_prefix_logps.engine.trie import build_trie

TREE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "qwen3_moe")
SHAPES = [(1, 8), (2, 8), (3, 3), (5, 2)]


def compare_tree_with_dense(model, ids, mask, score, *, temperature=1.0):
    """(max |logps diff|, max |entropy diff|, max relative grad error) of the tree against dense full rows."""
    tree = compute_logps_tree(model, ids, mask, score, temperature=temperature, return_entropy=True)
    dense = compute_logps_tree(model, ids, mask, score, temperature=temperature, return_entropy=True, backend="dense")
    assert tree.logps.dtype == torch.float32 and tree.logps.shape == ids.shape
    assert torch.equal(tree.mask, score)
    assert (tree.logps[~score] == 0).all() and (tree.entropy[~score] == 0).all()
    assert (tree.logps <= 0).all()
    assert (tree.logps[score] != 0).all()  # every scored position was written
    logps_err = (tree.logps - dense.logps).abs().max().item()
    entropy_err = (tree.entropy - dense.entropy).abs().max().item()
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    return logps_err, entropy_err, grad_err


@pytest.mark.parametrize("family", TREE_FAMILIES)
@pytest.mark.parametrize("depth,branching", SHAPES)
def test_matches_dense_on_random_tries(family, depth, branching):
    model = build_model(family)
    seed = depth * 10 + branching
    rows = random_tree_rows(seed, depth=depth, branching=branching)
    ids, mask, score = pad_rows(rows, seed)
    logps_err, entropy_err, grad_err = compare_tree_with_dense(model, ids, mask, score, temperature=0.7)
    assert logps_err < 1e-5, logps_err
    assert entropy_err < 1e-5, entropy_err
    assert grad_err < 1e-4, grad_err


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_without_grad_equals_with_grad(family):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(3, depth=3, branching=3), 3)
    with torch.no_grad():
        scored = compute_logps_tree(model, ids, mask, score, return_entropy=True)
    graded = compute_logps_tree(model, ids, mask, score, return_entropy=True)
    assert not scored.logps.requires_grad
    assert torch.allclose(scored.logps, graded.logps.detach(), atol=1e-6)
    assert torch.allclose(scored.entropy, graded.entropy.detach(), atol=1e-6)


def test_checkpointing_and_long_windows():
    """Non-reentrant activation checkpointing recomputes node calls in backward; rows longer than the window."""
    model = build_model("mistral")  # sliding window 6
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = random_tree_rows(5, depth=3, branching=2, max_segment=6)
    ids, mask, score = pad_rows(rows, 5)
    assert ids.shape[1] > 12
    logps_err, entropy_err, grad_err = compare_tree_with_dense(model, ids, mask, score)
    assert logps_err < 1e-5 and entropy_err < 1e-5 and grad_err < 1e-4, (logps_err, entropy_err, grad_err)


def test_tokens_forwarded_are_the_unique_tokens():
    """A forward pre-hook on the input embeddings counts what the model embeds. Without merging: the trie's unique
    tokens, within the bound of unique tokens plus one boundary token per node. With the tiny-node rule: the merged
    trie's tokens, which count each merged node's tokens once per node that received them, so the bound holds for
    the merged trie's nodes, and exceeds the unique tokens by less than the rule's threshold per merged node; both
    fewer than the dense rows' real tokens."""
    model = build_model("qwen2")
    rows = random_tree_rows(7, depth=4, branching=3)
    ids, mask, score = pad_rows(rows, 7)
    with torch.no_grad():
        compute_logps_tree(model, ids, mask, score)  # the model's first call checks its head with a forward of its own
    counted = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counted.append(args[0].numel()))

    def forwarded(**kwargs):
        counted.clear()
        with torch.no_grad():
            compute_logps_tree(model, ids, mask, score, **kwargs)
        return sum(counted)

    try:
        unique_tokens = forwarded(merge_tiny_nodes=False)
        merged_tokens = forwarded()
        dense_tokens = forwarded(backend="dense")
    finally:
        handle.remove()
    lengths = mask.sum(1)
    justified = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, row in enumerate(rows):
        justified[i, : len(row)] = torch.tensor(row)
    trie = build_trie(justified, lengths)
    assert unique_tokens <= trie.num_tokens + trie.num_nodes
    assert unique_tokens == trie.num_tokens
    merged = merge_tiny_nodes(trie)
    num_merged = trie.num_nodes - merged.num_nodes
    assert num_merged >= 3  # the rule merged something here
    assert merged_tokens <= merged.num_tokens + merged.num_nodes
    assert merged_tokens == merged.num_tokens
    assert unique_tokens < merged_tokens < unique_tokens + num_merged * MERGE_BELOW_SAVED_TOKENS
    assert merged_tokens < int(lengths.sum()) <= dense_tokens


def test_nothing_scored_with_grad_backpropagates_zero():
    model = build_model("llama")
    ids, mask, _ = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    out = compute_logps_tree(model, ids, mask, torch.zeros_like(mask))
    assert (out.logps == 0).all()
    out.logps.sum().backward()  # connected to the model's graph, as the dense forward's result would be
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters() if p.grad is not None)


def test_lora_with_an_empty_row_and_the_adapter_disabled():
    """PEFT LoRA (the head included) and a row with no real token (all zeros out, nothing forwarded for it)."""
    import peft
    from support.tiny_models import randomize_lora

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
    model = randomize_lora(peft.get_peft_model(build_model("llama"), config))
    ids, mask, score = pad_rows(random_tree_rows(3, depth=3, branching=2), 3)
    ids, mask, score = (torch.cat([t, torch.zeros_like(t[:1])]) for t in (ids, mask, score))
    logps_err, entropy_err, grad_err = compare_tree_with_dense(model, ids, mask, score)
    assert logps_err < 1e-5 and entropy_err < 1e-5 and grad_err < 1e-4, (logps_err, entropy_err, grad_err)
    with model.disable_adapter(), torch.no_grad():  # reference log-probs of a PEFT policy
        tree = compute_logps_tree(model, ids, mask, score)
        dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
