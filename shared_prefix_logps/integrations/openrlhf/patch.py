"""The patched ``Actor.forward`` of OpenRLHF: action log-probs (and entropy) through the shared prefix, everything
else through OpenRLHF's own forward; installing it on one actor and undoing it exactly."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...api import compute_logps_concatenated
from ...model import prepare_model
from ..common.backends import PLUGIN_BACKENDS
from ..common.lockstep import Lockstep
from ..common.modules import dropout_active
from ..common.patching import Unpatched, replace_attribute, restore_attributes
from ..common.scored_rows import scored_rows_problem, to_next_token_layout, to_prefix_rows
from ..common.self_check import SelfCheckError, compare, default_tolerance
from ..common.stats import PatchStats, WarnOnce
from .outputs import SharedPrefixActorOutput

PATCH_ATTRIBUTE = "_shared_prefix_logps_patch"
# set on the class-level forward that install() puts on Actor: the forward it replaced
ORIGINAL_ATTRIBUTE = "_shared_prefix_logps_original"
BACKENDS = PLUGIN_BACKENDS


@dataclass
class ActorStats(PatchStats):
    """:class:`PatchStats` plus, for every call with gradient (a training micro-batch), ``(rows, distinct prompts)``
    in ``grad_calls``: how many prompts the micro-batch shared (rows / prompts completions per forwarded prompt)."""

    grad_calls: list[tuple[int, int]] = field(default_factory=list)


def make_lockstep(model) -> Lockstep | None:
    """A :class:`Lockstep` when ``model`` is partitioned by DeepSpeed ZeRO-3 over several processes (every submodule's
    forward gathers its parameters: the processes must make the same model calls whatever their rows), else None."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    parameter = next(iter(model.parameters()), None)
    if parameter is None or not hasattr(parameter, "ds_id"):
        return None
    device = parameter.device if parameter.device.type != "cpu" else torch.device("cpu")
    return Lockstep(device)


def _model_dtype(model) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.dtype.is_floating_point:
            return parameter.dtype
    return torch.float32


