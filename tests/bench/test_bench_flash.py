"""The benchmark's ``flash`` method: listed, refused by name without flash-attn, and on the reference kernels the
dense method's log-probs and gradients."""

import torch
from support.flash_reference import REFERENCE
from support.tiny_models import build_model

from shared_prefix_logps.backends import flash_kernels
from shared_prefix_logps.bench.methods import METHODS, method_unavailable
from shared_prefix_logps.bench.runner import Shape, make_batch


def test_flash_method_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(flash_kernels, "_INSTALLED", [None])
    assert method_unavailable("flash") == ("not installed (pip install 'shared-prefix-logps[flash]')")


def test_flash_method_matches_dense_on_the_reference_kernels():
    model = build_model("qwen2")
    batch = make_batch(Shape(prompts=2, generations=3, prompt_len=9, completion_len=5), 101, torch.device("cpu"))
    grads = {}
    for method in ("dense", "flash"):
        model.zero_grad(set_to_none=True)
        with flash_kernels.substituted(REFERENCE):
            logps = METHODS[method][0](model, batch, True)
        grads[method] = (logps, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (dense, dense_grads), (flash, flash_grads) = grads["dense"], grads["flash"]
    assert (flash - dense).abs().max() <= 1e-5
    assert dense_grads.keys() == flash_grads.keys()
    for name, want in dense_grads.items():
        assert (flash_grads[name] - want).norm() <= 1e-4 * want.norm() + 1e-7, name
