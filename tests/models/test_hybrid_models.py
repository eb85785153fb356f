"""Linear-attention hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) through every entry point: each trie node forwarded
once, its recurrent layers' end states forked to its children and its attention layers' keys/values shared, exact
against each full row through the model's own forward (log-probs and entropy within 1e-5, every parameter's gradient
within 1e-4 relative); every other hybrid family refused by name with its reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from packaging.version import Version
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads, weighted_loss
from support.hybrid_families import tiny_family_model
from support.hybrid_models import HYBRID_FAMILIES, build_hybrid, hybrid_batch, hybrid_tree_rows
from support.trees import pad_alternating

from shared_prefix_logps import (
    UnsupportedModelError,
    chunked_backward,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.engine.trie import build_trie
from shared_prefix_logps.recurrent import families

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < families.MIN_TRANSFORMERS,
    reason=f"hybrids are refused below transformers {families.MIN_TRANSFORMERS} (test_old_transformers_refuses_them)",
)

MOE_HYBRIDS = ("qwen3_5_moe_text", "qwen3_next")


def _assert_exact(errors):
    logps_err, entropy_err, grad_err = errors
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, errors


def _grads(model) -> dict:
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _tree():
    """(ids, attention_mask, score_mask) of :func:`hybrid_tree_rows`, rows left- and right-padded, a scored hole."""
    return pad_alternating(hybrid_tree_rows())


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("generations", [1, 4])
def test_compute_logps_matches_the_full_rows(family, generations):
    """Prompts of 11, 1 and 3 tokens (one token, shorter than the convolution kernel), an empty completion."""
    model = build_hybrid(family)
    prompts, pmask, comps, cmask = hybrid_batch(generations, seed=generations)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True)
    _assert_exact(compare_with_dense(model, prompts, comps, **kwargs))
    with torch.no_grad():
        scored = compute_logps(model, prompts, comps, **kwargs)
        ids = torch.cat([prompts.repeat_interleave(generations, 0), comps], 1)
        mask = torch.cat([pmask.repeat_interleave(generations, 0), cmask], 1)
        concatenated = compute_logps_concatenated(
            model, ids, mask, comps.shape[1], temperature=0.7, return_entropy=True
        )
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    for out in (scored, concatenated):
        assert (out.logps - dense.logps).abs().max() <= 1e-5
        assert (out.entropy - dense.entropy).abs().max() <= 1e-5


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_chunked_backward_at_every_chunk_size(family):
    model = build_hybrid(family)
    prompts, pmask, comps, cmask = hybrid_batch(4, seed=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True)
    weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(6))

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum() + (out.entropy * weights[rows].flip(1)).sum()

    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, loss_fn(dense, torch.arange(comps.shape[0])))
    for per_chunk in range(1, 5):
        out = chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=per_chunk, **kwargs)
        assert (out.logps - dense.logps.detach()).abs().max() <= 1e-5
        assert (out.entropy - dense.entropy.detach()).abs().max() <= 1e-5
        assert max_relative_grad_error(_grads(model), expected) <= 1e-4, per_chunk


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_tree_of_depth_three_through_the_tree_entry_points(family):
    """Forks inside and at the boundaries of the recurrence's 64-token chunks; tiny nodes kept (a one-token middle
    node continues from its parent's state and hands its own on). With gradients in one graph, in chunks of rows,
    and without gradients within a small token budget."""
    model = build_hybrid(family)
    ids, mask, score = _tree()
    kwargs = dict(temperature=0.7, return_entropy=True, merge_tiny_nodes=False)
    gen = torch.Generator().manual_seed(7)
    w_logps, w_entropy = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)

    def loss_fn(out, rows):
        return (out.logps * w_logps[rows]).sum() + (out.entropy * w_entropy[rows]).sum()

    every_row = torch.arange(ids.shape[0])
    dense = compute_logps_tree(model, ids, mask, score, backend="dense", **kwargs)
    expected = parameter_grads(model, loss_fn(dense, every_row))
    dense = dense.logps.detach(), dense.entropy.detach()
    shared = compute_logps_tree(model, ids, mask, score, **kwargs)
    assert max_relative_grad_error(parameter_grads(model, loss_fn(shared, every_row)), expected) <= 1e-4
    outputs = [shared]
    for rows_per_chunk in (1, 3):
        outputs.append(chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=rows_per_chunk, **kwargs))
        assert max_relative_grad_error(_grads(model), expected) <= 1e-4, rows_per_chunk
    with torch.no_grad():
        outputs.append(compute_logps_tree(model, ids, mask, score, token_budget=80, **kwargs))
    for out in outputs:
        assert (out.logps.detach() - dense[0]).abs().max() <= 1e-5
        assert (out.entropy.detach() - dense[1]).abs().max() <= 1e-5


def _count_decode_steps(monkeypatch, model) -> list[bool]:
    """A list that grows by one entry per one-token recurrence step from a state (the Gated DeltaNet layers' decode
    path) that ``model``'s layers run: whether gradients were enabled."""
    import importlib

    modeling = importlib.import_module(type(model).__module__)
    original = modeling.torch_recurrent_gated_delta_rule
    steps = []

    def counted(*args, **kwargs):
        steps.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "torch_recurrent_gated_delta_rule", counted)
    return steps


