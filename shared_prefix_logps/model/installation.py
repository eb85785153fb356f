"""Installing the shared-prefix attention on a model: the registry entries transformers calls from every attention
layer (and the mask builders beside them), and non-reentrant activation checkpointing during node calls. All of it
passes through to the model's own implementation outside a node call."""

from __future__ import annotations

import functools

from torch import nn

from ..errors import UnsupportedModelError
from ..forward import attention


def install_attention(causal_lm) -> None:
    """Route ``causal_lm``'s attention through the library's registry entries: calls with a node context take the
    shared-prefix path, every other call the model's own implementation (its name kept, or an eager model switched
    to a name that encodes ``eager``).

    Raises:
        UnsupportedModelError: for models that do not route attention through ``AttentionInterface``, ``sdpa`` with
            an attention softcap, or an implementation that is not a registry entry.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = causal_lm.config
    current = config._attn_implementation
    if attention.is_shared_prefix_name(current):
        # Prepared before (or deep-copied from a prepared model): the name carries the original; make sure it is
        # registered in this process too.
        attention.register(current)
        return
    if hasattr(causal_lm, "_can_set_attn_implementation") and not causal_lm._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} does not route attention through transformers' AttentionInterface"
        )
    if current == "sdpa" and getattr(config, "attn_logit_softcapping", None) is not None:
        # transformers' sdpa path cannot softcap attention scores: older versions drop the softcap silently (the
        # model's own dense numbers are then not the model's math), newer ones raise.
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} has attn_logit_softcapping but runs attn_implementation='sdpa', which does "
            "not apply it; load the model with attn_implementation='eager'"
        )
    if current in (None, "eager"):
        # Modeling files call their own eager function without consulting the registry, so the model is switched
        # to a name that encodes "eager" (see attention.implementation_name).
        attention.register_eager_name()
        causal_lm.set_attn_implementation(attention.implementation_name("eager"))
        return
    if not isinstance(current, str) or current.startswith("paged|") or current not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} uses attn_implementation={current!r}, which is not an entry of transformers' "
            "AttentionInterface the shared-prefix path can intercept"
        )
    # Any other implementation (sdpa, flash_attention_2/3/4, flex_attention, hub kernels) keeps its name: its
    # registry entries are wrapped so that only calls carrying a node context take the shared-prefix path.
    AttentionInterface.register(current, attention.intercepting(ALL_ATTENTION_FUNCTIONS[current]))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(current, _intercepting_mask(ALL_MASK_ATTENTION_FUNCTIONS[current]))


def _intercepting_mask(original):
    """The mask builder of an intercepted implementation: none inside a node call (the shared-prefix attention builds
    its own masks from the call's context, so no rows x keys tensor is made), ``original`` otherwise."""
    if getattr(original, "_shared_prefix_original", None) is not None:
        return original

    def build(*args, **kwargs):
        return None if attention.in_node_call() else original(*args, **kwargs)

    build._shared_prefix_original = original
    return build


def force_non_reentrant_checkpointing(causal_lm: nn.Module):
    """Context manager: run reentrant activation checkpointing of transformers layers as non-reentrant.

    Reentrant checkpointing runs layers with gradients disabled, so the captured prompt keys/values would carry no
    gradient. The non-reentrant variant recomputes the same layers exactly; its recomputation is bound at forward
    time, so restoring the original function afterwards is safe even though backward runs later.
    """
    return _SwappedCheckpointing(causal_lm)


class _SwappedCheckpointing:
    def __init__(self, causal_lm):
        self.causal_lm = causal_lm
        self.swapped = []

    def __enter__(self):
        from torch.utils.checkpoint import checkpoint

        for module in self.causal_lm.modules():
            func = getattr(module, "_gradient_checkpointing_func", None)
            if not getattr(module, "gradient_checkpointing", False) or func is None:
                continue
            if isinstance(func, functools.partial) and func.func is checkpoint and func.keywords.get("use_reentrant"):
                keywords = {**func.keywords, "use_reentrant": False}
                self.swapped.append((module, func))
                module._gradient_checkpointing_func = functools.partial(checkpoint, *func.args, **keywords)
        return self

    def __exit__(self, *exc):
        for module, func in self.swapped:
            module._gradient_checkpointing_func = func
        return False
