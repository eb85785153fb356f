"""Peak memory of a piece of work: CUDA's allocator statistics, or on CPU a count of live tensor bytes."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages allocated inside the mode and still alive; ``peak`` is the maximum.

    Storages that existed before (parameters, inputs) are not counted, views and in-place results add nothing.
    Used on CPU, where no allocator keeps statistics; slows the work down, so time it separately. It cannot see
    inside higher-order operators (flex_attention), so it is for the ``expand`` and ``dense`` paths.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            # A result sharing an input's storage (a view, an in-place op) allocated nothing.
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= nbytes


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose ``"peak_bytes"`` holds, after the block, the peak bytes allocated inside it.

    On CUDA that is the allocator's peak during the block less what was allocated when it began (``"base_bytes"``,
    also in the dict: parameters, inputs and whatever earlier work left allocated); memory the block frees from that
    base lowers the figure, so measure with nothing left over from earlier steps. On CPU, the peak of the live
    bytes of tensors allocated inside the block (:class:`LiveTensorBytes`).
    """
    result = {"peak_bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result["base_bytes"] = base
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    else:
        tracker = LiveTensorBytes()
        with tracker:
            yield result
        result["peak_bytes"] = tracker.peak


@contextlib.contextmanager
def long_lived_objects_frozen():
    """Collect garbage once, then keep what is alive now (imported modules, the model, the batch) out of the garbage
    collector's scans until the block ends (``gc.freeze``), so that the ``gc.collect()`` between a cell's runs scans
    only what its steps made. A full collection over the objects torch, transformers and Triton keep alive takes
    about half a second on CPU: run between every method and repeat, it was most of a small benchmark's time.
    Nothing made inside the block is kept from collection; the frozen objects outlive the block anyway."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
