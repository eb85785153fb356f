"""Whole rows with a score mask re-laid as prompt and completion (``integrations/common/scored_rows.py``): the
OpenRLHF and ms-swift plug-ins' frame. The log-probs put back must be the full-row forward's at every scored token."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import VOCAB, build_model

from shared_prefix_logps import compute_logps_concatenated
from shared_prefix_logps.integrations.common.scored_rows import (
    scored_rows_problem,
    to_next_token_layout,
    to_prefix_rows,
)


def _rows(right_padded: bool, seed: int = 0):
    """(ids, attention_mask, score_mask (B, A)): 2 prompts x 3 completions of different lengths, prompts of different
    lengths, the second row of each group with an unscored observation inside its completion."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 3)]
    rows, scored = [], []
    for prompt in prompts:
        for length in (4, 2, 5):
            completion = torch.randint(0, VOCAB, (length,), generator=gen)
            rows.append(torch.cat([prompt, completion]))
            mark = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(length, dtype=torch.bool)])
            if length == 2:
                mark[len(prompt) + 1] = False  # an observation: computed, not scored
            scored.append(mark)
    width = max(len(r) for r in rows) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    tokens = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, mark) in enumerate(zip(rows, scored)):
        span = slice(0, len(row)) if right_padded else slice(width - len(row), width)
        ids[i, span], mask[i, span], tokens[i, span] = row, 1, mark
    first_scored = int(tokens.long().argmax(dim=1).min())
    return ids, mask, tokens[:, first_scored:]  # column j scores token width - A + j


@pytest.mark.parametrize("right_padded", [True, False])
def test_put_back_log_probs_are_the_full_rows(right_padded):
    """The re-laid rows' log-probs, put back in the (B, S - 1) frame and cut to the last A columns, equal the model's
    own full-row log-probs at every scored token (float32, 1e-5), and are 0.0 where no completion token is predicted."""
    model = build_model("qwen2", seed=1).eval()
    ids, mask, score = _rows(right_padded)
    assert scored_rows_problem(ids, mask, score) is None
    rows = to_prefix_rows(ids, mask, score)
    out = compute_logps_concatenated(model, rows.input_ids, rows.attention_mask, rows.completion_width)
    ours = to_next_token_layout(out.logps, rows, ids.shape[1])[:, -score.shape[1] :]

    with torch.no_grad():
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1].float()
    reference = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0][:, -score.shape[1] :]
    torch.testing.assert_close(ours[score], reference[score], atol=1e-5, rtol=0)
    completion = torch.zeros_like(score)
    completion[rows.rows, rows.positions - (ids.shape[1] - 1 - score.shape[1])] = True
    assert bool((ours[~completion] == 0).all())
    assert bool(completion[score].all())  # every scored token is a completion token


def test_problems_name_the_trainers_tensors():
    """A batch that cannot be re-laid exactly is named, with the trainer's names of its tensors."""
    ids, mask, score = _rows(True)
    names = dict(ids_name="sequences", score_name="completion_mask")
    holed = mask.clone()
    holed[0, 2] = 0
    assert "contiguous" in scored_rows_problem(ids, holed, score, **names)
    padded_score = score.clone()
    padded_score[:, -1] = True  # the last column is padding in the right-padded rows
    assert scored_rows_problem(ids, mask, padded_score, **names) == "completion_mask marks padding tokens"
    assert scored_rows_problem(ids.float(), mask, score, **names) == "sequences is not a 2-D integer tensor"
    too_wide = torch.ones(ids.shape[0], ids.shape[1], dtype=torch.bool)
    assert "completion_mask is not (rows, A)" in scored_rows_problem(ids, mask, too_wide, **names)
