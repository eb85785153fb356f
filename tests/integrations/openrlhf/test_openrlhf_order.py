"""The group-preserving order: OpenRLHF's own ``ppo_train`` DataLoader over its own replay buffer yields micro-batches
of whole prompt groups, every sample once; OpenRLHF's sample shuffle does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")

import torch  # noqa: E402
from support.openrlhf_setup import import_ppo_actor, openrlhf_rows

from shared_prefix_logps.integrations.openrlhf import install_group_order, uninstall_group_order
from shared_prefix_logps.integrations.openrlhf.order import prompt_key


def _replay_buffer(prompts, generations, monkeypatch):
    from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
    from openrlhf.trainer.ppo_utils.experience import Experience

    sequences, attention, actions = openrlhf_rows(prompts, generations, seed=3)
    # the buffer records a CUDA device it never uses in what this test runs (append, len, getitem, collate)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buffer = NaiveReplayBuffer(sample_batch_size=generations, cpu_offload=False)
    buffer.append(Experience(sequences=sequences, attention_mask=attention, action_mask=actions))
    return buffer


def _micro_batches(ppo_actor, buffer, generations):
    torch.manual_seed(0)
    loader = ppo_actor.DataLoader(
        buffer, batch_size=generations, shuffle=True, drop_last=True, collate_fn=buffer.collate_fn
    )
    fields = ("sequences", "attention_mask", "action_mask")
    return [
        [prompt_key(SimpleNamespace(**{k: getattr(batch, k)[i] for k in fields})) for i in range(len(batch.sequences))]
        for batch in loader
    ]


def test_group_order_keeps_each_prompt_in_one_micro_batch(monkeypatch):
    ppo_actor = import_ppo_actor()
    buffer = _replay_buffer(6, 4, monkeypatch)
    shuffled = _micro_batches(ppo_actor, buffer, 4)
    assert max(len(set(batch)) for batch in shuffled) > 1  # OpenRLHF's order splits groups
    assert install_group_order() is True and install_group_order() is False
    try:
        grouped = _micro_batches(ppo_actor, buffer, 4)
    finally:
        assert uninstall_group_order() is True
    assert ppo_actor.DataLoader is torch.utils.data.DataLoader
    assert [len(set(batch)) for batch in grouped] == [1] * 6
    assert sorted(key for batch in grouped for key in batch) == sorted(key for batch in shuffled for key in batch)
