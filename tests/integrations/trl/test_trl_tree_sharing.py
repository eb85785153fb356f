"""The TRL plug-in shares a system prompt common to different prompts (deeper than the two-level trie) with no
configuration change, and returns what the unpatched trainer returns."""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest
import torch

pytest.importorskip("trl")
if version("trl").startswith("1.15.") and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRL 1.15's GRPOTrainer needs Triton on the device", allow_module_level=True)

from support.trl_tiny import make_trainer  # noqa: E402

from shared_prefix_logps.engine import merge, sharing  # noqa: E402
from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

SYSTEM_LEN = 70


def _batch(trainer, rows=6, completion=4, seed=0):
    """Three distinct prompts (two rows each) that start with the same system prompt, left-padded; right-padded
    completions."""
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    system = torch.randint(3, vocab, (SYSTEM_LEN,), generator=gen)
    width = SYSTEM_LEN + 5
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for p in range(rows // 2):
        prompt = torch.cat([system, torch.randint(3, vocab, (3 + p % 3,), generator=gen)])
        for row in (2 * p, 2 * p + 1):
            prompt_ids[row, width - len(prompt) :] = prompt
            prompt_mask[row, width - len(prompt) :] = 1
    completion_ids = torch.randint(3, vocab, (rows, completion), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 2:] = 0
    return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), completion


def _embedded(model, fn):
    counted = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counted.append(args[0].numel()))
    try:
        result = fn()
    finally:
        handle.remove()
    return result, sum(counted)


def test_shared_system_prompt_embeds_fewer_tokens_with_the_unpatched_numbers(tmp_path, monkeypatch):
    # The trie's own count: the tiny-node rule would merge each 3-5-token prompt into its two rows (tests/engine).
    monkeypatch.setattr(merge, "MERGE_BELOW_SAVED_TOKENS", 0)
    trainer = make_trainer(tmp_path, temperature=0.7)
    input_ids, attention_mask, keep = _batch(trainer)
    expected = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, keep, compute_entropy=True
    )
    patch_grpo_trainer(trainer)

    def patched():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, keep, compute_entropy=True
        )

    patched()  # the first call runs the plug-in's self-check against the unpatched method
    got, deeper = _embedded(trainer.model, patched)
    for ours, theirs in zip(got[:2], expected[:2]):
        assert float((ours - theirs).detach().abs().max()) <= 1e-5
    weights = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    ours = torch.autograd.grad((got[0] * weights).sum(), params, allow_unused=True)
    theirs = torch.autograd.grad((expected[0] * weights).sum(), params, allow_unused=True)
    for a, b in zip(ours, theirs):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-6)

    monkeypatch.setattr(sharing, "DEEPER_SHARING_MIN_TOKENS", 10**9)  # the two-level trie, as before
    _, two_level = _embedded(trainer.model, patched)
    assert deeper <= two_level - 2 * (SYSTEM_LEN - 1), (deeper, two_level)
