"""The head check follows what the model's forward really does to its logits, and refuses by name the PEFT setups
whose forward the check cannot run.

Covered: Cohere's ``logit_scale`` set on the instance after a first call (the forward multiplies by the attribute,
not by the config), PEFT prompt learning (virtual tokens change every row's length), and LoRA on the lm_head added
to a model already used (the base head keeps its proxy inside the adapter).
"""

from __future__ import annotations

import pytest
from support.exactness import compare_with_dense
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import UnsupportedModelError, compute_logps


def _assert_exact(errors):
    logps_err, entropy_err, grad_err = errors
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, errors


@pytest.mark.parametrize("family", ["cohere", "cohere2"])
def test_logit_scale_set_on_the_instance_after_use_is_followed(family, monkeypatch):
    from shared_prefix_logps.model import preparation

    checks = []
    verify = preparation.verify_head
    monkeypatch.setattr(preparation, "verify_head", lambda prepared: (checks.append(1), verify(prepared)))
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=6, completion_len=4)
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))
    assert len(checks) == 1
    # The forward multiplies by the attribute (copied from the config at construction); the config keeps 0.25.
    model.logit_scale = 2.0
    assert model.config.logit_scale == 0.25
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )
    assert len(checks) == 2  # the new scale was checked against the model's own logits once
    # A config edit the forward does not read changes nothing.
    model.config.logit_scale = 7.0
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


def test_lora_on_the_lm_head_added_after_use_is_exact():
    """The base model's head got its proxy at the first call; PEFT then wraps that head, and its LoRA forward calls
    the base head inside the new one. Only the head the model has now may count as the head."""
    peft = pytest.importorskip("peft")
    base = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=5, seed=2)
    compute_logps(base, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    model = randomize_lora(peft.get_peft_model(base, config))
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )
    # Unwrapped again, the base head (still holding its proxy) is the head (PEFT left the base weights frozen).
    unloaded = model.unload().requires_grad_(True)
    _assert_exact(compare_with_dense(unloaded, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "p_tuning"])
@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_peft_prompt_learning_is_refused_by_name(kind, backend):
    """Virtual tokens go in front of every row inside PEFT's own forward (prompt tuning and p-tuning as embeddings,
    prefix tuning as keys/values): refused by name, before any forward, instead of a tensor-size error."""
    peft = pytest.importorskip("peft")
    configs = {
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "p_tuning": lambda: peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8
        ),
    }
    model = peft.get_peft_model(build_model("llama"), configs[kind]())
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    with pytest.raises(UnsupportedModelError, match=rf"PEFT prompt learning \({kind.upper()}, adapter 'default'\)"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend=backend)
