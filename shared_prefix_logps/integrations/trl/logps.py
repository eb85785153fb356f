"""The replacement for ``GRPOTrainer._get_per_token_logps_and_entropies``.

TRL calls that method for the policy (with gradient, one micro-batch, rows shuffled), for the old policy and for the
reference model (without gradient, whole generation batches, groups consecutive). Each call gets trainer-shaped rows
``[left-padded prompt | right-padded completion]``; :func:`~shared_prefix_logps.compute_logps_concatenated` forwards
every distinct prompt once, whatever the row order, so sharing holds for partial and shuffled groups too.

TRL does not apply the temperature in this method: its fused head (``add_fused_lm_head``) divides by the temperature
it was given at construction. The patch reads ``trainer.temperature`` (the same value) and passes it on.

With ``compute_aux_loss=True`` (MoE policy, ``router_aux_loss_coef != 0``) TRL forwards rows in sub-batches of
``batch_size`` and returns the mean of the model's ``aux_loss`` over them. The patch computes every row's router
statistics in the shared forward and forms each sub-batch's loss from its rows (:mod:`shared_prefix_logps.moe_router`),
differentiable, so ``_compute_loss`` adds ``router_aux_loss_coef * aux_loss`` as it does unpatched.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ...api import compute_logps_concatenated
from ...distributed.lockstep import caller_keeps_step
from ...errors import UnsupportedModelError
from ...model import unwrap_causal_lm
from ..common.modules import AutocastForward, dropout_active, eval_mode
from ..common.rows import layout_problem
from ..common.self_check import SelfCheck, SelfCheckError, compare

# Arguments the shared path understands; any other argument that is not None (images, token types ...) falls back.
_HANDLED = (
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)


def result_arity(original) -> int:
    """How many values the installed TRL's method returns: 3 ``(logps, entropies, aux_loss)`` since the MoE aux loss
    argument exists (1.x), 2 ``(logps, entropies)`` before. The self-check confirms it on the first call."""
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return 3
    return 3 if "compute_aux_loss" in parameters else 2


def compute_dtype(trainer, model) -> torch.dtype:
    """The dtype the model's matmuls run in: the autocast dtype under mixed precision, else the weights'."""
    precision = str(getattr(trainer.accelerator, "mixed_precision", "no"))
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    try:
        return unwrap_causal_lm(model).get_input_embeddings().weight.dtype
    except (UnsupportedModelError, AttributeError):
        return torch.float32


class LogpsPatch:
    """Callable installed as ``trainer._get_per_token_logps_and_entropies``.

    Returns exactly what the original returns (a 3-tuple in TRL 1.x): ``logps`` (N, C) float32 with 0 at masked
    positions, differentiable under grad; ``entropies`` (N, C) float32 or None; ``aux_loss``: with
    ``compute_aux_loss=True`` the 0-dim float32 mean over TRL's sub-batches of the router load-balancing loss
    (differentiable), else None.
    """

    def __init__(self, patch, original):
        self.patch = patch  # the GRPOPatch handle: trainer, options, stats, warn-once
        self.original = original  # the bound method (or whatever the instance held) before patching
        try:
            self.signature = inspect.signature(original)
        except (TypeError, ValueError):
            self.signature = None
        self.arity = result_arity(original)
        self.checked: set[str] = set()

    def __call__(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        arguments, reason = self._bind(model, input_ids, attention_mask, logits_to_keep, args, kwargs)
        if reason is None:
            reason = layout_problem(input_ids, attention_mask, logits_to_keep)
        if self.patch.lockstep is not None:
            reason = self._agreed_reason(reason)
        if reason is not None:
            return self.fallback(reason, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        compute_entropy = bool(arguments.get("compute_entropy", False))
        compute_aux = bool(arguments.get("compute_aux_loss", False))
        # Under FSDP a no-grad call's forwards are joined with the other processes' (how many there are depends on the
        # rows); a call with gradient agrees on its number of node calls in the core (its own lockstep)
        with self._in_step(model) if not torch.is_grad_enabled() else contextlib.nullcontext():
            try:
                out = self.compute(model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux)
            except UnsupportedModelError as error:
                out, reason = None, f"unsupported model ({error})"
        if out is None:
            return self.fallback(reason, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        stats = self.patch.stats
        stats.shared_calls += 1
        stats.record_batch(input_ids, attention_mask, logits_to_keep)
        aux_loss = sub_batch_aux_loss(out.router, arguments.get("batch_size")) if compute_aux else None
        result = self.pack(out.logps, out.entropy, aux_loss)
        key = "logps (grad)" if torch.is_grad_enabled() else "logps (no grad)"
        checking = self.patch.self_check and key not in self.checked
        if checking and not bool(out.mask.any()):
            # Every completion token masked: the comparison would cover nothing; the next call of this kind does it.
            stats.count_trivial_check(f"{key} (no valid token)")
            checking = False
        if checking:
            self.checked.add(key)
        if checking or self.patch.lockstep is not None:  # under a lockstep every process joins, checking or not
            call = (input_ids, attention_mask, logits_to_keep, args, kwargs)
            self.self_check(key, model, call, out, compute_entropy, aux_loss, checking)
        return result

    def _in_step(self, model, pad=None):
        """Under FSDP or ZeRO-3, join the block's no-grad forwards of ``model`` with the other processes'
        (``.distributed``); ``pad`` as for :meth:`Lockstep.forwards`."""
        lockstep = self.patch.lockstep
        return contextlib.nullcontext() if lockstep is None else lockstep.forwards(model, pad)

    def _agreed_reason(self, reason):
        """FSDP: the processes fall back together, if any of them has a reason to (``.distributed``)."""
        if self.patch.lockstep.any(reason is not None) and reason is None:
            reason = "another process falls back (FSDP: all processes fall back together)"
        return reason

    def compute(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux=False):
        """The shared-prefix log-probs of a trainer-shaped batch, under the trainer's autocast (with every row's router
        statistics when ``compute_aux``)."""
        trainer = self.patch.trainer
        # The model is called as TRL calls it, DDP included: the node calls' results leave through the model's outputs,
        # so DDP's reducer (unused-parameter search, gradient hooks, communication hooks) sees one ordinary graph.
        return compute_logps_concatenated(
            AutocastForward(model, trainer.accelerator.autocast),
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature=float(trainer.temperature),
            return_entropy=compute_entropy,
            backend=self.patch.backend,
            return_router_stats=compute_aux,
        )

    def pack(self, logps, entropy, aux_loss=None):
        """The tuple the installed TRL returns."""
        return (logps, entropy, aux_loss) if self.arity == 3 else (logps, entropy)

    def fallback(self, reason, *args, **kwargs):
        stats = self.patch.stats
        stats.count_fallback(reason)
        self.patch.warn(f"shared_prefix_logps: falling back to TRL's own log-prob computation: {reason}")
        return self.original(*args, **kwargs)

    def _bind(self, model, input_ids, attention_mask, logits_to_keep, args, kwargs):
        """The call's arguments by name, and a reason to fall back (or None)."""
        if self.signature is None:
            return {}, "unknown signature of the original method"
        try:
            bound = self.signature.bind(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        except TypeError as error:
            return {}, f"arguments this TRL version's method does not take ({error})"
        arguments = bound.arguments
        extra = sorted(name for name, value in arguments.items() if name not in _HANDLED and value is not None)
        if extra:
            return arguments, f"inputs the shared path does not handle ({', '.join(extra)})"
        return arguments, None

    def self_check(self, key, model, call, out, compute_entropy, aux_loss=None, checking=True):
        """Compare with the original method on this batch (``call``: the arguments it was given); raise
        :class:`SelfCheckError` on mismatch.

        Both run without gradient. With dropout active the two forwards would draw different masks, so both are
        then recomputed in eval mode.

        Under a lockstep every process calls this at the same point, ``checking`` False where it does not check now.
        Our forwards and the original method's run in two joins, each padded with a forward of its own kind: TRL's
        method reads the lm_head's weight in its fused head without calling the lm_head, so its padding is that
        method on one row (under ZeRO-3 the two kinds gather different submodules' parameters).
        """
        input_ids, attention_mask, logits_to_keep, args, kwargs = call
        compute_aux = aux_loss is not None
        dropout = dropout_active(model)
        ours, reference = out, None
        with torch.no_grad(), eval_mode(model) if dropout else contextlib.nullcontext():
            if dropout:
                with self._in_step(model):
                    if checking:  # on this process only: no agreement with the others (caller_keeps_step)
                        with caller_keeps_step():
                            ours = self.compute(
                                model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux
                            )
                        if compute_aux:
                            aux_loss = sub_batch_aux_loss(ours.router, self._bound_batch_size(model, call))
            row = (input_ids[:1], attention_mask[:1], logits_to_keep)
            with self._in_step(model, pad=lambda: self.original(model, *row, *args, **kwargs)):
                if checking:
                    reference = self.original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if checking:
            detail = "(dropout active: compared in eval mode)" if dropout else ""
            valid = attention_mask[:, -logits_to_keep:] != 0
            self.check_result(key, ours.logps, ours.entropy, reference, valid, detail, aux_loss=aux_loss)

    def _bound_batch_size(self, model, call):
        input_ids, attention_mask, logits_to_keep, args, kwargs = call
        bound = self.signature.bind(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        return bound.arguments.get("batch_size")

    def check_result(self, key, logps, entropy, reference, valid, detail="", aux_loss=None):
        """Compare ``logps``/``entropy`` (and ``aux_loss``, when given) with the original method's result
        ``reference``; record and raise."""
        patch = self.patch
        if not isinstance(reference, tuple) or len(reference) != self.arity:
            raise SelfCheckError(
                f"{key}: the original method returned {type(reference).__name__} of length "
                f"{len(reference) if isinstance(reference, tuple) else '?'}, the patch returns {self.arity} values"
            )
        ref_logps, ref_entropy = reference[0], reference[1]
        if ref_logps.shape != logps.shape:
            raise SelfCheckError(f"{key}: shapes differ: ours {tuple(logps.shape)}, TRL's {tuple(ref_logps.shape)}")
        tolerance = patch.tolerance(self.patch.trainer.model)
        check = compare(key, logps, ref_logps, valid, tolerance, entropy, ref_entropy, detail)
        if ref_logps.dtype != logps.dtype:
            check.detail = f"{check.detail} dtype ours {logps.dtype} vs TRL's {ref_logps.dtype}".strip()
        patch.stats.self_checks.append(check)
        if aux_loss is not None:
            self.check_aux_loss(key, aux_loss, reference[2], tolerance)
        if not check.passed:
            raise SelfCheckError(
                f"shared_prefix_logps self-check failed for {key}: max |logp diff| {check.max_abs:.3g}, mean "
                f"{check.mean_abs:.3g}, max |entropy diff| {check.max_abs_entropy}, tolerance {tolerance}. The "
                "patched trainer would optimize different numbers than TRL; unpatch it (unpatch_grpo_trainer) and "
                "report the model and config."
            )

    def check_aux_loss(self, key, ours, reference, tolerance) -> None:
        """Compare the router aux loss with the original method's (relative to its size, with the log-prob bound)."""
        if not isinstance(reference, torch.Tensor):
            raise SelfCheckError(f"{key}: the original method returned no aux loss ({type(reference).__name__})")
        theirs, ours = float(reference.detach()), float(ours.detach())
        difference = abs(ours - theirs) / max(1.0, abs(theirs))
        passed = difference <= tolerance[0]
        detail = f"aux loss ours {ours:.8g} vs TRL {theirs:.8g}"
        check = SelfCheck(f"{key} router aux loss (relative)", difference, difference, None, tolerance, passed, detail)
        self.patch.stats.self_checks.append(check)
        if not passed:
            raise SelfCheckError(
                f"shared_prefix_logps self-check failed for {key}: the router aux loss differs ({detail}). The patched "
                "trainer would optimize a different loss than TRL; unpatch it and report the model and config."
            )


def sub_batch_aux_loss(router, batch_size) -> torch.Tensor:
    """TRL's aux loss of a call: the mean over its sub-batches of ``batch_size`` consecutive rows (one sub-batch when
    None) of the load-balancing loss of each sub-batch's rows, from ``router`` (:class:`RouterStats` of every row)."""
    rows = router.counts.shape[0]
    batch_size = batch_size or rows
    losses = [
        router.aux_loss(torch.arange(start, min(start + batch_size, rows), device=router.counts.device))
        for start in range(0, rows, batch_size)
    ]
    return torch.stack(losses).mean()
