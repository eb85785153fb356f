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
