"""The MoE router load-balancing loss from every entry point against the model's own ``aux_loss`` of the full rows.

The model computes it from the router logits of every real token of every row ``[prompt | completion]``: a prompt
token counts once per row that contains it, and each row's last completion token counts although no log-prob needs
its output. The shared path forwards a prompt once and must weight it by its rows; it must forward the last
completion token too. Value within 1e-6 (float32), every parameter's gradient within 1e-4 relative.
"""

import dataclasses

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import NOT_ROUTED, build_model, make_batch
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import (
    UnsupportedModelError,
    chunked_backward,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.engine import walk

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

AUX_FAMILIES = [f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss") if f not in NOT_ROUTED]


def _rows(prompts, pmask, comps, cmask):
    """The dense rows ``[left-padded prompt | right-padded completion]`` of a grouped batch, and their mask."""
    generations = comps.shape[0] // prompts.shape[0]
    ids = torch.cat([prompts.repeat_interleave(generations, 0), comps], 1)
    mask = torch.cat([pmask.repeat_interleave(generations, 0), cmask], 1).long()
    return ids, mask


def _dense_aux(model, ids, mask):
    """The model's own aux loss of full rows, called as TRL calls it (no position ids)."""
    return model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss


def _batch(generations, seed):
    # Left-padded prompts of different lengths (one of a single token), right-padded completions of different
    # lengths (one empty when there are more than two rows); rows longer than every sliding window.
    return make_batch(3, generations, prompt_len=10, completion_len=6, seed=seed)


@pytest.mark.parametrize("family", AUX_FAMILIES)
@pytest.mark.parametrize("generations", [1, 3])
def test_aux_loss_and_its_gradient_match_the_model(family, generations):
    model = build_model(family)
    prompts, pmask, comps, cmask = _batch(generations, seed=generations)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    aux = out.router.aux_loss()
    assert float((aux - dense).detach().abs()) <= 1e-6, (float(aux.detach()), float(dense.detach()))
    assert out.router.counts.sum() == out.router.tokens.sum() * model.num_experts_per_tok
    # The gradient of the aux loss alone (router weights and everything below them) and together with log-probs.
    grads = parameter_grads(model, aux)
    expected = parameter_grads(model, dense)
    assert max_relative_grad_error(grads, expected) <= 1e-4
    router = [n for n, g in expected.items() if ("gate" in n or "router" in n) and "proj" not in n and g.norm() > 0]
    assert router, "the aux loss must reach the router weights"
    plain = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert float((plain.logps - out.logps).abs().max()) <= 1e-6  # the extra routed column changes no log-prob
    # Together with log-probs (fresh graphs: the ones above were consumed)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    dense_logps = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    ours = parameter_grads(model, weighted_loss(out) + 0.5 * out.router.aux_loss())
    reference = parameter_grads(model, weighted_loss(dense_logps) + 0.5 * dense)
    assert max_relative_grad_error(ours, reference) <= 1e-4


@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_flex_and_token_budget_chunks_give_the_same_aux_loss(family):
    model = build_model(family)
    prompts, pmask, comps, cmask = _batch(4, seed=7)
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    with torch.no_grad():
        for options in (dict(backend="flex"), dict(backend="expand", token_budget=24)):
            out = compute_logps(model, prompts, comps, **kwargs, **options)
            assert float((out.router.aux_loss() - dense).abs()) <= 1e-6, options


def test_any_subset_of_rows_is_its_own_batch():
    # TRL averages the aux loss of sub-batches of rows; each is the loss of those rows alone, shuffled rows included.
    model = build_model("qwen3_moe")
    prompts, pmask, comps, cmask = _batch(3, seed=2)
    ids, mask = _rows(prompts, pmask, comps, cmask)
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))
    ids, mask = ids[order], mask[order]
    with torch.no_grad():
        out = compute_logps_concatenated(model, ids, mask, comps.shape[1], return_router_stats=True)
        for rows in (torch.arange(4), torch.arange(4, ids.shape[0]), torch.tensor([1, 5, 6])):
            dense = _dense_aux(model, ids[rows], mask[rows])
            assert float((out.router.aux_loss(rows) - dense).abs()) <= 1e-6, rows


def test_all_masked_completions_still_count_their_prompts():
    model = build_model("mixtral")
    prompts, pmask, comps, cmask = _batch(2, seed=3)
    cmask = torch.zeros_like(cmask)
    comps = comps.masked_fill(~cmask, 0)
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = compute_logps(
                model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True
            )
        assert float((out.router.aux_loss() - dense).detach().abs()) <= 1e-6
        assert (out.logps == 0).all()


