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
See the module docstrings of ``.logps`` and ``.chunked`` for how.

Distributed: ``mode="logps"`` calls the wrapped model as TRL does; under DDP, DDP reduces the gradients itself. In
``mode="chunked"`` the grad-enabled forwards run the module inside DDP and the gradients are averaged once per
optimizer step, after the backward that ends the accumulation window (``.distributed``). Under accelerate's FSDP both
modes call the sharded model, FSDP gathers and reduce-scatters as usual, and the processes are kept making the same
model calls whatever their rows (``.distributed``); tested with FSDP2 and FSDP1 (``mode="chunked"`` needs
``use_orig_params=True`` under FSDP1). Under DeepSpeed ZeRO-3 ``mode="logps"`` calls the engine as TRL does, with
the same lockstep, whose padding forwards call the submodules the padded forwards call (ZeRO-3 gathers per
submodule); tested. Under ZeRO-0/1/2 ``mode="logps"`` calls the wrapped model as TRL does (untested).
``mode="chunked"`` refuses DeepSpeed, as it refuses Megatron.

Modules: ``patch`` (the handle, patching and undoing), ``checks`` (settings refused at patch time), ``logps`` (the
log-prob method), ``chunked`` (the chunked training step), ``loss`` (TRL's micro-batch loss for chunks),
``distributed`` (DDP and FSDP), ``fp32_head`` (``cast_lm_head_to_fp32``). Trainer-neutral pieces are in
``integrations.common``.
"""

from ..common.self_check import SelfCheck, SelfCheckError
from ..common.stats import PatchStats
from .patch import MODES, GRPOPatch, patch_grpo_trainer, unpatch_grpo_trainer

__all__ = [
    "MODES",
    "GRPOPatch",
    "PatchStats",
    "SelfCheck",
    "SelfCheckError",
    "patch_grpo_trainer",
    "unpatch_grpo_trainer",
]
