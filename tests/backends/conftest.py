"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest
from support.graph_counter import compile_flex_on_cpu


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Compile the flex path on CPU with a counting backend, and allow its backward there."""
    return compile_flex_on_cpu(monkeypatch)
