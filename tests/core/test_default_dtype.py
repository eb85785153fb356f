"""A float64 default dtype (``torch.set_default_dtype(torch.float64)``, common in numerics code and some test
suites) with a float32 model: every entry point works and returns the same float32 results and gradients as under
the float32 default."""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated


def _calls(family):
    """name -> function of a model returning (LogpsOutput, parameter gradients or None)."""
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=5, seed=3)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    rows = torch.cat([prompts.repeat_interleave(3, 0), comps], 1)
    mask = torch.cat([pmask.repeat_interleave(3, 0), cmask], 1)

    def shared(model, backend="auto"):
        out = compute_logps(model, prompts, comps, backend=backend, **kwargs)
        return out, parameter_grads(model, weighted_loss(out))

    def chunked(model):
        model.zero_grad(set_to_none=True)
        out = chunked_backward(
            model, prompts, comps, lambda o, r: o.logps.sum() + o.entropy.sum(), generations_per_chunk=2, **kwargs
        )
        return out, {n: p.grad for n, p in model.named_parameters()}

    def concatenated(model):
        with torch.no_grad():
            return compute_logps_concatenated(model, rows, mask, comps.shape[1], return_entropy=True), None

    def all_masked(model):
        with torch.no_grad():
            return compute_logps(
                model, prompts, comps, prompt_mask=pmask, completion_mask=torch.zeros_like(cmask)
            ), None

    def router(model):
        out = compute_logps(model, prompts, comps, return_router_stats=True, **kwargs)
        return out, parameter_grads(model, weighted_loss(out) + out.router.aux_loss())

    if family == "qwen3_moe":
        return {"router": router}
    return {
        "shared": shared,
        "dense": lambda model: shared(model, "dense"),
        "chunked": chunked,
        "concatenated": concatenated,
        "all_masked": all_masked,
    }


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_float64_default_dtype_with_a_float32_model(family):
    model = build_model(family)
    expected = {name: call(model) for name, call in _calls(family).items()}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = {name: call(model) for name, call in _calls(family).items()}
    finally:
        torch.set_default_dtype(previous)
    for name, (out, grads) in got.items():
        reference, reference_grads = expected[name]
        for field in ("logps", "entropy"):
            value = getattr(out, field)
            if value is not None:
                assert value.dtype == torch.float32, (name, field)
                torch.testing.assert_close(value, getattr(reference, field), rtol=0, atol=1e-6, msg=name)
        if out.router is not None:
            torch.testing.assert_close(out.router.probs, reference.router.probs, rtol=0, atol=1e-6, msg=name)
        if grads is not None:
            assert max_relative_grad_error(grads, reference_grads) <= 1e-6, name
