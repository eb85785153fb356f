"""The ``backend`` values every plug-in accepts, in one place.

The plug-ins offer ``auto`` and the layouts their tests run them with (``expand``, ``flex``: ``plugins=True`` in the
layout table, ``backends/layouts.py``); ``flash`` is not offered through them yet (no plug-in test runs it: it needs
CUDA and flash-attn). ``dense`` is the reference, not a
layout: a user who wants the trainer's own forward switches the plug-in off.
"""

from __future__ import annotations

from ...backends.layouts import LAYOUTS

#: What a plug-in's ``backend`` option may be: ``auto`` and the layouts the table offers to plug-ins.
PLUGIN_BACKENDS = ("auto", *(layout.name for layout in LAYOUTS if layout.plugins))


def check_plugin_backend(value: str, name: str = "backend") -> str:
    """``value`` if it is one of :data:`PLUGIN_BACKENDS`; otherwise a ValueError naming ``name`` (an argument or an
    environment variable)."""
    if value not in PLUGIN_BACKENDS:
        raise ValueError(f"{name} must be one of {PLUGIN_BACKENDS}, got {value!r}")
    return value
