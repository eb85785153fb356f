"""What the verl plug-in hands back to verl's own ``forward_step``: each reason warns once, is counted, and the engine
then computes exactly what the unpatched engine computes (or fails as it fails)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from support import verl_setup as vs  # noqa: E402


@pytest.fixture(scope="module")
def model_path(process_group, tmp_path_factory):
    return vs.save_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def engines(model_path):
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    patched, unpatched = vs.build_engine(model_path), vs.build_engine(model_path)
    unpatch_verl_engine(unpatched)
    return patched, unpatched


def fresh_patch(engine, **options):
    """A new patch on ``engine`` (so that each test starts with zero counts and no warning seen)."""
    from shared_prefix_logps.integrations.verl import patch_verl_engine, unpatch_verl_engine

    unpatch_verl_engine(engine)
    return patch_verl_engine(engine, **options)


def run(engine, make_batch, *, train=False, loss_fn=None):
    """``infer_batch`` (or ``forward_backward_batch``) on a fresh batch; returns the output or the exception."""
    td = make_batch(engine)
    try:
        if train:
            with engine.train_mode():
                return engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
        with engine.eval_mode():
            return engine.infer_batch(td)
    except Exception as error:  # noqa: BLE001 - compared with the unpatched engine's failure
        return error


def assert_same(ours, theirs, td=None):
    """The same result; with ``td``, only the response slices of the log-probs/entropies (micro-batches the shared
    path served have zeros elsewhere)."""
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs) and str(ours) == str(theirs), (ours, theirs)
        return
    assert not isinstance(ours, Exception), ours
    assert set(ours["model_output"]) == set(theirs["model_output"])
    for key, value in theirs["model_output"].items():
        if td is None:
            assert torch.equal(ours["model_output"][key].values(), value.values()), key
        else:
            from verl.workers.utils.padding import no_padding_2_padding

            diff = no_padding_2_padding(ours["model_output"][key], td) - no_padding_2_padding(value, td)
            assert diff.abs().max().item() < 1e-5, key
    assert ours["loss"] == theirs["loss"]


def check_fallback(engines, make_batch, reason_part, *, micro_batches=3, shared=0, **kwargs):
    """Two calls on the patched engine: one warning, a count per micro-batch of both calls under a reason containing
    ``reason_part``, and the unpatched engine's result."""
    patched, unpatched = engines
    patch = fresh_patch(patched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run(patched, make_batch, **kwargs)
        run(patched, make_batch, **kwargs)
    ours = [str(w.message) for w in caught if "falling back to verl's own forward_step" in str(w.message)]
    assert len(ours) == 1 and reason_part in ours[0], ours
    assert patch.stats.fallback_calls == 2 * micro_batches and patch.stats.shared_calls == 2 * shared
    (reason, count), *rest = patch.stats.fallback_reasons.items()
    assert not rest and count == 2 * micro_batches and reason_part in reason
    assert_same(first, run(unpatched, make_batch, **kwargs), make_batch(unpatched) if shared else None)
    return first


def batch(**options):
    def make(engine):
        td = vs.batch_options(engine, vs.rollout_batch(seed=31, shuffle=True))
        return vs.assign(td, **options)

    return make


def test_calculate_sum_pi_squared(engines):
    out = check_fallback(engines, batch(calculate_sum_pi_squared=True), "calculate_sum_pi_squared")
    assert "sum_pi_squared" in out["model_output"]


def test_distillation_only(engines):
    out = check_fallback(engines, batch(distillation_only=True), "distillation")
    assert "log_probs" not in out["model_output"]


def test_distillation_top_k(engines):
    # verl's own step needs the distillation loss (with teacher data) as logits processor: both engines fail alike
    out = check_fallback(engines, batch(distillation_use_topk=True), "distillation", micro_batches=1)
    assert isinstance(out, Exception)


def test_multimodal_inputs(engines):
    from tensordict import NonTensorStack

    def make(engine):
        td = batch()(engine)
        td.set("multi_modal_inputs", NonTensorStack(*[{} for _ in range(len(td))]))
        return td

    check_fallback(engines, make, "multimodal")


def test_three_d_position_ids(engines):
    def make(engine):
        td = vs.batch_options(engine, vs.rollout_batch(seed=32))
        # rebuild with (N, 4, L) position ids, as verl's multimodal-RoPE models take them
        positions = torch.nested.as_nested_tensor(
            [p.expand(4, -1).contiguous() for p in td["position_ids"].unbind()], layout=torch.jagged
        )
        td["position_ids"] = positions
        return td

    # a text model's own step fails on them at the first micro-batch, patched or not
    check_fallback(engines, make, "3-D position ids", micro_batches=1)


def test_prompts_not_left_padded(engines):
    def make(engine):
        # one group of 4 rows per micro-batch; the first prompt fills the width (no padding: served), the second
        # is right-padded
        td = vs.rollout_batch(num_prompts=2, seed=33, prompt_padding="right", prompt_len=12)
        return vs.batch_options(engine, td)

    out = check_fallback(engines, make, "not left-padded", micro_batches=1, shared=1)
    assert not isinstance(out, Exception)


def test_batch_without_prompts(engines):
    """An SFT-shaped batch (no prompts/responses): verl's own step, log-probs over whole sequences."""

    def make(engine):
        td = batch()(engine)
        del td["prompts"], td["responses"]
        return td

    check_fallback(engines, make, "no prompts, responses")


def test_fused_kernels(process_group, tmp_path):
    """``use_fused_kernels`` (verl's torch-backend fused log-prob forward). verl installs it on the model class (here
    Mistral's, restored afterwards)."""
    from transformers import MistralForCausalLM

    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = vs.save_model(tmp_path, "mistral")

    def build():
        options = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}
        return vs.build_engine(path, model_kwargs=options)

    forward = MistralForCausalLM.__dict__["forward"]
    try:
        engines = build(), build()
        unpatch_verl_engine(engines[1])
        # Under FSDP2 on CPU verl 0.9.1's torch-backend fused forward raises at the first micro-batch (its head
        # multiplies by the sharded lm_head weight outside FSDP's unshard), patched or not: the same error
        out = check_fallback(engines, batch(use_fused_kernels=True), "use_fused_kernels", micro_batches=1)
    finally:
        MistralForCausalLM.forward = forward
    assert isinstance(out, RuntimeError), out


