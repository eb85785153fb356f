"""shared-prefix-logps: per-token log-probs of G completions per prompt, each prompt forwarded once.

The public names are imported on first use (``from shared_prefix_logps import compute_logps`` as usual): importing
the package itself loads neither torch nor transformers, so that the command line (``shared-prefix-logps --help``,
``plan``) starts at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "LogpsOutput",
    "SharedDropoutWarning",
    "UnsupportedModelError",
    "chunked_backward",
    "chunked_backward_tree",
    "compute_logps",
    "compute_logps_concatenated",
    "compute_logps_tree",
]
__version__ = "0.1.0"

#: Public name -> the module that defines it.
_SOURCES = {
    "LogpsOutput": ".output",
    "SharedDropoutWarning": ".errors",
    "UnsupportedModelError": ".errors",
    "chunked_backward": ".training",
    "chunked_backward_tree": ".training",
    "compute_logps": ".api",
    "compute_logps_concatenated": ".api",
    "compute_logps_tree": ".api",
}

if TYPE_CHECKING:
    from .api import compute_logps, compute_logps_concatenated, compute_logps_tree
    from .errors import SharedDropoutWarning, UnsupportedModelError
    from .output import LogpsOutput
    from .training import chunked_backward, chunked_backward_tree


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept as a module attribute)."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
