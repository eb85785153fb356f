"""Compare a shared-prefix result with the dense reference: log-probs, entropy and every parameter's gradient."""

from __future__ import annotations

import torch

from shared_prefix_logps import compute_logps


def weighted_loss(out, seed: int = 1):
    """A loss that weights every position differently, so a gradient routed to the wrong token shows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.logps.shape, generator=gen, dtype=torch.float32).to(out.logps.device)
    loss = (out.logps * w).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * w.flip(0)).sum()
    return loss


def parameter_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, params, grads)}


def max_relative_grad_error(grads, reference):
    """Largest ||g - ref|| / ||ref|| over parameters (absolute norm where the reference is zero)."""
    worst = 0.0
    for name, ref in reference.items():
        diff = (grads[name] - ref).norm().item()
        scale = ref.norm().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def compare_with_dense(model, *args, temperature=1.0, return_entropy=False, backend="auto", **kwargs):
    """(max |logps diff|, max |entropy diff| or 0, max relative grad error) of ``backend`` vs 'dense'."""
    shared = compute_logps(
        model, *args, temperature=temperature, return_entropy=return_entropy, backend=backend, **kwargs
    )
    dense = compute_logps(
        model, *args, temperature=temperature, return_entropy=return_entropy, backend="dense", **kwargs
    )
    assert shared.logps.dtype == torch.float32
    assert torch.equal(shared.mask, dense.mask)
    assert (shared.logps <= 0).all()
    assert (shared.logps[~shared.mask] == 0).all()
    logps_err = (shared.logps - dense.logps).abs().max().item()
    entropy_err = 0.0
    if return_entropy:
        entropy_err = (shared.entropy - dense.entropy).abs().max().item()
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(shared)), parameter_grads(model, weighted_loss(dense))
    )
    return logps_err, entropy_err, grad_err
