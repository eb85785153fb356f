"""The patched log-prob method of ms-swift's ``GRPOTrainer``: every pass through the shared prefix, what it cannot
serve through ms-swift's own code; the patch of one trainer and undoing it exactly.

ms-swift (4.6.0, ``swift/rlhf_trainers/grpo_trainer.py``) computes every log-prob pass with
``_get_per_token_logps_and_entropies(model, model_inputs, grpo_batch, compute_entropy=False, origin_data=None)``: the
old policy and the reference model in ``_prepare_batch_inputs`` (no grad), a local teacher (``_compute_teacher_logps``,
no grad) and the policy with gradient (``_compute_loss_and_metrics``). The method either runs
``_get_per_token_logps_and_entropies_single`` on the whole micro-batch or, with ``dynamic_num_samples`` and more rows
than the configured batch size on any process, splits it into chunks (a collective agrees on their number) and runs the
single method per chunk. The patch keeps that split: under ``dynamic_num_samples`` ms-swift's own method runs with the
single method served by the patch.

A micro-batch's ``model_inputs['input_ids']`` ``(B, S)`` are whole rows ``[prompt | completion]``, right-padded in
training (left-padded where the template pads left), with ``attention_mask``; ``grpo_batch.completion_mask``
``(B, logits_to_keep)`` marks the completion tokens among the last ``logits_to_keep`` columns (column ``j`` scores token
``S - logits_to_keep + j``; tool outputs inside a multi-turn completion are not marked). That is the frame of
:mod:`..common.scored_rows`: each row's tokens before its first completion token are its prompt, forwarded once per
distinct prompt of the call (rows whose distinct prompts share deeper, e.g. a system prompt, take the prefix trie).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch

from ...api import compute_logps_concatenated
from ...errors import UnsupportedModelError
from ...model import prepare_model, unwrap_causal_lm
from ..common.backends import check_plugin_backend
from ..common.lockstep import make_lockstep
from ..common.modules import dropout_active
from ..common.patching import Unpatched, instance_attribute
from ..common.scored_rows import scored_rows_problem, to_next_token_layout, to_prefix_rows
from ..common.self_check import SelfCheckError, compare, default_tolerance
from ..common.stats import PatchStats, WarnOnce

logger = logging.getLogger("shared_prefix_logps.swift")

PATCH_ATTRIBUTE = "_shared_prefix_logps_patch"
# set on the class-level methods that install() puts on GRPOTrainer: the function each replaced
ORIGINAL_ATTRIBUTE = "_shared_prefix_logps_original"
LOGPS_METHOD = "_get_per_token_logps_and_entropies"
SINGLE_METHOD = "_get_per_token_logps_and_entropies_single"
LIGER_METHOD = "compute_liger_loss"

# Model inputs the shared path reproduces: the token rows, and what ms-swift's own method adds to the dict it is given
# (``use_cache=False``, ``logits_to_keep``) before its forward, which later passes over the same dict then carry.
_TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep")
# Prefixes of the keys ms-swift's multimodal templates add (pixel_values, image_grid_thw, video_*, input_features ...).
_MULTIMODAL_PREFIXES = ("pixel", "image", "video", "audio", "input_features", "feature_attention_mask", "mm_")

REASON_SEQUENCE_PARALLEL = "sequence parallel (sequence_parallel_size > 1)"
REASON_PADDING_FREE = "padding_free (rows packed into one sequence)"
REASON_MULTIMODAL = "multimodal inputs"
REASON_LIGER = "Liger's gradient path (compute_liger_loss)"


@dataclass
class SwiftStats(PatchStats):
    """:class:`PatchStats` plus the calls served per pass, ``passes``: ``"policy (grad)"``, ``"policy (no grad)"`` (the
    old policy; the reference pass of a LoRA run, whose adapter ms-swift disables), ``"ref_model (no grad)"``,
    ``"teacher_model (no grad)"``, ``"other model (...)"``."""

    passes: dict[str, int] = field(default_factory=dict)


class SwiftPatch:
    """What the patched ``GRPOTrainer`` methods of one trainer call (:func:`patch_trainer`, or
    :func:`~.install.install` for every trainer of a process).

    Attributes:
        trainer: the patched ``swift.rlhf_trainers.GRPOTrainer``.
        backend: completion-attention backend (``"auto"``, ``"expand"``, ``"flex"``).
        self_check: compare the first no-grad and the first grad call with ms-swift's own method on the same
            micro-batch; raise :class:`SelfCheckError` on mismatch.
        self_check_tolerance: ``(max_abs, mean_abs)`` bounds; None picks them from the model's dtype.
        stats: :class:`SwiftStats`.
    """

    def __init__(self, trainer, *, backend: str = "auto", self_check: bool = True, self_check_tolerance=None):
        check_plugin_backend(backend)
        for name in (LOGPS_METHOD, SINGLE_METHOD, "template", "temperature"):
            if not hasattr(trainer, name):
                raise TypeError(f"expected ms-swift's GRPOTrainer; {type(trainer).__name__} has no {name!r}")
        if self_check_tolerance is not None and len(tuple(self_check_tolerance)) != 2:
            raise ValueError(f"self_check_tolerance must be (max_abs, mean_abs), got {self_check_tolerance!r}")
        self.trainer = trainer
        self.backend = backend
        self.self_check = bool(self_check)
        self.self_check_tolerance = self_check_tolerance
        self.stats = SwiftStats()
        self.warn = WarnOnce()
        self.replaced: list = []  # instance attributes patch_trainer set (none under the class-level install)
        self._checked: set[bool] = set()  # grad modes already self-checked
        self._unpatched = {name: Unpatched(trainer, name) for name in (LOGPS_METHOD, SINGLE_METHOD, LIGER_METHOD)}
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None or why not served
        # under FSDP or ZeRO-3 every forward is a collective: fallbacks and self-checks agreed, no-grad forwards joined
        self.lockstep = make_lockstep(trainer) if hasattr(trainer, "accelerator") else None

    # -- ms-swift's own methods ---------------------------------------------------------------------------------------

    def original(self, name: str):
        """ms-swift's own ``name`` of this trainer, bound (under :func:`~.install.install`, the one the class had)."""
        method = self._unpatched[name].resolve()
        inner = getattr(getattr(method, "__func__", method), ORIGINAL_ATTRIBUTE, None)
        if inner is not None:
            method = inner.__get__(self.trainer, type(self.trainer))
        return method

    @staticmethod
    def _arguments(args, kwargs) -> dict:
        """The call's arguments by name, bound as ms-swift 4.6.0's method takes them (its profiling decorator hides
        the signature); arguments it does not have land in ``extra``."""

        def bind(model, model_inputs, grpo_batch, compute_entropy=False, origin_data=None, **extra):
            return dict(
                model=model,
                model_inputs=model_inputs,
                grpo_batch=grpo_batch,
                compute_entropy=compute_entropy,
                origin_data=origin_data,
                extra=extra,
            )

        return bind(*args, **kwargs)

    # -- the patched methods -----------------------------------------------------------------------------------------

    def logps(self, *args, **kwargs):
        """The patched ``_get_per_token_logps_and_entropies``: ``(logps, entropies)``, see :meth:`single`."""
        a = self._arguments(args, kwargs)
        reason = self.call_reason(a["model"], a["model_inputs"])
        if reason is None and a["extra"]:
            reason = f"arguments this plug-in does not know: {', '.join(sorted(a['extra']))}"
        if self.lockstep is not None and self.lockstep.any(reason is not None) and reason is None:
            reason = "another process falls back (FSDP/ZeRO-3: all processes take the same path)"
        if reason is not None:
            return self._fall_back(reason, self.original(LOGPS_METHOD), args, kwargs)
        if getattr(self.trainer, "dynamic_num_samples", False):
            # ms-swift's own split (its chunk count agreed across processes), each chunk served by single()
            with instance_attribute(self.trainer, SINGLE_METHOD, self.single):
                return self.original(LOGPS_METHOD)(*args, **kwargs)
        return self.single(a["model"], a["model_inputs"], a["grpo_batch"], compute_entropy=a["compute_entropy"])

    def liger_loss(self, *args, **kwargs):
        """The patched ``compute_liger_loss``: ms-swift's own. Liger's fused GRPO loss computes the policy's log-probs
        from the last hidden states of full rows inside the loss, not through the log-prob method, so that pass stays
        ms-swift's (counted and warned about once); the old-policy and reference passes are still served."""
        self.stats.count_fallback(REASON_LIGER)
        self.warn(f"shared_prefix_logps: ms-swift's own code serves the policy pass: {REASON_LIGER}")
        return self.original(LIGER_METHOD)(*args, **kwargs)

    def single(self, model, model_inputs: dict, grpo_batch, compute_entropy: bool = False):
        """``_get_per_token_logps_and_entropies_single`` through the shared prefix.

        Returns:
            ``(logps, entropies)``: ``(B, logits_to_keep)`` in the dtype of ms-swift's own (the logits' dtype),
            differentiable under grad; column ``j`` is the log-prob at ``trainer.temperature`` of token
            ``S - logits_to_keep + j`` where that token belongs to the completion (every token from the row's first
            completion token to its last real token), 0.0 at prompt and padding columns, which ms-swift's own fills
            with the model's log-probs of those tokens and its losses mask out with ``completion_mask``. ``entropies``
            alike when ``compute_entropy``, else None.
        """
        reason = self.rows_reason(model_inputs, grpo_batch)
        if self.lockstep is not None and self.lockstep.any(reason is not None) and reason is None:
            reason = "another process falls back (FSDP/ZeRO-3: all processes take the same path)"
        if reason is not None:
            return self._fall_back(
                reason,
                self.original(SINGLE_METHOD),
                (model, model_inputs, grpo_batch),
                {"compute_entropy": compute_entropy},
            )
        input_ids, attention_mask = model_inputs["input_ids"], model_inputs["attention_mask"]
        completion_mask = grpo_batch.completion_mask
        keep = completion_mask.shape[1]
        rows = to_prefix_rows(input_ids, attention_mask, completion_mask)
        grad = torch.is_grad_enabled()
        join = self.lockstep is not None and not grad
        # no-grad scoring may split a process's rows into a number of forwards of its own: join them
        with (
            self.lockstep.forwards(model) if join else contextlib.nullcontext(),
            _non_reentrant_checkpointing(model) if grad else contextlib.nullcontext(),
        ):
            out = compute_logps_concatenated(
                model,
                rows.input_ids,
                rows.attention_mask,
                rows.completion_width,
                temperature=float(self.trainer.temperature),
                return_entropy=bool(compute_entropy),
                backend=self.backend,
            )
        dtype = _logits_dtype(model, input_ids.device)
        length = input_ids.shape[1]
        logps = to_next_token_layout(out.logps, rows, length)[:, -keep:].to(dtype)
        entropies = to_next_token_layout(out.entropy, rows, length)[:, -keep:].to(dtype) if compute_entropy else None

        self.stats.shared_calls += 1
        self.stats.record_batch(rows.input_ids, rows.attention_mask, rows.completion_width)
        role = f"{self._role(model)} ({'grad' if grad else 'no grad'})"
        self.stats.passes[role] = self.stats.passes.get(role, 0) + 1
        if self.self_check and grad not in self._checked:
            self._check(logps, entropies, model, model_inputs, grpo_batch, compute_entropy)
        return logps, entropies

    # -- what is served ----------------------------------------------------------------------------------------------

    def call_reason(self, model, model_inputs) -> str | None:
        """Why ms-swift's own method must serve this call (the trainer's setup, its inputs, the model), or None."""
        template = getattr(self.trainer, "template", None)
        if int(getattr(template, "sequence_parallel_size", 1) or 1) > 1:
            return REASON_SEQUENCE_PARALLEL
        if getattr(template, "padding_free", False):
            return REASON_PADDING_FREE
        if not isinstance(model_inputs, dict):
            return "model_inputs is not a dict"
        others = sorted(k for k, v in model_inputs.items() if k not in _TEXT_INPUTS and v is not None)
        multimodal = [k for k in others if k.startswith(_MULTIMODAL_PREFIXES)]
        if getattr(self.trainer, "is_multimodal", False) or multimodal:
            return f"{REASON_MULTIMODAL} ({', '.join(multimodal) or 'a multimodal model'})"
        if others:
            return f"model inputs the shared path does not take: {', '.join(others)}"
        return self._model_reason(model)

    def _model_reason(self, model) -> str | None:
        if model not in self._models:
            try:
                prepare_model(model)  # once per model: an unsupported one falls back at every call, warned once
                self._models[model] = None
            except UnsupportedModelError as error:
                self._models[model] = f"unsupported model: {error}"
        return self._models[model]

    @staticmethod
    def rows_reason(model_inputs: dict, grpo_batch) -> str | None:
        """Why this micro-batch's rows cannot be served exactly, or None."""
        completion_mask = getattr(grpo_batch, "completion_mask", None)
        keep = getattr(grpo_batch, "logits_to_keep", None)
        if not isinstance(completion_mask, torch.Tensor) or completion_mask.dim() != 2:
            return "rows not servable: grpo_batch.completion_mask is not a 2-D tensor"
        if keep is not None and int(keep) != completion_mask.shape[1]:
            return "rows not servable: completion_mask does not cover the last logits_to_keep columns"
        input_ids, attention_mask = model_inputs.get("input_ids"), model_inputs.get("attention_mask")
        problem = scored_rows_problem(input_ids, attention_mask, completion_mask, score_name="completion_mask")
        if problem is not None:
            return f"rows not servable: {problem}"
        position_ids = model_inputs.get("position_ids")
        if position_ids is not None:
            # the shared path gives each real token its position in its row's run (what left-padding templates pass)
            valid = attention_mask != 0
            expected = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            if position_ids.shape != input_ids.shape or bool((position_ids != expected)[valid].any()):
                return "position_ids other than each token's position in its row (3-D or offset positions)"
        return None

    def _role(self, model) -> str:
        for name in ("ref_model", "teacher_model"):
            if model is not None and model is getattr(self.trainer, name, None):
                return name
        trainer_model = getattr(self.trainer, "model", None)
        wrapped = getattr(self.trainer, "model_wrapped", None)
        if model is trainer_model or model is wrapped or getattr(model, "module", None) is trainer_model:
            return "policy"
        return f"other model ({type(model).__name__})"

    def _fall_back(self, reason: str, method, args, kwargs):
        self.stats.count_fallback(reason)
        self.warn(f"shared_prefix_logps: ms-swift's own log-prob method serves this call: {reason}")
        return method(*args, **kwargs)

    # -- self-check --------------------------------------------------------------------------------------------------

    def _check(self, logps, entropies, model, model_inputs, grpo_batch, compute_entropy) -> None:
        grad = torch.is_grad_enabled()
        what = "logps (grad)" if grad else "logps (no grad)"
        valid = grpo_batch.completion_mask.bool()
        trivial = not bool(valid.any()) or dropout_active(model)  # nothing to compare, or two forwards differ by design
        if self.lockstep is not None:
            trivial = self.lockstep.any(trivial)  # the check's forward is a collective: all check, or none
        if trivial:
            self.stats.count_trivial_check(what)
            return
        # ms-swift's own method adds keys to the dict it is given: give it a copy. Checkpointing is off for the
        # reference forward as in ms-swift's own no-grad passes (a checkpointed layer without grad only warns).
        with torch.no_grad(), _checkpointing_disabled(self.trainer, model):
            reference, reference_entropies = self.original(SINGLE_METHOD)(
                model, dict(model_inputs), grpo_batch, compute_entropy=compute_entropy
            )
        tolerance = tuple(self.self_check_tolerance or default_tolerance(reference.dtype))
        check = compare(
            what,
            logps.float(),
            reference.float(),
            valid,
            tolerance,
            None if entropies is None else entropies.float(),
            None if reference_entropies is None else reference_entropies.float(),
            detail=f"rows {tuple(valid.shape)}",
        )
        if reference.dtype != logps.dtype or reference.shape != logps.shape:
            check.passed = False
            check.detail = f"{check.detail}; ours {logps.dtype} {tuple(logps.shape)}, ms-swift's {reference.dtype} " + (
                f"{tuple(reference.shape)}"
            )
        self.stats.self_checks.append(check)
        self._checked.add(grad)
        logger.info("shared_prefix_logps (ms-swift): %s", self.stats.summary())
        if not check.passed:
            raise SelfCheckError(
                f"shared-prefix {what} differ from ms-swift's GRPOTrainer: max|diff| {check.max_abs:.3e}, mean|diff| "
                f"{check.mean_abs:.3e}, entropy max|diff| {check.max_abs_entropy}, tolerance {check.tolerance} "
                f"{check.detail}; set SHARED_PREFIX_LOGPS_SWIFT=0 (or unpatch_trainer(trainer)) and report the model "
                "and batch"
            )


