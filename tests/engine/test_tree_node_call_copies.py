"""A node call's planned tensors reach the device in one host-to-device copy (from page-locked memory on CUDA), not
one pageable copy per tensor, each of which the host waits for. The copies are counted on CPU with "meta" as the
target device; the packing round trip is checked for values."""

from __future__ import annotations

import torch
from support.trees import planned_node_calls, random_tree_rows
from torch.utils._python_dispatch import TorchDispatchMode

from shared_prefix_logps.forward.node_call import pack, unpack


class HostToDeviceCopies(TorchDispatchMode):
    """Counts the copies from CPU tensors to tensors on another device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in ("aten::_to_copy", "aten::copy_", "aten::to") and isinstance(out, torch.Tensor):
            source = args[1] if name == "aten::copy_" else args[0]
            if source.device.type == "cpu" and out.device.type != "cpu":
                self.count += 1
        return out


def _calls():
    rows = random_tree_rows(3, depth=3, branching=3, max_segment=20)
    _, calls = planned_node_calls(rows, rows_per_chunk=2)
    assert len(calls) > 1
    return calls


def test_a_node_call_reaches_the_device_in_one_copy():
    for call in _calls():
        tensors = [name for name in call.__dataclass_fields__ if isinstance(getattr(call, name), torch.Tensor)]
        assert len(tensors) == 17  # the expand layout's: packing, ancestors, head pairs, the store's structure, slots
        with HostToDeviceCopies() as copies:
            moved = call.to(torch.device("meta"))
        assert copies.count == 1
        for name in tensors:
            before, after = getattr(call, name), getattr(moved, name)
            assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype
        assert moved.sources == call.sources


def test_packing_keeps_every_value_shape_and_dtype():
    for call in _calls():
        tensors = {n: getattr(call, n) for n in call.__dataclass_fields__ if isinstance(getattr(call, n), torch.Tensor)}
        buffer, layout = pack(tensors)
        assert buffer.dtype == torch.long and buffer.dim() == 1
        back = unpack(buffer, layout)
        assert list(back) == list(tensors)
        for name, value in tensors.items():
            assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


def test_a_call_already_on_the_device_is_not_copied():
    call = _calls()[0]
    with HostToDeviceCopies() as copies:
        same = call.to(torch.device("cpu"))
    assert copies.count == 0 and same.input_ids is call.input_ids
