"""One forward of the model over a node call, through the caller's outermost module."""

from __future__ import annotations

import torch

from ..forward.routing import release
from ..model import PreparedModel
from ..moe_router import token_sums
from ..phases import forward_phase
from .context import TreeContext
from .plan import NodeCall


def forward_call(
    prepared: PreparedModel,
    call: NodeCall,
    sources: list[dict],
    *,
    temperature: float,
    return_entropy: bool,
    packed: bool = False,
    router_top_k: int | None = None,
) -> TreeContext:
    """Forward ``call`` (on the model's device) attending over ``sources`` (the keys/values of ``call.sources``).

    ``packed`` selects the ``flex`` layout; with ``router_top_k`` the model also returns its router logits and
    ``context.router`` sums them per node of the call. Returns the context with ``kv`` (attention module -> (key,
    value), each (kv_heads, T, head_dim)) and ``logps`` / ``entropy`` ((p,) float32, one per pair of
    ``call.head_pairs``), all differentiable when grad is enabled and leaving through the model's output (see
    ``forward/routing.py``).
    """
    context = TreeContext(
        call=call,
        sources=sources,
        needs_grad=torch.is_grad_enabled(),
        head_spec=prepared.head,
        temperature=temperature,
        return_entropy=return_entropy,
        packed=packed,
    )
    output, router_logits = forward_phase(
        prepared, call.input_ids, call.positions, context, router=router_top_k is not None
    )
    if not context.routes:
        raise ValueError(f"{type(prepared.causal_lm).__name__} ran no attention layer through the shared-prefix path")
    if context.route is None:
        raise ValueError(f"{type(prepared.causal_lm).__name__} did not call its lm_head inside its forward")
    if not context.needs_grad:
        # No backward recomputes through this call, and the walk keeps its context while descendants attend over
        # its keys/values: its masks would stay alive for nothing.
        context.masks.clear()
    modules = list(context.routes)
    released = release(output, [context.routes[module] for module in modules] + [context.route])
    context.kv = {module: (released[2 * i], released[2 * i + 1]) for i, module in enumerate(modules)}
    context.logps = released[2 * len(modules)]
    context.entropy = released[2 * len(modules) + 1] if return_entropy else None
    if router_top_k is not None:
        valid = call.pack_valid
        owner = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)[valid]
        tokens = torch.arange(owner.numel(), device=owner.device)
        context.router = token_sums(router_logits, tokens, owner, valid.shape[0], router_top_k)
    return context
