"""Two-process gloo FSDP (FSDP2 ``fully_shard`` and FSDP1) wrapped the way trainers wrap models: each decoder layer,
the input embedding and an untied lm_head their own units, then the root; ``reshard_after_forward=True``; forward
inputs cast by the mixed-precision policy; optionally non-reentrant activation checkpointing and LoRA.

Every call goes through the wrapped model: no-grad ``compute_logps_concatenated``, grad-enabled ``compute_logps``
and ``chunked_backward`` (under FSDP1 also twice, the first under ``no_sync``, as gradient accumulation runs it).
Log-probs are compared with the single-process dense path on each rank's batch, and every parameter's full gradient
with the average of the two ranks' dense gradients (what FSDP's reduce-scatter computes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.distributed import (
    GENERATIONS,
    concatenated,
    decoder_parts,
    free_port,
    full_gradients,
    init_gloo,
    spawn_ranks,
    weighted_loss,
    wrap_fsdp1,
    wrap_fsdp2,
)
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated


def _model(family: str, lora: bool):
    model = build_model(family, tied=False)
    if lora:
        import peft

        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
        model = randomize_lora(peft.get_peft_model(model, config))
    return model


def _batch(rank: int):
    return make_batch(2, GENERATIONS, prompt_len=9, completion_len=5, seed=rank)


def _worker(rank, port, results, engine, family, lora, checkpointing):
    init_gloo(rank, port, timeout_s=120)
    try:
        model = _model(family, lora)
        names = [name for name, param in model.named_parameters() if param.requires_grad]
        if checkpointing:
            decoder_parts(model)[0].gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.train()  # checkpointing only runs in training mode; the tiny models have no dropout
        wrapped = {"fsdp2": wrap_fsdp2, "fsdp1": wrap_fsdp1}[engine](model)
        prompts, pmask, comps, cmask = _batch(rank)
        with torch.no_grad():
            scored = compute_logps_concatenated(wrapped, *concatenated(prompts, pmask, comps, cmask), comps.shape[1])
        out = compute_logps(wrapped, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
        weighted_loss(out).backward()
        grads = full_gradients(engine, wrapped, names)
        wrapped.zero_grad(set_to_none=True)

        def chunked_call():
            return chunked_backward(
                wrapped,
                prompts,
                comps,
                weighted_loss,
                generations_per_chunk=1,
                prompt_mask=pmask,
                completion_mask=cmask,
                return_entropy=True,
            )

        chunked = chunked_call()
        results[rank] = dict(
            scored=scored.logps,
            logps=out.logps.detach(),
            chunked=chunked.logps,
            grads=grads,
            chunked_grads=full_gradients(engine, wrapped, names),
        )
        if engine == "fsdp1":
            # Gradient accumulation as trainers run it: a micro-batch under no_sync (gradients stay unsharded and
            # local), then a synchronizing one that reduce-scatters the sum: twice the one-call gradient.
            wrapped.zero_grad(set_to_none=True)
            with wrapped.no_sync():
                chunked_call()
            chunked_call()
            results[rank] = {**results[rank], "accumulated_grads": full_gradients(engine, wrapped, names)}
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dense_reference(family, lora):
    model = _model(family, lora)
    logps, grads = [], []
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        prompts, pmask, comps, cmask = _batch(rank)
        out = compute_logps(
            model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
        )
        weighted_loss(out).backward()
        logps.append(out.logps.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    averaged = {name: (grads[0][name] + grads[1][name]) / 2 for name in grads[0]}
    return logps, averaged


CASES = [
    pytest.param("fsdp2", "llama", False, False, id="fsdp2-llama"),
    pytest.param("fsdp2", "qwen3", True, True, id="fsdp2-qwen3-lora-checkpointing"),
    pytest.param("fsdp2", "gemma2", False, True, id="fsdp2-gemma2-checkpointing"),
    pytest.param("fsdp1", "mistral", True, False, id="fsdp1-mistral-lora"),
    pytest.param("fsdp1", "gemma2", False, True, id="fsdp1-gemma2-checkpointing"),
]


@pytest.mark.parametrize("engine, family, lora, checkpointing", CASES)
def test_fsdp_matches_dense(engine, family, lora, checkpointing):
    results = mp.Manager().dict()
    spawn_ranks(_worker, (free_port(), results, engine, family, lora, checkpointing))
    dense_logps, dense_grads = _dense_reference(family, lora)
    for rank in range(2):
        got = results[rank]
        for key in ("scored", "logps", "chunked"):
            assert (got[key] - dense_logps[rank]).abs().max() <= 1e-5, (rank, key)
        for key in ("grads", "chunked_grads", "accumulated_grads"):
            if key not in got:  # accumulated_grads: FSDP1 only (see the worker)
                continue
            for name, reference in dense_grads.items():
                reference = 2 * reference if key == "accumulated_grads" else reference
                grad = got[key][name]
                assert grad is not None, (rank, key, name)
                error = (grad - reference).norm().item()
                assert error <= 1e-4 * reference.norm().item() + 1e-8, (rank, key, name, error)
