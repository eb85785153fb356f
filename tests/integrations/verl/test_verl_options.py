"""The verl plug-in's options (environment variables) and installation: what the import hook patches, what
``patch_verl_engine``/``unpatch_verl_engine`` change, and that a critic's value-head engine is left alone."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("verl")

from support import verl_setup as vs  # noqa: E402
from support.distributed import free_port  # noqa: E402


def test_options_from_environment():
    from shared_prefix_logps.integrations.verl import VerlOptions, options_from_environment

    assert options_from_environment({}) == VerlOptions()
    options = options_from_environment(
        {
            "SHARED_PREFIX_LOGPS_MODE": "logps",
            "SHARED_PREFIX_LOGPS_BACKEND": "Expand",
            "SHARED_PREFIX_LOGPS_SELF_CHECK": "0",
            "SHARED_PREFIX_LOGPS_TOKEN_BUDGET": "4096",
            "SHARED_PREFIX_LOGPS_TOLERANCE": "1e-2,1e-3",
            "SHARED_PREFIX_LOGPS_LOG_EVERY": "10",
        }
    )
    assert options == VerlOptions(True, "expand", False, 4096, (1e-2, 1e-3), 10)
    assert not options_from_environment({"SHARED_PREFIX_LOGPS_MODE": "off"}).enabled
    with pytest.raises(ValueError, match="backward itself"):
        options_from_environment({"SHARED_PREFIX_LOGPS_MODE": "chunked"})
    for bad in ({"SHARED_PREFIX_LOGPS_MODE": "maybe"}, {"SHARED_PREFIX_LOGPS_BACKEND": "dense"}):
        with pytest.raises(ValueError):
            options_from_environment(bad)
    with pytest.raises(ValueError):
        options_from_environment({"SHARED_PREFIX_LOGPS_TOKEN_BUDGET": "0"})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    vs.use_cpu_platform()
    vs.init_single_process(free_port())
    return vs.save_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def infer(engine, **options):
    td = vs.assign(vs.batch_options(engine, vs.rollout_batch(seed=51)), **options)
    with engine.eval_mode():
        return engine.infer_batch(td)


def test_uninstall_and_install(model_path):
    """Without the class patch engines run verl's step; patch_verl_engine still serves one engine; unpatching it
    gives verl's step back; install() restores the hook for the rest."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from shared_prefix_logps.integrations import verl as plugin

    engine = vs.build_engine(model_path)
    assert plugin.installed()
    try:
        assert plugin.uninstall() and not plugin.installed()
        assert FSDPEngineWithLMHead.forward_step is plugin.step.verl_forward_step()
        infer(engine)
        assert plugin.get_patch(engine) is None
        patch = plugin.patch_verl_engine(engine, backend="expand", self_check=False)
        infer(engine)
        assert patch.stats.shared_calls == 3 and not patch.stats.self_checks
        plugin.unpatch_verl_engine(engine)
        assert "forward_step" not in engine.__dict__
        infer(engine)
        assert patch.stats.shared_calls == 3
    finally:
        assert plugin.install()
    assert not plugin.install()  # idempotent
    fresh = vs.build_engine(model_path)
    infer(fresh)
    assert plugin.get_patch(fresh).stats.shared_calls == 3
    assert plugin.get_patch(engine) is None  # unpatched stays unpatched under the hook


def test_statistics_logged(model_path, caplog):
    """After each self-check, and every ``log_every`` micro-batches: the summary, on the plug-in's logger."""
    from shared_prefix_logps.integrations.verl import patch_verl_engine

    engine = vs.build_engine(model_path)
    patch_verl_engine(engine, log_every=2)
    with caplog.at_level("INFO", logger="shared_prefix_logps.verl"):
        infer(engine)  # 3 micro-batches: the self-check's log, then one at the second micro-batch
    messages = [r.getMessage() for r in caplog.records if r.name == "shared_prefix_logps.verl"]
    assert len(messages) == 2 and all("real tokens forwarded" in m for m in messages), messages
    assert "self-check log-probs (no grad): passed" in messages[0]


def test_self_check_failure_raises(model_path):
    """A tolerance no float noise meets makes the first self-check fail loudly."""
    from shared_prefix_logps.integrations.verl import SelfCheckError, patch_verl_engine

    engine = vs.build_engine(model_path)
    patch = patch_verl_engine(engine, tolerance=(0.0, 0.0))
    with pytest.raises(SelfCheckError, match="self-check failed"):
        infer(engine)
    assert [check.passed for check in patch.stats.self_checks] == [False]


def test_value_head_engine_untouched(model_path):
    """A critic (``FSDPEngineWithValueHead``) inherits forward_step from FSDPEngineWithLMHead: the hook passes it to
    verl's own step without a patch or a warning. (verl loads value models with flash_attention_2 only, so the
    engine here is a language-model engine given the value-head class: verl's value-head output code runs on it.)"""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    from shared_prefix_logps.integrations.verl import get_patch, patch_verl_engine

    critic = vs.build_engine(model_path)
    critic.__class__ = FSDPEngineWithValueHead
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = infer(critic)
    assert set(out["model_output"]) == {"values"}
    assert get_patch(critic) is None and "_shared_prefix_logps_patch" not in critic.__dict__
    assert not [w for w in caught if "shared_prefix_logps" in str(w.message)]
    with pytest.raises(ValueError, match="values, not log-probs"):
        patch_verl_engine(critic)
