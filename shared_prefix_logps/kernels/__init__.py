"""The kernels: log-softmax-gather (Triton, with a torch fallback) and the fused lm_head built on it.

- ``function.logsoftmax_gather``: differentiable per-token log-probs (and entropy) from a logits tensor;
- ``fused_head.linear_logps``: ``hidden @ weight.T`` + log-softmax-gather, token-chunked, no (tokens x vocab) logits;
- ``implementation``: which implementation (``"triton"`` or ``"torch"``) computes the statistics;
- ``launch_probe``: whether compiled Triton kernels can launch on CUDA in this process (a C compiler, or a trial);
- ``triton_logsoftmax_gather`` / ``torch_logsoftmax_gather``: the two implementations, one file each.
"""

from .function import LogsoftmaxGatherFunction, logsoftmax_gather
from .fused_head import linear_logps
from .implementation import IMPLEMENTATIONS, resolve_implementation

__all__ = ["IMPLEMENTATIONS", "LogsoftmaxGatherFunction", "linear_logps", "logsoftmax_gather", "resolve_implementation"]
