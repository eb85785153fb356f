"""One forward of the model over a node call, through the caller's outermost module (DDP, FSDP, ZeRO-3 and
accelerate hooks fire as in any forward), and the one-token forward that stands in for one another process makes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..backends.non_finite import NonFiniteWatch
from ..forward.context import CONTEXT_KWARG, CallSettings, ContextHandle, NodeContext, activated
from ..forward.node_call import NodeCall
from ..forward.routing import release
from ..model import PreparedModel
from ..model.compiled import graph_breaks_allowed
from ..model.installation import force_non_reentrant_checkpointing
from ..moe_router import token_sums
from ..recurrent import RECURRENT_CALL_KWARG, RecurrentCall


@dataclass(frozen=True)
class CallOutputs:
    """What one node call hands on to later calls and to the chunks' results, the one description of them.

    The walk reads them by name; :meth:`tensors` and :meth:`from_tensors` (as ``RecurrentState`` has) turn them into a
    flat list and back, for the chunked backwards' leaves and for the call's backward.

    Attributes:
        states: attention module -> (key, value), each (kv_heads, T, head_dim): the prefix states later calls attend
            over (empty when no later call does: ``call.keeps_states``).
        ends: recurrent layer -> the nodes' end states (a ``RecurrentState``, one row per node of ``call.nodes``):
            a hybrid's prefix states (empty for a model without recurrent layers or a call whose nodes have no
            children).
        logps: (p,) float32, one per head pair of the call.
        entropy: (p,) float32, or None when not requested.
        router: ``(counts, probs, tokens)`` of each of the call's nodes, (S, E), (S, E), (S,) float32, when router
            statistics were requested; only ``probs`` is differentiable (counts come from top-k).
    """

    states: dict
    ends: dict
    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    router: tuple | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every output that can carry a gradient, in a fixed order: each attention layer's key and value, each
        recurrent layer's end-state tensors, the log-probs, then the entropy and the router probabilities where
        present (the order :meth:`from_tensors` reads)."""
        tensors = [tensor for pair in self.states.values() for tensor in pair]
        tensors += [tensor for end in self.ends.values() for tensor in end.tensors()]
        tensors.append(self.logps)
        if self.entropy is not None:
            tensors.append(self.entropy)
        if self.router is not None:
            tensors.append(self.router[1])
        return tensors

    def from_tensors(self, tensors: list[torch.Tensor]) -> CallOutputs:
        """Outputs of the same layout holding ``tensors`` (in :meth:`tensors` order); the router's counts and token
        counts, which carry no gradient, are kept."""
        expected = len(self.tensors())
        if len(tensors) != expected:
            raise ValueError(f"expected {expected} tensors, got {len(tensors)}")
        rest = iter(tensors)
        states = {module: (next(rest), next(rest)) for module in self.states}
        ends = {}
        for module, end in self.ends.items():
            ends[module] = end.from_tensors([next(rest) for _ in end.tensors()])
        logps = next(rest)
        entropy = next(rest) if self.entropy is not None else None
        router = None
        if self.router is not None:
            counts, _, tokens = self.router
            router = (counts, next(rest), tokens)
        return CallOutputs(states, ends, logps, entropy, router)


