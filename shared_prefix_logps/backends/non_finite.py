"""A packed attention call that keeps one row's non-finite values in that row (the ``flex`` layouts).

A packed call attends over every row's keys at once, and the kernel multiplies each key's value by its softmax
weight, zero where the mask hides the key: ``0 x NaN`` is NaN, so one row's NaN or inf (a bf16 overflow, a bad
sample) would reach every query of its blocks, other rows' included. Backward has the same products the other way:
a query's non-finite output gradient (or its non-finite log-sum-exp) times its zero weights over the keys it does
not see reaches those keys' gradients. Full rows (the dense forward) and the per-row batches of ``expand`` keep such
values in their row; :class:`NonFiniteGuard` makes a packed call do the same, by selecting, never by multiplying:

- forward: the tokens whose query, key or value holds a non-finite entry are replaced by zeros before the kernel, and
  the queries that are non-finite themselves or see such a key get NaN selected into their output afterwards, as
  full rows would give them;
- backward: the output gradient's non-finite rows are replaced by zeros before the kernel's backward, and NaN is
  selected afterwards into the gradients of those queries and of every key they see, where full rows put it.

Which queries see a flagged key, and which keys a flagged query sees, come from a second call of the same kernel
under the same mask (:data:`Probe`): zero queries and keys give every visible key the same weight, so with the flags
as values a query's output is positive exactly when it sees a flagged key, and the value gradient of flags given to
the queries is positive exactly on the keys they see. Nothing is changed and no probe runs when every entry is finite;
what that costs is one check of the tensors (and of the output gradient in backward) and one boolean read per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``probe(query, key, value) -> output``: the packed call's kernel under its mask, on (1, 1, length, width) float32
#: tensors of the padded lengths, scale 1 and no score modification.
Probe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _finite_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """(T,) bool: tokens of (1, heads, T, d) ``tensor`` whose every entry is finite."""
    return torch.isfinite(tensor[0]).all(-1).all(0)


class NonFiniteGuard:
    """The non-finite isolation of one packed call (module docstring).

    Args:
        probe: the kernel under the call's mask (:data:`Probe`).
        q_len, kv_len: the padded lengths the mask is built for; width: head dimension of the probe's tensors.
    """

    def __init__(self, probe: Probe, q_len: int, kv_len: int, width: int):
        self.probe = probe
        self.q_len, self.kv_len, self.width = q_len, kv_len, width
        self.poisoned: torch.Tensor | None = None  # (n,) bool: queries whose output is NaN
        self.bad_gradients: torch.Tensor | None = None  # (n,) bool: queries whose output gradient was not finite

    def inputs(self, query, key, value):
        """(1, heads, n, d) queries and (1, kv_heads, K, d) keys/values with non-finite tokens zeroed, and, with
        gradients, routed through the step that puts NaN back into their gradients."""
        bad_query, bad_key = ~_finite_tokens(query), ~(_finite_tokens(key) & _finite_tokens(value))
        if bool(bad_query.any() | bad_key.any()):
            self.poisoned = bad_query | self._queries_seeing(bad_key, bad_query.shape[0])
            query, key, value = (_zeroed(t, bad) for t, bad in ((query, bad_query), (key, bad_key), (value, bad_key)))
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            query, key, value = _GradientsIn.apply(self, query, key, value)
        return query, key, value

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """(1, heads, n, v_head_dim) kernel output with NaN selected into the poisoned queries, and, with gradients,
        routed through the step that zeroes non-finite output gradients before the kernel's backward."""
        if self.poisoned is not None:
            out = out.masked_fill(self.poisoned[None, None, :, None], float("nan"))
        if torch.is_grad_enabled() and out.requires_grad:
            out = _GradientsOut.apply(self, out)
        return out

    def _flags(self, flags: torch.Tensor, length: int) -> torch.Tensor:
        """(1, 1, length, width) float32, ``flags`` (m,) bool in the first feature of the first m tokens."""
        padded = torch.zeros(1, 1, length, self.width, dtype=torch.float32, device=flags.device)
        padded[0, 0, : flags.shape[0], 0] = flags.float()
        return padded

    def _queries_seeing(self, bad_key: torch.Tensor, num_queries: int) -> torch.Tensor:
        """(n,) bool: queries that see a key flagged in ``bad_key`` (K,)."""
        values = self._flags(bad_key, self.kv_len)
        with torch.no_grad():
            out = self.probe(values.new_zeros(1, 1, self.q_len, self.width), torch.zeros_like(values), values)
        return out[0, 0, :num_queries, 0] > 0

    def keys_seen(self, bad_query: torch.Tensor, num_keys: int) -> torch.Tensor:
        """(K,) bool: keys that a query flagged in ``bad_query`` (n,) sees."""
        values = torch.zeros(1, 1, self.kv_len, self.width, dtype=torch.float32, device=bad_query.device)
        values.requires_grad_()
        with torch.enable_grad():
            out = self.probe(values.new_zeros(1, 1, self.q_len, self.width), torch.zeros_like(values), values)
            (grad,) = torch.autograd.grad(out, values, self._flags(bad_query, self.q_len))
        return grad[0, 0, :num_keys, 0] > 0


def _zeroed(tensor: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return torch.where(bad[None, None, :, None], tensor.new_zeros(()), tensor)


class _GradientsOut(torch.autograd.Function):
    """Identity; backward: zeros selected into the non-finite rows of the output gradient, which are noted."""

    @staticmethod
    def forward(ctx, guard: NonFiniteGuard, out):
        ctx.guard = guard
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        bad = ~_finite_tokens(grad)
        if bool(bad.any()):
            ctx.guard.bad_gradients = bad
            grad = _zeroed(grad, bad)
        return None, grad


class _GradientsIn(torch.autograd.Function):
    """Identity; backward: NaN selected into the gradients of the queries whose output gradient was not finite and of
    every key they see."""

    @staticmethod
    def forward(ctx, guard: NonFiniteGuard, query, key, value):
        ctx.guard, ctx.num_keys = guard, key.shape[2]
        return query.view_as(query), key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        bad = ctx.guard.bad_gradients
        if bad is None:
            return None, grad_query, grad_key, grad_value
        seen = ctx.guard.keys_seen(bad, ctx.num_keys)
        return None, _nan_at(grad_query, bad), _nan_at(grad_key, seen), _nan_at(grad_value, seen)


def _nan_at(grad: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    """(1, heads, T, d) ``grad`` with NaN selected into ``tokens`` (T,) bool; None stays None (no gradient)."""
    if grad is None:
        return None
    return torch.where(tokens[None, None, :, None], grad.new_full((), float("nan")), grad)
