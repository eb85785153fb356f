"""Fixtures of the ms-swift plug-in's tests: the tiny models saved once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """A folder holding the tiny models and datasets (:func:`support.swift_setup.build_tiny`)."""
    return tmp_path_factory.mktemp("swift_tiny")


@pytest.fixture(autouse=True)
def _no_plugin_left_installed():
    """Every test starts and ends with ms-swift's own GRPOTrainer methods: a run with ``--external_plugins`` installs
    the plug-in on the class for the rest of the process, as it would in a ``swift rlhf`` process."""
    from shared_prefix_logps.integrations.swift import uninstall

    uninstall()
    yield
    uninstall()
