"""The expand backend's fused-kernel path (the one it takes on CUDA), selected on CPU to check its numbers: one
additive mask per phase shared by every layer, the SDPA kernel chosen by torch's own checks (the math kernel on CPU),
and no per-row prefix copies kept for backward. Exact against dense in float32; the attention itself
against plain attention in float64."""

from __future__ import annotations

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads, weighted_loss
from support.sdpa_spy import SdpaCalls
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, compute_logps
from shared_prefix_logps.backends import expand, sdpa_kernels
from shared_prefix_logps.bench.memory import LiveTensorBytes
from shared_prefix_logps.forward.context import CaptureContext, SharedContext

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fused_path_on_cpu(monkeypatch):
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2", "gpt_oss"])
def test_fused_path_matches_dense(family):
    # GQA everywhere; Mistral and Gemma2 slide windows shorter than the rows; Gemma2 softcaps; GPT-OSS sinks.
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=11, completion_len=7, seed=2)
    errors = compare_with_dense(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True
    )
    assert errors[0] <= 1e-5 and errors[1] <= 1e-5 and errors[2] <= 1e-4, errors


def _reference_attention(query, keys, values, allowed, scaling, softcap):
    """Plain softmax attention, (rows, heads, C, d) -> (rows, C, heads, d), KV heads repeated by hand."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query @ keys.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ values).transpose(1, 2)


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gathered_attention_in_float64(softcap):
    """The fused path's attention (prefix gathered per row and recomputed in backward, additive mask, grouped
    heads) against plain attention over explicitly gathered keys, values and gradients, in float64."""
    gen = torch.Generator().manual_seed(0)
    prompts, rows_per_prompt, heads, kv_heads, prefix, length, dim = 3, 4, 6, 2, 7, 5, 8
    rows = torch.arange(prompts).repeat_interleave(rows_per_prompt)
    n = rows.numel()

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    query, key, value = rand(n, heads, length, dim), rand(n, kv_heads, length, dim), rand(n, kv_heads, length, dim)
    prefix_key, prefix_value = rand(prompts, kv_heads, prefix, dim), rand(prompts, kv_heads, prefix, dim)
    allowed = torch.rand(n, 1, length, prefix + length, generator=gen) < 0.6
    allowed[..., prefix:] |= torch.eye(length, dtype=torch.bool)  # every query sees at least itself
    options = dict(scaling=0.3, softcap=softcap, dropout=0.0)
    mask = expand.additive_mask(allowed, torch.float64)
    ours = expand.gathered_attention(query, prefix_key, prefix_value, key, value, rows, mask, options)
    keys, values = torch.cat([prefix_key[rows], key], 2), torch.cat([prefix_value[rows], value], 2)
    expected = _reference_attention(query, keys, values, allowed, 0.3, softcap)
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    inputs = (query, key, value, prefix_key, prefix_value)
    grads = torch.autograd.grad((ours * upstream).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs)
    # With a softcap the scores take the explicit path, whose softmax is float32 as in transformers' eager attention.
    tolerance = 1e-12 if softcap is None else 1e-6
    assert (ours - expected).abs().max() <= tolerance
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max() <= tolerance


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_path_chunked_backward_matches_dense(checkpointing):
    # With activation checkpointing the recomputation of the prefix gather nests inside the layer's checkpoint.
    model = build_model("mistral")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    reference = build_model("mistral")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=10, completion_len=6, seed=4)
    weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(0))
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    dense = compute_logps(reference, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(reference, (dense.logps * weights).sum())
    out = chunked_backward(
        model,
        prompts,
        comps,
        lambda chunk, rows: (chunk.logps * weights[rows]).sum(),
        generations_per_chunk=2,
        **kwargs,
    )
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert (out.logps - dense.logps.detach()).abs().max() <= 1e-5
    assert max_relative_grad_error(grads, expected) <= 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_one_additive_mask_per_phase_shared_by_every_layer(fused, monkeypatch):
    if fused:
        monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    spy = SdpaCalls(torch.nn.functional.scaled_dot_product_attention)
    sdpa_kernels.clear_cache()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layers = 3
    model = build_model("llama", layers=layers)  # 4 query heads over 2 KV heads
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=5)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")
    forward_calls = len(spy.calls)
    out.logps.sum().backward()
    backward_calls = spy.calls[forward_calls:]
    # The two phases are the last forward calls (preparing the model may run a plain forward first).
    phase1, phase2 = spy.calls[forward_calls - 2 * layers : forward_calls - layers], spy.calls[forward_calls - layers :]
    for phase in (phase1, phase2):
        assert len({id(call["mask"]) for call in phase}) == 1  # one mask object for all layers
        assert phase[0]["mask"].dtype == torch.float32
    assert phase2[0]["key_len"] > phase1[0]["key_len"]  # Phase 2 keys: prefix and own tokens
    ours = phase1 + phase2 + backward_calls
    if fused:
        # On CPU no fused kernel accepts a call, so each runs on the math kernel alone, which takes grouped heads:
        # none are repeated. (CUDA's kernels are emulated in test_expand_cuda_rules.py.)
        assert all(call["gqa"] and not call["same_heads"] for call in ours)
        assert all(call["enabled"] == ("MATH",) for call in ours)
        # Phase 2's attention runs again in backward, over the same shared mask.
        assert [id(call["mask"]) for call in backward_calls] == [id(phase2[0]["mask"])] * layers
    else:
        assert all(call["gqa"] and not call["same_heads"] for call in ours)
        assert not backward_calls


def _bytes_held_by_graph(model, num_prompts, generations, prompt_len, completion_len):
    """Bytes allocated by a grad-enabled forward that are still alive once it returned (what backward will use)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 101, (num_prompts, prompt_len), generator=gen)
    comps = torch.randint(0, 101, (num_prompts * generations, completion_len), generator=gen)
    tracker = LiveTensorBytes()
    with tracker:
        out = compute_logps(model, prompts, comps, backend="expand")
        held = tracker.live
    weighted_loss(out).backward()
    return held


