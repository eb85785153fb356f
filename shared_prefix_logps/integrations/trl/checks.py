"""Trainer settings the plug-in refuses at patch time, each with the reason and what to do instead."""

from __future__ import annotations

from .loss import REQUIRED_ARGS, REQUIRED_TRAINER_ATTRIBUTES


def check_aux_loss_supported(trainer) -> None:
    """Refuse a trainer that adds the MoE router load-balancing loss (TRL's ``aux_loss_enabled``) where the plug-in
    cannot reproduce it exactly; allow it otherwise (both modes compute it from the shared forward).

    Refused: a policy whose model type computes no aux loss (GLM4-MoE and DeepSeek-V3 return router logits but no
    ``aux_loss``; TRL 1.16's own fused forward fails on them too, reading ``num_experts`` from a config that has
    none), and FSDP or DeepSpeed, whose lockstep and engine paths the aux term has not been brought through or
    tested.
    """
    if not getattr(trainer, "aux_loss_enabled", False):
        return
    from accelerate.utils import DistributedType

    from ...model import unwrap_causal_lm
    from ...moe_router import AUX_LOSS_MODEL_TYPES

    coef = getattr(trainer, "router_aux_loss_coef", None)
    model_type = getattr(unwrap_causal_lm(trainer.model).config, "model_type", None)
    if model_type not in AUX_LOSS_MODEL_TYPES:
        raise NotImplementedError(
            f"this GRPOTrainer adds the MoE router aux loss (router_aux_loss_coef={coef}), but model type "
            f"{model_type!r} computes none (its forward returns no aux_loss, and TRL's unpatched trainer fails on it "
            f"too). The plug-in reproduces it for {', '.join(sorted(AUX_LOSS_MODEL_TYPES))}. Set "
            "GRPOConfig(router_aux_loss_coef=0.0) to train without it."
        )
    kind = trainer.accelerator.distributed_type
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"the MoE router aux loss (router_aux_loss_coef={coef}) is reproduced single-process and under DDP only, "
            f"not under {kind}. Set GRPOConfig(router_aux_loss_coef=0.0) to train without it, or leave the trainer "
            "unpatched."
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
        # chunked_backward under FSDP1 is tested with use_orig_params=True (tests/distributed/test_fsdp.py,
        # tests/integrations/trl/test_trl_fsdp.py); the flat-parameter variant is not.
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