def test_unsupported_model(process_group, tmp_path):
    """A model type the shared path does not serve (Starcoder2): verl's step, the first call's reason names it."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = save_starcoder2(tmp_path)
    engines = vs.build_engine(path), vs.build_engine(path)
    unpatch_verl_engine(engines[1])
    out = check_fallback(engines, batch(), "unsupported model")
    assert not isinstance(out, Exception), out


def save_starcoder2(path):
    import transformers as tf

    config = tf.Starcoder2Config(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    tf.Starcoder2ForCausalLM(config).save_pretrained(str(path))
    return str(path)


def test_engine_subclass(model_path):
    """Engine classes derived from FSDPEngineWithLMHead (VeOmni, FSDP-Turbo ... override how inputs are built or
    sharded) are left to their own step."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    class DerivedEngine(FSDPEngineWithLMHead):
        pass

    engine = vs.build_engine(model_path)
    engine.__class__ = DerivedEngine
    twin = vs.build_engine(model_path)
    unpatch_verl_engine(twin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(engine, batch())
    theirs = run(twin, batch())
    assert_same(ours, theirs)
    patch = get_patch(engine)
    assert patch.stats.fallback_calls == 3 and "DerivedEngine" in next(iter(patch.stats.fallback_reasons))
    assert any("DerivedEngine" in str(w.message) for w in caught)


def test_switched_off_by_environment(model_path, monkeypatch):
    """``SHARED_PREFIX_LOGPS_MODE=off``: the import hook leaves every engine to verl's own step, silently."""
    from shared_prefix_logps.integrations.verl import get_patch

    monkeypatch.setenv("SHARED_PREFIX_LOGPS_MODE", "off")
    engine = vs.build_engine(model_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(engine, batch())
    assert not isinstance(out, Exception)
    assert get_patch(engine) is None and "_shared_prefix_logps_patch" in engine.__dict__
    assert not [w for w in caught if "shared_prefix_logps" in str(w.message)]


def test_patch_refuses_other_engines(model_path, tmp_path):
    """patch_verl_engine takes FSDPEngineWithLMHead only: a value-head (critic) engine is refused, and so is any
    other engine class (Megatron's)."""
    from shared_prefix_logps.integrations.verl import patch_verl_engine

    with pytest.raises(NotImplementedError, match="FSDPEngineWithLMHead only"):
        patch_verl_engine(object())
    engine = vs.build_engine(model_path)
    patch_verl_engine(engine)
    with pytest.raises(ValueError, match="patched already"):
        patch_verl_engine(engine)
