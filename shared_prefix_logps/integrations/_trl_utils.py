"""Pieces shared by the TRL log-prob patch and the chunked training step: statistics, self-check comparison,
temporary attribute swaps, the autocast wrapper and the float32-head shim."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

_MISSING = object()


class SelfCheckError(RuntimeError):
    """The shared-prefix result differs from what the unpatched trainer computes on the same batch."""


@dataclass
class SelfCheck:
    """One comparison against the unpatched trainer.

    Attributes:
        what: which computation was compared (e.g. ``"logps (no grad)"``, ``"chunked loss"``).
        max_abs: largest absolute difference of the compared quantity (log-probs, or the loss gradient w.r.t. them).
        mean_abs: mean absolute difference over valid completion tokens.
        max_abs_entropy: largest absolute entropy difference, when entropies were compared.
        tolerance: ``(max_abs, mean_abs)`` bounds the check used.
        passed: whether both bounds held.
        detail: free text (shapes, the loss values compared ...).
    """

    what: str
    max_abs: float
    mean_abs: float
    max_abs_entropy: float | None
    tolerance: tuple[float, float]
    passed: bool
    detail: str = ""


@dataclass
class PatchStats:
    """What the patch did so far (cumulative over calls).

    Attributes:
        shared_calls: log-prob calls served by the shared-prefix path.
        fallback_calls: calls handed to the original method; ``fallback_reasons`` counts them per reason.
        rows: completion rows scored by the shared path.
        distinct_prompts: prompts forwarded (rows with identical prompts count once per call).
        tokens_forwarded: real (unpadded) tokens the shared path forwards: each distinct prompt once plus every
            completion token.
        dense_tokens: real tokens the original method forwards for the same calls (every row in full).
        chunked_steps: micro-batches whose backward ran through ``chunked_backward``.
        chunked_calls: ``chunked_backward`` calls (one per group size present in a micro-batch).
        self_checks: every comparison made against the unpatched trainer.
        trivial_self_checks: self-checks postponed because the batch would have compared nothing, per check and
            reason (no valid completion token; chunked mode: a loss gradient that is exactly zero, e.g. every
            advantage 0). Each check runs on the first batch where it is not trivial.
        max_loss_discrepancy: chunked mode: the largest ``|sum of chunk losses - TRL's loss on the same log-probs|``
            relative to ``max(1, |loss|)``, over all chunked steps.
    """

    shared_calls: int = 0
    fallback_calls: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    distinct_prompts: int = 0
    tokens_forwarded: int = 0
    dense_tokens: int = 0
    chunked_steps: int = 0
    chunked_calls: int = 0
    self_checks: list[SelfCheck] = field(default_factory=list)
    trivial_self_checks: dict[str, int] = field(default_factory=dict)
    max_loss_discrepancy: float = 0.0

    def count_fallback(self, reason: str) -> None:
        """One more call or micro-batch that went to TRL's own path for ``reason``."""
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def count_trivial_check(self, what: str) -> None:
        """One more self-check ``what`` postponed because its batch would have compared nothing."""
        self.trivial_self_checks[what] = self.trivial_self_checks.get(what, 0) + 1

    def record_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> None:
        """Count rows, distinct prompts and real tokens of one trainer-shaped batch ``(N, P + C)``."""
        split = input_ids.shape[1] - logits_to_keep
        valid = attention_mask.bool()
        prompt_valid = valid[:, :split]
        distinct = torch.unique(input_ids[:, :split].masked_fill(~prompt_valid, -1), dim=0)
        self.rows += int(input_ids.shape[0])
        self.distinct_prompts += int(distinct.shape[0])
        self.tokens_forwarded += int((distinct >= 0).sum()) + int(valid[:, split:].sum())
        self.dense_tokens += int(valid.sum())

    def summary(self) -> str:
        """A few human-readable lines."""
        saved = 1.0 - self.tokens_forwarded / self.dense_tokens if self.dense_tokens else 0.0
        lines = [
            f"shared-prefix calls: {self.shared_calls} ({self.rows} rows, {self.distinct_prompts} distinct prompts), "
            f"fallbacks: {self.fallback_calls} {self.fallback_reasons or ''}".rstrip(),
            f"real tokens forwarded: {self.tokens_forwarded} instead of {self.dense_tokens} ({saved:.0%} fewer)",
        ]
        if self.chunked_steps:
            lines.append(
                f"chunked backward: {self.chunked_steps} micro-batches, {self.chunked_calls} chunked_backward calls, "
                f"max |loss - TRL loss| = {self.max_loss_discrepancy:.2e}"
            )
        for what, count in self.trivial_self_checks.items():
            lines.append(f"self-check {what}: postponed on {count} trivial micro-batch(es)")
        for check in self.self_checks:
            entropy = "" if check.max_abs_entropy is None else f", entropy max|diff| {check.max_abs_entropy:.2e}"
            lines.append(
                f"self-check {check.what}: {'passed' if check.passed else 'FAILED'} (max|diff| {check.max_abs:.2e}, "
                f"mean|diff| {check.mean_abs:.2e}{entropy}; tolerance {check.tolerance}) {check.detail}".rstrip()
            )
        return "\n".join(lines)


