"""Parsing the verl plug-in's environment variables, without verl installed: the options module imports nothing
from verl, so it is loaded from its file (the package's ``__init__`` needs verl). A bad value names its variable and
the form the variable accepts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import shared_prefix_logps


@pytest.fixture(scope="module")
def options():
    path = Path(shared_prefix_logps.__file__).parent / "integrations" / "verl" / "options.py"
    spec = importlib.util.spec_from_file_location("verl_options_without_verl", path)
    module = importlib.util.module_from_spec(spec)
    # Its relative imports (the trainer-neutral ``integrations.common``) resolve from the package it lives in, whose
    # ``__init__`` is never run here.
    module.__package__ = "shared_prefix_logps.integrations.verl"
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_good_values_are_parsed(options):
    parsed = options.options_from_environment(
        {
            "SHARED_PREFIX_LOGPS_BACKEND": " Expand ",
            "SHARED_PREFIX_LOGPS_TOKEN_BUDGET": "4096",
            "SHARED_PREFIX_LOGPS_TOLERANCE": "1e-2, 1e-3",
            "SHARED_PREFIX_LOGPS_LOG_EVERY": "0",
        }
    )
    assert (parsed.backend, parsed.token_budget, parsed.tolerance, parsed.log_every) == (
        "expand",
        4096,
        (1e-2, 1e-3),
        0,
    )
    assert options.options_from_environment({}) == options.VerlOptions()


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("SHARED_PREFIX_LOGPS_TOKEN_BUDGET", "abc", r"whole number >= 1 written in digits"),
        ("SHARED_PREFIX_LOGPS_TOKEN_BUDGET", "1e6", r"whole number >= 1 written in digits"),
        ("SHARED_PREFIX_LOGPS_TOKEN_BUDGET", "0", r"whole number >= 1 written in digits"),
        ("SHARED_PREFIX_LOGPS_TOLERANCE", "x", r"two non-negative numbers max_abs,mean_abs"),
        ("SHARED_PREFIX_LOGPS_TOLERANCE", "1e-2", r"two non-negative numbers max_abs,mean_abs"),
        ("SHARED_PREFIX_LOGPS_TOLERANCE", "1e-2,nan", r"two non-negative numbers max_abs,mean_abs"),
        ("SHARED_PREFIX_LOGPS_LOG_EVERY", "1.5", r"whole number >= 0 written in digits"),
        ("SHARED_PREFIX_LOGPS_LOG_EVERY", "-1", r"whole number >= 0 written in digits"),
        ("SHARED_PREFIX_LOGPS_BACKEND", "dense", r"one of \('auto', 'expand', 'flex'\)"),
    ],
)
def test_bad_values_name_the_variable_and_the_accepted_form(options, name, value, accepted):
    with pytest.raises(ValueError, match=rf"^{name} must be .*{accepted}.*got '{value}'"):
        options.options_from_environment({name: value})
