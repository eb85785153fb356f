"""The GPU tests' models, checked on CPU in ``make test``: heads large enough for inductor's CUDA flex lowering, and
each model's shared path exact against its dense forward (so a GPU failure is the GPU's, not the config's)."""

from __future__ import annotations

import pytest
from support.exactness import compare_with_dense
from support.gpu_models import GPU_FAMILIES, MIN_FLEX_HEAD_DIM, gpu_test_model, head_dim
from support.tiny_models import make_batch


@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_models_have_heads_inductor_flex_takes(family):
    model = gpu_test_model(family)
    assert head_dim(model) >= MIN_FLEX_HEAD_DIM
    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # grouped-query attention


@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_models_are_exact_on_cpu(family):
    model = gpu_test_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 3, 20, 12, seed=4)
    # backend "auto": expand on CPU (flex trains on CUDA only)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    logps_err, entropy_err, grad_err = errors
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, errors
