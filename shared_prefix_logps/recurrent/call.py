"""The recurrent layers' part of a node call: which state each node starts from, carried into the model's forward as
a model kwarg, and the nodes' end states coming out through the model's output.

:func:`install` wraps the forward of each recurrent layer of a model. Outside a node call (no
:data:`RECURRENT_CALL_KWARG` among its kwargs) the wrapper calls the layer's own forward unchanged, so plain forwards
and generation are untouched. Inside one, it runs the layer with :func:`~.layer.run_from_states` over the call's node
spans from the call's initial states, and attaches the end states to the layer's output (``forward/routing.py``):
they leave through module outputs, where wrappers (FSDP2, DDP, ZeRO-3) see their gradient. The kwarg travels with the
forward through every decoder layer and survives non-reentrant activation checkpointing, which drops a ``cache``
argument (transformers' ``GradientCheckpointingLayer`` sets it to None in training).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn

from ..forward.routing import RouteBox, attach, release
from .layer import run_from_states
from .spans import NodeSpans
from .state import RecurrentState

#: The model kwarg that carries a :class:`RecurrentCall` to the recurrent layers.
RECURRENT_CALL_KWARG = "shared_prefix_recurrent"

#: Attribute under which a wrapped layer keeps its own forward.
_ORIGINAL_FORWARD = "_shared_prefix_original_forward"


class RecurrentCall:
    """The recurrent layers' part of one forward over some nodes.

    A plain class, not a dataclass: FSDP2 rebuilds dataclass kwargs when it casts forward inputs, and the layers
    must fill the object the caller holds.

    Attributes:
        spans: where each node's tokens sit in the layers' input (the same for every layer).
        initial: recurrent layer -> the nodes' initial states (one row per node); empty when every node starts a row.
        keep_ends: whether the nodes hand their end states on (they have children): one bool for every node, or
            (N,) bool per node (see :func:`~.layer.run_from_states`). With no node keeping one, no end state is
            recorded, and one-token nodes avoid the layers' one-token decode path.
        records: whether some node keeps its end state (the layers record and route end states).
        ran: the recurrent layers that ran in this forward (a layer object met twice is refused: its end state, or
            its place in the call, would be ambiguous).
        routes: recurrent layer -> the RouteBox its end state rides on (filled during the forward).
        layouts: recurrent layer -> its end state as attached (the layout :meth:`release` rebuilds).
        ends: recurrent layer -> the nodes' end states, set by :meth:`release`.
        finished: set by :meth:`release`; later layer runs are activation-checkpoint recomputations.
    """

    def __init__(
        self,
        spans: NodeSpans,
        initial: Mapping[nn.Module, RecurrentState] | None = None,
        *,
        keep_ends: bool | torch.Tensor = True,
    ):
        self.spans = spans
        self.initial = dict(initial or {})
        self.keep_ends = keep_ends
        self.records = keep_ends if isinstance(keep_ends, bool) else bool(keep_ends.any())
        self.ran: set[nn.Module] = set()
        self.routes: dict[nn.Module, RouteBox] = {}
        self.layouts: dict[nn.Module, RecurrentState] = {}
        self.ends: dict[nn.Module, RecurrentState] = {}
        self.finished = False
        self.padded_layouts: dict = {}  # the nodes' padded layout on the device, shared by the call's layers

    def initial_state(self, module: nn.Module) -> RecurrentState | None:
        """``module``'s initial states for this call's nodes (None: every node starts a row)."""
        if not self.initial:
            return None
        try:
            return self.initial[module]
        except KeyError:
            raise ValueError(
                f"no initial state for recurrent layer {type(module).__name__} "
                f"(layer_idx {getattr(module, 'layer_idx', '?')}): the parent call did not run it"
            ) from None

    def release(self, output: torch.Tensor) -> dict[nn.Module, RecurrentState]:
        """After the forward: each recurrent layer's end states, their gradient routed through ``output`` (a tensor
        the outermost module returned). Sets :attr:`ends` and :attr:`finished`."""
        return self.receive(release(output, self.boxes()))

    def boxes(self) -> list[RouteBox]:
        """The RouteBoxes the end states ride on, in layer order: for a caller that releases them together with
        other results from the same output (then :meth:`receive` what came out of them)."""
        return [self.routes[module] for module in self.routes]

    def attached(self) -> dict[nn.Module, RecurrentState]:
        """Each recurrent layer's end states as attached during the forward, in the order of :meth:`boxes` (the layout
        a caller that releases them together with other results rebuilds them in). Sets :attr:`finished`: later
        layer runs are activation-checkpoint recomputations."""
        self.finished = True
        return {module: self.layouts[module] for module in self.routes}

    def receive(self, released: list[torch.Tensor]) -> dict[nn.Module, RecurrentState]:
        """Each recurrent layer's end states from ``released``, the tensors released from :meth:`boxes` in order.
        Sets :attr:`ends` and :attr:`finished`."""
        position = 0
        for module in self.routes:
            layout = self.layouts[module]
            size = len(layout.tensors())
            self.ends[module] = layout.from_tensors(released[position : position + size])
            position += size
        if position != len(released):
            raise ValueError(f"received {len(released)} tensors for {position} end-state tensors")
        self.finished = True
        return self.ends


def install(mixers: list[nn.Module]) -> None:
    """Wrap the forward of each recurrent layer in ``mixers`` (idempotent); see the module docstring."""
    for module in mixers:
        if hasattr(module, _ORIGINAL_FORWARD):
            continue
        original = module.forward
        # Whether the forward was already an instance attribute (accelerate's hooks set one), to restore it as found.
        setattr(module, _ORIGINAL_FORWARD, (original, "forward" in module.__dict__))
        module.forward = functools.wraps(original)(functools.partial(_forking_forward, module, original))


def uninstall(mixers: list[nn.Module]) -> None:
    """Give each layer of ``mixers`` its own forward back."""
    for module in mixers:
        if hasattr(module, _ORIGINAL_FORWARD):
            original, was_attribute = getattr(module, _ORIGINAL_FORWARD)
            delattr(module, _ORIGINAL_FORWARD)
            if was_attribute:
                module.forward = original
            else:
                del module.forward  # the class's forward shows through again


def _forking_forward(module: nn.Module, original, *args, **kwargs):
    call = kwargs.pop(RECURRENT_CALL_KWARG, None)
    if call is None:
        return original(*args, **kwargs)
    return _forked_forward(module, original, call, args[0] if args else kwargs["hidden_states"])


# Eager under torch.compile, as the attention and head of a node call are: the call's spans, states and routes change
# with every call (a traced graph would freeze the first call's), and the layer runs once per node length.
@torch.compiler.disable
def _forked_forward(module: nn.Module, original, call: RecurrentCall, hidden_states: torch.Tensor) -> torch.Tensor:
    if not call.finished:
        if module in call.ran:
            raise ValueError(
                f"recurrent layer {type(module).__name__} ran twice in one forward (the same layer object appears more "
                "than once in the model's layers); its end state would be ambiguous"
            )
        call.ran.add(module)
    # The layer's other arguments (its cache, the padding mask, packed-sequence kwargs) describe the caller's batch
    # layout; the spans replace them: each node's tokens run unpadded from the node's own state.
    output, end = run_from_states(
        module,
        hidden_states,
        call.spans,
        call.initial_state(module),
        forward=original,
        keep_ends=call.keep_ends,
        layouts=call.padded_layouts,
    )
    if call.finished or not call.records:
        # Nothing to hand on (a call of leaves), or an activation-checkpoint recomputation in backward (the end
        # states are already in the graph).
        return output
    box = call.routes[module] = RouteBox()
    call.layouts[module] = end
    return attach(output, box, *end.tensors())