def default_tolerance(compute_dtype: torch.dtype) -> tuple[float, float]:
    """``(max_abs, mean_abs)`` bounds for log-probs/entropies of the shared path against the trainer's own.

    In float32 the two differ only by summation order and by TRL's ``arange`` positions on left-padded rows (a
    uniform RoPE shift, 1e-6 level). In half precision every token's rounding differs (DESIGN: trl#6789), so only
    gross errors (a wrong temperature, softcap or prefix) are caught: those move the mean by far more than 0.05.
    """
    if compute_dtype in (torch.float32, torch.float64):
        return (1e-3, 1e-4)
    return (1.0, 0.05)


def compare(
    what: str,
    ours: torch.Tensor,
    reference: torch.Tensor,
    valid: torch.Tensor,
    tolerance: tuple[float, float],
    ours_entropy: torch.Tensor | None = None,
    reference_entropy: torch.Tensor | None = None,
    detail: str = "",
) -> SelfCheck:
    """Compare ``(N, C)`` tensors at the ``valid`` positions (and the entropies, with the same bounds)."""
    diff = (ours.detach().double() - reference.detach().double()).abs()
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    count = max(int(valid.sum()), 1)
    max_abs, mean_abs = float(diff.max()) if diff.numel() else 0.0, float(diff.sum()) / count
    passed = max_abs <= tolerance[0] and mean_abs <= tolerance[1]
    max_abs_entropy = None
    if ours_entropy is not None and reference_entropy is not None:
        ediff = (ours_entropy.detach().double() - reference_entropy.detach().double()).abs()
        ediff = torch.where(valid, ediff, torch.zeros_like(ediff))
        max_abs_entropy = float(ediff.max()) if ediff.numel() else 0.0
        passed = passed and max_abs_entropy <= tolerance[0] and float(ediff.sum()) / count <= tolerance[1]
    # NaN anywhere fails the check (comparisons with NaN are False)
    return SelfCheck(what, max_abs, mean_abs, max_abs_entropy, tolerance, bool(passed), detail)


@contextlib.contextmanager
def instance_attribute(obj, name: str, value):
    """Set ``obj.name = value`` on the instance for the block; afterwards restore exactly what the instance held
    (its own attribute, or none, so that the class attribute shows through again)."""
    previous = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, previous)


def replace_attribute(obj, name: str, value, record: list) -> None:
    """Set ``obj.name = value`` on the instance, appending ``(obj, name, what the instance held)`` to ``record`` so
    that :func:`restore_attributes` can undo it."""
    record.append((obj, name, obj.__dict__.get(name, _MISSING)))
    setattr(obj, name, value)


def restore_attributes(record: list) -> None:
    """Undo :func:`replace_attribute` calls, last first: each instance gets back exactly what it held (its own
    attribute, or none, so that the class attribute shows through again)."""
    while record:
        obj, name, previous = record.pop()
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, previous)


