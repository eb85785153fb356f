"""The one-line install: the class-level ``Actor.forward`` every actor of a process gets, its options from the
environment, Ray's worker setup hook added to OpenRLHF's ``ray.init`` by the launcher (no Ray cluster is started)."""

from __future__ import annotations

import copy
import sys

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
from support.openrlhf_setup import import_openrlhf, make_actor, openrlhf_rows

from shared_prefix_logps.integrations.openrlhf import get_patch, install, launch, uninstall, with_setup_hook
from shared_prefix_logps.integrations.openrlhf.install import SETUP_HOOK, setup_worker


@pytest.fixture
def installed():
    models = import_openrlhf()
    original = models.Actor.__dict__["forward"]
    yield models.Actor
    uninstall()
    assert models.Actor.__dict__["forward"] is original


def test_installed_forward_serves_every_actor(installed, monkeypatch):
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_OPENRLHF_BACKEND", "expand")
    reference = make_actor(temperature=0.8)
    actor = copy.deepcopy(reference)
    assert install() is True and install() is False
    sequences, attention, actions = openrlhf_rows(2, 3)
    with torch.no_grad():
        ours = actor(sequences, actions, attention)
    patch = get_patch(actor)
    assert patch is not None and patch.backend == "expand" and patch.stats.shared_calls == 1
    assert [check.passed for check in patch.stats.self_checks] == [True]
    with torch.no_grad():
        torch.testing.assert_close(
            ours,
            installed.__dict__["forward"]._shared_prefix_logps_original(reference, sequences, actions, attention),
            atol=1e-5,
            rtol=0,
        )


def test_disabled_by_environment(installed, monkeypatch):
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_OPENRLHF", "0")
    setup_worker()
    actor = make_actor()
    sequences, attention, actions = openrlhf_rows(2, 2)
    with torch.no_grad():
        actor(sequences, actions, attention)
    assert get_patch(actor) is None


def test_bad_environment_value_is_refused(installed, monkeypatch):
    install()
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_OPENRLHF_SELF_CHECK", "yes")
    actor = make_actor()
    sequences, attention, actions = openrlhf_rows(2, 2)
    with pytest.raises(ValueError, match="SHARED_PREFIX_LOGPS_OPENRLHF_SELF_CHECK must be 0 or 1"):
        actor(sequences, actions, attention)


def test_runtime_env_gets_the_hook_and_options(monkeypatch):
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_OPENRLHF_GROUP_ORDER", "1")
    given = {"env_vars": {"NCCL_DEBUG": "WARN"}, "working_dir": "/w"}
    env = with_setup_hook(given)
    assert env["worker_process_setup_hook"] == SETUP_HOOK
    assert env["env_vars"] == {"NCCL_DEBUG": "WARN", "SHARED_PREFIX_LOGPS_OPENRLHF_GROUP_ORDER": "1"}
    assert env["working_dir"] == "/w" and "worker_process_setup_hook" not in given
    with pytest.raises(ValueError, match="one hook per worker"):
        with_setup_hook({"worker_process_setup_hook": "mine.setup"})


def test_launcher_runs_openrlhf_with_the_hook(installed, monkeypatch):
    """``python -m shared_prefix_logps.integrations.openrlhf.launch ARGS`` runs ``openrlhf.cli.train_ppo_ray`` as
    ``__main__`` with ARGS, and OpenRLHF's own ``ray.init(runtime_env=...)`` call gets the setup hook."""
    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append(k))

    def run_module(name, run_name, alter_sys):
        calls.append((name, run_name, list(sys.argv)))
        import ray as ray_in_launcher  # what OpenRLHF's launcher calls

        ray_in_launcher.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})

    monkeypatch.setattr(launch.runpy, "run_module", run_module)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    launch.main(["--actor.model_name_or_path", "m"])
    assert calls[0] == (launch.LAUNCHER, "__main__", [launch.LAUNCHER, "--actor.model_name_or_path", "m"])
    assert calls[1]["runtime_env"]["worker_process_setup_hook"] == SETUP_HOOK
    assert calls[1]["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] == "true"
    assert "_shared_prefix_logps_original" in vars(installed.__dict__["forward"])


def test_group_order_option(installed, monkeypatch):
    """SHARED_PREFIX_LOGPS_OPENRLHF_GROUP_ORDER=1: the worker hook also installs the group-preserving order."""
    from support.openrlhf_setup import import_ppo_actor

    from shared_prefix_logps.integrations.openrlhf import uninstall_group_order

    ppo_actor = import_ppo_actor()
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_OPENRLHF_GROUP_ORDER", "1")
    setup_worker()
    try:
        assert ppo_actor.DataLoader is not torch.utils.data.DataLoader
    finally:
        assert uninstall_group_order() is True
    assert ppo_actor.DataLoader is torch.utils.data.DataLoader