class ActorPatch:
    """The forward installed on one OpenRLHF ``Actor`` (:func:`patch_actor`, or :func:`~.install.install` for every
    actor of a process).

    Attributes:
        actor: the patched ``openrlhf.models.Actor``.
        backend: completion-attention backend (``"auto"``, ``"expand"``, ``"flex"``).
        self_check: compare the first no-grad and the first grad call with OpenRLHF's own forward; raise
            :class:`SelfCheckError` on mismatch.
        self_check_tolerance: ``(max_abs, mean_abs)`` bounds; None picks them from the model's dtype.
        stats: :class:`ActorStats`.
    """

    def __init__(self, actor, *, backend="auto", self_check=True, self_check_tolerance=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name in ("forward", "model"):
            if not hasattr(actor, name):
                raise TypeError(f"expected an openrlhf.models.Actor; {type(actor).__name__} has no {name!r}")
        self.actor = actor
        self.backend = backend
        self.self_check = bool(self_check)
        self.self_check_tolerance = self_check_tolerance
        self.stats = ActorStats()
        self.warn = WarnOnce()
        self.replaced: list = []
        self._checked: set[bool] = set()  # grad modes already self-checked
        self._unpatched = Unpatched(actor, "forward")
        prepare_model(actor.model)  # an unsupported model fails here, not at the first training step
        # under ZeRO-3: fallbacks and self-checks agreed, no-grad forwards joined (see ..common.lockstep)
        self.lockstep = make_lockstep(actor.model)

    def original(self, *args, **kwargs):
        """OpenRLHF's own forward of this actor (under :func:`~.install.install`, the one the class had before)."""
        method = self._unpatched.resolve()
        inner = getattr(getattr(method, "__func__", method), ORIGINAL_ATTRIBUTE, None)
        if inner is not None:
            method = inner.__get__(self.actor, type(self.actor))
        return method(*args, **kwargs)

    def _arguments(self, args, kwargs) -> dict:
        method = self._unpatched.resolve()
        inner = getattr(getattr(method, "__func__", method), ORIGINAL_ATTRIBUTE, None)
        signature = inspect.signature(inner.__get__(self.actor) if inner is not None else method)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments["extra_inputs"] = arguments.pop(name, {})
        return arguments

    def fallback_reason(self, a: dict) -> str | None:
        """Why OpenRLHF's own forward must serve this call, or None."""
        if a.get("action_mask") is None:
            return "no action_mask: the caller wants logits or full-row log-probs"
        if a.get("ring_attn_group") is not None:
            return "ring attention (ring_attn_group)"
        if a.get("extra_inputs") or getattr(self.actor, "is_vlm", False):
            return "vision-language inputs"
        if a.get("return_entropy") and not a.get("return_output"):
            return "return_entropy without return_output (OpenRLHF refuses it)"
        config = getattr(getattr(self.actor.model, "module", self.actor.model), "config", None)
        if config is not None and getattr(config, "output_router_logits", False):
            return "MoE router logits (output_router_logits): the aux loss needs the model's full output"
        problem = scored_rows_problem(
            a.get("sequences"),
            a.get("attention_mask"),
            a.get("action_mask"),
            ids_name="sequences",
            score_name="action_mask",
        )
        if problem is not None:
            return f"rows not servable: {problem}"
        return None

    def __call__(self, *args, **kwargs):
        arguments = self._arguments(args, kwargs)
        reason = self.fallback_reason(arguments)
        if self.lockstep is not None and self.lockstep.any(reason is not None) and reason is None:
            reason = "another process falls back (ZeRO-3: all processes take the same path)"
        if reason is not None:
            self.stats.count_fallback(reason)
            self.warn(f"shared_prefix_logps: OpenRLHF's own Actor.forward serves this call: {reason}")
            return self.original(*args, **kwargs)
        return self.serve(arguments)

    def serve(self, a: dict):
        sequences, attention_mask, action_mask = a["sequences"], a["attention_mask"], a["action_mask"]
        return_entropy = bool(a.get("return_entropy"))
        length, actions = sequences.shape[1], action_mask.shape[1]
        rows = to_prefix_rows(sequences, attention_mask, action_mask)
        # no-grad scoring may split a process's rows into a number of forwards of its own: join them
        join = self.lockstep is not None and not torch.is_grad_enabled()
        with self.lockstep.forwards(self.actor.model) if join else contextlib.nullcontext():
            out = compute_logps_concatenated(
                self.actor.model,
                rows.input_ids,
                rows.attention_mask,
                rows.completion_width,
                temperature=float(getattr(self.actor, "temperature", 1.0)),
                return_entropy=return_entropy,
                backend=self.backend,
            )
        action_log_probs = to_next_token_layout(out.logps, rows, length)[:, -actions:] * action_mask.float()
        entropy = to_next_token_layout(out.entropy, rows, length) if return_entropy else None

        self.stats.shared_calls += 1
        distinct_before = self.stats.distinct_prompts
        self.stats.record_batch(rows.input_ids, rows.attention_mask, rows.completion_width)
        if torch.is_grad_enabled():
            self.stats.grad_calls.append((int(sequences.shape[0]), self.stats.distinct_prompts - distinct_before))
        if self.self_check and torch.is_grad_enabled() not in self._checked:
            self._check(action_log_probs, entropy, action_mask, a)
        if a.get("return_output"):
            return action_log_probs, SharedPrefixActorOutput(entropy)
        return action_log_probs

    def _check(self, action_log_probs, entropy, action_mask, arguments: dict) -> None:
        grad = torch.is_grad_enabled()
        what = "action log-probs (grad)" if grad else "action log-probs (no grad)"
        valid = action_mask != 0
        trivial = not bool(valid.any())
        if self.lockstep is not None:
            trivial = self.lockstep.any(trivial)  # the check's forward is a collective: all check, or none
        if trivial:
            self.stats.count_trivial_check(what)
            return
        if dropout_active(self.actor.model):
            # two forwards with dropout differ by design; the check waits for an eval-mode call
            self.stats.count_trivial_check(what)
            return
        # the call as made, by name (whatever was passed positionally), asking for the entropy where it was served
        call = {name: value for name, value in arguments.items() if name != "extra_inputs"}
        call.update(arguments.get("extra_inputs") or {})
        if entropy is not None:
            call.update(return_output=True, return_entropy=True)
        with torch.no_grad():
            reference = self.original(**call)
        reference_entropy = None
        if isinstance(reference, tuple):
            reference, output = reference
            if entropy is not None:
                reference_entropy = output.entropy[:, -action_mask.shape[1] :]
        ours_entropy = entropy[:, -action_mask.shape[1] :] if entropy is not None else None
        tolerance = self.self_check_tolerance or default_tolerance(_model_dtype(self.actor.model))
        check = compare(
            what,
            action_log_probs,
            reference,
            valid,
            tuple(tolerance),
            ours_entropy,
            reference_entropy,
            detail=f"rows {tuple(action_mask.shape)}",
        )
        self.stats.self_checks.append(check)
        self._checked.add(grad)
        if not check.passed:
            raise SelfCheckError(
                f"shared-prefix {what} differ from OpenRLHF's Actor.forward: max|diff| {check.max_abs:.3e}, mean|diff| "
                f"{check.mean_abs:.3e}, entropy max|diff| {check.max_abs_entropy}, tolerance {check.tolerance}; "
                "unpatch_actor(actor) and report the model and batch"
            )


def patch_actor(actor, *, backend: str = "auto", self_check: bool = True, self_check_tolerance=None) -> ActorPatch:
    """Serve an OpenRLHF ``Actor``'s action log-prob calls through the shared-prefix path (patches the instance).

    The three log-prob passes of OpenRLHF's PPO/GRPO go through ``Actor.forward``: the policy with gradient
    (``ActorPPOTrainer.training_step``), the old policy (``PolicyModelActor.forward``) and the reference model
    (``ReferenceModelActor.forward``). Calls with an ``action_mask`` return what OpenRLHF's forward returns
    (``(B, A)`` float32 action log-probs at ``actor.temperature``, zero where ``action_mask`` is 0; with
    ``return_output=True`` also a :class:`~.outputs.SharedPrefixActorOutput` holding ``entropy``); rows that share the
    tokens before their first action token forward them once. Other calls go to OpenRLHF's forward, with one warning
    per reason and a count in ``stats.fallback_reasons``.

    Args:
        actor: an ``openrlhf.models.Actor`` (its ``model`` may be DeepSpeed-wrapped).
        backend: completion-attention backend (``"auto"``: flex on CUDA, expand elsewhere).
        self_check: compare the first no-grad and first grad call with OpenRLHF's own forward (one extra no-grad
            forward each, once); raise :class:`SelfCheckError` on mismatch.
        self_check_tolerance: ``(max_abs, mean_abs)`` bounds of that comparison; None picks them from the dtype.

    Returns:
        The :class:`ActorPatch` (also :func:`get_patch`'s answer).

    Raises:
        UnsupportedModelError: the actor's model cannot take the shared path.
        ValueError / TypeError: a bad option, not an Actor, or an actor patched already.
    """
    previous = getattr(actor, "__dict__", {}).get(PATCH_ATTRIBUTE)
    if previous is not None and previous.replaced:
        raise ValueError("this actor is patched already; call unpatch_actor(actor) first")
    patch = ActorPatch(actor, backend=backend, self_check=self_check, self_check_tolerance=self_check_tolerance)
    replace_attribute(actor, "forward", patch, patch.replaced)
    actor.__dict__[PATCH_ATTRIBUTE] = patch
    return patch


def unpatch_actor(actor) -> None:
    """Undo :func:`patch_actor`: the actor's ``forward`` is OpenRLHF's again (the model keeps the library's attention
    function and head proxy, which pass through to the originals outside a shared-prefix call). Under
    :func:`~.install.install` the actor is also left to OpenRLHF from then on."""
    patch = actor.__dict__.get(PATCH_ATTRIBUTE)
    if patch is None:
        raise ValueError("this actor is not patched")
    restore_attributes(patch.replaced)
    actor.__dict__[PATCH_ATTRIBUTE] = None


def get_patch(actor) -> ActorPatch | None:
    """The actor's :class:`ActorPatch` (its ``stats``), or None."""
    return actor.__dict__.get(PATCH_ATTRIBUTE)
