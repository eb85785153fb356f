"""Compare a shared-prefix result with the dense reference: log-probs, entropy and every parameter's gradient."""

from __future__ import annotations

import torch

from shared_prefix_logps import LogpsOutput, chunked_backward, compute_logps


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


def in_full_batch(chunk, rows, num_rows: int):
    """A chunk's output scattered into zeros of the full batch of ``num_rows`` rows, so :func:`weighted_loss` weighs
    each row as it does for the whole batch."""

    def scatter(values):
        full = torch.zeros(num_rows, values.shape[1], dtype=values.dtype, device=values.device)
        return full.index_copy(0, rows, values)

    entropy = None if chunk.entropy is None else scatter(chunk.entropy)
    return LogpsOutput(scatter(chunk.logps), entropy, scatter(chunk.mask))


def run_mode(model, mode: str, backend: str, batch, *, generations_per_chunk: int = 2, **kwargs):
    """(logps (rows, C) float32, entropy, parameter grads or None) of one way of calling the library on ``batch``
    (prompts, prompt_mask, completions, completion_mask): ``"score"`` (compute_logps without gradients), ``"train"``
    (compute_logps, gradients of :func:`weighted_loss`) or ``"chunked"`` (chunked_backward with the same loss)."""
    prompts, pmask, comps, cmask = batch
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True, **kwargs)
    if mode == "score":
        with torch.no_grad():
            out = compute_logps(model, prompts, comps, backend=backend, **kwargs)
        return out.logps, out.entropy, None
    if mode == "train":
        out = compute_logps(model, prompts, comps, backend=backend, **kwargs)
        return out.logps.detach(), out.entropy.detach(), parameter_grads(model, weighted_loss(out))
    if mode != "chunked":
        raise ValueError(f"mode must be 'score', 'train' or 'chunked', got {mode!r}")
    model.zero_grad(set_to_none=True)
    out = chunked_backward(
        model,
        prompts,
        comps,
        lambda chunk, rows: weighted_loss(in_full_batch(chunk, rows, comps.shape[0])),
        generations_per_chunk=min(generations_per_chunk, comps.shape[0] // prompts.shape[0]),
        backend=backend,
        **kwargs,
    )
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.logps, out.entropy, grads
