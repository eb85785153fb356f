"""One-line plug-in for TRL's ``GRPOTrainer`` (tested with TRL 1.15.0 and 1.16.0).

```python
from shared_prefix_logps.integrations.trl import patch_grpo_trainer

trainer = GRPOTrainer(...)
patch = patch_grpo_trainer(trainer)                    # log-probs: each prompt forwarded once
# patch = patch_grpo_trainer(trainer, mode="chunked")  # ... and a backward whose memory does not grow with G
trainer.train()
print(patch.stats.summary())
```

``mode="logps"`` replaces ``trainer._get_per_token_logps_and_entropies`` on the instance (policy, old-policy and
reference log-probs). ``mode="chunked"`` does that and also runs each micro-batch's forward+backward through
``shared_prefix_logps.chunked_backward`` (it replaces ``trainer.compute_loss`` and ``trainer.accelerator.backward``
on the instances); ``training_step``, optimizer steps, LR schedule, ``global_step`` and logged metrics stay TRL's.
See the module docstrings of ``_trl_logps`` and ``_trl_chunked`` for how.

Distributed: ``mode="logps"`` calls the wrapped model as TRL does; under DDP, DDP reduces the gradients itself. In
``mode="chunked"`` the grad-enabled forwards run the module inside DDP and the gradients are averaged once per
optimizer step, after the backward that ends the accumulation window (``_trl_ddp``). Under accelerate's FSDP both
modes call the sharded model, FSDP gathers and reduce-scatters as usual, and the processes are kept making the same
model calls whatever their rows (``_trl_fsdp``); tested with FSDP2, and ``mode="chunked"`` refuses FSDP1. Under
DeepSpeed ZeRO-3 both modes refuse (its per-module parameter gathers fell out of step between processes and hung);
under ZeRO-0/1/2 ``mode="logps"`` calls the wrapped model as TRL does (untested) and ``mode="chunked"`` refuses it,
as it refuses Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model_support import prepare_model
from ._trl_chunked import REQUIRED_ARGS, REQUIRED_TRAINER_ATTRIBUTES, ChunkedStep
from ._trl_fsdp import Lockstep, make_lockstep
from ._trl_logps import LogpsPatch, compute_dtype
from ._trl_utils import (
    PatchStats,
    SelfCheck,
    SelfCheckError,
    Unpatched,
    WarnOnce,
    default_tolerance,
    install_fp32_head,
    remove_fp32_head,
    replace_attribute,
    restore_attributes,
)

__all__ = ["GRPOPatch", "PatchStats", "SelfCheck", "SelfCheckError", "patch_grpo_trainer", "unpatch_grpo_trainer"]

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
            the compute dtype (:func:`~shared_prefix_logps.integrations._trl_utils.default_tolerance`).
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
    # the DDP wrapper a grad-enabled call bypassed since the last gradient averaging (see _trl_ddp)
    bypassed_ddp: object = field(default=None, repr=False)
    # under FSDP: keeps the processes' model calls in step (see _trl_fsdp); None otherwise
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
        NotImplementedError: the trainer adds the MoE router aux loss (``aux_loss_enabled``; either mode), or
            ``mode="chunked"`` under DeepSpeed, FSDP1 or Megatron, with a LOMO
            optimizer, or a trainer subclass that overrides ``_compute_loss``.
        ValueError / TypeError: bad options, or not a GRPOTrainer, or already patched.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in ("auto", "expand", "flex"):
        raise ValueError(f"backend must be 'auto', 'expand' or 'flex', got {backend!r}")
    if isinstance(generations_per_chunk, bool) or not isinstance(generations_per_chunk, int):
        raise TypeError(f"generations_per_chunk must be an int, got {type(generations_per_chunk).__name__}")
    if generations_per_chunk < 1:
        raise ValueError(f"generations_per_chunk must be >= 1, got {generations_per_chunk}")
    for name in ("_get_per_token_logps_and_entropies", "temperature", "accelerator", "args", "model"):
        if not hasattr(trainer, name):
            raise TypeError(f"expected a trl GRPOTrainer; {type(trainer).__name__} has no {name!r}")
    if getattr(trainer, _PATCH_ATTRIBUTE, None) is not None:
        raise ValueError("this trainer is patched already; call unpatch_grpo_trainer(trainer) first")
    _check_no_aux_loss(trainer)
    _check_not_zero3(trainer)
    if mode == "chunked":
        _check_chunked_supported(trainer)

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


def _check_not_zero3(trainer) -> None:
    """Refuse DeepSpeed ZeRO-3 (either mode): its parameter gathers pair up between processes submodule by
    submodule, and the patched trainer's forwards were seen to gather for different submodules on different processes
    (no lm_head gather in some no-grad forwards), so two CPU processes hung in the first backward. A refusal is better
    than a hang; the core's own calls under ZeRO-3 are tested (tests/test_deepspeed.py)."""
    try:
        from accelerate.utils import DistributedType
    except ImportError:  # pragma: no cover - TRL needs accelerate
        return
    accelerator = trainer.accelerator
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if getattr(plugin, "zero_stage", None) == 3:
        raise NotImplementedError(
            "patch_grpo_trainer does not support DeepSpeed ZeRO-3 yet: the patched trainer's processes can fall out "
            "of step in ZeRO-3's per-module parameter gathers and hang. Use ZeRO-2 or FSDP2, or leave the trainer "
            "unpatched."
        )


