"""Whole tiny hybrids: prompts forwarded once, their children continuing from the prompts' end states (recurrent
layers, shared_prefix_logps.recurrent) and keys/values (attention layers, the model's own cache), against each full
row through the model's own forward: log-probs within 1e-5, every parameter's gradient within 1e-4 relative."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from support.exactness import max_relative_grad_error, parameter_grads
from support.hybrid_models import GDN_CHUNK_SIZE, HYBRID_FAMILIES, VOCAB, build_hybrid, recurrent_layers
from support.state_forking import (
    attention_leaves,
    detach_states,
    fork_cache,
    forward_nodes,
    logprob_loss,
    positions,
    select_states,
    spans_of,
)
from transformers import DynamicCache

from shared_prefix_logps.recurrent import install, uninstall
from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS

# The state cache speaks the linear-attention cache layer of transformers >= 5.15 (see families.MIN_TRANSFORMERS).
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < MIN_TRANSFORMERS, reason=f"needs transformers >= {MIN_TRANSFORMERS}"
)


@pytest.fixture
def installed():
    models = []

    def build(family, **kwargs):
        model = build_hybrid(family, **kwargs)
        install(recurrent_layers(model))
        models.append(model)
        return model

    yield build
    for model in models:
        uninstall(recurrent_layers(model))


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


def _tokens(generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=generator).tolist()


def _node_logits(logits: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's logits at its real positions."""
    return [logits[r][mask[r]] for r in range(logits.shape[0])]


class _Levels:
    """Rows built from nodes at several depths: ``levels[d][r]`` is row r's node at depth d (an int index into
    ``nodes[d]``, the token lists of that depth's nodes); ``parent[d]`` the parent node of each node of depth d."""

    def __init__(self, nodes: list[list[list[int]]], parent: list[list[int]]):
        self.nodes, self.parent = nodes, parent

    def rows(self) -> list[list[int]]:
        """Each deepest node's full row: its ancestors' tokens then its own."""
        rows = []
        for leaf in range(len(self.nodes[-1])):
            chain, node = [], leaf
            for depth in range(len(self.nodes) - 1, -1, -1):
                chain.append(self.nodes[depth][node])
                node = self.parent[depth][node] if depth else node
            rows.append([t for part in reversed(chain) for t in part])
        return rows

    def first_row(self, depth: int, node: int) -> tuple[int, int]:
        """(row, offset): a row holding ``node`` of ``depth`` and the number of its tokens before the node."""
        for leaf in range(len(self.nodes[-1])):
            chain, current = [], leaf
            for d in range(len(self.nodes) - 1, -1, -1):
                chain.append(current)
                current = self.parent[d][current] if d else current
            chain.reverse()
            if chain[depth] == node:
                offset = sum(len(self.nodes[d][chain[d]]) for d in range(depth))
                return leaf, offset
        raise ValueError("node on no row")


def _forward_levels(model, levels: _Levels, *, detach_prefix: bool = False, leaves_keep_ends: bool = True):
    """Forward depth by depth (the deepest call with ``keep_ends=leaves_keep_ends``); returns each depth's (logits,
    mask of real tokens)."""
    cache = DynamicCache(config=model.config)
    ends = None
    history_mask = None  # attention mask of every earlier column, per node of the previous depth
    lengths = None
    per_depth = []
    for depth, nodes in enumerate(levels.nodes):
        if depth == 0:
            ids, mask = _left_padded(nodes)
            attention_mask, position_ids = mask, positions(mask)
            initial = None
        else:
            ids, mask = _right_padded(nodes)
            parent = torch.tensor(levels.parent[depth])
            cache = fork_cache(model, cache, parent, detach=detach_prefix)
            attention_mask = torch.cat([history_mask[parent], mask], 1)
            position_ids = lengths[parent][:, None] + torch.arange(ids.shape[1])
            initial = select_states(detach_states(ends) if detach_prefix else ends, parent)
        keep_ends = leaves_keep_ends or depth < len(levels.nodes) - 1
        logits, ends = forward_nodes(
            model, ids, attention_mask, position_ids, spans_of(mask), cache, initial, keep_ends=keep_ends
        )
        per_depth.append((logits, mask))
        history_mask = attention_mask
        lengths = mask.sum(1) if depth == 0 else lengths[torch.tensor(levels.parent[depth])] + mask.sum(1)
    return per_depth


