"""Preparing a model for node calls (idempotent, once per model; pass-through for ordinary forwards):

1. routes node calls' attention to :func:`~shared_prefix_logps.forward.attention.shared_prefix_attention`: a registry
   implementation (sdpa, flash, flex_attention, hub kernels) keeps its name and its registry entries are wrapped to
   divert only calls carrying a node context; an eager model is switched to a registered name that encodes "eager"
   and falls back to the model's own eager function without a node context (``installation``);
2. swaps the lm_head's ``forward`` on the instance for a proxy (module hooks of FSDP/ZeRO still fire around it;
   ``forward/head_proxy.py``);
3. wraps a linear-attention hybrid's recurrent layers, so that node calls fork their states (``recurrent/``);
4. checks, per model instance and again whenever the head, its hooks, its PEFT wrapping or the logit settings
   change, that the fused head reproduces the model's own logits (``head_check``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..forward.head_proxy import install_head_proxy
from ..recurrent.served import RecurrentPart, prepare_recurrent
from .compiled import graph_breaks_allowed
from .discovery import HeadSpec, check_supported, head_spec, rope_length_limit, vocab_rows
from .head_check import head_signature, verify_head
from .installation import install_attention

# Attribute of the causal LM holding the head signatures (see _head_signature) that passed the check.
_VERIFIED_ATTRIBUTE = "_shared_prefix_verified_heads"


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for node calls.

    Attributes:
        outer: the module the caller passed (DDP, PEFT, ...): every forward goes through it.
        causal_lm: the transformers ``PreTrainedModel`` with the lm_head.
        head: the head's post-processing.
        input_vocab_size: rows of the input embedding (valid input ids are below it).
        output_vocab_size: rows of the lm_head weight (valid target ids are below it).
        device: device of the input embedding.
        rope_length_limit: longest row (padded prompt + completion width) the model's RoPE serves with fixed
            frequencies, or None when its frequencies never depend on the forward's length.
        recurrent: a linear-attention hybrid's recurrent layers, wrapped so that node calls fork their states
            (``recurrent/``), or None for a model without them.
    """

    outer: nn.Module
    causal_lm: nn.Module
    head: HeadSpec
    input_vocab_size: int
    output_vocab_size: int
    device: torch.device
    rope_length_limit: int | None = None
    recurrent: RecurrentPart | None = None


def prepare_model(model: nn.Module) -> PreparedModel:
    """Check that ``model`` is supported, install the attention function and head proxy, verify the head once.

    Raises:
        UnsupportedModelError: the model type is not supported or its head does not match its logits.
        ValueError: the model's weights are meta tensors (shapes without data).
    """
    causal_lm = check_supported(model)
    embeddings = causal_lm.get_input_embeddings()
    if embeddings.weight.is_meta:
        raise ValueError(
            f"model: {type(causal_lm).__name__}'s weights are meta tensors (shapes without data); load or materialize "
            "them (e.g. model.to_empty(device=...) and initialize, or from_pretrained) before computing log-probs"
        )
    head = head_spec(causal_lm)
    install_attention(causal_lm)
    install_head_proxy(head.lm_head)
    device = embeddings.weight.device
    recurrent = prepare_recurrent(causal_lm, device)
    prepared = PreparedModel(
        outer=model,
        causal_lm=causal_lm,
        head=head,
        input_vocab_size=vocab_rows(embeddings),
        output_vocab_size=vocab_rows(head.lm_head),
        device=device,
        rope_length_limit=rope_length_limit(causal_lm),
        recurrent=recurrent,
    )
    signature = head_signature(prepared)
    verified = causal_lm.__dict__.setdefault(_VERIFIED_ATTRIBUTE, set())
    if signature not in verified:
        with graph_breaks_allowed(model):
            verify_head(prepared)
        verified.add(signature)
    return prepared
