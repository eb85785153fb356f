"""ms-swift ``--external_plugins`` file of the ms-swift plug-in's command-line tests (``swift rlhf`` in processes of its
own): records what each rank's trainer computed and saves it, after training, to ``rank<RANK>.pt`` in the folder named
by ``SHARED_PREFIX_LOGPS_SWIFT_TEST_RECORD``: the log-prob calls (grad mode, rows, completion mask, log-probs), the
losses, the gradients before the first optimizer step, the trained parameters, the plug-in's stats (or None), and how
the trainer is distributed."""

import dataclasses
import os

import torch
from swift.pipelines.train.sft import SwiftSft
from transformers import TrainerCallback

_train = SwiftSft.train


def _train_and_record(self, trainer):
    record = {"calls": [], "losses": [], "first_grads": {}}
    logps_method = trainer._get_per_token_logps_and_entropies
    step_method = trainer.training_step

    def logps(model, model_inputs, grpo_batch, *args, **kwargs):
        out = logps_method(model, model_inputs, grpo_batch, *args, **kwargs)
        record["calls"].append(
            {
                "grad": torch.is_grad_enabled(),
                "model": type(model).__name__,
                "input_ids": model_inputs["input_ids"].detach().clone(),
                "completion_mask": grpo_batch.completion_mask.detach().clone(),
                "logps": out[0].detach().clone(),
            }
        )
        return out

    def training_step(*args, **kwargs):
        loss = step_method(*args, **kwargs)
        record["losses"].append(float(loss))
        return loss

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not record["first_grads"]:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                record["first_grads"] = grads

    trainer._get_per_token_logps_and_entropies = logps
    trainer.training_step = training_step
    trainer.add_callback(FirstGradients())
    result = _train(self, trainer)

    from shared_prefix_logps.integrations.swift import get_patch

    patch = get_patch(trainer)
    record["stats"] = None if patch is None else dataclasses.asdict(patch.stats)
    record["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    record["distributed_type"] = str(trainer.accelerator.distributed_type)
    record["num_processes"] = trainer.accelerator.num_processes
    folder = os.environ["SHARED_PREFIX_LOGPS_SWIFT_TEST_RECORD"]
    torch.save(record, os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.pt"))
    return result


SwiftSft.train = _train_and_record
