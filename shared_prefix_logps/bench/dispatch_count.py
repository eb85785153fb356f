"""What a step would cost a CUDA device's host, counted on CPU: kernel launches, host syncs and gradient additions.

On a GPU a training or scoring step costs its kernels' time *and* its host's: every kernel launch is some 10-30 us
of Python and dispatch, and every host sync (the host reading a device value) drains the device's queue, so the
host cannot run ahead of the GPU. Both can be counted on CPU, where the same code dispatches the same ATen operations:

- **kernels**: every ATen operation the step dispatches but views and metadata (operations whose outputs alias their
  inputs, allocations without a fill). On the GPU runs of ``benchmarks/gpu_quick.sh`` a model with the real layer
  count and narrow widths gave 0.76-1.16x the GPU's launch counts (``docs/benchmarks.md``), whatever the lengths.
- **host syncs**: operations that read a *device* value on the host: ``.item()``/``int()``/``bool()``, ``.tolist()``,
  ``.cpu()``/``.numpy()``, output shapes that depend on values (``nonzero``, boolean-mask indexing, ``unique``,
  ``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``, ``equal``), and blocking
  host-to-device copies (``.to(device)`` without ``non_blocking``, ``torch.tensor(..., device=...)``: PyTorch waits for
  the stream after them). On CPU host and device are one, so each tensor's side is tracked: the model's parameters and
  buffers and the step's inputs (:meth:`DispatchCount.on_device`) are device tensors, so is every result of an
  operation with a device tensor among its inputs and of a factory called with an explicit ``device``; what the
  library plans on the host stays host. A node call's tensors moved by ``forward.node_call.to_device`` (one pinned,
  non-blocking copy) become device tensors without a sync. Each sync is recorded by its call site in the library.
- **gradient additions**: pointwise additions into a parameter's existing ``.grad`` (``AccumulateGrad``'s ``add_``; a
  ``_foreach_add_`` over gradients counts once; a matrix product accumulating into ``.grad`` computes the gradient and
  is no addition on top of it).

:func:`count_step` runs a callable under the counter.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

#: Operations that launch no kernel although they return a new tensor: allocations without a fill, metadata.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::detach",
    "aten::alias",
    "aten::set_",
    "aten::resize_",
    "aten::_local_scalar_dense",  # a host read: counted as a sync, not as a kernel
    "aten::is_same_size",
    "aten::_has_compatible_shallow_copy_type",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
}

#: Operations whose output size depends on their input's values: the host reads the device first.
_VALUE_SHAPED = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::equal",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
}

#: Pointwise additions, what ``AccumulateGrad`` adds a new gradient into ``.grad`` with (a matrix product that
#: accumulates into ``.grad``, ``addmm_``, is the gradient's own computation, not an addition on top of it).
_ADDITIONS = {"aten::add_", "aten::_foreach_add_", "aten::sub_", "aten::add"}

#: Factories whose result is on the device where the caller names one (``device=``), on the host otherwise.
_FACTORIES = ("zeros", "ones", "full", "empty", "arange", "randn", "rand", "randint", "linspace", "eye")

#: The package's root: call sites are reported relative to it.
_PACKAGE = Path(__file__).resolve().parents[1]


def launches_kernel(func) -> bool:
    """Whether ATen operation ``func`` launches a kernel on CUDA: not a view (its outputs alias an input without
    writing it), not an allocation without a fill, not metadata."""
    schema = func._schema
    if schema.name in _NO_KERNEL:
        return False
    return not any(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns)


def reads_device_values(func, args, kwargs) -> bool:
    """Whether ATen operation ``func`` on device tensors makes the host wait for the device: it reads a value
    (``item``, ``bool``, ``equal``) or its output's size depends on the values (``nonzero``, boolean-mask indexing,
    ``repeat_interleave`` without ``output_size``, ``unique``, ``bincount``)."""
    name = func._schema.name
    if name in _VALUE_SHAPED:
        return True
    if name == "aten::repeat_interleave":
        output_size = kwargs.get("output_size", args[-1] if len(args) > 1 and func._overloadname == "Tensor" else None)
        return output_size is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def call_site() -> str:
    """The innermost frame of the library outside this module (else the innermost frame outside torch), as
    ``path:line function``."""
    frames = traceback.extract_stack()[:-1]
    here = Path(__file__).resolve()
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if path != here and _PACKAGE in path.parents:
            return f"{path.relative_to(_PACKAGE.parent)}:{frame.lineno} {frame.name}"
    for frame in reversed(frames):
        if "torch" not in Path(frame.filename).parts and Path(frame.filename).resolve() != here:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "unknown"


@dataclass
class Counts:
    """What a step dispatched.

    Attributes:
        kernels: ATen operation -> launches (operations on device tensors).
        host_ops: ATen operation -> runs on host tensors only (the library's planning: CPU work, no launch).
        syncs: call site -> host syncs made there.
        grad_additions: operations that added into a parameter's existing ``.grad``.
    """

    kernels: collections.Counter = field(default_factory=collections.Counter)
    host_ops: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)
    grad_additions: int = 0

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


class DispatchCount(TorchDispatchMode):
    """The counter (see the module). Enter it around a step; ``counts`` holds what it saw.

    Args:
        parameters: the model's parameters (their ``.grad`` is watched for additions) and buffers: device tensors.
    """

    #: Higher-order operators (flex_attention and its backward) come through ``__torch_dispatch__`` too: each is one
    #: compiled kernel on CUDA, however many operations its eager CPU implementation runs.
    supports_higher_order_operators = True

    def __init__(self, parameters=()):
        super().__init__()
        self.counts = Counts()
        self.parameters = [p for p in parameters if isinstance(p, torch.Tensor)]
        self.device_side = WeakTensorKeyDictionary()
        self.on_device(*self.parameters)
        self._patches = contextlib.ExitStack()

    def on_device(self, *tensors) -> None:
        """Mark ``tensors`` (nested lists and tuples too) as living on the device."""
        for tensor in _tensors(tensors):
            self.device_side[tensor] = True

    def is_device(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and self.device_side.get(tensor, False)

    def sync(self, kind: str) -> None:
        self.counts.syncs[f"{call_site()} ({kind})"] += 1

    def __enter__(self):
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _patch(self) -> None:
        """Python-level reads and copies the dispatcher does not see on CPU tensors, and flex_attention's entry."""
        counter = self
        patches = self._patches

        def replace(owner, name, make):
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            patches.callback(setattr, owner, name, original)

        def reading(kind):
            def make(original):
                def read(tensor, *args, **kwargs):
                    if not counter.is_device(tensor):
                        return original(tensor, *args, **kwargs)
                    counter.sync(kind)
                    if kind != ".cpu()":
                        return original(tensor, *args, **kwargs)
                    # A copy on the host, as CUDA's would be (a host tensor from here on).
                    with _outside(counter):
                        copy = original(tensor, *args, **kwargs).clone()
                    counter.device_side.pop(copy, None)
                    return copy

                return read

            return make

        replace(torch.Tensor, "tolist", reading(".tolist()"))
        replace(torch.Tensor, "numpy", reading(".numpy()"))
        replace(torch.Tensor, "cpu", reading(".cpu()"))

        def make_to(original):
            def to(tensor, *args, **kwargs):
                target = _target_device(args, kwargs)
                if target is None or not isinstance(tensor, torch.Tensor):
                    return original(tensor, *args, **kwargs)
                if _names_host(args, kwargs):
                    if not counter.is_device(tensor):
                        return original(tensor, *args, **kwargs)
                    # A device tensor copied to the host: a sync; a host tensor from here on.
                    counter.sync('.to("cpu")')
                    with _outside(counter):
                        copy = original(tensor, *args, **kwargs)
                        copy = copy.clone() if copy is tensor else copy
                    counter.device_side.pop(copy, None)
                    return copy
                if counter.is_device(tensor):
                    return original(tensor, *args, **kwargs)
                # A host tensor copied to the device: a copy on CUDA (emulated by a clone here), blocking unless
                # non_blocking.
                if not kwargs.get("non_blocking", False) and not (len(args) > 1 and args[1] is True):
                    counter.sync(".to(device)")
                counter.counts.kernels["host-to-device copy"] += 1  # a copy launched on the device's stream
                with _outside(counter):
                    moved = original(tensor, *args, **kwargs)
                    moved = moved.clone() if moved is tensor else moved
                counter.on_device(moved)
                return moved

            return to

        replace(torch.Tensor, "to", make_to)

        # The dispatcher hands every factory a device, given or not: which side a new tensor is on is read here,
        # from whether the caller named a device. Copying host data to it (``torch.tensor``) is a blocking copy.
        def make_factory(original, copies: bool):
            def factory(*args, **kwargs):
                result = original(*args, **kwargs)
                if isinstance(result, torch.Tensor):
                    if kwargs.get("device") is not None and not _names_host((), kwargs):
                        if copies:
                            counter.sync(f"torch.{original.__name__}(..., device=)")
                        counter.on_device(result)
                    else:
                        counter.device_side.pop(result, None)
                return result

            return factory

        for name in ("tensor", "as_tensor"):
            replace(torch, name, lambda original: make_factory(original, True))
        for name in _FACTORIES:
            replace(torch, name, lambda original: make_factory(original, False))

        from ..forward import node_call

        def make_to_device(original):
            # One pinned, non-blocking copy on CUDA (no sync), then a cast per bool field; emulated by copies here,
            # which are device tensors from then on (the host keeps its own).
            def to_device(tensors, device):
                counter.counts.kernels["host-to-device copy"] += 1
                moved = {}
                with _outside(counter):
                    for name, tensor in tensors.items():
                        moved[name] = tensor.clone()
                for tensor in moved.values():
                    counter.on_device(tensor)
                    if tensor.dtype == torch.bool:
                        counter.counts.kernels["aten::_to_copy"] += 1
                return moved

            return to_device

        replace(node_call, "to_device", make_to_device)

        from .. import inputs

        # The inputs' host copy (``inputs.on_host``) is made of the tensors that live off the host: here, the ones
        # the counter holds for device tensors.
        replace(inputs, "off_host", lambda original: counter.is_device)

        from ..backends import flex

        def make_flex_entry(original):
            # flex_attention runs as one compiled kernel on CUDA; its eager CPU implementation is itself a compiled
            # wrapper that a dispatch mode would stop. It runs outside the counter and counts as one kernel.
            def flex_entry(query, key, value, *args, **kwargs):
                counter.counts.kernels["flex_attention"] += 1
                device = any(counter.is_device(t) for t in (query, key, value))
                with torch.utils._python_dispatch._disable_current_modes(), _outside(counter):
                    out = original(query, key, value, *args, **kwargs)
                if device:
                    counter.on_device(out)
                return out

            return flex_entry

        replace(flex, "_flex_entry", make_flex_entry)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args) + _tensors(kwargs.values())
        from_device = any(self.is_device(t) for t in inputs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.counts.kernels[f"hop::{func.name()}"] += 1
            out = func(*args, **kwargs)
            if from_device:
                self.on_device(out)
            return out
        if launches_kernel(func):
            # On the device a kernel; on the host (the library's planning on host tensors) an operation of the CPU.
            (self.counts.kernels if from_device else self.counts.host_ops)[func._schema.name] += 1
        if from_device and reads_device_values(func, args, kwargs):
            self.sync(func._schema.name)
        if func._schema.name in _ADDITIONS and self.parameters and inputs:
            grads = {id(p.grad) for p in self.parameters if p.grad is not None}
            target = args[0] if args else None
            written = _tensors([target]) if target is not None else []
            if any(id(t) in grads for t in written):
                self.counts.grad_additions += 1
        out = func(*args, **kwargs)
        if from_device:
            self.on_device(out)
        return out


def _names_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the host by the string ``"cpu"``: the library writes its host copies as
    ``.cpu()`` or ``.to("cpu", ...)`` and its device copies as ``.to(device)`` with the model's ``torch.device``, so
    the two directions stay apart on a CPU run, where both devices are the CPU."""
    return any(isinstance(value, str) and value == "cpu" for value in (*args, kwargs.get("device")))


def _target_device(args, kwargs):
    """The device a ``Tensor.to`` call names (None: a dtype-only conversion)."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (torch.device, str)):
            try:
                return torch.device(value)
            except RuntimeError:
                continue
        if isinstance(value, torch.Tensor):
            return value.device
    return None


@contextlib.contextmanager
def _outside(mode: DispatchCount):
    """The counter's own work (the emulated copies) uncounted."""
    counts = mode.counts
    saved = (
        collections.Counter(counts.kernels),
        collections.Counter(counts.host_ops),
        collections.Counter(counts.syncs),
        counts.grad_additions,
    )
    try:
        yield
    finally:
        counts.kernels, counts.host_ops, counts.syncs, counts.grad_additions = saved


def count_step(step: Callable[[], object], model: torch.nn.Module, inputs=()) -> Counts:
    """Run ``step()`` under a :class:`DispatchCount` of ``model`` (its parameters and buffers on the device, and
    ``inputs``, the step's input tensors); the counts."""
    counter = DispatchCount([*model.parameters(), *model.buffers()])
    counter.on_device(*inputs)
    with counter:
        step()
    return counter.counts
