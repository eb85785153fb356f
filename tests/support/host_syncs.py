"""Counting, on CPU, the operations that would make the host wait for a CUDA device.

On CUDA an operation whose output size or value the host needs synchronizes with the device: reading a value
(``int(t)``, ``bool(t)``, ``t.item()``: ``_local_scalar_dense``), output sizes that depend on values (``nonzero``,
boolean-mask indexing and assignment, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``,
``bincount``: CUDA's kernel reads the maximum first), and ``equal``. The same operations on CPU tensors are counted
here by a dispatch mode (the rule is the kernel counter's, ``bench/dispatch_count.py``), so a CPU test can bound what
a CUDA run would wait for.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shared_prefix_logps.bench.dispatch_count import reads_device_values


class HostSyncs(TorchDispatchMode):
    """``counts``: operation name -> how many times it ran inside the mode among those that synchronize on CUDA;
    ``total`` their sum. ``Tensor.tolist`` (a copy to the host, which the dispatcher does not see on CPU tensors) is
    counted too."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self._tolist = None

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        original, counts = self._tolist, self.counts

        def tolist(tensor):
            counts["Tensor.tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_device_values(func, args, kwargs):
            self.counts[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
