"""Calls the shared path cannot serve go to OpenRLHF's own forward (one warning per reason, a count per reason) and
return exactly what it returns; a self-check that disagrees raises."""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
from support.openrlhf_setup import make_actor, openrlhf_rows

from shared_prefix_logps.integrations.openrlhf import SelfCheckError, patch_actor
from shared_prefix_logps.integrations.openrlhf import patch as patch_module


def _padding_inside(sequences, actions, attention):
    attention = attention.clone()
    attention[0, 1] = 0  # a hole in the first row's prompt
    return sequences, actions, attention


CASES = {
    "no action_mask": (lambda s, a, m: ((s, None, a), {"return_output": True}), "no action_mask"),
    "ring attention": (lambda s, a, m: ((s, m, a), {"ring_attn_group": object()}), "ring attention"),
    "vision inputs": (lambda s, a, m: ((s, m, a), {"pixel_values": torch.zeros(1)}), "vision-language"),
    "padding inside a row": (lambda s, a, m: (_padding_inside(s, m, a), {}), "contiguous"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fallback_returns_openrlhf_result_warns_once_and_counts(case):
    make_call, reason_text = CASES[case]
    reference = make_actor()
    patched = copy.deepcopy(reference)
    patch = patch_actor(patched)
    sequences, attention, actions = openrlhf_rows(2, 2)
    args, kwargs = make_call(sequences, attention, actions)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        first = patched(*args, **kwargs)
        patched(*args, **kwargs)
        theirs = reference(*args, **kwargs)
    ours_warnings = [w for w in caught if "OpenRLHF's own Actor.forward" in str(w.message)]
    assert len(ours_warnings) == 1 and reason_text in str(ours_warnings[0].message)
    assert patch.stats.fallback_calls == 2 and patch.stats.shared_calls == 0
    assert list(patch.stats.fallback_reasons.values()) == [2]
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(first, theirs)
    else:
        assert torch.equal(first["logits"], theirs["logits"])


def test_moe_router_logits_fall_back():
    """A model that returns router logits (OpenRLHF's MoE aux loss reads output.aux_loss) stays on OpenRLHF's path."""
    actor = make_actor()
    actor.model.config.output_router_logits = True
    patch = patch_actor(actor)
    sequences, attention, actions = openrlhf_rows(2, 2)
    with pytest.warns(UserWarning, match="router logits"), torch.no_grad():
        actor(sequences, actions, attention)
    assert patch.stats.fallback_reasons == {
        "MoE router logits (output_router_logits): the aux loss needs the model's full output": 1
    }


def test_output_refuses_logits():
    actor = make_actor()
    patch_actor(actor)
    sequences, attention, actions = openrlhf_rows(2, 2)
    with torch.no_grad():
        _, output = actor(sequences, actions, attention, return_output=True)
    with pytest.raises(KeyError, match="never materializes logits"):
        _ = output["logits"]
    with pytest.raises(AttributeError, match="return_entropy=True"):
        _ = output.entropy


def test_self_check_raises_on_a_wrong_result(monkeypatch):
    """A shared result off by 1e-2 (the self-check's tolerance is 1e-3) raises on the first call, with the figures."""
    real = patch_module.compute_logps_concatenated

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        out.logps = out.logps + 1e-2 * out.mask
        return out

    monkeypatch.setattr(patch_module, "compute_logps_concatenated", off)
    actor = make_actor()
    patch = patch_actor(actor)
    sequences, attention, actions = openrlhf_rows(2, 2)
    with pytest.raises(SelfCheckError, match="max\\|diff\\| 1.000e-02"), torch.no_grad():
        actor(sequences, actions, attention)
    assert [check.passed for check in patch.stats.self_checks] == [False]


def test_bad_options_are_refused():
    actor = make_actor()
    with pytest.raises(ValueError, match="backend"):
        patch_actor(actor, backend="dense")
    with pytest.raises(TypeError, match="Actor"):
        patch_actor(object())
