"""``mode="chunked"``: each TRL micro-batch's forward and backward run through ``chunked_backward``.

What stays TRL's: the training loop (transformers' ``Trainer``: optimizer, LR scheduler, gradient clipping,
``global_step``), ``training_step`` (``GRPOTrainer``'s ``self._step`` bookkeeping and step time, or whatever the
trainer's class holds when it is called: the patch does not replace it), ``_prepare_inputs`` (generation, buffering,
shuffling) and every logged metric. The patch replaces, on the instances and for its lifetime, the two things a
training step calls in between:

- ``trainer.compute_loss``: instead of one graph over the micro-batch, the rows are regrouped by prompt and
  ``chunked_backward`` runs forward+backward chunk by chunk with ``shared_prefix_logps.losses.grpo_loss`` under
  ``micro_batch_counts`` (``.loss``), so that the chunk losses sum to exactly TRL's micro-batch loss (its
  per-micro-batch normalizers, ``/ gradient_accumulation_steps`` included). It returns TRL's own loss value, computed by
  TRL's ``_compute_loss`` on the (detached) log-probs, which also logs every metric once per micro-batch as usual.
  Outside training (evaluation runs it without gradient) it is the trainer's own;
- ``trainer.accelerator.backward``: skipped for that returned (already back-propagated) loss; any other loss is
  back-propagated as usual. Under DDP the gradients are then averaged at the accumulation boundary (``.distributed``).

Under FSDP (FSDP2, or FSDP1 with ``use_orig_params``) the chunked calls go through the sharded model and FSDP
reduce-scatters as usual; the micro-batch then runs as one ``chunked_backward`` call of a shape all processes agree
on, so that they stay in step (``.distributed``).

With the MoE router aux loss (``trainer.aux_loss_enabled``) the loss also holds ``router_aux_loss_coef * aux / GA``,
where ``aux`` is the load-balancing loss of the micro-batch's full rows. It is not a sum over chunks, but given the
routing counts it is linear in the router probabilities (``aux = E * counts . probs / N**2``; the counts, from
top-k, carry no gradient): one no-grad scoring pass (the one that finds the entropy threshold, when there is one)
gives the counts, and each chunk then adds ``(w * probs).sum()`` with ``w = coef * E * counts / (N**2 * GA)``, the
prompt's share through its leaf, so the chunk losses sum to TRL's loss and their gradients to its gradient.

The loss gradient is checked against TRL's own (``self_check``): TRL's ``_compute_loss`` is differentiated with
respect to leaf log-probs/entropies and compared with ``grpo_loss``'s gradient, on the first micro-batch where TRL's
gradient is not exactly zero (a zero gradient, e.g. every advantage 0, would pass whatever the normalizers; such
micro-batches are counted in ``PatchStats.trivial_self_checks``). The chunked log-probs are compared with TRL's on the
first micro-batch with a valid completion token.
"""

from __future__ import annotations

import contextlib

import torch

from ...api import compute_logps_concatenated
from ...moe_router import RouterStats, in_row_order
from ...output import result_zeros
from ...training import chunked_backward
from ..common.ddp import average_gradients, unwrap_ddp
from ..common.modules import AutocastForward, dropout_active
from ..common.patching import instance_attribute
from ..common.rows import layout_problem, padded_groups, regroup_rows
from ..common.self_check import SelfCheckError, compare
from .loss import MicroBatchLoss

# Input keys of multimodal batches; the chunked path only serves text.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def unsupported_reason(trainer, model, inputs) -> str | None:
    """Why this micro-batch cannot take the chunked path (it then runs TRL's own), or None."""
    present = [key for key in _MULTIMODAL_KEYS if inputs.get(key) is not None]
    if present:
        return f"multimodal inputs ({', '.join(present)})"
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"):
        if key not in inputs:
            return f"inputs without {key!r}"
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return layout_problem(input_ids, attention_mask, inputs["completion_ids"].shape[1])


