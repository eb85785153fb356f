"""A group-preserving order for OpenRLHF's training micro-batches.

The shared path shares a prompt only among the rows of one call. OpenRLHF's ``ActorPPOTrainer.ppo_train`` draws
training micro-batches from its replay buffer with ``DataLoader(shuffle=True)``, which scatters a prompt's samples over
micro-batches (a micro-batch of 8 from 64 prompts x 8 samples holds ~8 different prompts). The group-preserving order
shuffles whole groups (the samples of one prompt, kept together in their order) instead of samples: a micro-batch of
``k x G`` samples holds ``k`` whole groups. Every sample is still visited once per epoch; only which samples share a
micro-batch changes, so the token-mean loss of a step's window is the same sum.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

ORIGINAL_ATTRIBUTE = "_shared_prefix_logps_original"


def prompt_key(item) -> tuple:
    """The tokens before an experience's first action token (its prompt), as a hashable key.

    ``item`` is one replay-buffer sample: ``sequences`` (L,) or (1, L), ``attention_mask`` alike, ``action_mask``
    (L - 1,) or (1, L - 1) (OpenRLHF's shifted layout: entry ``t`` marks token ``t + 1``)."""
    sequences = item.sequences.reshape(-1)
    valid = item.attention_mask.reshape(-1) != 0
    actions = item.action_mask.reshape(-1) != 0
    tokens = torch.zeros_like(valid)
    tokens[sequences.numel() - actions.numel() :] = actions
    first = int(tokens.long().argmax()) if bool(tokens.any()) else sequences.numel()
    return tuple(sequences[:first][valid[:first]].tolist())


class GroupShuffleSampler(Sampler[int]):
    """Indices of ``items`` with each prompt's samples together (in buffer order) and the groups shuffled.

    Args:
        items: the replay buffer's samples (``Experience`` objects), read at each ``__iter__``.
        generator: optional ``torch.Generator`` for the group order.
    """

    def __init__(self, items, generator: torch.Generator | None = None):
        self.items = items
        self.generator = generator

    def groups(self) -> list[list[int]]:
        """Sample indices per prompt, groups in order of first appearance."""
        groups: dict[tuple, list[int]] = {}
        for index, item in enumerate(self.items):
            groups.setdefault(prompt_key(item), []).append(index)
        return list(groups.values())

    def __iter__(self):
        groups = self.groups()
        for group in torch.randperm(len(groups), generator=self.generator).tolist():
            yield from groups[group]

    def __len__(self) -> int:
        return len(self.items)


def group_preserving_dataloader(dataloader_class):
    """A drop-in for ``DataLoader`` that, asked to shuffle a dataset with ``items`` (OpenRLHF's replay buffer),
    shuffles whole prompt groups (:class:`GroupShuffleSampler`); any other call is the plain ``dataloader_class``."""

    def make(dataset, *args, shuffle=None, **kwargs):
        if shuffle and hasattr(dataset, "items") and not args and "sampler" not in kwargs:
            return dataloader_class(dataset, sampler=GroupShuffleSampler(dataset.items), **kwargs)
        return dataloader_class(dataset, *args, shuffle=shuffle, **kwargs)

    setattr(make, ORIGINAL_ATTRIBUTE, dataloader_class)
    return make


def install_group_order() -> bool:
    """Make ``ActorPPOTrainer.ppo_train`` draw micro-batches in the group-preserving order (it looks ``DataLoader`` up
    in ``openrlhf.trainer.ray.ppo_actor`` at each call). Returns False if it was installed already."""
    from openrlhf.trainer.ray import ppo_actor

    if getattr(ppo_actor.DataLoader, ORIGINAL_ATTRIBUTE, None) is not None:
        return False
    ppo_actor.DataLoader = group_preserving_dataloader(ppo_actor.DataLoader)
    return True


def uninstall_group_order() -> bool:
    """Undo :func:`install_group_order`. Returns False if it was not installed."""
    from openrlhf.trainer.ray import ppo_actor

    original = getattr(ppo_actor.DataLoader, ORIGINAL_ATTRIBUTE, None)
    if original is None:
        return False
    ppo_actor.DataLoader = original
    return True
