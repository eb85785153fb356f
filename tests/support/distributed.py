"""Pieces shared by the multi-process tests (DDP, FSDP, DeepSpeed): a free port, the rows' loss and layouts."""

from __future__ import annotations

import os
import socket

import torch

#: Completions per prompt in the multi-process tests (2 prompts per rank).
GENERATIONS = 3


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weighted_loss(out, rows=None):
    """Log-probs and entropies weighted per position (the same weights on every rank), so a gradient routed to the
    wrong token or row shows; ``rows`` selects the weights of a chunk's rows (``chunked_backward``)."""
    weights = torch.randn((2 * GENERATIONS, out.logps.shape[1]), generator=torch.Generator().manual_seed(7))
    weights = weights if rows is None else weights[rows]
    return (out.logps * weights).sum() + (out.entropy * weights.flip(1)).sum()


def concatenated(prompts, prompt_mask, completions, completion_mask):
    """``[prompt | completion]`` rows and mask as trainers build them (each prompt repeated GENERATIONS times)."""
    rows = torch.cat([prompts.repeat_interleave(GENERATIONS, 0), completions], dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(GENERATIONS, 0), completion_mask], dim=1)
    return rows, mask


def set_rank_environment(rank: int, port: int, world_size: int = 2) -> None:
    """The environment variables torch.distributed and accelerate read to join a process group on the loopback."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def init_gloo(rank: int, port: int, world_size: int = 2, timeout_s: float = 30.0) -> None:
    """Join a gloo process group on the loopback whose collectives give up after ``timeout_s`` (a rank left waiting
    for a collective another rank never makes then raises instead of hanging)."""
    import datetime

    import torch.distributed as dist

    set_rank_environment(rank, port, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def keep_deepspeed_from_compiling() -> None:
    """Start DeepSpeed's process groups without its shared-memory all-reduce op (used only by its inference
    all-reduce, not by ZeRO). Its CPU backend otherwise compiles that op when a process group starts, under a file lock
    in ``~/.cache/torch_extensions``: a rank killed mid-compile (a test's timeout) leaves the lock behind, and every
    later DeepSpeed start on the machine then waits on it forever."""
    import importlib

    # By its module path: the attribute ``deepspeed.comm.torch`` is the torch package itself.
    backend_module = importlib.import_module("deepspeed.comm.torch")
    backend_module.build_shm_op = lambda: None  # TorchBackend calls it at each start; None means "no op"


def init_deepspeed_gloo(timeout_s: float = 60.0) -> None:
    """``deepspeed.init_distributed`` on gloo (after :func:`set_rank_environment`), compiling nothing, its
    collectives giving up after ``timeout_s``."""
    import datetime

    import deepspeed

    keep_deepspeed_from_compiling()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def spawn_ranks(worker, args: tuple, *, timeout_s: float = 180.0, world_size: int = 2) -> None:
    """``mp.spawn(worker, args, nprocs=world_size)``, but a run still going after ``timeout_s`` is killed and
    reported as a hang (an exception raised in a rank propagates as with ``mp.spawn``)."""
    import time

    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.5, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the {world_size} ranks were still running after {timeout_s:.0f} s (hung)")


def decoder_parts(model):
    """``(causal LM, decoder layers, input embedding, lm_head)`` of a (PEFT-wrapped) tiny model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner, inner.model.layers, inner.model.embed_tokens, inner.lm_head


def wrap_fsdp2(model):
    """FSDP2 as trainers shard: each decoder layer, the embedding and the untied lm_head their own units, then the
    root; ``reshard_after_forward=True``; forward inputs cast by the mixed-precision policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2,))
    options = dict(mesh=mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=True))
    _, layers, embed, lm_head = decoder_parts(model)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(embed, **options)
    fully_shard(lm_head, **options)
    fully_shard(model, **options)
    return model


def wrap_fsdp1(model):
    """FSDP1 as accelerate's TRANSFORMER_BASED_WRAP: each decoder layer a unit, embeddings and head in the root."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _, layers, _, _ = decoder_parts(model)
    wrap = functools.partial(
        FullyShardedDataParallel,
        auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}),
        use_orig_params=True,
        mixed_precision=MixedPrecision(cast_forward_inputs=True),
        # Named explicitly: FSDP1 picks an accelerator by itself and refuses CPU-only processes otherwise.
        device_id=torch.device("cpu"),
    )
    return wrap(model)


def full_gradients(engine: str, wrapped, names) -> dict:
    """Every named parameter's full (unsharded) gradient under ``engine`` (``ddp``, ``fsdp1`` or ``fsdp2``), or None
    where it has none; a collective under FSDP: every rank calls it at the same point."""
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
            params = {key.replace("_fsdp_wrapped_module.", ""): p for key, p in wrapped.named_parameters()}
            return {name: None if params[name].grad is None else params[name].grad.detach().clone() for name in names}
    module = wrapped.module if engine == "ddp" else wrapped
    params = dict(module.named_parameters())
    result = {}
    for name in names:
        grad = params[name].grad
        result[name] = None if grad is None else (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return result