class ChunkedStep:
    """The chunked forward+backward inside the trainer's own training step.

    :meth:`compute_loss` is installed as ``trainer.compute_loss`` and :meth:`backward` as
    ``trainer.accelerator.backward`` (instance attributes, for the patch's lifetime). A training step calls
    ``compute_loss`` then ``accelerator.backward`` on the loss it returned: when ``compute_loss`` ran the chunked
    path (the backward happened inside it), that one backward is skipped.

    Args:
        patch: the ``GRPOPatch`` handle.
        logps_patch: the installed ``LogpsPatch`` (its ``original`` method serves the self-check).
        previous_compute_loss, previous_backward: the methods without the patch (:class:`~..common.patching.Unpatched`),
            for micro-batches the chunked path does not serve.
    """

    def __init__(self, patch, logps_patch, previous_compute_loss, previous_backward):
        self.patch = patch
        self.logps_patch = logps_patch
        self.previous_compute_loss = previous_compute_loss
        self.previous_backward = previous_backward
        self.skip_backward = False
        # the DDP wrapper a grad-enabled call bypassed since the last gradient averaging (see .distributed)
        self.bypassed_ddp = None
        self.checked = False  # the loss-gradient self-check ran (on a micro-batch with a non-zero TRL gradient)
        self.logps_checked = False  # the chunked log-probs were compared with TRL's (on a micro-batch with a token)

    def backward(self, loss, **kwargs):
        """``accelerator.backward``: skipped once after a chunked ``compute_loss`` (it back-propagated already);
        then, under DDP, the gradients are averaged at the accumulation boundary."""
        if self.skip_backward:
            self.skip_backward = False
            result = None
        else:
            result = self.previous_backward(loss, **kwargs)
        self._sync_bypassed_ddp()
        return result

    def _sync_bypassed_ddp(self) -> None:
        """If a grad-enabled call bypassed DDP since the last sync and this micro-batch ends the accumulation
        window, average the gradients now (what DDP's synchronizing backward computes)."""
        ddp = self.bypassed_ddp
        if ddp is not None and self.patch.trainer.accelerator.sync_gradients:
            average_gradients([p for p in ddp.parameters() if p.requires_grad], ddp.process_group)
            self.bypassed_ddp = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        trainer = self.patch.trainer
        # A compute_loss whose backward did not follow (it raised) must not make the next backward skip.
        self.skip_backward = False
        if not torch.is_grad_enabled() or not trainer.model.training:
            # Evaluation (prediction_step): no backward follows; nothing for the chunked path to do.
            return self.previous_compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        reason = "return_outputs=True" if return_outputs else unsupported_reason(trainer, model, inputs)
        lockstep = self.patch.lockstep
        if lockstep is not None and lockstep.any(reason is not None) and reason is None:
            reason = "another process cannot take the chunked path (FSDP: all processes fall back together)"
        if reason is not None:
            self.patch.stats.count_fallback(f"chunked: {reason}", log_prob_call=False)
            self.patch.warn(f"shared_prefix_logps: chunked backward not used for this micro-batch: {reason}")
            return self.previous_compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss = self.forward_backward(model, inputs)
        self.skip_backward = True
        return loss

    def forward_backward(self, model, inputs) -> torch.Tensor:
        """Forward+backward of one micro-batch in chunks; returns TRL's (detached) loss value for logging."""
        trainer, patch = self.patch.trainer, self.patch
        accelerator = trainer.accelerator
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        width = completion_ids.shape[1]
        inner, ddp = unwrap_ddp(model)
        if ddp is not None:  # see .distributed: forward the inner module, average at the accumulation boundary
            self.bypassed_ddp = ddp
        forward_model = AutocastForward(inner, accelerator.autocast)

        entropy_mask, aux_weight = None, None
        need_entropy, need_router = trainer.top_entropy_quantile < 1.0, bool(trainer.aux_loss_enabled)
        if need_entropy or need_router:
            scored = self._scoring_pass(inner, forward_model, inputs, need_entropy, need_router)
            if need_entropy:
                entropy_mask = trainer.get_high_entropy_mask(
                    scored.entropy, loss_mask, 1 - trainer.top_entropy_quantile
                )
            if need_router:
                aux_weight = aux_loss_weight(trainer, scored.router)
        loss_of_rows = MicroBatchLoss(trainer, inputs, loss_mask, entropy_mask)
        logps, entropies, total, router = self._chunked_backward(forward_model, inputs, loss_of_rows, aux_weight)
        aux_loss = None if router is None else router.aux_loss()

        stats = patch.stats
        stats.chunked_steps += 1
        stats.shared_calls += 1
        stats.record_batch(
            torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1), width
        )
        check = patch.self_check and not self.checked
        trl_loss = self.trl_loss(inner, inputs, logps, entropies, loss_of_rows, check, aux_loss)
        discrepancy = abs(float(total) - float(trl_loss)) / max(1.0, abs(float(trl_loss)))
        stats.max_loss_discrepancy = max(stats.max_loss_discrepancy, discrepancy)
        if check and not discrepancy <= 1e-4:
            raise SelfCheckError(
                f"shared_prefix_logps self-check failed: chunk losses sum to {float(total):.8g}, TRL's loss on the "
                f"same log-probs is {float(trl_loss):.8g}"
            )
        valid = completion_mask != 0
        with self._in_step(inner):  # under FSDP every process enters, whether or not it checks now
            if patch.self_check and not self.logps_checked:
                self._check_logps(inner, inputs, logps, entropies, valid, aux_loss)
        return trl_loss.detach()

    def _in_step(self, model):
        """Under FSDP, join the block's no-grad forwards of ``model`` with the other processes' (``.distributed``)."""
        lockstep = self.patch.lockstep
        return contextlib.nullcontext() if lockstep is None else lockstep.forwards(model)

    def _check_logps(self, model, inputs, logps, entropies, valid, aux_loss=None) -> None:
        """Compare the chunked (B, C) log-probs/entropies (and the router aux loss) with TRL's own, once, on a
        micro-batch with a valid token (with none, the comparison would cover nothing and is postponed)."""
        if not bool(valid.any()):
            self.patch.stats.count_trivial_check("chunked logps (no valid token)")
            return
        self.logps_checked = True
        if dropout_active(model):
            self.patch.warn("shared_prefix_logps: self-check of the chunked log-probs skipped: dropout is active")
            return
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        reference = self._original_logps(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, aux_loss is not None
        )
        self.logps_patch.check_result("chunked logps (grad)", logps, entropies, reference, valid, aux_loss=aux_loss)

    def _scoring_pass(self, model, forward_model, inputs, entropy: bool, router: bool):
        """One no-grad scoring pass over the micro-batch, in bounded memory (token budget): the entropies TRL's
        high-entropy mask is taken from (its quantile spans the whole micro-batch and all processes) and the routing
        counts of the aux loss, both needed before the first chunk's loss."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        # (under FSDP the scoring's forwards are joined; TRL's masking gathers over processes, outside the join)
        with torch.no_grad(), self._in_step(model):
            return compute_logps_concatenated(
                forward_model,
                input_ids,
                attention_mask,
                inputs["completion_ids"].shape[1],
                temperature=float(self.patch.trainer.temperature),
                return_entropy=entropy,
                backend=self.patch.backend,
                return_router_stats=router,
            )

    def _chunked_backward(self, forward_model, inputs, loss_of_rows, aux_weight=None):
        """``chunked_backward`` once per group size of the micro-batch.

        ``aux_weight``: (E,) float32 weights of the router probabilities (:func:`aux_loss_weight`), or None without
        the aux loss. Returns the detached (B, C) float32 log-probs and entropies of every row, the float64 sum of the
        chunk losses (before any loss scaling), which equals TRL's micro-batch loss, and the rows' detached
        :class:`RouterStats` (None without the aux loss).
        """
        patch = self.patch
        accelerator = patch.trainer.accelerator
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        scale = 1.0 / accelerator.gradient_accumulation_steps  # 1 under Trainer; accelerate would divide by it
        scaler = getattr(accelerator, "scaler", None)  # fp16: scale every chunk's loss, as accelerate.backward does
        logps = result_zeros(*completion_ids.shape, device=completion_ids.device)
        entropies = torch.zeros_like(logps)
        total = torch.zeros((), dtype=torch.float64, device=completion_ids.device)
        if patch.lockstep is not None:
            if aux_weight is not None:  # refused at patch time (checks.check_aux_loss_supported)
                raise NotImplementedError("the MoE router aux loss under FSDP")
            total = self._padded_chunked_backward(forward_model, inputs, loss_of_rows, logps, entropies, scale, scaler)
            return logps, entropies, total, None
        routed_rows, routed = [], []
        for first_rows, bucket_rows in regroup_rows(prompt_ids, prompt_mask):
            group_size = bucket_rows.numel() // first_rows.numel()

            def loss_fn(chunk_out, local_rows, bucket_rows=bucket_rows):
                nonlocal total
                loss = loss_of_rows(chunk_out.logps, chunk_out.entropy, bucket_rows[local_rows])
                if aux_weight is not None:
                    # This chunk's share of coef * aux / GA, the prompt's part included (through its leaf)
                    loss = loss + (chunk_out.router.probs * aux_weight).sum()
                total = total + loss.detach().double()
                loss = loss * scale
                return scaler.scale(loss) if scaler is not None else loss

            out = chunked_backward(
                forward_model,
                prompt_ids[first_rows],
                completion_ids[bucket_rows],
                loss_fn,
                generations_per_chunk=min(patch.generations_per_chunk, group_size),
                prompt_mask=prompt_mask[first_rows],
                completion_mask=completion_mask[bucket_rows],
                temperature=float(patch.trainer.temperature),
                return_entropy=True,
                backend=patch.backend,
                return_router_stats=aux_weight is not None,
            )
            logps[bucket_rows] = out.logps
            entropies[bucket_rows] = out.entropy
            if out.router is not None:
                routed_rows.append(bucket_rows)
                routed.append(out.router)
            patch.stats.chunked_calls += 1
        router = None
        if routed:
            rows = completion_ids.shape[0]
            router = in_row_order(routed_rows, routed, routed[0].num_experts, rows=rows, device=logps.device)
        return logps, entropies, total, router

    def _padded_chunked_backward(self, forward_model, inputs, loss_of_rows, logps, entropies, scale, scaler):
        """FSDP: the micro-batch as one ``chunked_backward`` call whose shape all processes share
        (:func:`~..common.rows.padded_groups`), so that they forward and back-propagate in step. Writes the real rows'
        log-probs and entropies into ``logps``/``entropies``; returns the float64 sum of the chunk losses."""
        patch = self.patch
        prompts, prompts_mask, completions, completions_mask, slot_rows, generations = padded_groups(
            patch.lockstep,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            inputs["completion_mask"],
        )
        total = torch.zeros((), dtype=torch.float64, device=logps.device)

        def loss_fn(chunk_out, local_rows):
            nonlocal total
            rows = slot_rows[local_rows]
            real = rows >= 0
            # Every row's outputs (padding and placeholder rows included) reach the loss, times zero: each chunk's
            # backward then covers the same parameters and the prompts' keys/values on every process.
            loss = (chunk_out.logps.sum() + chunk_out.entropy.sum()) * 0.0
            if bool(real.any()):
                part = loss_of_rows(chunk_out.logps[real], chunk_out.entropy[real], rows[real])
                total = total + part.detach().double()
                loss = part + loss
            loss = loss * scale
            return scaler.scale(loss) if scaler is not None else loss

        out = chunked_backward(
            forward_model,
            prompts,
            completions,
            loss_fn,
            generations_per_chunk=min(patch.generations_per_chunk, generations),
            prompt_mask=prompts_mask,
            completion_mask=completions_mask,
            temperature=float(patch.trainer.temperature),
            return_entropy=True,
            backend=patch.backend,
        )
        real = slot_rows >= 0
        logps[slot_rows[real]] = out.logps[real]
        entropies[slot_rows[real]] = out.entropy[real]
        patch.stats.chunked_calls += 1
        return total

    def _original_logps(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, aux=False):
        """TRL's own log-probs and entropies (and aux loss, with ``aux``) of the micro-batch (no gradient), for the
        self-check."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        extra = {"compute_aux_loss": True} if aux else {}
        with torch.no_grad():
            return self.logps_patch.original(
                model, input_ids, attention_mask, completion_ids.shape[1], compute_entropy=True, **extra
            )

    def trl_loss(self, model, inputs, logps, entropies, loss_of_rows, check, aux_loss=None) -> torch.Tensor:
        """TRL's ``_compute_loss`` on our (detached) log-probs: its loss value, and every metric logged once.

        ``_get_per_token_logps_and_entropies`` is stubbed to return the given tensors (and the micro-batch's router aux
        loss, which TRL then adds and logs as ``aux_loss``), so no model runs. With
        ``check``, the stubbed tensors are leaves and TRL's gradient with respect to them is compared with
        ``grpo_loss``'s (this checks every argument and normalizer the chunked loss takes from the trainer); the check
        counts as done (``self.checked``) only if TRL's gradient was not exactly zero.
        """
        trainer = self.patch.trainer
        leaf_logps = logps.detach().clone().requires_grad_(check)
        leaf_entropies = entropies.detach().clone().requires_grad_(check)
        result = self.logps_patch.pack(leaf_logps, leaf_entropies, None if aux_loss is None else aux_loss.detach())

        def stub(*args, **kwargs):
            return result

        grad_mode = torch.enable_grad() if check else torch.no_grad()
        with grad_mode, instance_attribute(trainer, "_get_per_token_logps_and_entropies", stub):
            loss = trainer._compute_loss(model, inputs)
        if check:
            aux_term = 0.0 if aux_loss is None else aux_loss_term(trainer, aux_loss)
            self.checked = self._check_loss_gradient(loss, leaf_logps, leaf_entropies, loss_of_rows, aux_term)
        return loss.detach()

    def _check_loss_gradient(self, trl_loss, leaf_logps, leaf_entropies, loss_of_rows, aux_term=0.0) -> bool:
        """Compare ``grpo_loss``'s gradient with TRL's; raise on mismatch. Returns False, comparing nothing, when TRL's
        gradient is exactly zero (no signal: every advantage 0, or every token masked): then any normalizer or clip
        setting would pass, so the check waits for a later micro-batch. ``aux_term``: the chunked loss's router aux
        term (a constant with respect to the log-probs), added to the loss value compared."""
        trl_grads = torch.autograd.grad(trl_loss, [leaf_logps, leaf_entropies], allow_unused=True)
        if not any(grad is not None and bool((grad != 0).any()) for grad in trl_grads):
            self.patch.stats.count_trivial_check("chunked loss gradient (TRL's gradient is zero)")
            return False
        logps = leaf_logps.detach().clone().requires_grad_(True)
        entropies = leaf_entropies.detach().clone().requires_grad_(True)
        rows = torch.arange(logps.shape[0], device=logps.device)
        ours = loss_of_rows(logps, entropies, rows)
        our_grads = torch.autograd.grad(ours, [logps, entropies], allow_unused=True)
        ours, trl_loss = float(ours.detach()) + float(aux_term), float(trl_loss.detach())

        def dense(grad, like):
            return torch.zeros_like(like) if grad is None else grad

        trl_logp_grad, our_logp_grad = dense(trl_grads[0], logps), dense(our_grads[0], logps)
        trl_ent_grad, our_ent_grad = dense(trl_grads[1], logps), dense(our_grads[1], logps)
        scale = max(float(trl_logp_grad.abs().max()), float(trl_ent_grad.abs().max()), 1e-12)
        valid = torch.ones_like(logps, dtype=torch.bool)
        # Relative to the largest gradient entry: both are computed in float32 from the same numbers
        check = compare(
            "chunked loss gradient (relative)",
            our_logp_grad / scale,
            trl_logp_grad / scale,
            valid,
            (1e-4, 1e-5),
            our_ent_grad / scale,
            trl_ent_grad / scale,
            detail=f"loss ours {ours:.8g} vs TRL {trl_loss:.8g}",
        )
        loss_ok = abs(ours - trl_loss) <= 1e-5 * max(1.0, abs(trl_loss))
        check.passed = check.passed and loss_ok
        self.patch.stats.self_checks.append(check)
        if not check.passed:
            raise SelfCheckError(
                "shared_prefix_logps self-check failed: the chunked loss does not reproduce TRL's _compute_loss "
                f"({check.detail}; max relative gradient difference {check.max_abs:.3g}). This TRL version or "
                "trainer subclass computes its loss differently; use mode='logps'."
            )
        return True


def aux_loss_term(trainer, aux_loss: torch.Tensor) -> torch.Tensor:
    """The term TRL's ``_compute_loss`` adds to a training micro-batch's loss: ``coef * aux / GA``."""
    return trainer.router_aux_loss_coef * aux_loss / trainer.current_gradient_accumulation_steps


def aux_loss_weight(trainer, router: RouterStats) -> torch.Tensor:
    """(E,) float32 ``w`` such that ``sum over rows of (w * probs_row).sum()`` is TRL's aux term of the micro-batch
    (:func:`aux_loss_term`), given its rows' routing counts ``router.counts`` (from a no-grad pass): the aux loss is
    ``E * sum_e counts_e * probs_e / N**2`` with N the (MoE layer, real token) pairs, and the counts carry no
    gradient, so the term's value and gradient are those of the linear form."""
    total = router.tokens.sum()
    aux = router.num_experts * router.counts.sum(0) / total**2
    return aux_loss_term(trainer, aux)
