"""Competitor methods for the benchmark, each driven the way its own project drives it.

- ``prefix_grouper``: PrefixGrouper 0.0.1 (PyPI ``prefix-grouper``), as verl's ``prefix_grouper_utils`` uses it:
  one packed row ``[P; R1 .. RG]`` per prompt (``concat_input``), positions restarting at the prompt length for
  every response, PrefixGrouper's attention (registered with transformers' ``AttentionInterface``; per layer the
  prefix's keys/values are repeated for each response), the model's full logits, ``split_output(...,
  include_prefix_last=1)``, then a float32 log-softmax and gather.
- ``liger``: Liger-Kernel (PyPI ``liger-kernel``), as its fused linear GRPO loss computes log-probs: full
  ``[prompt | completion]`` rows through the decoder only, then Liger's chunked selective log-prob
  (``LigerFusedLinearPPOBase.chunk_forward``: sequence x vocabulary chunks, logits recomputed in backward) on the
  completion positions' hidden states and the lm_head weight. The GRPO loss itself returns only a loss; this is the
  piece of it that yields per-token log-probs. It is plain PyTorch, so it runs on CPU too.

Both steps return (rows, C) float32 log-probs with 0 where the completion is padded, and with ``train`` run a
backward of their sum.
"""

from __future__ import annotations

import sys

import torch

from ..model import unwrap_causal_lm

#: Name of PrefixGrouper's attention function in transformers' ``AttentionInterface`` (set by its registration).
PG_ATTENTION_NAME = "prefix_grouper_attention"
#: Our adapter that PrefixGrouper calls for its prefix and suffix attentions (``prefix_grouper_attn_func``). Kept
#: free of "sdpa"/"flash"/"flex_attention": transformers switches code paths on those substrings.
PG_INNER_NAME = "spl_bench_pg_inner"
_PG_BASE_KWARG = "spl_bench_pg_base"


def prefix_grouper_available() -> bool:
    """Whether PrefixGrouper and its transformers attention registration import here."""
    try:
        import prefix_grouper  # noqa: F401
        from prefix_grouper.utils.register_transformers import register_attention  # noqa: F401
    except ImportError:
        return False
    return True


def liger_available() -> bool:
    """Whether Liger-Kernel's fused-linear PPO loss imports here."""
    try:
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- PrefixGrouper


