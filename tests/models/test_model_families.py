"""The families beyond the original six (MoE, attention sinks, MLA, QK-norm, logit scales, local/global layers):
exact against their own dense forward in float32, the flex forward included, and clear refusals where not."""

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import MORE_FAMILIES, NOT_ROUTED, build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends.expand import masked_attention
from shared_prefix_logps.model import SUPPORTED_MODEL_TYPES, UnsupportedModelError

# Eager flex_attention on CPU warns that it is unfused; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def family_is_routed(request):
    """Skip a family's parametrized tests where the installed transformers does not route its attention through
    AttentionInterface (test_families_not_routed_here_are_refused covers it there)."""
    callspec = getattr(request.node, "callspec", None)
    family = callspec.params.get("family") if callspec is not None else None
    if family in NOT_ROUTED:
        pytest.skip(NOT_ROUTED[family])


def _assert_exact(errors):
    logps_err, entropy_err, grad_err = errors
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, errors


def test_every_tested_family_is_supported():
    assert set(MORE_FAMILIES) <= SUPPORTED_MODEL_TYPES
    for family in MORE_FAMILIES:
        assert build_model(family).config.model_type == family


@pytest.mark.skipif(not NOT_ROUTED, reason="every tested family routes attention through AttentionInterface here")
def test_families_not_routed_here_are_refused():
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=4)
    for family in NOT_ROUTED:
        with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
            compute_logps(build_model(family), prompts, comps, prompt_mask=pmask, completion_mask=cmask)


@pytest.mark.parametrize("family", MORE_FAMILIES)
@pytest.mark.parametrize("generations", [1, 4])
def test_matches_dense(family, generations):
    # Rows of 11 + 7 tokens: longer than every sliding window of the tiny configs (5 or 6).
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=11, completion_len=7, seed=generations)
    errors = compare_with_dense(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True
    )
    _assert_exact(errors)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_opposite_embedding_tying(family):
    # Each tiny config ties its embeddings as the family's released checkpoints do; here the other way round.
    default = build_model(family)
    tied = default.lm_head.weight is default.get_input_embeddings().weight
    model = build_model(family, tied=not tied)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == (not tied)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=5, seed=5)
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_flex_forward_matches_dense(family):
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=13, completion_len=8, seed=4)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True)
    with torch.no_grad():
        flex = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (flex.logps - dense.logps).abs().max() <= 1e-5
    assert (flex.entropy - dense.entropy).abs().max() <= 1e-5
    assert (flex.logps[~cmask] == 0).all()


def test_attention_sinks_change_the_numbers_and_get_their_gradient():
    model = build_model("gpt_oss")
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=11, completion_len=7, seed=2)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    shared = compute_logps(model, prompts, comps, **kwargs)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    ours = torch.autograd.grad(weighted_loss(shared), sinks)
    reference = torch.autograd.grad(weighted_loss(dense), sinks)
    for g, ref in zip(ours, reference):
        assert ref.abs().min() > 0  # every head's sink matters to the loss
        assert (g - ref).norm() <= 1e-4 * ref.norm()
    # Sinks pushed far down take no mass: the numbers change, so the sinks are not being ignored.
    with torch.no_grad():
        for sink in sinks:
            sink.fill_(-1e4)
        without = compute_logps(model, prompts, comps, **kwargs)
    assert (without.logps - shared.logps).abs().max() > 1e-3


