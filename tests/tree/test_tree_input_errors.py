"""Bad input to the tree entry points gets a clear error naming the argument."""

import pytest
import torch
from support.tiny_models import build_model

from shared_prefix_logps import compute_logps_tree


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _rows():
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    score = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    return ids, mask, score


def test_valid_rows_pass(model):
    ids, mask, score = _rows()
    with torch.no_grad():
        out = compute_logps_tree(model, ids, mask, score)
    assert out.logps.shape == (2, 4)


@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (
            lambda i, m, s: (i, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool), s),
            ValueError,
            "attention_mask row 0 is not contiguous",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 0 scores column 0, which is padding",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 1 scores column 0, the row's first real token",
        ),
        (lambda i, m, s: (i, m[:, :3], s), ValueError, "attention_mask has shape"),
        (lambda i, m, s: (i, m, s[:1]), ValueError, "score_mask has shape"),
        (lambda i, m, s: (i, None, s), ValueError, "attention_mask is required"),
        (lambda i, m, s: (i, m, None), ValueError, "score_mask is required"),
        (lambda i, m, s: (i.float(), m, s), TypeError, "input_ids must hold integer token ids"),
        (lambda i, m, s: (i[0], m, s), ValueError, "input_ids must be 2-D"),
        (lambda i, m, s: (i.tolist(), m, s), TypeError, "input_ids must be a LongTensor"),
        (lambda i, m, s: (i + 1000, m, s), ValueError, "input_ids holds token id"),
        (lambda i, m, s: (i, m.float(), s), TypeError, "attention_mask must be bool or integer"),
        (lambda i, m, s: (i, m, s.long() * 2), ValueError, "score_mask must hold only 0 and 1"),
    ],
)
def test_bad_rows(model, change, error, pattern):
    ids, mask, score = change(*_rows())
    with pytest.raises(error, match=pattern):
        compute_logps_tree(model, ids, mask, score)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(backend="flex"), "no backward on CPU"),
        (dict(backend="nope"), "backend must be one of"),
        (dict(temperature=0.0), "temperature must be positive"),
    ],
)
def test_bad_options(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_logps_tree(model, *_rows(), **kwargs)
