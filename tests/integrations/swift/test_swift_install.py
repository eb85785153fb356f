"""Installing the ms-swift plug-in: the ``--external_plugins`` file and its path, ``swift rlhf`` itself with the flag
(a subprocess, the command users run), the class-level patch and its exact restore, the options."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (make test-swift)")

import torch  # noqa: E402
from support import swift_setup as ss  # noqa: E402

from shared_prefix_logps.integrations import swift as plugin  # noqa: E402
from shared_prefix_logps.integrations.swift.install import trainer_class  # noqa: E402
from shared_prefix_logps.integrations.swift.patch import LIGER_METHOD, LOGPS_METHOD  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _plugin_path_from_the_command_line() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "shared_prefix_logps.integrations.swift", "--plugin-path"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return Path(out.stdout.strip())


def test_plugin_path_names_a_lone_file_with_a_distinct_name():
    """``--plugin-path`` prints the file; ms-swift puts its folder first on ``sys.path``, so the folder holds no other
    module, and no installed module has the file's name."""
    path = _plugin_path_from_the_command_line()
    assert path == Path(plugin.plugin_path()) and path.is_file()
    assert path.name == "shared_prefix_logps_swift_plugin.py"
    assert sorted(p.name for p in path.parent.glob("*.py")) == ["__init__.py", path.name]
    # the only module of that name is the file itself (in this process ms-swift may have put its folder on sys.path)
    spec = importlib.util.find_spec(path.stem)
    assert spec is None or Path(spec.origin) == path, spec


def test_swift_command_runs_a_grpo_step_with_every_pass_served(tiny_root, tmp_path):
    """``swift rlhf --rlhf_type grpo ... --external_plugins <reward> <the plug-in>`` (ms-swift's command, a fresh
    process) runs a GRPO step whose three passes the plug-in served, none fallen back, both self-checks passed."""
    model_dir, dataset = ss.build_tiny(tiny_root)
    plugins = [str(ss.REWARD_PLUGIN), str(_plugin_path_from_the_command_line())]
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path / "out", external_plugins=plugins)
    record = ss.run_swift_command(argv, tmp_path / "record")[0]
    stats = record["stats"]
    assert stats["passes"] == {"policy (no grad)": 1, "ref_model (no grad)": 1, "policy (grad)": 1}
    assert stats["shared_calls"] == 3 and stats["fallback_calls"] == 0 and stats["fallback_reasons"] == {}
    assert [(check["what"], check["passed"]) for check in stats["self_checks"]] == [
        ("logps (no grad)", True),
        ("logps (grad)", True),
    ]


def test_install_and_uninstall_restore_the_class_exactly():
    """The class-level install replaces both methods once and is undone to the very functions ms-swift defined."""
    cls = trainer_class()
    before = {name: cls.__dict__[name] for name in (LOGPS_METHOD, LIGER_METHOD)}
    assert not plugin.installed()
    assert plugin.install() is True and plugin.installed()
    assert all(cls.__dict__[name] is not function for name, function in before.items())
    assert plugin.install() is False  # once
    assert plugin.uninstall() is True and not plugin.installed()
    assert all(cls.__dict__[name] is function for name, function in before.items())
    assert plugin.uninstall() is False


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("SHARED_PREFIX_LOGPS_SWIFT_BACKEND", "dense", "SHARED_PREFIX_LOGPS_SWIFT_BACKEND must be one of"),
        ("SHARED_PREFIX_LOGPS_SWIFT", "yes", "SHARED_PREFIX_LOGPS_SWIFT must be 0 or 1"),
        ("SHARED_PREFIX_LOGPS_SWIFT_SELF_CHECK", "2", "SHARED_PREFIX_LOGPS_SWIFT_SELF_CHECK must be 0 or 1"),
    ],
)
def test_bad_options_name_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        plugin.options_from_environment()