def forward_call(
    prepared: PreparedModel,
    call: NodeCall,
    sources: list[dict],
    settings: CallSettings,
    *,
    weight_grads=None,
    keep_logits_bytes: int = 0,
    recurrent: RecurrentCall | None = None,
    rerun: Callable[[bool], bool] | None = None,
    read_gradients: bool = True,
) -> CallOutputs:
    """Forward ``call`` (on the model's device) attending over ``sources`` (the prefix states of ``call.sources``).

    ``settings``: the entry point's (with ``settings.router`` the model also returns its router logits, summed per
    node of the call); ``weight_grads``, ``keep_logits_bytes``: see :class:`NodeContext`; ``recurrent``: a
    linear-attention hybrid's recurrent part of the call (``engine/recurrent_states.py``), required when the model has
    recurrent layers. Returns the call's :class:`CallOutputs`, all differentiable when grad is enabled and leaving
    through the model's output (see ``forward/routing.py``).

    ``rerun``: where a forward may be run again (``rerun(this process found a non-finite value) -> every process runs
    again``; the identity for a single process), a packed layout runs optimistically: no layer checks for non-finite
    values, the call checks its final hidden states once and runs again isolating in the rare case one is not finite
    (``backends/non_finite.py``). None: every layer checks (a second forward would break the pairing of collectives).
    ``read_gradients``: in backward, read once whether the gradients reaching the call are finite (False: every layer
    isolates non-finite gradients without a read, for calls whose backward the library runs, one per chunk).
    """
    if (recurrent is None) != (prepared.recurrent is None):
        raise ValueError(
            f"{type(prepared.causal_lm).__name__}: a node call of a model "
            f"{'with' if prepared.recurrent is not None else 'without'} recurrent layers needs "
            f"{'a' if prepared.recurrent is not None else 'no'} recurrent part"
        )
    # A hybrid's recurrent part holds the state of its one forward: such calls check every layer.
    optimistic = rerun is not None and recurrent is None
    watch = NonFiniteWatch(optimistic, always_isolate_gradients=optimistic and not read_gradients)
    options = dict(weight_grads=weight_grads, keep_logits_bytes=keep_logits_bytes, recurrent=recurrent)
    outputs = _forward_once(prepared, call, sources, settings, watch=watch, **options)
    if watch.optimistic and rerun(not watch.all_finite()):
        del outputs  # the optimistic forward's graph goes before the isolating one is built
        outputs = _forward_once(prepared, call, sources, settings, watch=NonFiniteWatch(optimistic=False), **options)
    return outputs


def _forward_once(prepared, call, sources, settings, *, weight_grads, keep_logits_bytes, recurrent, watch):
    context = NodeContext(
        call=call,
        sources=sources,
        settings=settings,
        needs_grad=torch.is_grad_enabled(),
        head_spec=prepared.head,
        weight_grads=weight_grads,
        keep_logits_bytes=keep_logits_bytes,
        non_finite=watch,
    )
    extra = {"output_router_logits": True} if settings.router is not None else {}
    if recurrent is not None:
        extra[RECURRENT_CALL_KWARG] = recurrent
    else:
        # An all-ones padding mask of the packed tokens (a device fill, no host data): without one, transformers'
        # mask preparation looks for packed sequences in the position ids on the host (a sync per call). The node
        # call's attention builds its own masks; the mask builder registered beside it returns none in node calls.
        # (A hybrid's linear-attention layers read the mask on the host either way.)
        extra["attention_mask"] = torch.ones(call.input_ids.shape, dtype=torch.bool, device=call.input_ids.device)
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
    # The results as attached inside the forward, in the order they are released: their layout, then the released
    # aliases (downstream of the model's output) in it.
    attached = CallOutputs(
        states={module: tuple(box.results) for module, box in context.routes.items() if box is not None},
        ends={} if recurrent is None else _ran_every_recurrent_layer(prepared, recurrent).attached(),
        logps=context.route.results[0],
        entropy=context.route.results[1] if settings.return_entropy else None,
    )
    boxes = [box for box in context.routes.values() if box is not None]
    boxes += ([] if recurrent is None else recurrent.boxes()) + [context.route]
    outputs = attached.from_tensors(watch.watch_gradients(release(logits, boxes)))
    if settings.router is not None:
        owner = call.query_slot
        tokens = torch.arange(owner.numel(), device=owner.device)
        router_logits = getattr(output, "router_logits", None)
        nodes = call.nodes.numel()
        outputs = replace(outputs, router=token_sums(router_logits, tokens, owner, nodes, settings.router[1]))
    return outputs


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
