"""Processes that see different rows still make the same model calls.

Under DDP, FSDP1/FSDP2 and DeepSpeed the processes' forwards and backwards run collectives that are matched by
order: FSDP gathers each unit's parameters in every forward and reduce-scatters in every backward, ZeRO-3 gathers per
submodule, and DDP broadcasts its buffers in the first forward after a grad-enabled synchronizing one (and in every
forward after such a forward). How many model calls an entry point makes depends on the process's own rows: the
trie's depth, the chunks a token budget cuts, the chunks of a chunked backward. A process that forwards once more
than another pairs its collectives with the other's next ones: a hang, a "collective mismatch" error, or silently
wrong numbers.

So, when the model is wrapped by one of those engines and the process group has more than one process, each core
entry point keeps the processes in step itself (:func:`call_lockstep`; how, in ``engine/lockstep.py``): no-grad calls
join (:meth:`Lockstep.forwards`: each process announces every forward with a one-integer all-reduce; a process that
is done makes a one-token no-grad forward for each forward another process announces), grad-enabled ones agree on
their calls (all-reduces of an integer) and make placeholder calls in place of the ones they lack, whose results
join the backward with weight zero.

A caller that keeps the processes in step itself (the trainer plug-ins' joins) runs the core entry points under
:func:`caller_keeps_step`, and a caller can opt out per call with ``lockstep=False``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .ddp import find_ddp

_CALLER_KEEPS_STEP = contextvars.ContextVar("shared_prefix_logps_caller_keeps_step", default=False)


class Lockstep:
    """Agreement between the processes of ``group`` (default: the default process group), with tensors on ``device``
    (the accelerator's: NCCL reduces CUDA tensors only)."""

    def __init__(self, device: torch.device, group=None):
        self.device = torch.device(device)
        self.group = group
        self.padding_forwards = 0  # one-token forwards made to keep in step (this process)

    def max_all(self, values: list[int]) -> list[int]:
        """Each of ``values``' largest value over the processes (one all-reduce)."""
        tensor = torch.tensor([int(v) for v in values], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in tensor.tolist()]

    def max(self, value: int) -> int:
        """The largest ``value`` of any process."""
        return self.max_all([value])[0]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process."""
        return self.max(int(bool(flag))) > 0

    @contextlib.contextmanager
    def forwards(self, model: nn.Module, pad: Callable[[], object] | None = None):
        """Keep the block's no-grad forwards of ``model`` in step with the other processes' (a join).

        Before each forward of ``model`` in the block, the process announces it (an all-reduce); a process that has left
        the block keeps answering announcements, making a one-token forward (no gradient, eval mode, output dropped) for
        each forward another process makes, until no process forwards any more. Every process must enter the block at
        the same point; in it, ``model`` may be forwarded only without gradient, and no other collective may run. The
        core entry points called in the block make no agreement of their own (:func:`caller_keeps_step`). If the block
        raises, the error propagates without the join.

        ``pad`` makes one padding forward of ``model`` (it runs without gradient, in eval mode; its result is dropped);
        by default a one-token ``model(input_ids=...)``, which calls the same submodules, in the same order, as a
        plain forward or a node call (the lm_head included). A block whose forwards call the model another
        way (TRL's fused head, which reads the lm_head's weight without calling the lm_head) must pass a ``pad`` that
        does the same: under ZeRO-3 a forward that skips a submodule skips that submodule's parameter gather, and the
        processes' gathers would pair up wrongly.
        """

        def announce(module, args):
            self.max(1)

        # Before the wrappers' own pre-forward work (FSDP's parameter gathers, DDP's buffer broadcast)
        handle = model.register_forward_pre_hook(announce, prepend=True)
        try:
            with caller_keeps_step():
                yield
        finally:
            handle.remove()
        pad = pad if pad is not None else self._one_token_forward(model)
        while self.max(0):
            with torch.no_grad(), eval_mode(model):
                pad()
            self.padding_forwards += 1

    def _one_token_forward(self, model: nn.Module) -> Callable[[], object]:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return lambda: model(input_ids=ids, use_cache=False)


@contextlib.contextmanager
def caller_keeps_step():
    """In the block the core entry points make no agreement of their own: the caller keeps the processes' model calls
    in step (a join, or calls that every process makes alike)."""
    token = _CALLER_KEEPS_STEP.set(True)
    try:
        yield
    finally:
        _CALLER_KEEPS_STEP.reset(token)


def collective_wrapper(model: nn.Module) -> str | None:
    """The name of the engine among ``model`` and its submodules whose forwards or backwards are collectives (DDP,
    FSDP1, FSDP2, DeepSpeed), or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    deepspeed = sys.modules.get("deepspeed")
    engine_type = getattr(deepspeed, "DeepSpeedEngine", ()) if deepspeed is not None else ()
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return "DistributedDataParallel"
        if isinstance(module, FullyShardedDataParallel):
            return "FullyShardedDataParallel"
        if isinstance(module, FSDPModule):
            return "FSDP2 (fully_shard)"
        if isinstance(module, engine_type):
            return "DeepSpeed"
    if any(hasattr(param, "ds_id") for param in model.parameters()):
        return "DeepSpeed ZeRO-3"
    return None


def call_lockstep(model: nn.Module, lockstep: bool | None, device: torch.device) -> Lockstep | None:
    """The agreement a core entry point keeps with the other processes, or None when it needs none.

    ``lockstep``: None (default) keeps step when ``model`` is wrapped by DDP, FSDP or DeepSpeed and the process group
    has more than one process; True also for other models (a caller whose own collectives pair with the model calls);
    False never (the caller guarantees that every process makes the same model calls). Inside
    :func:`caller_keeps_step` there is no agreement either.
    """
    if lockstep is not None and not isinstance(lockstep, bool):
        raise TypeError(f"lockstep must be True, False or None, got {type(lockstep).__name__}")
    if lockstep is False or _CALLER_KEEPS_STEP.get():
        return None
    initialized = dist.is_available() and dist.is_initialized()
    if lockstep is None and not (initialized and collective_wrapper(model) is not None):
        return None
    if not initialized:
        raise ValueError("lockstep=True needs an initialized torch.distributed process group")
    ddp = find_ddp(model)
    group = ddp.process_group if ddp is not None else None
    if dist.get_world_size(group) == 1:
        return None
    return Lockstep(device, group)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` for the block, then every submodule's own ``training`` flag restored."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