def test_fused_path_keeps_no_prefix_copy_per_row_for_backward(monkeypatch):
    layers, num_prompts, prompt_len, completion_len = 3, 2, 96, 4
    model = build_model("llama", layers=layers, hidden=64)

    def growth(generations):  # bytes held per 16 more generations
        return _bytes_held_by_graph(model, num_prompts, generations + 16, prompt_len, completion_len) - (
            _bytes_held_by_graph(model, num_prompts, generations, prompt_len, completion_len)
        )

    default = growth(16)
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    fused = growth(16)
    kv_heads, head_dim = model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    # Keys and values of 16 more rows per prompt over the prefix (P - 1 tokens) and their own tokens, float32, per
    # layer: what the default path keeps for backward and the fused path does not.
    copies = layers * 2 * num_prompts * 16 * kv_heads * (prompt_len - 1 + completion_len) * head_dim * 4
    assert fused <= default - 0.85 * copies, (default, fused, copies)


@pytest.mark.parametrize("window", [None, 4])
def test_masks_are_written_in_place_and_follow_the_rule(window, monkeypatch):
    """Phase 2's (rows, 1, C, L + C) and Phase 1's (prompts, 1, L, L) additive masks are written in place, query rows
    in chunks: the peak while building one is its own storage plus small per-row index tensors, not boolean
    temporaries of its full size (nor int64 position differences, 4x a bfloat16 mask). And each is the boolean rule:
    causal, no padded key, keys within the window; a padded prompt query sees itself."""
    monkeypatch.setattr(expand, "_FILL_CHUNK_ELEMENTS", 1024)
    num_prompts, generations, prefix_len, length = 2, 16, 47, 16
    key_valid = torch.arange(prefix_len)[None, :] >= torch.tensor([[0], [5]])  # the second prompt left-padded
    positions = (key_valid.long().cumsum(1) - 1).clamp(min=0)
    capture = CaptureContext(key_valid=key_valid, positions=positions, needs_grad=False)
    rows = torch.arange(num_prompts).repeat_interleave(generations)
    context = SharedContext(
        capture=capture,
        group_index=rows,
        positions=key_valid.sum(1)[rows][:, None] + torch.arange(length)[None, :],
        query_valid=torch.ones(rows.numel(), length, dtype=torch.bool),
        head_targets=torch.zeros(0, dtype=torch.long),
        temperature=1.0,
        return_entropy=False,
        needs_grad=False,
        head_spec=None,
    )
    tracker = LiveTensorBytes()
    with tracker:
        mask = expand.shared_mask(context, window, torch.float32)
    storage = mask.untyped_storage().nbytes()
    assert storage == rows.numel() * length * 64 * 4  # L + C = 63 keys, rows of 64 elements
    index_bytes = 8 * rows.numel() * (prefix_len + 2 * length)  # gathered key positions, window starts
    assert tracker.peak <= storage + index_bytes + 4096, (tracker.peak, storage)

    def allowed_by_rule(query_pos, key_pos, valid, causal):
        allowed = valid[:, None, :] & (True if window is None else query_pos[:, :, None] - key_pos[:, None, :] < window)
        return allowed & causal if causal is not None else allowed

    own = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    own_allowed = (own >= 0) & (True if window is None else own < window)
    prefix_allowed = allowed_by_rule(context.positions, positions[rows], key_valid[rows], None).expand(-1, length, -1)
    expected = torch.cat([prefix_allowed, own_allowed.expand(rows.numel(), -1, -1)], dim=-1)[:, None]
    assert torch.equal(mask == 0, expected) and torch.equal(mask == float("-inf"), ~expected)

    tracker = LiveTensorBytes()
    with tracker:
        phase1 = expand.prefix_mask(capture, window, torch.float32)
    assert tracker.peak <= phase1.untyped_storage().nbytes() + 8 * num_prompts * 2 * prefix_len + 4096
    causal = torch.arange(prefix_len)[:, None] >= torch.arange(prefix_len)[None, :]
    expected = allowed_by_rule(positions, positions, key_valid, causal) | torch.eye(prefix_len, dtype=torch.bool)
    assert torch.equal(phase1 == 0, expected[:, None]) and torch.equal(phase1 == float("-inf"), ~expected[:, None])
