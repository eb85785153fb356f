"""compute_logps equals the dense full-row forward: log-probs, entropy and every parameter gradient (float32)."""

import pytest
import torch
from support.exactness import compare_with_dense, weighted_loss
from support.tiny_models import FAMILIES, VOCAB, build_model, make_batch

from shared_prefix_logps import compute_logps, compute_logps_concatenated


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("generations", [1, 3, 8])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_matches_dense(family, generations, return_entropy):
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=11, completion_len=7, seed=generations)
    logps_err, entropy_err, grad_err = compare_with_dense(
        model,
        prompts,
        comps,
        prompt_mask=pmask,
        completion_mask=cmask,
        temperature=0.7,
        return_entropy=return_entropy,
    )
    assert logps_err <= 1e-5
    assert entropy_err <= 1e-5
    assert grad_err <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tied_and_untied_embeddings(family):
    for tied in (False, True):
        model = build_model(family, tied=tied)
        assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
        prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=9, completion_len=5)
        errs = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
        assert errs[0] <= 1e-5 and errs[1] <= 1e-5 and errs[2] <= 1e-4


def test_all_prompts_one_token():
    model = build_model("llama")
    prompts = torch.tensor([[5], [7]])
    comps = torch.randint(0, VOCAB, (6, 4), generator=torch.Generator().manual_seed(3))
    errs = compare_with_dense(model, prompts, comps, temperature=1.3)
    assert errs[0] <= 1e-5 and errs[2] <= 1e-4


def test_sequences_longer_than_sliding_window():
    # Mistral's window is 6 and Gemma2's 5 in the tiny configs; these rows are 3-4x longer.
    for family in ("mistral", "gemma2"):
        model = build_model(family)
        prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=14, completion_len=9, seed=4)
        errs = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
        assert errs[0] <= 1e-5 and errs[1] <= 1e-5 and errs[2] <= 1e-4


def test_list_inputs_equal_tensor_inputs():
    model = build_model("qwen2")
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=8, completion_len=6)
    prompt_lists = [row[m].tolist() for row, m in zip(prompts, pmask)]
    comp_lists = [row[m].tolist() for row, m in zip(comps, cmask)]
    with torch.no_grad():
        from_tensors = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
        from_lists = compute_logps(model, prompt_lists, comp_lists)
    width = from_lists.logps.shape[1]
    assert width == int(cmask.sum(1).max())
    assert torch.equal(from_lists.mask, cmask[:, :width])
    torch.testing.assert_close(from_lists.logps, from_tensors.logps[:, :width], rtol=0, atol=1e-6)


def test_concatenated_rows_share_identical_prompts_in_any_order():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=10, completion_len=6, seed=7)
    group = torch.arange(3).repeat_interleave(4)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([prompts[group], comps], 1)[order]
    attention_mask = torch.cat([pmask[group], cmask], 1)[order]
    out = compute_logps_concatenated(model, input_ids, attention_mask, 6, temperature=0.9, return_entropy=True)
    ref = compute_logps(
        model,
        prompts,
        comps,
        prompt_mask=pmask,
        completion_mask=cmask,
        temperature=0.9,
        return_entropy=True,
        backend="dense",
    )
    torch.testing.assert_close(out.logps, ref.logps[order], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref.entropy[order], rtol=0, atol=1e-5)
    assert torch.equal(out.mask, cmask[order])


def test_concatenated_shares_each_prompt_once(monkeypatch):
    from shared_prefix_logps.engine import walk

    seen = []
    original = walk.forward_call

    def recording(prepared, call, sources, settings, **kwargs):
        seen.append(call)
        return original(prepared, call, sources, settings, **kwargs)

    monkeypatch.setattr(walk, "forward_call", recording)
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=10, completion_len=6, seed=7)
    group = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])
    compute_logps_concatenated(model, torch.cat([prompts[group], comps], 1), torch.cat([pmask[group], cmask], 1), 6)
    # The prompts' node call, then the completions': each distinct prompt's tokens forwarded once.
    assert len(seen) == 2 and seen[0].nodes.numel() == 3 and not seen[0].sources
    assert seen[0].num_tokens == int(pmask.sum()) and seen[1].num_tokens == int(cmask.sum())


