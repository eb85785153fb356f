"""Fixtures of the verl plug-in's tests."""

import pytest


@pytest.fixture(scope="module")
def process_group():
    """The one-process gloo group verl's engine needs, on the CPU platform the tests register (per test module, as
    each module builds its own engines)."""
    from support import verl_setup as vs
    from support.distributed import free_port

    vs.use_cpu_platform()
    vs.init_single_process(free_port())
