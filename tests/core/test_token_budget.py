"""No-grad scoring batches are sized by what the expand backend's attention really allocates (masks, gathered and
repeated keys/values, explicit scores), not by tokens alone."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import expand, expand_memory
from shared_prefix_logps.bench.memory import LiveTensorBytes
from shared_prefix_logps.token_budget import ScoringCosts, plan_prompt_batches, plan_row_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _peak_scoring_bytes(model, batch, budget):
    prompts, pmask, comps, cmask = batch
    tracker = LiveTensorBytes()
    with torch.no_grad(), tracker:
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, token_budget=budget)
    return tracker.peak


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_a_budget_of_a_few_rows_tokens_keeps_the_peak_of_one_at_a_time(family):
    # Long prompts, short completions: the masks, the gathered keys/values and (Gemma2) the explicit scores outweigh
    # the C + P tokens of a row, and the prompt's mask its P tokens, several times, so a budget of 4 rows' tokens
    # holds one prompt's (and Gemma2's one row's) memory. Counting tokens alone, it held 4 rows and both prompts:
    # 2.1x (Gemma2) and 2.5x (Llama) the peak.
    model = build_model(family, layers=2)
    prompt_len, completion_len = 96, 8
    batch = make_batch(2, 8, prompt_len, completion_len, seed=3)
    budget = 4 * (prompt_len + completion_len)
    one_at_a_time = _peak_scoring_bytes(model, batch, 1)
    planned = _peak_scoring_bytes(model, batch, budget)
    assert planned <= 1.1 * one_at_a_time, (planned, one_at_a_time)


def test_every_planned_batch_fits_its_memory_terms():
    model = build_model("gemma2")  # explicit scores, sliding window: every term counts
    shape = expand_memory.AttentionShape.of_model(model)
    costs = ScoringCosts.of(model, torch.device("cpu"), packed=False)
    token_bytes = shape.hidden_size * shape.itemsize
    _, pmask, _, cmask = make_batch(3, 5, 40, 12, seed=1)
    budget = 2000
    rows = plan_row_batches(cmask, pmask, budget, costs)
    per_row = 12 * token_bytes + expand_memory.row_bytes(shape, 39, 12, masked=True, repeats_kv=False)
    assert all(batch.numel() * per_row <= budget * token_bytes for batch in rows)
    # As many rows as fit, up to the rounding of each row's bytes to whole tokens.
    fit = budget * token_bytes // per_row
    assert fit - 1 <= max(batch.numel() for batch in rows) <= fit
    assert len(rows) == 3
    prompts = plan_prompt_batches(pmask, budget, costs)
    per_prompt = 40 * token_bytes + expand_memory.prompt_bytes(shape, 39, masked=True, repeats_kv=False)
    assert all(batch.numel() * per_prompt <= budget * token_bytes for batch in prompts)
    assert [batch.numel() for batch in prompts] == [2, 1]


def test_fused_path_counts_repeated_heads_and_unpadded_prompts_no_mask(monkeypatch):
    model = build_model("llama")  # 4 query heads over 2 KV heads, no window
    _, pmask, _, cmask = make_batch(2, 3, 40, 12)
    unpadded = torch.ones_like(pmask)
    cpu = ScoringCosts.of(model, torch.device("cpu"), packed=False)
    assert cpu.row_tokens(unpadded, 12) < cpu.row_tokens(pmask, 12)  # no per-row mask without padding
    assert cpu.prompt_tokens(unpadded) == 40  # causal SDPA, no mask: the prompt's tokens only
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    fused = ScoringCosts.of(model, torch.device("cpu"), packed=False)
    # Decided per call shape by the kernel expand will choose: no fused kernel takes a CPU call, so the math kernel
    # would, and it repeats the heads itself (enable_gqa): the repeated keys/values count.
    assert fused.repeats_kv is None
    shape = expand_memory.AttentionShape.of_model(model)
    repeated = expand_memory.row_bytes(shape, 39, 12, masked=True, repeats_kv=True)
    token_bytes = shape.hidden_size * shape.itemsize
    assert fused.row_tokens(pmask, 12) == 12 + -(-repeated // token_bytes) > cpu.row_tokens(pmask, 12)
    packed = ScoringCosts.of(model, torch.device("cpu"), packed=True)
    assert packed.row_tokens(pmask, 12) == 12 and packed.prompt_tokens(pmask) == 40
