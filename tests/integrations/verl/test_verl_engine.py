"""The verl plug-in on verl's real ``FSDPEngineWithLMHead`` (FSDP2, one gloo process, CPU): installed through
``external_lib``, ``infer_batch`` and ``train_batch`` give what the unpatched engine gives, from fewer tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from support import verl_setup as vs  # noqa: E402
from support.distributed import free_port  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    vs.use_cpu_platform()
    vs.init_single_process(free_port())
    return vs.save_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def engines(model_path):
    """A patched engine (the plug-in named in external_lib) and its unpatched twin (same weights)."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    patched = vs.build_engine(model_path)
    unpatched = vs.build_engine(model_path)
    unpatch_verl_engine(unpatched)
    return patched, unpatched


def infer(engine, td):
    with engine.eval_mode():
        return engine.infer_batch(td)


def response(nested, td):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, td)


def test_external_lib_installs_the_patch(engines):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from shared_prefix_logps.integrations import verl as plugin

    patched, unpatched = engines
    assert plugin.installed()
    assert FSDPEngineWithLMHead.forward_step is not plugin.step.verl_forward_step()
    infer(patched, vs.batch_options(patched, vs.rollout_batch()))
    patch = plugin.get_patch(patched)
    assert patch is not None and patch.stats.shared_calls > 0 and patch.stats.fallback_calls == 0
    assert plugin.get_patch(unpatched) is None  # unpatched: verl's own step, no patch made


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("temperature", ["scalar", "per-row"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["grouped", "shuffled"])
def test_infer_batch_equals_unpatched(engines, remove_padding, temperature, shuffle):
    """Old-policy log-probs and entropy: verl's whole-sequence jagged output, the response slice within 1e-5 of the
    unpatched engine's, zeros elsewhere; micro-batches of 4 rows split the groups of 4 when shuffled."""
    patched, unpatched = engines
    rows = 12
    temp = 0.7 if temperature == "scalar" else torch.tensor([0.7, 1.3, 0.9])[torch.arange(rows) // 4]
    results = []
    for engine in engines:
        td = vs.rollout_batch(shuffle=shuffle, temperature=temp, seed=3)
        td = vs.assign(vs.batch_options(engine, td), use_remove_padding=remove_padding)
        results.append((td, infer(engine, td)))
    (td, ours), (_, theirs) = results
    for key in ("log_probs", "entropy"):
        mine, verl = ours["model_output"][key], theirs["model_output"][key]
        assert mine.is_nested and torch.equal(mine.offsets(), verl.offsets())
        assert mine.dtype == verl.dtype == torch.float32
        diff = (response(mine, td) - response(verl, td)).abs().max().item()
        assert diff < 1e-5, (key, diff)
        # outside the response slice the shared path computes nothing: zeros
        inside = torch.zeros_like(mine.values(), dtype=torch.bool)
        inside[response_positions(td)] = True
        assert torch.all(mine.values()[~inside] == 0)
    assert set(ours) == set(theirs) and ours["metrics"] == theirs["metrics"]


def response_positions(td):
    """Flat positions of the valid response log-probs in verl's jagged order."""
    attention = td["attention_mask"]
    width = td["responses"].shape[1]
    offsets = td["input_ids"].offsets()
    prompt_lens = attention[:, :-width].sum(1)
    positions = offsets[:-1, None] + prompt_lens[:, None] - 1 + torch.arange(width)[None, :]
    return positions[attention[:, -width:] != 0]


def test_entropy_off_and_dynamic_batch_size(model_path):
    """``calculate_entropy=False`` returns no entropy, as verl's step; ``use_dynamic_bsz`` micro-batches by tokens and
    reorders rows (verl restores the order)."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    engines = [vs.build_engine(model_path, dynamic_bsz=True, max_token_len=40) for _ in range(2)]
    unpatch_verl_engine(engines[1])
    outs = []
    for engine in engines:
        td = vs.batch_options(engine, vs.rollout_batch(shuffle=True, seed=5), calculate_entropy=False)
        outs.append((td, infer(engine, td)))
    (td, ours), (_, theirs) = outs
    assert set(ours["model_output"]) == set(theirs["model_output"]) == {"log_probs"}
    diff = (response(ours["model_output"]["log_probs"], td) - response(theirs["model_output"]["log_probs"], td)).abs()
    assert diff.max().item() < 1e-5


def test_patched_engine_embeds_fewer_tokens(engines):
    """verl-shaped old-log-prob pass: 3 prompts of 24 tokens, 4 responses of 4 each, micro-batches of 4 rows (one
    group each): the patched engine embeds each prompt once per micro-batch."""
    # the patched engine's first no-grad call is also checked against verl's own step, which embeds the full rows:
    # count a later one (whichever test of the module runs first)
    infer(engines[0], vs.batch_options(engines[0], vs.rollout_batch(seed=7)))
    counts = []
    for engine in engines:
        td = vs.batch_options(engine, vs.rollout_batch(prompt_len=24, response_len=4, seed=7))
        counter = vs.TokenCounter(engine)
        try:
            infer(engine, td)
        finally:
            counter.close()
        counts.append(counter.tokens)
    patched, unpatched = counts
    # unpatched: every row's valid tokens; patched: (prompt - 1) + 4 rows x 4 response slots per group (padding incl.)
    assert patched < unpatched * 0.6, counts


def test_train_batch_equals_unpatched(model_path):
    """One optimizer step of ``ppo_loss`` (token-mean, entropy bonus, KL loss) on shuffled rows: equal loss, metrics,
    gradient norm and parameters."""
    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    engines = [vs.build_engine(model_path) for _ in range(2)]
    unpatch_verl_engine(engines[1])
    loss_fn = vs.ppo_loss(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    outputs, params = [], []
    for engine in engines:
        td = vs.batch_options(engine, vs.rollout_batch(shuffle=True, seed=11), infer=False)
        with engine.train_mode():
            outputs.append(engine.train_batch(td, loss_function=loss_fn))
        params.append(vs.full_parameters(engine))
    ours, theirs = outputs
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)
    vs.assert_metrics_close(ours["metrics"], theirs["metrics"])
    worst = max((params[0][name] - params[1][name]).abs().max().item() for name in params[1])
    assert worst < 1e-5, worst
    stats = get_patch(engines[0]).stats
    assert stats.fallback_calls == 0 and [c.passed for c in stats.self_checks] == [True]


def test_lora_reference_through_disable_adapter(model_path):
    """LoRA engine: the reference log-probs (``engine.disable_adapter()``, as verl's ref-in-actor) and the policy's
    equal the unpatched engine's, and differ from each other (the adapter is not zero)."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    engines = [vs.build_engine(model_path, lora_rank=4) for _ in range(2)]
    unpatch_verl_engine(engines[1])
    for engine in engines:
        vs.randomize_lora(engine)
    results = []
    for engine in engines:
        td = vs.batch_options(engine, vs.rollout_batch(seed=13))
        with engine.disable_adapter():
            ref = infer(engine, td)
        policy = infer(engine, td)
        results.append([response(out["model_output"]["log_probs"], td) for out in (ref, policy)])
    (ref, policy), (verl_ref, verl_policy) = results
    assert (ref - verl_ref).abs().max().item() < 1e-5
    assert (policy - verl_policy).abs().max().item() < 1e-5
    assert (ref - policy).abs().max().item() > 1e-3


def test_bf16_mixed_precision(model_path):
    """verl's default mixed precision (bf16 parameters and autocast): the patched engine returns verl's dtypes (so a
    micro-batch that falls back concatenates with served ones), and its log-probs are as close to a float32 engine's
    as verl's own bf16 log-probs are."""
    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    bf16 = dict(mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    ours, theirs = vs.build_engine(model_path, **bf16), vs.build_engine(model_path, **bf16)
    reference = vs.build_engine(model_path)
    for engine in (theirs, reference):
        unpatch_verl_engine(engine)
    results = {}
    for name, engine in (("ours", ours), ("verl", theirs), ("fp32", reference)):
        td = vs.batch_options(engine, vs.rollout_batch(seed=17, shuffle=True))
        out = infer(engine, td)["model_output"]
        results[name] = (response(out["log_probs"], td).float(), out["log_probs"].dtype, out["entropy"].dtype)
    assert results["ours"][1:] == results["verl"][1:]
    our_error = (results["ours"][0] - results["fp32"][0]).abs().max().item()
    verl_error = (results["verl"][0] - results["fp32"][0]).abs().max().item()
    assert 0 < our_error <= 1.5 * verl_error + 1e-2, (our_error, verl_error)
    # one micro-batch served, the next (right-padded prompts) left to verl: verl concatenates both
    td = vs.batch_options(ours, vs.rollout_batch(num_prompts=2, seed=33, prompt_padding="right"))
    out = infer(ours, td)["model_output"]
    assert out["log_probs"].dtype == results["verl"][1]
    stats = get_patch(ours).stats
    assert stats.fallback_calls == 1 and [check.passed for check in stats.self_checks] == [True]


def test_model_configured_for_flash_attention_2(model_path):
    """verl loads models with ``attn_implementation="flash_attention_2"``. flash-attn does not exist on CPU, so the
    patched engine's model is an sdpa-built one whose config then names flash_attention_2 (what the shared path reads):
    log-probs and the first training step's gradient norm equal the unpatched sdpa engine's. The self-check is off:
    verl's own step would call the flash-attn kernel."""
    from shared_prefix_logps.integrations.verl import get_patch, patch_verl_engine, unpatch_verl_engine
    from shared_prefix_logps.model import unwrap_causal_lm

    ours, theirs = vs.build_engine(model_path), vs.build_engine(model_path)
    unpatch_verl_engine(theirs)
    unpatch_verl_engine(ours)
    patch_verl_engine(ours, self_check=False)
    unwrap_causal_lm(ours.module).config._attn_implementation = "flash_attention_2"
    results = []
    for engine in (ours, theirs):
        td = vs.batch_options(engine, vs.rollout_batch(seed=19, shuffle=True))
        logps = response(infer(engine, td)["model_output"]["log_probs"], td)
        td = vs.batch_options(engine, vs.rollout_batch(seed=20, shuffle=True), infer=False)
        with engine.train_mode():
            trained = engine.train_batch(td, loss_function=vs.ppo_loss())
        results.append((logps, trained["metrics"]["grad_norm"]))
    (logps, norm), (verl_logps, verl_norm) = results
    assert (logps - verl_logps).abs().max().item() < 1e-5
    assert norm == pytest.approx(verl_norm, rel=1e-5)
    assert unwrap_causal_lm(ours.module).config._attn_implementation == "flash_attention_2"
    stats = get_patch(ours).stats
    assert stats.shared_calls == 6 and stats.fallback_calls == 0


def test_nested_prompts_and_responses(engines):
    """verl's v1 trainer keeps ``prompts``/``responses`` jagged and has no padded ``attention_mask``: the rows are
    padded by the plug-in; old log-probs and a ``ppo_loss`` backward equal the unpatched engine's."""
    from shared_prefix_logps.integrations.verl import get_patch

    patched, _ = engines
    before = get_patch(patched).stats.shared_calls if get_patch(patched) else 0  # made at the engine's first step
    results = []
    for engine in engines:
        padded = vs.batch_options(engine, vs.rollout_batch(seed=27, shuffle=True))
        td = vs.nested_layout(vs.batch_options(engine, vs.rollout_batch(seed=27, shuffle=True)))
        out = infer(engine, td)["model_output"]
        logps = response(out["log_probs"], padded)
        td = vs.nested_layout(vs.batch_options(engine, vs.rollout_batch(seed=28, shuffle=True), infer=False))
        with engine.train_mode():
            trained = engine.forward_backward_batch(
                td, loss_function=vs.ppo_loss(entropy_coeff=0.01), forward_only=False
            )
            grads = vs.full_gradients(engine)
        results.append((logps, trained["loss"], grads))
    (logps, loss, grads), (verl_logps, verl_loss, verl_grads) = results
    assert (logps - verl_logps).abs().max().item() < 1e-5
    assert torch.allclose(torch.tensor(loss), torch.tensor(verl_loss), rtol=1e-5, atol=1e-7)
    worst = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in verl_grads.items())
    assert worst < 1e-4, worst
    assert get_patch(patched).stats.shared_calls == before + 6  # 3 + 3 micro-batches, none left to verl
