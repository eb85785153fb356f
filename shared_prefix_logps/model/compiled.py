"""Models under ``torch.compile``: node calls need graph breaks.

A node call's attention, lm_head and result routing run eagerly inside a compiled model (they read and fill the call's
context, which a traced graph would freeze at its first call; see ``forward/routing.py``), so dynamo breaks the graph
around them and compiles the rest of each layer. A model or layer compiled with ``fullgraph=True`` forbids those
breaks: dynamo raises instead, and the error is turned into one that says what to change.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UnsupportedModelError


def _graph_break_errors() -> tuple[type[BaseException], ...]:
    """The exception dynamo raises where ``fullgraph=True`` forbids a graph break."""
    unsupported = getattr(getattr(torch, "_dynamo", None), "exc", None)
    unsupported = getattr(unsupported, "Unsupported", None)
    return (unsupported,) if unsupported is not None else ()


@contextlib.contextmanager
def graph_breaks_allowed(model: torch.nn.Module):
    """Around a forward of ``model`` through the library's attention and head: a ``fullgraph=True`` compilation
    (whole model or per layer) is refused with an :class:`UnsupportedModelError` naming it."""
    errors = _graph_break_errors()
    try:
        yield
    except errors as error:
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise UnsupportedModelError(
            f"{type(model).__name__} (or a module inside it) is compiled with fullgraph=True (or runs under dynamo's "
            "error_on_graph_break), but the shared-prefix attention and head run outside the compiled graph, between "
            "graph breaks; compile the model or its layers without fullgraph (torch.compile(model), layer.compile(), "
            f"accelerate's compile_regions) to compute shared-prefix log-probs. Dynamo's error: {reason}"
        ) from error
