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


def check_grads_or_exact(grads: dict, expected: dict, exact_grads, *, tol: float, noise: float) -> None:
    """Every parameter's gradient within ``tol`` relative of ``expected`` (the float32 dense one), or, failing that,
    of the exact one.

    Some gradients are zero in exact arithmetic (the query/key projections when all values a query sees are equal:
    one-token prompts and completions, rows of one repeated token, a query that sees one key); both float32 paths then
    return rounding noise (seen up to ~1e-6 of the largest parameter gradient, differing between the paths by more
    than 10x), whose relative difference means nothing. A parameter that fails the relative check is measured against
    the dense path in float64 (``exact_grads()``, called only then): within ``tol`` relative plus ``noise`` times the
    largest exact gradient.
    """
    failing = [name for name, ref in expected.items() if max_relative_grad_error(grads, {name: ref}) > tol]
    if not failing:
        return
    exact = exact_grads()
    largest = max(ref.norm().item() for ref in exact.values())
    for name in failing:
        error = (grads[name].double() - exact[name]).norm().item()
        allowed = tol * exact[name].norm().item() + noise * largest
        assert error <= allowed, f"{name}: {error:.3e} from the float64 gradient (allowed {allowed:.3e})"
