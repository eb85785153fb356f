"""bfloat16: judged against a float32 reference, with the dense bfloat16 path's own error as the yardstick."""

import pytest
import torch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_error_within_dense_bf16_error(family):
    reference = build_model(family, dtype=torch.float32)
    model = build_model(family, dtype=torch.bfloat16)
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=12, completion_len=8, seed=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7)
    # The float32 reference runs the float32 copy of the very bf16 weights, so only arithmetic differs.
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        exact = compute_logps(reference, prompts, comps, backend="dense", **kwargs).logps
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs).logps
        shared = compute_logps(model, prompts, comps, **kwargs).logps
    assert shared.dtype == torch.float32 and (shared <= 0).all()
    dense_err = (dense - exact)[cmask].abs()
    shared_err = (shared - exact)[cmask].abs()
    assert dense_err.max() > 0  # bf16 really rounds here, so the yardstick is not zero
    assert shared_err.mean() <= 1.5 * dense_err.mean()
    assert shared_err.max() <= 2.0 * dense_err.max()
