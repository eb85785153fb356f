"""The OpenRLHF plug-in's tests run where OpenRLHF is installed (`make test-openrlhf`, its own venv)."""

import pytest

pytest.importorskip("openrlhf")
