"""Counting, on CPU, the operations that would make the host wait for a CUDA device.

On CUDA an operation whose output size or value the host needs synchronizes with the device: reading a value
(``int(t)``, ``bool(t)``, ``t.item()``: ``_local_scalar_dense``), output sizes that depend on values (``nonzero``,
boolean-mask indexing and assignment, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``,
``bincount``: CUDA's kernel reads the maximum first), and ``equal``. The same operations on CPU tensors are counted
here by a dispatch mode, so a CPU test can bound what a CUDA run would wait for.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::equal",
}


def _syncs(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in _ALWAYS:
        return True
    if name == "aten::repeat_interleave":
        output_size = kwargs.get("output_size", args[-1] if len(args) > 1 and func._overloadname == "Tensor" else None)
        return output_size is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


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
        if _syncs(func, args, kwargs):
            self.counts[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
