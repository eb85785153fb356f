"""Log-softmax-gather: Triton kernels with a torch fallback, and the autograd-facing ``logsoftmax_gather``."""

from ._backend import resolve_backend
from .function import LogsoftmaxGatherFunction, logsoftmax_gather

__all__ = ["LogsoftmaxGatherFunction", "logsoftmax_gather", "resolve_backend"]