class Unpatched:
    """Calls ``obj.name`` as it resolves without the patch, looked up at each call.

    Create it before replacing the attribute. If the instance had an attribute of its own, that one is called;
    otherwise the class's attribute as it is at call time (bound to ``obj``), so that class-level patches made after
    the plug-in was installed (e.g. ``unittest.mock.patch.object(GRPOTrainer, ...)``) still take effect.
    """

    def __init__(self, obj, name: str):
        self.obj = obj
        self.name = name
        self.held = obj.__dict__.get(name, _MISSING)

    def resolve(self):
        if self.held is not _MISSING:
            return self.held
        attribute = getattr(type(self.obj), self.name)
        bind = getattr(type(attribute), "__get__", None)  # functions bind; a plain callable (a mock) does not
        return bind(attribute, self.obj, type(self.obj)) if bind is not None else attribute

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


class AutocastForward(nn.Module):
    """Runs the wrapped model's forward under ``autocast()`` (accelerate's mixed-precision context), nothing else.

    TRL runs the model's forward inside ``accelerator.autocast()`` and its backward outside. Wrapping the model
    (instead of the whole call) keeps that split when forward and backward interleave (chunked backward). To
    ``shared_prefix_logps`` it looks like a DDP wrapper (a ``module`` child, no ``config``): the causal LM is found
    inside, and every call still goes through the wrapped module's own forward.
    """

    def __init__(self, module: nn.Module, autocast):
        super().__init__()
        self.module = module
        self._autocast = autocast

    def forward(self, *args, **kwargs):
        with self._autocast():
            return self.module(*args, **kwargs)


_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu")


def install_fp32_head(lm_head: nn.Module) -> bool:
    """Make the shared path's head compute in float32 outside autocast, as TRL's ``cast_lm_head_to_fp32`` head does.

    Must run after ``prepare_model`` installed its lm_head proxy: it wraps that proxy, casting the hidden states
    to float32 and disabling autocast around it. Outside a phase the proxy calls TRL's own float32 forward, which
    does the same, so ordinary forwards are unchanged. Returns False if the shim was already there.
    """
    if getattr(lm_head, "_trl_fp32_shim_previous", None) is not None:
        return False
    previous = lm_head.forward

    def forward(hidden_states, *args, **kwargs):
        device_type = hidden_states.device.type
        guard = (
            torch.autocast(device_type, enabled=False) if device_type in _AUTOCAST_DEVICES else contextlib.nullcontext()
        )
        with guard:
            return previous(hidden_states.float(), *args, **kwargs)

    lm_head._trl_fp32_shim_previous = previous
    lm_head.forward = forward
    return True


def remove_fp32_head(lm_head: nn.Module) -> None:
    """Undo :func:`install_fp32_head`."""
    previous = getattr(lm_head, "_trl_fp32_shim_previous", None)
    if previous is not None:
        lm_head.forward = previous
        del lm_head._trl_fp32_shim_previous


def dropout_active(model: nn.Module) -> bool:
    """Whether a forward of ``model`` in its current mode is random (dropout modules or attention dropout)."""
    for module in model.modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        config = getattr(module, "config", None)
        if config is not None and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return True
    return False


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` for the block, then every submodule's own ``training`` flag restored."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


class WarnOnce:
    """Emit each distinct message once per patch (fallbacks happen every step; one warning is enough)."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, message: str, category=UserWarning) -> None:
        if message not in self.seen:
            self.seen.add(message)
            warnings.warn(message, category, stacklevel=3)


def layout_problem(input_ids, attention_mask, logits_to_keep) -> str | None:
    """Why a trainer-shaped batch is not ``[left-padded prompt | right-padded completion]``, or None if it is.

    Checked before calling the shared path so that a batch it cannot serve falls back instead of raising.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        return "input_ids is not a 2-D integer tensor"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        return "attention_mask is missing or not shaped like input_ids"
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        return "logits_to_keep is not an int"
    if not 1 <= logits_to_keep < input_ids.shape[1]:
        return "no prompt columns (logits_to_keep covers the whole row)"
    split = input_ids.shape[1] - logits_to_keep
    valid = attention_mask != 0
    prompt, completion = valid[:, :split], valid[:, split:]
    if input_ids.shape[0] == 0:
        return "empty batch"
    if not bool(prompt[:, -1].all()) or bool((prompt[:, 1:] < prompt[:, :-1]).any()):
        return "a prompt is empty or not left-padded"
    if bool((completion[:, 1:] > completion[:, :-1]).any()):
        return "a completion is not right-padded"
    return None
