"""The handle of a patched ``GRPOTrainer``: installing the log-prob method (and, chunked, the training step's two
hooks) on the trainer's instances, and undoing it exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...inputs import as_int
from ...model import prepare_model
from ..common.backends import check_plugin_backend
from ..common.lockstep import Lockstep
from ..common.patching import Unpatched, replace_attribute, restore_attributes
from ..common.self_check import default_tolerance
from ..common.stats import PatchStats, WarnOnce
from .checks import check_aux_loss_supported, check_chunked_supported
from .chunked import ChunkedStep
from .distributed import make_lockstep
from .fp32_head import install_fp32_head, remove_fp32_head
from .logps import LogpsPatch, compute_dtype

MODES = ("logps", "chunked")
_PATCH_ATTRIBUTE = "_shared_prefix_logps_patch"


@dataclass
class GRPOPatch:
    """Handle returned by :func:`patch_grpo_trainer` (also stored on the trainer); ``stats`` shows what it did.

    Attributes:
        trainer: the patched trainer.
        mode: ``"logps"`` or ``"chunked"``.
        self_check: compare the first batch(es) with the unpatched trainer and raise on mismatch.
        backend: completion-attention backend of the shared path (``"auto"``, ``"expand"``, ``"flex"``).
        generations_per_chunk: chunked mode: generations of each prompt per chunk (memory grows with it).
        self_check_tolerance: ``(max_abs, mean_abs)`` bounds on log-prob/entropy differences; None picks them from
            the compute dtype (:func:`~shared_prefix_logps.integrations.common.self_check.default_tolerance`).
        stats: counters and self-check results.
    """

    trainer: object
    mode: str
    self_check: bool
    backend: str
    generations_per_chunk: int
    self_check_tolerance: tuple[float, float] | None
    stats: PatchStats = field(default_factory=PatchStats)
    warn: WarnOnce = field(default_factory=WarnOnce, repr=False)
    # instance attributes the patch replaced, in order: (object, name, what the instance held before)
    replaced: list = field(default_factory=list, repr=False)
    fp32_heads: list = field(default_factory=list, repr=False)
    logps: LogpsPatch | None = field(default=None, repr=False)
    # under FSDP: keeps the processes' model calls in step (see .distributed); None otherwise
    lockstep: Lockstep | None = field(default=None, repr=False)

    def tolerance(self, model) -> tuple[float, float]:
        if self.self_check_tolerance is not None:
            return tuple(self.self_check_tolerance)
        return default_tolerance(compute_dtype(self.trainer, model))


def patch_grpo_trainer(
    trainer,
    *,
    mode: str = "logps",
    self_check: bool = True,
    backend: str = "auto",
    generations_per_chunk: int = 1,
    self_check_tolerance: tuple[float, float] | None = None,
) -> GRPOPatch:
    """Route a TRL ``GRPOTrainer``'s log-prob computation through the shared-prefix path (patches the instance).

    Args:
        trainer: a constructed ``trl.GRPOTrainer`` (not yet trained, or between ``train`` calls).
        mode: ``"logps"``: every ``_get_per_token_logps_and_entropies`` call (policy with gradient, old policy,
            reference model) forwards each distinct prompt once. ``"chunked"``: additionally, each micro-batch's
            forward and backward run in chunks of ``generations_per_chunk`` generations per prompt
            (``chunked_backward``), so activation memory does not grow with the number of generations.
        self_check: compare the first call of each kind (and, chunked, the first micro-batch's log-probs and loss
            gradient) with the unpatched trainer; raise :class:`SelfCheckError` on mismatch. Costs one extra
            TRL forward per kind, once.
        backend: completion-attention backend (``"auto"``: flex on CUDA, expand elsewhere).
        generations_per_chunk: chunked mode only; >= 1.
        self_check_tolerance: override the ``(max_abs, mean_abs)`` bounds of the log-prob comparison.

    Returns:
        The :class:`GRPOPatch` handle (also ``trainer._shared_prefix_logps_patch``).

    Raises:
        UnsupportedModelError: the policy or reference model cannot take the shared path.
        NotImplementedError: the trainer adds the MoE router aux loss (``aux_loss_enabled``) for a model type that
            computes none, or under FSDP/DeepSpeed (either mode); or ``mode="chunked"`` under DeepSpeed, FSDP1
            without ``use_orig_params`` or Megatron, with a LOMO optimizer, or a trainer subclass that overrides
            ``_compute_loss``.
        ValueError / TypeError: bad options, or not a GRPOTrainer, or already patched.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_plugin_backend(backend)
    generations_per_chunk = as_int("generations_per_chunk", generations_per_chunk)
    if generations_per_chunk < 1:
        raise ValueError(f"generations_per_chunk must be >= 1, got {generations_per_chunk}")
    for name in ("_get_per_token_logps_and_entropies", "temperature", "accelerator", "args", "model"):
        if not hasattr(trainer, name):
            raise TypeError(f"expected a trl GRPOTrainer; {type(trainer).__name__} has no {name!r}")
    if getattr(trainer, _PATCH_ATTRIBUTE, None) is not None:
        raise ValueError("this trainer is patched already; call unpatch_grpo_trainer(trainer) first")
    check_aux_loss_supported(trainer)
    if mode == "chunked":
        check_chunked_supported(trainer)

    patch = GRPOPatch(
        trainer=trainer,
        mode=mode,
        self_check=bool(self_check),
        backend=backend,
        generations_per_chunk=generations_per_chunk,
        self_check_tolerance=self_check_tolerance,
        lockstep=make_lockstep(trainer),
    )
    # Prepare the models now (attention function, head proxy, one head check per class): unsupported models fail
    # here, and the float32 head shim needs the proxy in place.
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        prepared = prepare_model(model)
        if getattr(trainer.args, "cast_lm_head_to_fp32", False) and install_fp32_head(prepared.head.lm_head):
            patch.fp32_heads.append(prepared.head.lm_head)

    original = trainer._get_per_token_logps_and_entropies
    patch.logps = LogpsPatch(patch, original)
    replace_attribute(trainer, "_get_per_token_logps_and_entropies", patch.logps, patch.replaced)
    # training_step is never replaced: the trainer's class-level one (whatever it is at call time) runs, and calls
    # the two methods below.
    accelerator = trainer.accelerator
    if mode == "chunked":
        step = ChunkedStep(patch, patch.logps, Unpatched(trainer, "compute_loss"), Unpatched(accelerator, "backward"))
        replace_attribute(trainer, "compute_loss", step.compute_loss, patch.replaced)
        replace_attribute(accelerator, "backward", step.backward, patch.replaced)
    setattr(trainer, _PATCH_ATTRIBUTE, patch)
    return patch


def unpatch_grpo_trainer(trainer) -> None:
    """Undo :func:`patch_grpo_trainer`: the trainer's (and its accelerator's) methods are their own again.

    The models keep the shared-prefix attention function and lm_head proxy (both pass through to the original
    implementations outside a shared-prefix call), so generation and TRL's forwards are unaffected.
    """
    patch = getattr(trainer, _PATCH_ATTRIBUTE, None)
    if patch is None:
        raise ValueError("this trainer is not patched")
    restore_attributes(patch.replaced)
    for lm_head in patch.fp32_heads:
        remove_fp32_head(lm_head)
    delattr(trainer, _PATCH_ATTRIBUTE)