def test_a_prompt_weighted_once_instead_of_per_row_is_caught(monkeypatch):
    """The comparison above is sensitive to the weighting: a prompt's tokens counted once (not once per row of it)
    moves the loss far beyond the tolerance."""
    model = build_model("qwen3_moe")
    prompts, pmask, comps, cmask = _batch(4, seed=4)
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    real = walk.forward_call

    def once_per_prompt(prepared, call, sources, settings, **kwargs):
        outputs = real(prepared, call, sources, settings, **kwargs)
        if not call.sources:  # the prompts' node call
            counts, probs, tokens = outputs.router
            # 4 rows per prompt: each row gets a quarter
            outputs = dataclasses.replace(outputs, router=(counts / 4, probs / 4, tokens / 4))
        return outputs

    monkeypatch.setattr(walk, "forward_call", once_per_prompt)
    with torch.no_grad():
        out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    # 100x the tolerance the exact comparison above holds to (1e-6): the mutation cannot pass it.
    assert float((out.router.aux_loss() - dense).abs()) > 1e-4


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("generations_per_chunk", [1, 3])
def test_chunked_backward_with_the_linearized_aux_loss(family, generations_per_chunk):
    """Counts known from a no-grad pass, ``w = E * counts / N**2``: the chunks' ``(w * probs).sum()`` sum to the aux
    loss, and its gradient, through the prompt's leaf, is the aux loss's gradient."""
    if family in NOT_ROUTED:
        pytest.skip(NOT_ROUTED[family])
    model = build_model(family)
    prompts, pmask, comps, cmask = _batch(3, seed=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    coef = 0.7
    with torch.no_grad():
        stats = compute_logps(model, prompts, comps, return_router_stats=True, **kwargs).router
    total = stats.tokens.sum()
    weight = coef * model.num_experts * stats.counts.sum(0) / total**2
    weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(5))
    chunk_aux = []

    def loss_fn(out, rows):
        aux = (out.router.probs * weight).sum()
        chunk_aux.append(float(aux))
        return (out.logps * weights[rows]).sum() + (out.entropy * weights[rows].flip(1)).sum() + aux

    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    dense_aux = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    expected = parameter_grads(
        model, (dense.logps * weights).sum() + (dense.entropy * weights.flip(1)).sum() + coef * dense_aux
    )
    model.zero_grad(set_to_none=True)
    out = chunked_backward(
        model, prompts, comps, loss_fn, generations_per_chunk=generations_per_chunk, return_router_stats=True, **kwargs
    )
    assert abs(sum(chunk_aux) - coef * float(dense_aux.detach())) <= 1e-6
    assert float((out.router.aux_loss() - dense_aux).detach().abs()) <= 1e-6
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    assert max_relative_grad_error(grads, expected) <= 1e-4


def test_models_without_an_aux_loss_and_the_dense_backend_are_refused():
    prompts, pmask, comps, cmask = _batch(2, seed=1)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    for family in ("glm4_moe", "deepseek_v3", "qwen3"):
        with pytest.raises(UnsupportedModelError, match="computes no router aux loss"):
            compute_logps(build_model(family), prompts, comps, **kwargs)
    with pytest.raises(ValueError, match="dense"):
        compute_logps(build_model("mixtral"), prompts, comps, backend="dense", **kwargs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_non_reentrant_checkpointing(family):
    # Recomputed layers record router logits again in backward; the statistics must stay those of the forward.
    model = build_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    prompts, pmask, comps, cmask = _batch(3, seed=11)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_router_stats=True)
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    assert float((out.router.aux_loss() - dense).detach().abs()) <= 1e-6
    ours = parameter_grads(model, weighted_loss(out) + out.router.aux_loss())
    dense_logps = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    dense = _dense_aux(model, *_rows(prompts, pmask, comps, cmask))
    assert max_relative_grad_error(ours, parameter_grads(model, weighted_loss(dense_logps) + dense)) <= 1e-4


# Rows of prefix trees (compute_logps_tree): every real token routed once per row that holds it.


def _dense_tree_aux(model, ids, mask):
    """The model's own aux loss of the full rows (every real token routed once per row that holds it)."""
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, output_router_logits=True)
    return out.aux_loss


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tree_aux_loss_and_its_gradient_match_the_model(family):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(6, depth=3, branching=3), 6)
    out = compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    dense = _dense_tree_aux(model, ids, mask)
    aux = out.router.aux_loss()
    assert float((aux - dense).detach().abs()) <= 1e-6, (float(aux), float(dense))
    assert out.router.tokens.tolist() == (mask.sum(1) * 2).float().tolist()  # 2 MoE layers per real token
    assert max_relative_grad_error(parameter_grads(model, aux), parameter_grads(model, dense)) <= 1e-4
    out = compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    dense_logps = compute_logps_tree(model, ids, mask, score, backend="dense")
    ours = parameter_grads(model, weighted_loss(out) + 0.5 * out.router.aux_loss())
    reference = parameter_grads(model, weighted_loss(dense_logps) + 0.5 * _dense_tree_aux(model, ids, mask))
    assert max_relative_grad_error(ours, reference) <= 1e-4


@pytest.mark.parametrize("budget", [1, None])
def test_tree_no_grad_walk_gives_the_same_statistics(budget):
    model = build_model("qwen3_moe")
    ids, mask, score = pad_rows(random_tree_rows(6, depth=3, branching=3), 6)
    with torch.no_grad():
        out = compute_logps_tree(model, ids, mask, score, return_router_stats=True, token_budget=budget)
        dense = _dense_tree_aux(model, ids, mask)
        rows = torch.tensor([0, 2, 3])
        subset = _dense_tree_aux(model, ids[rows], mask[rows])
    assert float((out.router.aux_loss() - dense).abs()) <= 1e-6
    assert float((out.router.aux_loss(rows) - subset).abs()) <= 1e-6


def test_tree_router_stats_are_refused_where_the_model_has_no_aux_loss():
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    with pytest.raises(UnsupportedModelError, match="computes no router aux loss"):
        compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    with pytest.raises(ValueError, match="needs the shared path"):
        compute_logps_tree(model, ids, mask, score, return_router_stats=True, backend="dense")
