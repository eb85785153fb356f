"""Row layouts of trainer batches (``integrations/common/rows.py``)."""

from __future__ import annotations

import pytest
import torch

from shared_prefix_logps.integrations.common.rows import layout_problem


def test_layout_takes_logits_to_keep_as_any_integer_scalar():
    """A numpy or 0-d tensor ``logits_to_keep`` is the same count as the int (a trainer computing it with numpy
    would otherwise fall back to its own path for every batch); floats are not counts."""
    np = pytest.importorskip("numpy")
    ids = torch.arange(12).reshape(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 0] = 0  # left padding
    mask[0, 5] = 0  # right padding
    assert layout_problem(ids, mask, 3) is None
    for keep in (np.int64(3), np.int32(3), torch.tensor(3)):
        assert layout_problem(ids, mask, keep) is None
    for keep in (3.0, np.float64(3.0), torch.tensor(3.0), True):
        assert layout_problem(ids, mask, keep) == "logits_to_keep is not an int"
    assert layout_problem(ids, mask, np.int64(6)) == "no prompt columns (logits_to_keep covers the whole row)"
