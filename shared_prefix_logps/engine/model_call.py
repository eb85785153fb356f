"""One forward of the model over a node call, through the caller's outermost module (DDP, FSDP, ZeRO-3 and
accelerate hooks fire as in any forward), and the one-token forward that stands in for one another process makes."""

from __future__ import annotations

import contextlib

import torch

from ..forward.context import CONTEXT_KWARG, ContextHandle, NodeContext, activated
from ..forward.node_call import NodeCall
from ..forward.routing import release
from ..model import PreparedModel
from ..model.compiled import graph_breaks_allowed
from ..model.installation import force_non_reentrant_checkpointing
from ..moe_router import token_sums
from ..recurrent import RECURRENT_CALL_KWARG, RecurrentCall


def forward_call(
    prepared: PreparedModel,
    call: NodeCall,
    sources: list[dict],
    *,
    layout: str,
    temperature: float,
    return_entropy: bool,
    router_top_k: int | None = None,
    weight_grads=None,
    keep_logits_bytes: int = 0,
    recurrent: RecurrentCall | None = None,
) -> NodeContext:
    """Forward ``call`` (on the model's device) attending over ``sources`` (the prefix states of ``call.sources``).

    ``layout``: ``expand``, ``flex`` or ``flash``; with ``router_top_k`` the model also returns its router logits and
    ``context.router`` sums them per node of the call; ``weight_grads``, ``keep_logits_bytes``: see
    :class:`NodeContext`; ``recurrent``: a linear-attention hybrid's recurrent part of the call
    (``engine/recurrent_states.py``), required when the model has recurrent layers. Returns the context
    with ``states`` (attention module -> (key, value), each (kv_heads, T, head_dim)), ``ends`` (recurrent layer -> its
    nodes' end states, where some node has children) and ``logps`` / ``entropy`` ((p,) float32, one per pair of
    ``call.head_pairs``), all differentiable when grad is enabled and leaving through the model's output (see
    ``forward/routing.py``).
    """
    if (recurrent is None) != (prepared.recurrent is None):
        raise ValueError(
            f"{type(prepared.causal_lm).__name__}: a node call of a model "
            f"{'with' if prepared.recurrent is not None else 'without'} recurrent layers needs "
            f"{'a' if prepared.recurrent is not None else 'no'} recurrent part"
        )
    context = NodeContext(
        call=call,
        sources=sources,
        layout=layout,
        needs_grad=torch.is_grad_enabled(),
        head_spec=prepared.head,
        temperature=temperature,
        return_entropy=return_entropy,
        weight_grads=weight_grads,
        keep_logits_bytes=keep_logits_bytes,
    )
    extra = {"output_router_logits": True} if router_top_k is not None else {}
    if recurrent is not None:
        extra[RECURRENT_CALL_KWARG] = recurrent
    with (
        force_non_reentrant_checkpointing(prepared.causal_lm),
        activated(context),
        graph_breaks_allowed(prepared.outer),
        weight_grads.embedding_hook() if weight_grads is not None else contextlib.nullcontext(),
    ):
        output = prepared.outer(
            input_ids=call.input_ids,
            position_ids=call.positions,
            use_cache=False,
            **extra,
            **{CONTEXT_KWARG: ContextHandle(context)},
        )
    context.finished = True
    logits = output.logits if hasattr(output, "logits") else output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{type(prepared.outer).__name__} returned no logits tensor")
    if not context.routes:
        raise ValueError(f"{type(prepared.causal_lm).__name__} ran no attention layer through the shared-prefix path")
    if context.route is None:
        raise ValueError(f"{type(prepared.causal_lm).__name__} did not call its lm_head inside its forward")
    if not context.needs_grad:
        # No backward recomputes through this call, and the walk keeps its context while descendants attend over
        # its keys/values: its masks would stay alive for nothing.
        context.masks.clear()
    modules = [module for module, box in context.routes.items() if box is not None]
    recurrent_boxes = [] if recurrent is None else _ran_every_recurrent_layer(prepared, recurrent).boxes()
    released = release(logits, [context.routes[module] for module in modules] + recurrent_boxes + [context.route])
    context.states = {module: (released[2 * i], released[2 * i + 1]) for i, module in enumerate(modules)}
    head = len(released) - (2 if return_entropy else 1)
    if recurrent is not None:
        context.ends = recurrent.receive(released[2 * len(modules) : head])
    context.logps = released[head]
    context.entropy = released[head + 1] if return_entropy else None
    if router_top_k is not None:
        valid = call.pack_valid
        owner = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)[valid]
        tokens = torch.arange(owner.numel(), device=owner.device)
        router_logits = getattr(output, "router_logits", None)
        context.router = token_sums(router_logits, tokens, owner, valid.shape[0], router_top_k)
    return context


def _ran_every_recurrent_layer(prepared: PreparedModel, recurrent: RecurrentCall) -> RecurrentCall:
    """``recurrent`` once the forward is over, checked: every recurrent layer of the model ran under it (a layer that
    did not would have run from no state, silently)."""
    missing = [layer for layer in prepared.recurrent.layers if layer not in recurrent.ran]
    if missing:
        raise ValueError(
            f"{type(prepared.causal_lm).__name__}: {len(missing)} of its {len(prepared.recurrent.layers)} recurrent "
            f"layers ({type(missing[0]).__name__}) did not run through the shared-prefix path in a node call"
        )
    return recurrent


def one_token_zero(prepared: PreparedModel) -> torch.Tensor:
    """A 0-d float32 zero from a one-token forward of the caller's outermost module: connected to every parameter
    that produces the logits (with gradients enabled), so that a backward through it visits every unit and adds zero.
    It stands in for a model call another process makes and this one does not (lockstep)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=prepared.device)
    logits = prepared.outer(input_ids=ids, use_cache=False).logits
    return logits.float().sum() * 0.0