def _compare_levels(model, levels: _Levels, seed: int = 0, **options):
    """(max |log-prob diff|, max relative gradient error) of the node-by-node forward against the full rows."""
    per_depth = _forward_levels(model, levels, **options)
    full_ids, full_mask = _left_padded(levels.rows())
    reference = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
    generator = torch.Generator().manual_seed(seed)
    loss = reference_loss = 0.0
    worst = 0.0
    for depth, (logits, mask) in enumerate(per_depth):
        weight = torch.randn(logits.shape, generator=generator)
        loss = loss + logprob_loss(logits, mask, weight)
        for node, got in enumerate(_node_logits(logits, mask)):
            row, offset = levels.first_row(depth, node)
            start = int((~full_mask[row]).sum()) + offset
            expected = reference[row, start : start + got.shape[0]]
            worst = max(worst, (torch.log_softmax(got, -1) - torch.log_softmax(expected, -1)).abs().max().item())
            node_weight = weight[node][mask[node]]
            reference_loss = reference_loss + (torch.log_softmax(expected.float(), -1) * node_weight).sum()
    grad_error = max_relative_grad_error(parameter_grads(model, loss), parameter_grads(model, reference_loss))
    return worst, grad_error


def _prompts_and_children(seed: int) -> _Levels:
    """3 prompts (1, 3 and 66 tokens: one token, shorter than the convolution kernel, past a recurrence chunk),
    2 children each (1 to 65 tokens, ending inside and at the chunk boundaries)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [_tokens(g, n) for n in (1, 3, GDN_CHUNK_SIZE + 2)]
    children = [_tokens(g, n) for n in (4, 1, GDN_CHUNK_SIZE, GDN_CHUNK_SIZE + 1, 2, 30)]
    return _Levels([prompts, children], [[0, 1, 2], [0, 0, 1, 1, 2, 2]])


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("leaves_keep_ends", [True, False], ids=["leaves-keep-ends", "leaf-call"])
def test_prompts_then_children_equal_the_full_rows(installed, family, leaves_keep_ends):
    """Also as a call of leaves (``keep_ends=False``): its one-token children run as two copies of their token."""
    model = installed(family)
    logps_error, grad_error = _compare_levels(model, _prompts_and_children(seed=1), leaves_keep_ends=leaves_keep_ends)
    assert logps_error < 1e-5
    assert grad_error < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_tree_of_depth_three(installed, family):
    """Roots, middle nodes and leaves; the forks fall inside and at the boundaries of the recurrence's chunks (a
    root of 60 tokens whose middle node ends at 64, a root of 64 whose middle node is one token)."""
    model = installed(family)
    g = torch.Generator().manual_seed(2)
    roots = [_tokens(g, 60), _tokens(g, GDN_CHUNK_SIZE)]
    middles = [_tokens(g, 4), _tokens(g, 7), _tokens(g, 1)]
    leaves = [_tokens(g, n) for n in (3, 1, 9, 2, GDN_CHUNK_SIZE + 3)]
    levels = _Levels([roots, middles, leaves], [[0, 1], [0, 0, 1], [0, 0, 1, 2, 2]])
    logps_error, grad_error = _compare_levels(model, levels, seed=3)
    assert logps_error < 1e-5
    assert grad_error < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_children_in_chunks_send_their_gradient_into_the_prompt_once(installed, family):
    """chunked_backward's pattern: the prompts' end states and keys/values cut into leaves, each child chunk
    back-propagated on its own (the leaves collect the gradients), then one backward through the prompts."""
    model = installed(family)
    levels = _prompts_and_children(seed=4)
    prompts, children = levels.nodes
    parent = torch.tensor(levels.parent[1])
    generator = torch.Generator().manual_seed(5)

    passes = []
    prompt_ids, prompt_mask = _left_padded(prompts)
    cache = DynamicCache(config=model.config)

    def count_backward_passes(module, args, out):
        out.register_hook(lambda grad: passes.append(1))

    hook = model.model.embed_tokens.register_forward_hook(count_backward_passes)
    prompt_logits, ends = forward_nodes(
        model, prompt_ids, prompt_mask, positions(prompt_mask), spans_of(prompt_mask), cache
    )
    hook.remove()
    prompt_weight = torch.randn(prompt_logits.shape, generator=generator)
    prompt_loss = logprob_loss(prompt_logits, prompt_mask, prompt_weight)

    state_leaves = detach_states(ends)
    kv = attention_leaves(cache)
    kv_leaves = [t.detach().requires_grad_() for t in kv]
    leaf_cache = DynamicCache(config=model.config)
    attention_layers = [
        layer for layer in leaf_cache.layers if hasattr(layer, "keys") and not hasattr(layer, "conv_states")
    ]
    for layer, (keys, values) in zip(attention_layers, zip(kv_leaves[::2], kv_leaves[1::2])):
        layer.update(keys, values)

    child_ids, child_mask = _right_padded(children)
    child_weight = torch.randn(child_ids.shape + (VOCAB,), generator=generator)
    lengths = prompt_mask.sum(1)
    params = [p for p in model.parameters()]
    for g in params:
        g.grad = None
    for chunk in torch.arange(len(children)).split(2):
        chunk_parent = parent[chunk]
        logits, _ = forward_nodes(
            model,
            child_ids[chunk],
            torch.cat([prompt_mask[chunk_parent], child_mask[chunk]], 1),
            lengths[chunk_parent][:, None] + torch.arange(child_ids.shape[1]),
            spans_of(child_mask[chunk]),
            fork_cache(model, leaf_cache, chunk_parent),
            select_states(state_leaves, chunk_parent),
        )
        logprob_loss(logits, child_mask[chunk], child_weight[chunk]).backward()
    assert not passes  # no child chunk reached the prompts' forward
    ends_tensors = [t for state in ends.values() for t in state.tensors()]
    leaf_tensors = [t for state in state_leaves.values() for t in state.tensors()]
    assert all(t.grad is not None for t in leaf_tensors + kv_leaves)
    torch.autograd.backward(
        [prompt_loss, *ends_tensors, *kv], [None, *[t.grad for t in leaf_tensors], *[t.grad for t in kv_leaves]]
    )
    assert len(passes) == 1
    chunked = {name: p.grad.clone() for name, p in model.named_parameters()}

    full_ids, full_mask = _left_padded(levels.rows())
    reference = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
    width = prompt_ids.shape[1]
    first_child = [int((parent == p).nonzero()[0]) for p in range(len(prompts))]
    ref_prompt_logits = torch.stack([reference[first_child[p], :width] for p in range(len(prompts))])
    ref_child_logits = torch.zeros(child_ids.shape + (VOCAB,))
    for r in range(len(children)):
        start = int((~full_mask[r]).sum()) + len(prompts[int(parent[r])])
        ref_child_logits[r, : len(children[r])] = reference[r, start : start + len(children[r])]
    # The full rows are left-padded to the longest row, prompts to the longest prompt: realign the prompt part.
    for p in range(len(prompts)):
        r = first_child[p]
        start = int((~full_mask[r]).sum())
        ref_prompt_logits[p, width - len(prompts[p]) :] = reference[r, start : start + len(prompts[p])]
    reference_loss = logprob_loss(ref_prompt_logits, prompt_mask, prompt_weight) + logprob_loss(
        ref_child_logits, child_mask, child_weight
    )
    assert max_relative_grad_error(chunked, parameter_grads(model, reference_loss)) < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_non_reentrant_checkpointing_keeps_the_states(installed, family):
    """Under activation checkpointing transformers drops a layer's ``cache`` argument in training; the call travels
    as its own kwarg, and the backward's recomputation runs the layers again without recording a second state."""
    g = torch.Generator().manual_seed(6)
    ids, mask = _left_padded([_tokens(g, 70), _tokens(g, 5)])
    weight = torch.randn(ids.shape + (VOCAB,), generator=g)

    def loss_of(model):
        logits, ends = forward_nodes(
            model, ids, mask, positions(mask), spans_of(mask), DynamicCache(config=model.config)
        )
        state_term = sum((t.float() * (i + 1)).sum() for i, s in enumerate(ends.values()) for t in s.tensors())
        return logprob_loss(logits, mask, weight) + 1e-2 * state_term

    plain = installed(family).train()
    expected = parameter_grads(plain, loss_of(plain))
    checkpointed = installed(family).train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert max_relative_grad_error(parameter_grads(checkpointed, loss_of(checkpointed)), expected) < 1e-5


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_plain_forwards_are_untouched(family):
    model = build_hybrid(family)
    ids = torch.randint(3, VOCAB, (2, 12))
    before = model(ids).logits
    mixers = recurrent_layers(model)
    install(mixers)
    install(mixers)  # idempotent
    assert torch.equal(model(ids).logits, before)
    uninstall(mixers)
    assert all("forward" not in mixer.__dict__ for mixer in mixers)
    assert torch.equal(model(ids).logits, before)