def test_masked_attention_with_sinks_equals_gpt_oss_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 8, generator=gen)
    key, value = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    mask = torch.rand(2, 1, 5, 9, generator=gen) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=gen))
    module.num_key_value_groups = 2
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    expected, _ = eager_attention_forward(module, query, key, value, additive, scaling=0.3)
    got = masked_attention(query, key, value, mask, scaling=0.3, softcap=None, dropout=0.0, sinks=module.sinks)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_malformed_sinks_are_refused():
    model = build_model("gpt_oss")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)  # the head check runs here
    # The model's own eager attention would fail on these too; the shared path must refuse them by name.
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="s_aux"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_router_logits_requested_by_the_config_do_not_disturb_the_log_probs():
    # Users who train with the load-balancing loss set output_router_logits in the config; the forwards then also
    # record router logits and compute the aux loss, which the shared path ignores.
    model = build_model("qwen3_moe")
    model.config.output_router_logits = True
    prompts, pmask, comps, cmask = make_batch(3, 2, prompt_len=8, completion_len=5, seed=3)
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


def test_bidirectional_gemma3_is_refused():
    model = build_model("gemma3_text")
    model.config.use_bidirectional_attention = True
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(UnsupportedModelError, match="gemma3_text.*use_bidirectional_attention"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_moe_gradients_reach_every_routed_expert():
    # With 4 experts, 2 per token and a few dozen tokens, every expert is used; a routing slip between the paths
    # would show as a wrong expert gradient (compare_with_dense checks the values, this checks they are exercised).
    model = build_model("mixtral")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=11, completion_len=7, seed=1)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    grads = parameter_grads(model, weighted_loss(out))
    experts = {name: g for name, g in grads.items() if "experts" in name}
    assert experts
    for name, grad in experts.items():
        per_expert = grad.flatten(1).norm(dim=1)
        assert (per_expert > 0).all(), name


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_chunked_backward_matches_dense(family):
    # Sinks and MLA in the chunked path: the prompt's gradient arrives once, through the captured keys/values.
    from shared_prefix_logps import chunked_backward

    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, 3, prompt_len=9, completion_len=6, seed=6)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True)
    weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(5))

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum() + (out.entropy * weights[rows].flip(1)).sum()

    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, loss_fn(dense, torch.arange(comps.shape[0])))
    for chunk in (1, 2):
        model.zero_grad(set_to_none=True)
        out = chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=chunk, **kwargs)
        assert (out.logps - dense.logps.detach()).abs().max() <= 1e-5
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        assert max_relative_grad_error(grads, expected) <= 1e-4, chunk


def test_trl_trains_with_the_aux_loss_coefficient_of_the_model_config(tmp_path):
    pytest.importorskip("trl")
    from support.trl_tiny import make_trainer, moe_model

    from shared_prefix_logps.integrations.trl import patch_grpo_trainer

    # TRL takes the coefficient from the model config and adds the router aux loss; the plug-in reproduces it
    # (tests/integrations/trl/test_trl_aux_loss.py compares whole training runs).
    # router_aux_loss_coef keeps the config's default, 0.001, as in the released configs
    trainer = make_trainer(tmp_path, model=moe_model("qwen3_moe"), max_steps=1)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001
    patch = patch_grpo_trainer(trainer)  # self-check on: the first calls are compared with TRL's own forward
    trainer.train()
    assert patch.stats.shared_calls > 0 and patch.stats.fallback_calls == 0
    checks = {check.what: check.passed for check in patch.stats.self_checks}
    assert "logps (grad) router aux loss (relative)" in checks and all(checks.values()), checks


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_non_reentrant_checkpointing(family):
    model = build_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing only runs in training mode (both tiny configs have no dropout or router noise)
    prompts, pmask, comps, cmask = make_batch(3, 3, prompt_len=10, completion_len=6, seed=11)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    _assert_exact(errors)


def test_lora_on_latent_attention():
    peft = pytest.importorskip("peft")
    from support.tiny_models import randomize_lora

    # Adapters on the MLA projections that build queries and the per-head keys/values from the latent.
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_b_proj", "kv_b_proj", "o_proj"], lora_dropout=0.0)
    model = randomize_lora(peft.get_peft_model(build_model("deepseek_v3"), config))
    prompts, pmask, comps, cmask = make_batch(3, 3, prompt_len=10, completion_len=6, seed=12)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    _assert_exact(errors)