@pytest.mark.parametrize("one_token_backward", [True, False], ids=["decode-path", "merged-into-children"])
def test_one_token_nodes_between_a_parent_and_children(monkeypatch, one_token_backward):
    """A one-token node that continues its parent's state and hands its own on: where the family's verdict says the
    layer's one-token decode path back-propagates (transformers' torch fallbacks on the CPU) the node keeps its place,
    and a Gated DeltaNet layer runs it in its call's padded batch, two steps, the second the identity, so no decode
    step runs at all; where the verdict says it cannot, the plan merges it into its children (a leaf of its own for
    the row that ends there). Both exact."""
    family = "qwen3_5_text"
    verdict = families.VERDICTS[family]
    assert verdict.one_token is True
    if not one_token_backward:
        monkeypatch.setitem(families.VERDICTS, family, dataclasses.replace(verdict, one_token=False))
    model = build_hybrid(family)
    steps = _count_decode_steps(monkeypatch, model)
    ids, mask, score = _tree()
    dense = compute_logps_tree(model, ids, mask, score, backend="dense", merge_tiny_nodes=False)
    expected = parameter_grads(model, weighted_loss(dense))
    steps.clear()
    shared = compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=False)
    assert (shared.logps - dense.logps).abs().max() <= 1e-5
    assert max_relative_grad_error(parameter_grads(model, weighted_loss(shared)), expected) <= 1e-4
    assert not any(steps), steps


def test_every_trie_node_is_forwarded_once():
    """A forward pre-hook on the embeddings counts the tokens every forward takes: the distinct prompts' and the
    completions' tokens for a grouped batch, the trie's tokens for tree rows, with and without gradients."""
    model = build_hybrid("qwen3_5_text")
    counted = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: counted.append(args[0].numel()))
    compute_logps(model, [[3, 4]], [[5]])  # prepares the model (its head check forwards too)
    prompts, pmask, comps, cmask = hybrid_batch(4, seed=8)
    grouped = int(pmask.sum() + cmask.sum())
    ids, mask, score = _tree()
    justified = torch.stack([torch.cat([row[m], row[~m]]) for row, m in zip(ids, mask)])
    trie_tokens = build_trie(justified, mask.sum(1)).num_tokens
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            counted.clear()
            compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
            assert sum(counted) == grouped, (grad, counted)
            counted.clear()
            compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=False)
            assert sum(counted) == trie_tokens, (grad, counted)
    assert trie_tokens < int(mask.sum())


def test_lora():
    peft = pytest.importorskip("peft")
    from support.tiny_models import randomize_lora

    # Adapters on the recurrent layers' projections and the attention's.
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "v_proj", "o_proj"]
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0)
    model = randomize_lora(peft.get_peft_model(build_hybrid("qwen3_5_text"), config))
    prompts, pmask, comps, cmask = hybrid_batch(3, seed=9)
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )


@pytest.mark.parametrize("family", ["qwen3_5_moe_text"])
def test_non_reentrant_gradient_checkpointing(family):
    model = build_hybrid(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, pmask, comps, cmask = hybrid_batch(3, seed=10)
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )


@pytest.mark.slow
def test_compiled_layers():
    """Each decoder layer compiled (aot_eager: dynamo's trace and a traced backward); the recurrent layers of a node
    call run eagerly between graph breaks, as its attention and head do."""
    torch._dynamo.reset()
    try:
        model = build_hybrid("qwen3_5_text")
        prompts, pmask, comps, cmask = hybrid_batch(2, seed=11)
        kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
        expected = parameter_grads(model, weighted_loss(dense))
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        out = compute_logps(model, prompts, comps, **kwargs)
        assert (out.logps - dense.logps).abs().max() <= 1e-5
        assert max_relative_grad_error(parameter_grads(model, weighted_loss(out)), expected) <= 1e-4
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", MOE_HYBRIDS)
def test_router_aux_loss_equals_the_models_own(family):
    model = build_hybrid(family)
    prompts, pmask, comps, cmask = hybrid_batch(3, seed=12)
    ids = torch.cat([prompts.repeat_interleave(3, 0), comps], 1)
    mask = torch.cat([pmask.repeat_interleave(3, 0), cmask], 1).long()
    dense = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    aux = out.router.aux_loss()
    assert float((aux - dense).detach().abs()) <= 1e-6
    assert max_relative_grad_error(parameter_grads(model, aux), parameter_grads(model, dense)) <= 1e-4


@pytest.mark.parametrize("model_type", ["nemotron_h", "lfm2", "kimi_linear", "jamba"])
def test_other_hybrid_families_are_refused_by_name_with_the_reason(model_type):
    model = tiny_family_model(model_type)
    prompts, pmask, comps, cmask = hybrid_batch(2)
    with pytest.raises(UnsupportedModelError) as refusal:
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    message = str(refusal.value)
    assert repr(model_type) in message and families.VERDICTS[model_type].how in message


def test_a_vision_language_class_is_refused():
    config = transformers.Qwen3_5Config(
        text_config=dict(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
    )
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with pytest.raises(UnsupportedModelError, match="qwen3_5.*vision-language"):
        compute_logps(model, [[3, 4, 5]], [[6, 7]])


def test_old_transformers_refuses_them(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.14.1")
    with pytest.raises(UnsupportedModelError, match=r"qwen3_next.*transformers >= 5\.15.*5\.14\.1"):
        compute_logps(build_hybrid("qwen3_next"), [[3, 4, 5]], [[6, 7]])