@pytest.fixture(scope="module")
def trainer(tiny_root, tmp_path_factory):
    """``(trainer, model_inputs, grpo_batch)`` after one unpatched ``swift rlhf`` step."""
    model_dir, dataset = ss.build_tiny(tiny_root)
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path_factory.mktemp("swift_install"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        record = ss.run_grpo(monkeypatch, argv)
    return (record.trainer, *record.batches[0])


def test_patch_trainer_arguments_are_checked(trainer):
    """A bad backend or tolerance is a ValueError naming the argument, a non-trainer a TypeError."""
    trainer = trainer[0]
    with pytest.raises(ValueError, match="backend must be one of"):
        plugin.patch_trainer(trainer, backend="dense")
    with pytest.raises(ValueError, match="self_check_tolerance"):
        plugin.patch_trainer(trainer, self_check_tolerance=(1e-3,))
    with pytest.raises(TypeError, match="GRPOTrainer"):
        plugin.patch_trainer(object())
    assert plugin.get_patch(trainer) is None and "_get_per_token_logps_and_entropies" not in trainer.__dict__


def test_patch_trainer_serves_and_unpatch_restores_the_instance(trainer):
    """``patch_trainer`` serves the trainer's calls (a second patch is refused); ``unpatch_trainer`` leaves the
    instance holding nothing of its own, so the class's method (ms-swift's) serves again."""
    trainer, model_inputs, grpo_batch = trainer
    own = set(trainer.__dict__)
    patch = plugin.patch_trainer(trainer)
    with pytest.raises(ValueError, match="patched already"):
        plugin.patch_trainer(trainer)
    with torch.no_grad():
        logps, _ = trainer._get_per_token_logps_and_entropies(trainer.model, dict(model_inputs), grpo_batch)
    assert patch.stats.shared_calls == 1 and [c.passed for c in patch.stats.self_checks] == [True]
    plugin.unpatch_trainer(trainer)
    assert set(trainer.__dict__) - own == {"_shared_prefix_logps_patch"} and plugin.get_patch(trainer) is None
    with torch.no_grad():
        theirs, _ = trainer._get_per_token_logps_and_entropies(trainer.model, dict(model_inputs), grpo_batch)
    valid = grpo_batch.completion_mask
    assert patch.stats.shared_calls == 1  # ms-swift's own served the second call
    torch.testing.assert_close(logps[valid], theirs[valid], atol=1e-5, rtol=0)


def test_switched_off_by_environment(trainer, monkeypatch):
    """``SHARED_PREFIX_LOGPS_SWIFT=0`` under the class-level install leaves the trainer to ms-swift: no patch is made,
    ms-swift's own method returns its own log-probs (prompt columns included)."""
    trainer, model_inputs, grpo_batch = trainer
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_SWIFT", "0")
    trainer.__dict__.pop("_shared_prefix_logps_patch", None)
    plugin.install()
    with torch.no_grad():
        ours, _ = trainer._get_per_token_logps_and_entropies(trainer.model, dict(model_inputs), grpo_batch)
    plugin.uninstall()
    with torch.no_grad():
        theirs, _ = trainer._get_per_token_logps_and_entropies(trainer.model, dict(model_inputs), grpo_batch)
    assert plugin.get_patch(trainer) is None and trainer.__dict__["_shared_prefix_logps_patch"] is None
    assert torch.equal(ours, theirs) and bool((ours[~grpo_batch.completion_mask] != 0).any())


def test_self_check_catches_a_wrong_result(trainer, monkeypatch):
    """A shared-path result off by a 2% temperature error fails the first call's comparison with ms-swift's own
    method: ``SelfCheckError``, and the failed check is in the stats."""
    from shared_prefix_logps.integrations.swift import patch as patch_module

    trainer, model_inputs, grpo_batch = trainer
    served = patch_module.compute_logps_concatenated

    def off(*args, temperature=1.0, **kwargs):
        return served(*args, temperature=temperature * 1.02, **kwargs)

    monkeypatch.setattr(patch_module, "compute_logps_concatenated", off)
    patch = plugin.patch_trainer(trainer)
    try:
        with torch.no_grad(), pytest.raises(plugin.SelfCheckError, match="differ from ms-swift's GRPOTrainer"):
            trainer._get_per_token_logps_and_entropies(trainer.model, dict(model_inputs), grpo_batch)
    finally:
        plugin.unpatch_trainer(trainer)
    assert [check.passed for check in patch.stats.self_checks] == [False]