def _base_attention(module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _pg_inner_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """PrefixGrouper's ``attn_func`` for sdpa/eager models.

    PrefixGrouper hands its attention function a 2-D key padding mask, as flash-attention's varlen path takes it:
    keys are ``[left-padded prefix | right-padded suffix]`` (or the prefix alone), the queries are the last
    ``q_len`` key slots, and causality counts valid tokens only. sdpa and eager need that spelled out as a
    (batch, 1, q_len, k_len) mask; sliding windows are applied on the same token positions.
    """
    base = kwargs.pop(_PG_BASE_KWARG)
    kwargs.pop("is_causal", None)
    window = kwargs.pop("sliding_window", None)
    key_valid = attention_mask.to(device=query.device, dtype=torch.bool)
    q_len = query.shape[2]
    key_pos = key_valid.long().cumsum(1) - 1
    query_pos = key_pos[:, -q_len:]
    query_valid = key_valid[:, -q_len:]
    mask = key_valid[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
    if window is not None:
        mask = mask & ((query_pos[:, :, None] - key_pos[:, None, :]) < window)
    # Padded query slots are dropped by PrefixGrouper afterwards; let them see every key so no row is empty
    # (an all-masked softmax row is NaN and would poison the keys' gradients).
    mask = (mask | ~query_valid[:, :, None])[:, None]
    if base == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    elif base != "sdpa":
        raise NotImplementedError(f"the prefix_grouper bench method wraps sdpa or eager attention, not {base!r}")
    return _base_attention(module, base)(module, query, key, value, mask, *args, **kwargs)


_PG_REGISTERED = False


def _register_prefix_grouper() -> None:
    global _PG_REGISTERED
    if _PG_REGISTERED:
        return
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(PG_INNER_NAME, _pg_inner_attention)
    _PG_REGISTERED = True


def _base_implementation(config) -> str:
    """The sdpa/eager implementation behind the model's current one (ours falls back to the original)."""
    from ..forward import attention

    current = config._attn_implementation or "eager"
    if attention.is_shared_prefix_name(current):
        return attention.original_implementation_name(config)
    return current


def prefix_grouper_step(model, batch, train):
    """PrefixGrouper: packed ``[P; R1..RG]`` rows, its attention wrapper, full logits, ``split_output``."""
    from prefix_grouper import PrefixGrouper

    _register_prefix_grouper()
    causal_lm = unwrap_causal_lm(model)
    previous = causal_lm.config._attn_implementation
    base = _base_implementation(causal_lm.config)
    g = batch.generations
    c = batch.completions.shape[1]
    device = batch.prompts.device
    grouper = PrefixGrouper.from_ungrouped_masks(
        prefix_mask=batch.prompt_mask, suffix_mask=batch.completion_mask, group_sizes=g, device=device
    )
    input_ids = grouper.concat_input(batch.prompts, batch.prompt_mask, batch.completions, batch.completion_mask)
    # Prompt tokens at 0..Lp-1, every response restarting at Lp (verl's build_position_ids_for_prefix_grouper),
    # packed by the same index maps as the ids.
    prompt_lengths = batch.prompt_mask.sum(1)
    prompt_positions = (batch.prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    completion_positions = prompt_lengths.repeat_interleave(g)[:, None] + torch.arange(c, device=device)
    position_ids = grouper.concat_input(
        prompt_positions, batch.prompt_mask, completion_positions, batch.completion_mask
    )
    causal_lm.set_attn_implementation(PG_ATTENTION_NAME)
    try:
        with torch.set_grad_enabled(train):
            logits = model(
                input_ids=input_ids,
                attention_mask=grouper.padding_mask,
                position_ids=position_ids,
                use_cache=False,
                prefix_grouper=grouper,
                prefix_grouper_attn_func=PG_INNER_NAME,
                **{_PG_BASE_KWARG: base},
            ).logits
            _, _, suffix_logits, suffix_mask = grouper.split_output(logits, include_prefix_last=1)
            # split_output lays the suffixes out right-padded, as the completions already are.
            targets = grouper.convert_padding(batch.completions, batch.completion_mask, padding_mode="right")
            log_probs = torch.log_softmax(suffix_logits[:, :-1].float(), dim=-1)
            logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            logps = logps.masked_fill(~suffix_mask[:, 1:].to(torch.bool), 0.0)
            logps = torch.nn.functional.pad(logps, (0, c - logps.shape[1]))
            if train:
                # Backward while PrefixGrouper's attention is selected (checkpointed layers would recompute it).
                logps.sum().backward()
    finally:
        causal_lm.set_attn_implementation(previous)
    return logps.detach()


# ------------------------------------------------------------------------------------------------------------ Liger


def liger_step(model, batch, train):
    """Liger: full rows through the decoder, Liger's chunked selective log-prob on the completion positions."""
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    causal_lm = unwrap_causal_lm(model)
    config = causal_lm.config
    post = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    if any(getattr(config, name, None) is not None for name in post):
        raise NotImplementedError(
            "Liger's selective log-prob applies no final logit softcapping/scale; it would compute other numbers"
        )
    lm_head = causal_lm.get_output_embeddings()
    ids, mask = batch.rows()
    c = batch.completions.shape[1]
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.set_grad_enabled(train):
        hidden = causal_lm.get_decoder()(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        # As TRL's Liger path: drop the last position, keep the C that predict the completion tokens.
        hidden = hidden[:, -c - 1 : -1]
        logps = LigerFusedLinearPPOBase.chunk_forward(
            hidden, lm_head.weight, batch.completions, bias=lm_head.bias, temperature=1.0
        )
        logps = logps.float().masked_fill(~batch.completion_mask, 0.0)
        if train:
            logps.sum().backward()
    return logps.detach()


#: name -> (step, available, PyPI requirement it needs).
COMPETITORS = {
    "prefix_grouper": (prefix_grouper_step, prefix_grouper_available, "prefix-grouper"),
    "liger": (liger_step, liger_available, "liger-kernel"),
}
