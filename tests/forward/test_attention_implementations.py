"""Models loaded with any attention implementation: the shared path intercepts only its own node calls.

GPU users load models with ``attn_implementation="flash_attention_2"`` (or 3, ``flex_attention``, a hub kernel).
These tests name such an implementation in the config of an sdpa-built model (the flash kernels themselves need a
GPU): the shared path must give the dense numbers of the sdpa twin, and the model must keep its implementation,
its name and its own function for plain forwards.
"""

from __future__ import annotations

import pytest
import torch
from support.exactness import parameter_grads, weighted_loss
from support.tiny_models import VOCAB, build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.forward import attention

NAMES = ["flash_attention_2", "flash_attention_3", "flex_attention"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_named_implementation_is_exact_and_kept(name, family):
    model, twin = build_model(family), build_model(family)  # same seed: identical weights
    model.config._attn_implementation_internal = name
    prompts, pmask, comps, cmask = make_batch(3, 2, prompt_len=9, completion_len=6, seed=1)
    options = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.9, return_entropy=True)
    shared = compute_logps(model, prompts, comps, **options)
    dense = compute_logps(twin, prompts, comps, backend="dense", **options)
    assert (shared.logps - dense.logps).abs().max() <= 1e-5
    assert (shared.entropy - dense.entropy).abs().max() <= 1e-5
    grads, reference = parameter_grads(model, weighted_loss(shared)), parameter_grads(twin, weighted_loss(dense))
    for key, value in reference.items():
        assert (grads[key] - value).norm() <= 1e-4 * value.norm() + 1e-10, key
    assert model.config._attn_implementation == name


@pytest.mark.parametrize("name", NAMES)
def test_registry_entry_passes_plain_calls_to_the_original(name):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[name]
    original = getattr(original, "_shared_prefix_original", original)
    model = build_model("llama")
    model.config._attn_implementation_internal = name
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    entry = ALL_ATTENTION_FUNCTIONS[name]
    assert entry._shared_prefix_original is original
    # The interception itself: a call without a node call's context reaches the original function unchanged.
    calls = []
    fake = lambda module, query, key, value, mask, **kwargs: calls.append(kwargs) or (query, None)
    intercepted = attention.intercepting(fake)
    query = torch.zeros(1, 4, 3, 8)
    assert intercepted(model.model.layers[0].self_attn, query, query, query, None, scaling=0.5)[0] is query
    assert calls == [{"scaling": 0.5}]
    assert attention.intercepting(intercepted) is intercepted  # wrapping twice is a no-op


def test_flex_attention_model_plain_forward_unchanged():
    model, twin = build_model("qwen3"), build_model("qwen3")
    model.config._attn_implementation_internal = "flex_attention"
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = twin(input_ids=ids).logits
        before = model(input_ids=ids).logits
        prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
        after = model(input_ids=ids).logits
    torch.testing.assert_close(before, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.config._attn_implementation == "flex_attention"
