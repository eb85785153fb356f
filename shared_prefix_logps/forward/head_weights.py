"""The weight and bias an lm_head actually multiplies by, so the fused head computes what the module computes.

A plain ``nn.Linear`` head is its ``weight`` and ``bias``. PEFT wraps heads (LoRA with ``lm_head`` among the target
modules, ``trainable_token_indices`` on tied embeddings, ``modules_to_save``): its forward then adds a low-rank delta
or swaps rows, and reading ``.weight`` alone would silently drop the adapter (and its gradient). Each supported
wrapper is resolved to an effective ``(weight, bias)`` built differentiably from the parameters its forward uses;
any other head type is refused, never guessed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError


class UnsupportedHeadError(UnsupportedModelError):
    """The lm_head's forward does something the fused head cannot reproduce."""


def effective_head(lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (V, H), bias (V,) or None)`` such that ``lm_head(x) == x @ weight.T + bias``.

    Must be called inside the model's forward (sharded wrappers gather parameters only there). The result is built
    from the parameters with differentiable ops, so gradients reach adapters exactly as through the module.

    Raises:
        UnsupportedHeadError: naming the head type or PEFT option that cannot be fused.
    """
    kind = _peft_kind(lm_head)
    if kind == "lora":
        return _lora_head(lm_head)
    if kind == "trainable_tokens":
        return _trainable_tokens_head(lm_head)
    if kind == "wrapper":
        return effective_head(_wrapped_module(lm_head))
    if isinstance(lm_head, nn.Linear) and type(lm_head).forward is nn.Linear.forward:
        return lm_head.weight, lm_head.bias
    raise UnsupportedHeadError(
        f"the lm_head is a {type(lm_head).__name__} whose forward is not nn.Linear's; the fused head cannot tell "
        "what it computes"
    )


def head_state(lm_head: nn.Module) -> tuple:
    """Hashable summary of everything that changes what :func:`effective_head` returns (adapters switched on or
    off, merged, the module tree under the head); a change means the head must be checked again."""
    state = [type(lm_head), lm_head.training]
    for module in lm_head.modules():
        for name in ("merged", "disable_adapters", "_disable_adapters"):
            value = getattr(module, name, None)
            if isinstance(value, bool):
                state.append((id(module), name, value))
        active = getattr(module, "active_adapters", None)
        if isinstance(active, (list, tuple)):
            state.append((id(module), tuple(active)))
    state.extend((name, id(param)) for name, param in lm_head.named_parameters())
    return tuple(state)


def _peft_kind(module: nn.Module) -> str | None:
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return None
    if isinstance(module, LoraLinear):
        return "lora"
    if isinstance(module, TrainableTokensLayer):
        return "trainable_tokens"
    if isinstance(module, AuxiliaryTrainingWrapper):
        return "wrapper"
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(module, BaseTunerLayer):
        raise UnsupportedHeadError(
            f"the lm_head is wrapped by PEFT's {type(module).__name__}; only LoRA (without DoRA or other variants), "
            "trainable tokens and modules_to_save heads can be fused"
        )
    return None


def _wrapped_module(wrapper: nn.Module) -> nn.Module:
    """The module a PEFT ``modules_to_save`` / trainable-tokens wrapper forwards to, with its adapters as they are."""
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    if isinstance(wrapper, TrainableTokensWrapper):
        return wrapper.token_adapter  # it handles disabled adapters itself, as the wrapper's forward relies on
    if isinstance(wrapper, ModulesToSaveWrapper):
        active = list(wrapper.active_adapters)
        if wrapper.disable_adapters or not active or any(name not in wrapper._adapters for name in active):
            return wrapper.original_module
        return wrapper.modules_to_save[active[0]]
    raise UnsupportedHeadError(f"the lm_head is wrapped by PEFT's {type(wrapper).__name__}, which cannot be fused")


def _lora_head(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LoRA ``Linear``: ``base(x) + sum_a scaling_a * B_a(A_a(dropout_a(x)))`` as one weight and bias."""
    weight, bias = effective_head(layer.base_layer)
    if layer.disable_adapters or layer.merged:
        # Disabled: the base layer alone (PEFT unmerges first). Merged: the deltas already sit in the base weight.
        if layer.merged and layer.disable_adapters:
            layer.unmerge()
        return weight, bias
    if getattr(layer, "fan_in_fan_out", False):
        raise UnsupportedHeadError("a LoRA lm_head with fan_in_fan_out=True cannot be fused")
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}):
            raise UnsupportedHeadError(
                f"the LoRA lm_head uses a variant ({type(layer.lora_variant[name]).__name__}, e.g. DoRA) that the "
                "fused head does not reproduce"
            )
        dropout = layer.lora_dropout[name]
        if layer.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise UnsupportedHeadError(
                f"the LoRA lm_head has lora_dropout={dropout.p} in training mode: dropout on the head's input cannot "
                "be folded into a weight; use lora_dropout=0 for lm_head or leave lm_head out of target_modules"
            )
        lora_a, lora_b, scaling = layer.lora_A[name], layer.lora_B[name], layer.scaling[name]
        delta = (lora_b.weight @ lora_a.weight) * scaling
        weight = weight + delta.to(weight.dtype)
        if lora_a.bias is not None:
            raise UnsupportedHeadError("a LoRA lm_head whose lora_A has a bias cannot be fused")
        if lora_b.bias is not None:
            extra = (lora_b.bias * scaling).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return weight, bias


def _trainable_tokens_head(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PEFT trainable tokens on a tied head: the base weight with the trained rows swapped in, no bias (as its
    forward calls ``F.linear(x, W)``)."""
    base = layer.base_layer
    active = list(layer.active_adapters)
    if layer.disable_adapters or not active or layer.merged:
        return effective_head(base)
    if not isinstance(base, nn.Linear):
        raise UnsupportedHeadError(f"trainable tokens over a {type(base).__name__} lm_head cannot be fused")
    return layer.get_merged_weights(active), None
