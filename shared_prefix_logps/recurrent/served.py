"""The recurrent part of a model the node calls serve: its wrapped recurrent layers, and whether a one-token node may
hand its end state on under gradients."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedModelError
from .call import install
from .families import check_served, family_verdict, recurrent_layers


@dataclass(frozen=True)
class RecurrentPart:
    """A served hybrid's recurrent layers, wrapped (:func:`~.call.install`) so that node calls fork their states.

    Attributes:
        model_type: the family's ``model_type`` (:mod:`.families`).
        layers: the recurrent layers, in module order.
        one_token_backward: whether a one-token node that starts from a state may keep its end state under
            gradients. Such a node takes the layer's one-token decode path (:func:`~.layer.run_from_states`), which
            back-propagates into its start state only where the family's verdict says so for transformers' torch
            fallbacks (``one_token``) and the model runs on the CPU, where those fallbacks are the kernels. Elsewhere
            (flash-linear-attention's ``fused_recurrent`` kernel has no backward) the plan merges such nodes into
            their children instead (``engine/merge.py``).
    """

    model_type: str
    layers: tuple[nn.Module, ...]
    one_token_backward: bool


def prepare_recurrent(causal_lm: nn.Module, device) -> RecurrentPart | None:
    """The recurrent part of ``causal_lm`` (on ``device``), its layers wrapped (idempotent); None for a model without
    recurrent layers.

    Raises:
        UnsupportedModelError: the family's states cannot be forked (or not with the installed transformers), naming
            the model type and the reason (:func:`~.families.check_served`); or every layer of the model is
            recurrent (:func:`_check_attention_layer`).
    """
    verdict = check_served(causal_lm)
    if verdict is None:
        return None
    model_type, _ = family_verdict(causal_lm.config)
    layers = tuple(recurrent_layers(causal_lm, verdict))
    _check_attention_layer(causal_lm, model_type, layers)
    install(list(layers))
    one_token = verdict.one_token is True and getattr(device, "type", str(device)) == "cpu"
    return RecurrentPart(model_type=model_type, layers=layers, one_token_backward=one_token)


def _check_attention_layer(causal_lm: nn.Module, model_type: str, layers: tuple[nn.Module, ...]) -> None:
    """Refuse a hybrid whose layers are all recurrent, before any forward.

    A node call hands its descendants its attention layers' keys/values (and the recurrent layers' end states), and
    a forward that ran no attention layer through the shared-prefix path is taken for a model whose attention
    bypasses it (``engine/calls.py`` raises after the forward). A config of a served family whose ``layer_types``
    are all linear attention has no attention layer: not served (no model-level exactness test), refused here with
    its layer pattern rather than after a forward."""
    config = causal_lm.config.get_text_config() if hasattr(causal_lm.config, "get_text_config") else causal_lm.config
    decoder_layers = getattr(config, "num_hidden_layers", None)
    if decoder_layers is None or len(layers) < decoder_layers:
        return
    pattern = getattr(config, "layer_types", None) or [type(layers[0]).__name__] * len(layers)
    raise UnsupportedModelError(
        f"model type {model_type!r} ({type(causal_lm).__name__}) has no full-attention layer: its layer pattern is "
        f"{list(pattern)} (all {len(layers)} layers {type(layers[0]).__name__}); shared-prefix log-probs serve "
        "hybrids whose layers include full attention (a 'full_attention' entry in layer_types)"
    )
