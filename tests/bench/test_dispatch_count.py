"""The CPU counter of what a step would cost a GPU's host (bench/dispatch_count.py): kernels without views, host syncs
only on device values, gradient additions."""

import torch

from shared_prefix_logps.bench.dispatch_count import DispatchCount, count_step, launches_kernel


def test_views_and_allocations_launch_nothing():
    x = torch.randn(4, 6)
    counter = DispatchCount()
    counter.on_device(x)
    with counter:
        x.view(24)
        x.transpose(0, 1)
        x[1:3]
        torch.empty(3)
        x + 1  # a kernel
        x.mul_(2)  # a kernel (in place)
    assert counter.counts.kernels == {"aten::add": 1, "aten::mul_": 1}, counter.counts.kernels
    assert launches_kernel(torch.ops.aten.add.Tensor) and not launches_kernel(torch.ops.aten.view.default)


def test_host_syncs_are_device_reads_only():
    """Reading a device value (item, bool, tolist, a boolean-mask index, nonzero, a blocking copy to the device) is a
    sync; the same reads of host tensors are the host's own work."""
    device_values, host_values = torch.arange(6), torch.arange(6)
    counter = DispatchCount()
    counter.on_device(device_values)
    with counter:
        host_values[host_values > 2]  # host: no sync
        int(host_values.sum())
        host_values.tolist()
        made = torch.zeros(3, device="cpu") + device_values[:3]  # a device tensor, made without a read
        int(device_values.sum())  # item
        device_values[device_values > 2]  # boolean mask
        device_values.nonzero()
        made.tolist()
        device_values.cpu()
        host_values.to(torch.device("cpu"))  # a blocking copy to the device
        host_values.to(torch.device("cpu"), non_blocking=True)  # a non-blocking one: no sync
    kinds = sorted(site[site.rindex(" (") + 2 : -1] for site in counter.counts.syncs.elements())
    assert kinds == [
        ".cpu()",
        ".to(device)",
        ".tolist()",
        "aten::_local_scalar_dense",
        "aten::index",
        "aten::nonzero",
    ], kinds
    assert counter.counts.host_ops and counter.counts.kernels


def test_gradient_additions_count_pointwise_additions_into_grad():
    """AccumulateGrad's addition into an existing ``.grad`` counts; the first backward's assignment does not."""
    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)

    def step():
        (x @ weight).sum().backward()

    holder = torch.nn.Module()
    holder.weight = weight
    first = count_step(step, holder)  # assigns .grad
    counter = DispatchCount([weight])
    with counter:
        step()  # adds into it
        torch._foreach_add_([weight.grad], [torch.ones(3, 3)])  # one operation over a list
    assert first.grad_additions == 0
    assert counter.counts.grad_additions == 2, counter.counts.grad_additions
