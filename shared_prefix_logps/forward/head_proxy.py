"""The lm_head proxy: installed as the head's ``forward`` on the instance, it runs inside the model's forward and
computes the fused log-probs during Phase 2 (no logits), nothing during Phase 1, the module's own logits otherwise.
Module hooks of FSDP/ZeRO fire around it as around the original forward."""

from __future__ import annotations

import types

import torch
from torch import nn

from ..model.head_weights import effective_head
from ..tree.context import TreeContext
from .context import CaptureContext, HeadCheckContext, SharedContext, active_context
from .routing import RouteBox, attach

#: Rows of completion tokens per chunk of the fused head; None lets the head size chunks from its memory budget.
HEAD_CHUNK_ROWS: int | None = None


def install_head_proxy(lm_head: nn.Module) -> None:
    if getattr(lm_head, "_shared_prefix_original_forward", None) is not None:
        return
    lm_head._shared_prefix_original_forward = lm_head.forward
    lm_head.forward = types.MethodType(_lm_head_proxy_forward, lm_head)


def _lm_head_proxy_forward(self, hidden_states, *args, **kwargs):
    """lm_head forward inside the model's forward: full logits normally, fused log-probs inside Phase 2."""
    context = active_context()
    if context is None:
        return self._shared_prefix_original_forward(hidden_states, *args, **kwargs)
    if isinstance(context, HeadCheckContext):
        logits = self._shared_prefix_original_forward(hidden_states, *args, **kwargs)
        context.calls += 1
        with torch.no_grad():
            context.fused_logits = fused_logits(self, context.spec, hidden_states)
        return logits
    # Neither phase returns logits: the model gets a tensor of the right rank with an empty vocabulary axis, for any
    # post-processing it applies. It is a view of the hidden states, so gradient reaching the model's output flows
    # on into the model (wrappers' backward hooks fire on the way), and DDP's unused-parameter search walks it.
    if isinstance(context, CaptureContext):
        return hidden_states[..., :0]
    if isinstance(context, TreeContext):
        # Packed node tokens: a hidden state may predict several targets (a node's last token, one per child).
        hidden = hidden_states.flatten(0, -2)[context.head_index]
    elif isinstance(context, SharedContext):
        hidden = hidden_states[context.query_valid]
    else:
        raise TypeError(f"unexpected phase context {type(context).__name__}")
    from ..kernels.fused_head import linear_logps

    spec = context.head_spec
    if spec.scale != 1.0:
        hidden = hidden * spec.scale
    weight, bias = effective_head(self)
    results = linear_logps(
        hidden,
        weight,
        context.head_targets,
        bias=bias,
        temperature=context.temperature,
        softcap=spec.softcap,
        return_entropy=context.return_entropy,
        chunk_size=HEAD_CHUNK_ROWS,
    )
    results = results if context.return_entropy else (results,)
    context.route = RouteBox()
    # The log-probs leave on the head's output (and so on the model's), where wrappers see their gradient arrive.
    return attach(hidden_states[..., :0], context.route, *results)


def fused_logits(lm_head: nn.Module, spec, hidden: torch.Tensor) -> torch.Tensor:
    """Full float32 logits ``softcap(scale * hidden @ W.T + b)`` as the fused head computes them, with ``W, b`` the
    head's effective weight and bias (for checks on a few rows, not for training; call inside the forward)."""
    weight, bias = effective_head(lm_head)
    hidden = hidden * spec.scale if spec.scale != 1.0 else hidden
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    return logits
