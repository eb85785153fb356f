"""Trainer settings the plug-in refuses at patch time, each with the reason and what to do instead."""

from __future__ import annotations

from .loss import REQUIRED_ARGS, REQUIRED_TRAINER_ATTRIBUTES


def check_no_aux_loss(trainer) -> None:
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


def _fsdp1_orig_params(accelerator) -> bool:
    return bool(getattr(accelerator.state.fsdp_plugin, "use_orig_params", False))


def check_chunked_supported(trainer) -> None:
    """Refuse configurations the chunked step cannot reproduce exactly, with the reason."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and _fsdp_version(accelerator) == 1 and not _fsdp1_orig_params(accelerator):
        # chunked_backward under FSDP1 is tested with use_orig_params=True (tests/test_fsdp.py,
        # tests/test_trl_fsdp.py); the flat-parameter variant is not.
        raise NotImplementedError(
            "mode='chunked' under accelerate's FSDP1 needs use_orig_params=True (fsdp_config={'use_orig_params': "
            "True}); without it, it is untested. Set it, use fsdp_version=2, or mode='logps'."
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
