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
the queries is positive exactly on the keys they see. Nothing is changed and no probe runs when every entry is finite.

Checking every layer costs a host read per layer (the host waits for the device each time), so a node call runs
*optimistically* where it can (:class:`NonFiniteWatch`): no layer checks anything; the call checks once, after its
forward, whether every final hidden state is finite (a non-finite value anywhere in the forward reaches its token's
residual stream and stays there to the last layer, and a packed kernel's leak reaches other tokens' too), and runs
again isolating (every layer checked, as above) in the rare case one is not, which gives exactly the isolated results.
In backward either the per-layer steps stay in place but idle, and the call reads once whether every gradient
reaching its outputs is finite, arming them only if one is not (a read per call: a call of the one graph a caller
back-propagates); or they isolate in every layer without a read, zeroing the non-finite gradients and selecting NaN
where full rows put it by a probe that always runs (a read per call would be one per chunk: the chunked backwards'
calls, whose backward the library runs). With the reads, a gradient that first turns non-finite inside a call's
backward, from finite gradients of finite activations, is the one case left unisolated.
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


class NonFiniteWatch:
    """How a node call keeps non-finite values in their rows: optimistically (a check per call) or isolating (a check
    per layer); see the module.

    Attributes:
        optimistic: the layers check nothing in forward; the call checks its final hidden states once
            (:meth:`record_hidden`, :meth:`all_finite`) and runs again isolating if one is not finite.
        always_isolate_gradients: in backward, every layer isolates non-finite gradients without reading anything
            (else a read per call arms them: :meth:`watch_gradients`).
        used: some layer of the call ran a packed kernel that needs the isolation (a :class:`NonFiniteGuard`).
        hidden_finite: 0-d bool on the device: every final hidden state of the call is finite (set by the head).
        armed: in backward, some gradient reaching the call's outputs is not finite: the layers' steps isolate it.
    """

    def __init__(self, optimistic: bool, always_isolate_gradients: bool = False):
        self.optimistic = optimistic
        self.always_isolate_gradients = always_isolate_gradients
        self.used = False
        self.hidden_finite: torch.Tensor | None = None
        self.armed = not optimistic

    def record_hidden(self, hidden: torch.Tensor) -> None:
        """Note whether every entry of the call's final hidden states ``hidden`` is finite (on the device, no read)."""
        if self.optimistic and self.used:
            self.hidden_finite = torch.isfinite(hidden).all()

    def all_finite(self) -> bool:
        """After an optimistic forward: whether it kept every value finite (one host read; True when no layer needed
        the isolation)."""
        return not (self.optimistic and self.used and self.hidden_finite is not None) or bool(self.hidden_finite)

    def watch_gradients(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``outputs`` of an optimistic call unchanged; in backward, one read of whether every gradient reaching them
        is finite arms the layers' isolation if one is not."""
        if not (self.optimistic and self.used and torch.is_grad_enabled()) or self.always_isolate_gradients:
            return outputs
        if not any(t.requires_grad for t in outputs):
            return outputs
        return list(_WatchGradients.apply(self, *outputs))


class _WatchGradients(torch.autograd.Function):
    """Identity on a call's outputs; backward: arms the call's isolation when a gradient is not finite."""

    @staticmethod
    def forward(ctx, watch: NonFiniteWatch, *outputs):
        ctx.watch = watch
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if present:
            finite = torch.stack([torch.isfinite(g).all() for g in present]).all()
            ctx.watch.armed = ctx.watch.armed or not bool(finite)
        return (None, *grads)


class NonFiniteGuard:
    """The non-finite isolation of one packed call (module docstring).

    Args:
        probe: the kernel under the call's mask (:data:`Probe`).
        q_len, kv_len: the padded lengths the mask is built for; width: head dimension of the probe's tensors.
        watch: the node call's :class:`NonFiniteWatch` (None: isolate, checking every layer).
    """

    def __init__(self, probe: Probe, q_len: int, kv_len: int, width: int, watch: NonFiniteWatch | None = None):
        self.probe = probe
        self.q_len, self.kv_len, self.width = q_len, kv_len, width
        self.watch = watch
        if watch is not None:
            watch.used = True
        self.poisoned: torch.Tensor | None = None  # (n,) bool: queries whose output is NaN
        self.bad_gradients: torch.Tensor | None = None  # (n,) bool: queries whose output gradient was not finite

    @property
    def checks_forward(self) -> bool:
        return self.watch is None or not self.watch.optimistic

    @property
    def checks_backward(self) -> bool:
        return self.watch is None or self.watch.armed

    @property
    def isolates_without_reading(self) -> bool:
        return self.watch is not None and self.watch.always_isolate_gradients

    def inputs(self, query, key, value):
        """(1, heads, n, d) queries and (1, kv_heads, K, d) keys/values with non-finite tokens zeroed, and, with
        gradients, routed through the step that puts NaN back into their gradients."""
        if not self.checks_forward:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
                query, key, value = _GradientsIn.apply(self, query, key, value)
            return query, key, value
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
        if ctx.guard.isolates_without_reading:
            bad = ~_finite_tokens(grad)
            ctx.guard.bad_gradients = bad
            return None, _zeroed(grad, bad)
        if not ctx.guard.checks_backward:
            return None, grad
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