def _check_no_aux_loss(trainer) -> None:
    """Refuse a trainer that adds the MoE router load-balancing loss to its loss (TRL's ``aux_loss_enabled``).

    TRL asks for it on every policy forward (``compute_aux_loss=True``). The shared path does not compute it: the
    dense loss counts each prompt token once per completion row and includes each row's last token, which the
    shared forward never processes. Patched anyway, ``logps`` mode would hand every policy call back to TRL's
    full-row forward (sharing nothing where it matters) and ``chunked`` mode would drop the term from the loss.
    """
    if not getattr(trainer, "aux_loss_enabled", False):
        return
    coef = getattr(trainer, "router_aux_loss_coef", None)
    raise NotImplementedError(
        f"this GRPOTrainer adds the MoE router aux loss (router_aux_loss_coef={coef}, taken from GRPOConfig or the "
        "model config, which has output_router_logits), and the shared-prefix path does not compute it. Set "
        "GRPOConfig(router_aux_loss_coef=0.0) to train without it, or leave the trainer unpatched."
    )


def _fsdp_version(accelerator) -> int | None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) if plugin is not None else None


def _check_chunked_supported(trainer) -> None:
    """Refuse configurations the chunked step cannot reproduce exactly, with the reason."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and _fsdp_version(accelerator) != 2:
        raise NotImplementedError(
            "mode='chunked' supports accelerate's FSDP2 (fsdp_version=2) only; FSDP1 is untested with several "
            "backward calls per micro-batch. Use fsdp_version=2, or mode='logps'."
        )
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"mode='chunked' does not support {kind}: its engine steps or reduces per backward call, and chunked "
            "backward calls backward several times per micro-batch. Use mode='logps'."
        )
    missing = [name for name in REQUIRED_TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
    missing += [f"args.{name}" for name in REQUIRED_ARGS if not hasattr(trainer.args, name)]
    if missing:
        raise NotImplementedError(
            f"mode='chunked' reproduces TRL 1.15/1.16's GRPO loss; this trainer lacks {', '.join(missing)}. "
            "Use mode='logps'."
        )
    if "lomo" in str(getattr(trainer.args, "optim", "")).lower():
        raise NotImplementedError("mode='chunked' does not support LOMO optimizers (they step inside backward)")
    try:
        from trl import GRPOTrainer
    except ImportError:  # pragma: no cover - the trainer came from somewhere
        GRPOTrainer = None
    if GRPOTrainer is not None and isinstance(trainer, GRPOTrainer):
        if type(trainer)._compute_loss is not GRPOTrainer._compute_loss:
            raise NotImplementedError(
                f"{type(trainer).__name__} overrides _compute_loss; mode='chunked' reproduces GRPOTrainer's loss "
                "only. Use mode='logps'."
            )
