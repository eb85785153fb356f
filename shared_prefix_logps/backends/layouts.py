"""The attention layouts, one table: each layout's name, its module, and what the rest of the library reads of it.

A node call's attention layers run the layout the entry point's ``backend`` resolved to (``choice.py``). Every layout
module has the same three members:

- ``node_attention(query, key, value, layer: LayerCall) -> (1, T, heads, v_head_dim)``: one layer of a node call
  (``forward/attention.py`` calls it);
- ``unavailable(device, needs_grad) -> str | None``: why the layout cannot run on ``device`` in that grad mode (None:
  it can), the error message an explicit ``backend=`` gets;
- ``CALL_FIELDS``: the optional fields of a :class:`~shared_prefix_logps.forward.node_call.NodeCall` it reads beyond
  the packed tokens, positions and trie structure every call has (``engine/call_planner.py`` builds only these).

So adding a layout touches its module, its row in :data:`LAYOUTS` and its tests. The entry points' ``backend`` values
(``inputs.ATTENTION_BACKENDS``) and the plug-ins' (``integrations/common/backends.py``) are derived from this table.
Modules are imported on first use: the table is read where the backend names are validated, before any layout runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """One row of the table.

    Attributes:
        name: the ``backend=`` value that selects it.
        module: the module that runs it (dotted, imported on first use by :func:`layout_module`).
        auto_rank: ``backend="auto"`` takes the available layout of lowest rank among those whose ``auto_devices``
            hold the device (None: ``auto`` never takes it).
        auto_devices: device types on which ``auto`` may take it (None: any).
        padded: each node is a row of a padded batch with its ancestors' keys/values copied in: the no-grad token
            budget counts those copies (``backends/expand_memory.py`` via ``engine/budget.py``); packed layouts count
            their tokens only.
        plugins: offered through the trainer plug-ins' ``backend`` option.
        multi_depth: a node call may hold nodes of several depths, each attending over its ancestors in the call as
            over those of earlier calls: the walk forwards a plan of one chunk in one model call.
    """

    name: str
    module: str
    auto_rank: int | None
    auto_devices: frozenset[str] | None
    padded: bool
    plugins: bool
    multi_depth: bool = False


#: Every layout, in the order the ``backend=`` values list them.
LAYOUTS = (
    Layout("expand", f"{__package__}.expand", auto_rank=1, auto_devices=None, padded=True, plugins=True),
    Layout(
        "flex",
        f"{__package__}.flex",
        auto_rank=0,
        auto_devices=frozenset({"cuda"}),
        padded=False,
        plugins=True,
        multi_depth=True,
    ),
    Layout("flash", f"{__package__}.flash", auto_rank=None, auto_devices=None, padded=False, plugins=False),
)

#: The layouts' names, in table order.
LAYOUT_NAMES = tuple(layout.name for layout in LAYOUTS)


@dataclass(frozen=True)
class LayerCall:
    """One attention layer's part of a node call: what every layout's ``node_attention`` reads beside the layer's
    queries, keys and values.

    Attributes:
        module: the attention module (layouts name it in their errors).
        call: the :class:`~shared_prefix_logps.forward.node_call.NodeCall`, on the model's device.
        ancestors: each source call's (key, value) of this layer, (kv_heads, tokens, head_dim), in ``call.sources``
            order (their concatenation is the ancestor store).
        cache: the call's cache of what layouts build once per call (masks, kernel choices), shared by its layers.
        window: the layer's sliding window, or None.
        options: ``scaling``, ``softcap``, ``dropout`` and ``sinks`` (a (heads,) tensor or None) of the layer.
        needs_grad: whether the caller expects gradients (read before checkpointing disables them).
        non_finite: the node call's :class:`~.non_finite.NonFiniteWatch` (how packed layouts keep a non-finite
            value in its row: optimistically or checking every layer), or None to check every layer.
    """

    module: torch.nn.Module
    call: object
    ancestors: list
    cache: dict
    window: int | None
    options: dict
    needs_grad: bool
    non_finite: object = None


def layout(name: str) -> Layout:
    """The table's row for ``name``; a ValueError naming ``backend`` for anything else."""
    for row in LAYOUTS:
        if row.name == name:
            return row
    raise ValueError(f"backend must be one of {LAYOUT_NAMES}, got {name!r}")


def layout_module(name: str):
    """The module that runs layout ``name`` (imported on first use)."""
    return importlib.import_module(layout(name).module)