def test_plain_forward_untouched_after_use():
    model = build_model("mistral")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :5] = False
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        compute_logps(model, ids[:, :8], ids[:, 8:], prompt_mask=mask[:, :8])
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"  # the model keeps its implementation and its name
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_no_grad_result_has_no_graph():
    model = build_model("qwen3")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    with torch.no_grad():
        out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert not out.logps.requires_grad


def test_all_completions_empty():
    model = build_model("llama")
    out = compute_logps(
        model,
        torch.tensor([[3, 4]]),
        torch.zeros(2, 3, dtype=torch.long),
        completion_mask=torch.zeros(2, 3, dtype=torch.bool),
        return_entropy=True,
    )
    assert out.logps.shape == (2, 3) and not out.mask.any()
    assert (out.logps == 0).all() and (out.entropy == 0).all()


def _count_forwards(model):
    """Forward pre-hook on the outermost module: how many calls it got, and how many with gradient enabled."""
    calls = {"all": 0, "grad": 0}

    def hook(module, args, kwargs):
        calls["all"] += 1
        calls["grad"] += int(torch.is_grad_enabled())

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_masked_with_grad_is_connected_and_gives_zero_gradients_like_dense(family):
    """Every completion token masked (TRL: mask_truncated_completions with every completion truncated): with grad
    enabled the result must hang off the model's graph through the model's own forward, as the dense path's does,
    so a loss built from it back-propagates and every parameter gets a zero gradient (not None)."""
    model = build_model(family)
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5, seed=2)
    cmask = torch.zeros(comps.shape, dtype=torch.bool)
    params = [p for p in model.parameters() if p.requires_grad]
    calls, handle = _count_forwards(model)
    try:
        shared = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    finally:
        handle.remove()
    assert calls["grad"] >= 1, "no forward of the model with gradient"
    dense = compute_logps(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
    )
    for out in (shared, dense):
        assert out.logps.requires_grad and out.entropy.requires_grad
        assert (out.logps == 0).all() and (out.entropy == 0).all() and not out.mask.any()
    # allow_unused=False: a parameter the result does not reach raises here
    shared_grads = torch.autograd.grad(weighted_loss(shared), params)
    dense_grads = torch.autograd.grad(weighted_loss(dense), params)
    for ours, theirs in zip(shared_grads, dense_grads):
        assert torch.equal(ours, theirs) and not ours.any()


def test_all_masked_concatenated_backward_fills_every_grad():
    """The trainer-shaped entry: ``loss.backward()`` on all-masked rows works and leaves zero ``.grad`` everywhere."""
    model = build_model("qwen2")
    prompts, pmask, comps, _ = make_batch(2, 2, prompt_len=6, completion_len=4, seed=3)
    group = torch.arange(2).repeat_interleave(2)
    input_ids = torch.cat([prompts[group], comps], 1)
    attention_mask = torch.cat([pmask[group], torch.zeros(comps.shape, dtype=torch.bool)], 1)
    out = compute_logps_concatenated(model, input_ids, attention_mask, comps.shape[1], return_entropy=True)
    (out.logps.sum() + out.entropy.sum()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and not param.grad.any(), name


def test_all_masked_without_grad_forwards_nothing():
    model = build_model("llama")
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    with torch.no_grad():  # the first call checks the head with one forward of a few tokens
        compute_logps(model, prompts, comps, prompt_mask=pmask)
    calls, handle = _count_forwards(model)
    try:
        with torch.no_grad():
            out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=torch.zeros_like(comps) == 1)
    finally:
        handle.remove()
    assert calls["all"] == 0 and (out.logps == 0).all() and not out.logps.requires_grad


def test_completions_without_columns_with_grad():
    """Completions with no column at all: the (rows, 0) result is still connected, so ``sum().backward()`` works."""
    model = build_model("llama")
    prompts, pmask, _, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    out = compute_logps(model, prompts, torch.zeros(6, 0, dtype=torch.long), prompt_mask=pmask, return_entropy=True)
    assert out.logps.shape == out.entropy.shape == out.mask.shape == (6, 0)
    assert out.logps.requires_grad
    out.logps.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
