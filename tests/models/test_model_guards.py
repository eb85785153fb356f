"""Model setups that once gave silently wrong numbers: each is now exact against the dense path or refused.

Covered: RoPE whose frequencies depend on the forward's length (``dynamic``, ``longrope``), PEFT on the lm_head
(LoRA, trainable tokens, LoRA on a tied embedding), the head check per model instance (config logit settings the
class ignores, hooks added after first use, not again for each wrapper of the model), deep copies of a prepared
model, a decoder layer repeated in the layer list, and what DeepSpeed's engine looks like from outside (a wrapper
with a ``config`` of its own that forwards unknown attributes to the model; ZeRO-3's empty parameter placeholders).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.exactness import compare_with_dense, parameter_grads, weighted_loss
from support.tiny_models import VOCAB, build_model, make_batch, randomize_lora, rope_kwargs

from shared_prefix_logps import UnsupportedModelError, compute_logps, compute_logps_concatenated

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _assert_exact(errors):
    logps_err, entropy_err, grad_err = errors
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, errors


def _length_dependent_rope_model(kind: str, threshold: int):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "longrope":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.0, 1.0, 1.0],
            "long_factor": [4.0, 5.0, 6.0, 7.0],
            "original_max_position_embeddings": threshold,
        }
        config = tf.Phi3Config(
            **TINY,
            max_position_embeddings=4 * threshold,
            original_max_position_embeddings=threshold,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **rope_kwargs(rope),  # 4.x longrope reads the original length from the config above
        )
        return tf.Phi3ForCausalLM(config).eval()
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    config = tf.LlamaConfig(**TINY, max_position_embeddings=threshold, **rope_kwargs(rope))
    return tf.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_length_dependent_rope_exact_below_threshold_refused_above(kind):
    model = _length_dependent_rope_model(kind, threshold=12)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=6, completion_len=5, seed=2)
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )
    # Rows of 18 tokens cross the threshold: the node calls would pick other frequencies than the full-row forward
    # (measured without the guard: 4.7e-4 for longrope, 1.9e-5 for dynamic NTK).
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=10, completion_len=8, seed=2)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    rows = torch.cat([prompts.repeat_interleave(3, 0), comps], dim=1)
    mask = torch.cat([pmask.repeat_interleave(3, 0), cmask], dim=1)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        compute_logps_concatenated(model, rows, mask, comps.shape[1])


def _lora_head_model(peft, **lora_options):
    base = build_model("llama", tied=False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], **lora_options)
    return randomize_lora(peft.get_peft_model(base, config))


def test_lora_on_lm_head_is_exact_and_trains_the_head_adapter():
    peft = pytest.importorskip("peft")
    model = _lora_head_model(peft, lora_dropout=0.0)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=8, completion_len=5, seed=3)
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    grads = parameter_grads(model, weighted_loss(out))
    head_adapter = [name for name in grads if "lm_head" in name and "lora" in name]
    assert head_adapter and all(grads[name].abs().max() > 0 for name in head_adapter)
    # The reference through the disabled adapter is the base model's head, also exact (PEFT freezes the adapters
    # inside the context, so only the values are compared).
    with torch.no_grad(), model.disable_adapter():
        shared = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask).logps
        dense = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense").logps
    assert (shared - dense).abs().max() <= 1e-5
    assert (shared - out.logps.detach()).abs().max() > 1e-3  # the adapter was really off


def test_lora_on_lm_head_with_dropout_in_training_is_refused():
    peft = pytest.importorskip("peft")
    model = _lora_head_model(peft, lora_dropout=0.1)
    model.train()
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    with pytest.raises(UnsupportedModelError, match="lora_dropout"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_trainable_tokens_on_tied_embeddings_are_exact():
    peft = pytest.importorskip("peft")
    base = build_model("qwen2", tied=True)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # PEFT starts the trainable rows as copies of the originals; make them differ
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param))
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=8, completion_len=5, seed=4)
    comps[:, 0] = 5  # a trained token is a target, so its row of the head matters
    _assert_exact(
        compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    )


def test_lora_on_tied_embedding_is_exact():
    peft = pytest.importorskip("peft")
    base = build_model("qwen2", tied=True)
    model = randomize_lora(peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["embed_tokens", "k_proj"])))
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=8, completion_len=5, seed=5)
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


def test_head_check_runs_per_instance_not_per_class():
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    compute_logps(build_model("llama"), prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    # Same class, but its config carries a logit scale the Llama class ignores (the library would apply it).
    other = build_model("llama", seed=1)
    other.config.logit_scale = 2.0
    with pytest.raises(UnsupportedModelError, match="post-processes its logits"):
        compute_logps(other, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_hook_added_after_first_use_is_checked():
    model = build_model("qwen3")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output * 0.5)
    with pytest.raises(UnsupportedModelError, match="post-processes its logits"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    handle.remove()
    # A hook that leaves the logits alone passes the check.
    model.lm_head.register_forward_hook(lambda module, inputs, output: None)
    _assert_exact(compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


class _CallWrapper(torch.nn.Module):
    """A wrapper made for one call (as the trainer plug-ins wrap the model for autocast): a ``module`` child."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_head_check_runs_once_per_model_whatever_wrapper_calls_it(monkeypatch):
    """The verdict belongs to the model, not to the wrapper a call came through. Keyed on the wrapper's address, the
    check ran again whenever a new wrapper did not reuse a dead one's address: under FSDP that is an extra forward
    (collectives) on one process only. A hook on the wrapper that changes the logits is still caught."""
    from shared_prefix_logps.model import preparation

    checks = []
    verify = preparation.verify_head
    monkeypatch.setattr(preparation, "verify_head", lambda prepared: (checks.append(prepared.outer), verify(prepared)))
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    wrappers = [_CallWrapper(model) for _ in range(3)]  # alive together: three addresses
    for wrapper in wrappers:
        compute_logps(wrapper, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert checks == [wrappers[0]]

    def halve_logits(module, inputs, output):
        output.logits = output.logits * 0.5
        return output

    wrappers[1].register_forward_hook(halve_logits)
    with pytest.raises(UnsupportedModelError, match="post-processes its logits"):
        compute_logps(wrappers[1], prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_deep_copy_after_use_keeps_original_attention():
    model = build_model("gemma2")  # eager: sdpa cannot softcap attention scores
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=ids).logits, before, rtol=0, atol=0)
    _assert_exact(compare_with_dense(reference, prompts, comps, prompt_mask=pmask, completion_mask=cmask))


