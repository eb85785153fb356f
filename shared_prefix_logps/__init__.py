"""shared-prefix-logps: per-token log-probs of G completions per prompt, each prompt forwarded once."""

from .api import compute_logps, compute_logps_concatenated, compute_logps_tree
from .errors import UnsupportedModelError
from .output import LogpsOutput
from .training import chunked_backward, chunked_backward_tree

__all__ = [
    "LogpsOutput",
    "UnsupportedModelError",
    "chunked_backward",
    "chunked_backward_tree",
    "compute_logps",
    "compute_logps_concatenated",
    "compute_logps_tree",
]
__version__ = "0.1.0"