@contextlib.contextmanager
def _non_reentrant_checkpointing(model):
    """Activation checkpointing of ``model``'s layers run non-reentrant for the block.

    ms-swift replaces ``torch.utils.checkpoint.checkpoint`` with a function that forces its own ``use_reentrant``
    whatever the caller asks (keeping torch's as ``torch.utils.checkpoint._old_checkpoint``), reentrant on one process
    and under DeepSpeed or FSDP. Reentrant checkpointing runs a layer with gradients disabled, so the keys/values a
    prompt hands its completions would carry no gradient (the library refuses that rather than drop it). Non-reentrant
    checkpointing recomputes the same layers, exactly; a layer's recomputation is bound when its forward runs, so
    restoring the functions after the forward is safe although backward runs later.
    """
    from torch.utils import checkpoint as torch_checkpoint

    plain = getattr(torch_checkpoint, "_old_checkpoint", None)  # torch's own, where ms-swift replaced it
    swapped = []
    if plain is not None:
        for module in model.modules():
            func = getattr(module, "_gradient_checkpointing_func", None)
            if isinstance(func, functools.partial) and func.func is torch_checkpoint.checkpoint:
                swapped.append((module, func))
                keywords = {**func.keywords, "use_reentrant": False}
                module._gradient_checkpointing_func = functools.partial(plain, *func.args, **keywords)
    try:
        yield
    finally:
        for module, func in swapped:
            module._gradient_checkpointing_func = func


def _checkpointing_disabled(trainer, model):
    """ms-swift's ``disable_gradient_checkpointing(model, kwargs)`` where this ms-swift has it, else nothing."""
    try:
        from swift.trainers import disable_gradient_checkpointing
    except ImportError:
        return contextlib.nullcontext()
    kwargs = getattr(getattr(trainer, "args", None), "gradient_checkpointing_kwargs", None)
    return disable_gradient_checkpointing(model, kwargs)


def _logits_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype of the logits ms-swift's own forward would produce (its log-probs keep it): the autocast dtype when
    the call runs under autocast, else the output embedding's weight dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    try:
        return unwrap_causal_lm(model).get_output_embeddings().weight.dtype
    except (UnsupportedModelError, AttributeError):
        return torch.float32