def test_decoder_layer_repeated_in_layer_list_is_refused():
    model = build_model("llama")
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[0]])
    model.config.num_hidden_layers = 3
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    with pytest.raises(ValueError, match="ran twice in one forward"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


class _EngineLike(torch.nn.Module):
    """Shaped like DeepSpeed's engine: the model under ``module``, a ``config`` of its own (the engine's settings),
    and unknown attributes forwarded to the model, so ``get_output_embeddings`` resolves on the wrapper too."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = {"train_micro_batch_size_per_gpu": 1}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_wrapper_with_own_config_that_forwards_attributes_is_unwrapped():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    wrapped = _EngineLike(model)
    out = compute_logps(wrapped, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    dense = compute_logps(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
    )
    assert (out.logps - dense.logps).abs().max() <= 1e-5
    grads = parameter_grads(model, weighted_loss(out))
    reference = parameter_grads(model, weighted_loss(dense))
    assert max((grads[n] - r).norm().item() / r.norm().item() for n, r in reference.items()) <= 1e-4


def test_partitioned_parameter_reports_its_full_shape():
    from shared_prefix_logps.model.discovery import full_shape

    # What DeepSpeed ZeRO-3 leaves outside a forward: an empty placeholder, the real shape in ds_shape.
    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_shape = torch.Size([VOCAB, 32])
    assert full_shape(placeholder) == torch.Size([VOCAB, 32])
    assert full_shape(torch.nn.Parameter(torch.empty(3, 4))) == torch.Size([3, 4])
