"""The benchmark's FLOP model against torch's FlopCounterMode on tiny models, and the floors' arithmetic."""

import types

import pytest
import torch
from support.tiny_models import build_model
from torch.utils.flop_counter import FlopCounterMode

from shared_prefix_logps.bench.flops import (
    ModelShape,
    Workload,
    dense_flops,
    flop_floor,
    forward_flops,
    shared_floor_flops,
    step_flops,
    visible_pairs,
)
from shared_prefix_logps.bench.presets import build_preset


def _counted(model, ids, keep, train):
    """FlopCounterMode's FLOPs of a forward (and backward) of full rows: attention (the batched matmuls of eager
    attention) apart from the rest (the projections, MLP and head, as mm/addmm)."""
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
        if train:
            logits.float().sum().backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = by_op.pop("aten.bmm", 0)
    return attention, sum(by_op.values()), counter.get_total_flops()


@pytest.mark.parametrize("train", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("family", ["tiny", "phi3", "gemma2", "qwen3"])
def test_matches_flop_counter_on_full_rows(family, train):
    """Rows of L tokens through eager attention, which computes every (query, key) pair of the row, and the head
    over the last ``keep`` positions: the model's count equals the counter's, split by attention and the rest."""
    if family == "tiny":
        model = build_preset("tiny", layers=2)
    else:  # fused qkv/gate_up projections (Phi3), head_dim != hidden / heads (Gemma2, Qwen3), untied heads
        model = build_model(family, layers=2)
    model.set_attn_implementation("eager")
    rows, length, keep = 3, 24, 7
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    shape = ModelShape.from_config(model.config)
    # The kernels compute all length^2 pairs, masked or not: count those, not the causal ones, to compare.
    expected = step_flops(
        forward_flops(
            shape,
            tokens=rows * length,
            attention_pairs=[rows * length * length] * shape.layers,
            scored_tokens=rows * keep,
        ),
        train=train,
    )
    attention, rest, total = _counted(model, ids, keep, train)
    # Exact: the counter counts matmuls only, as the model does (norms, RoPE and softmax are left out by both).
    assert attention == expected.attention
    assert rest == expected.body + expected.head
    assert total == expected.total
    assert expected.attention > 0 and expected.head > 0


def test_visible_pairs_count_causal_and_windowed_keys():
    for start in (0, 1, 5, 9):
        for queries in (0, 1, 4, 11):
            for window in (None, 1, 3, 8, 40):
                brute = sum(q + 1 if window is None else min(q + 1, window) for q in range(start, start + queries))
                assert visible_pairs(start, queries, window) == brute, (start, queries, window)
    with pytest.raises(ValueError, match="start"):
        visible_pairs(-1, 3)
    with pytest.raises(ValueError, match="window"):
        visible_pairs(0, 5, 0)


def test_sliding_windows_per_layer_from_the_config():
    gemma = ModelShape.from_config(build_model("gemma2", layers=2).config)
    mistral = ModelShape.from_config(build_model("mistral", layers=2).config)
    qwen = ModelShape.from_config(build_preset("tiny", layers=2).config)
    assert gemma.windows == (5, None)  # Gemma2 alternates sliding and full layers
    assert mistral.windows == (6, 6)
    assert qwen.windows == (None, None)  # Qwen2 carries a sliding_window it does not use


def test_floors_decompose_into_prompt_once_and_completions():
    """Dense minus the shared floor is exactly the prompt's body and causal attention G-1 more times; the head is the
    same for both (scored tokens do not shrink with sharing)."""
    shape = ModelShape.from_config(build_preset("tiny", layers=2).config)
    workload = Workload(prompt_lengths=(40, 25), completion_lengths=(6, 0, 9, 3, 8, 1))
    assert workload.generations == 3
    dense, floor = dense_flops(shape, workload, train=False), shared_floor_flops(shape, workload, train=False)
    g = workload.generations
    assert dense.head == floor.head == sum(workload.completion_lengths) * shape.head_per_token
    assert dense.body - floor.body == (g - 1) * (40 + 25) * shape.body_per_token
    prompt_pairs = (g - 1) * (40 * 41 // 2 + 25 * 26 // 2) * shape.layers
    assert dense.attention - floor.attention == prompt_pairs * shape.attention_per_pair
    assert flop_floor(shape, workload, train=False) == pytest.approx(floor.total / dense.total)
    trained = dense_flops(shape, workload, train=True)
    assert (trained.body, trained.attention, trained.head) == (3 * dense.body, 3 * dense.attention, 3 * dense.head)
    # The FLOP floor lies above the token floor: the head and the completions' attention do not shrink.
    assert flop_floor(shape, workload, train=False) > workload.shared_tokens / workload.dense_tokens


def test_workload_counts_real_tokens():
    prompt_mask = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    completion_mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [False] * 3])
    workload = Workload.from_masks(prompt_mask, completion_mask)
    assert workload.prompt_lengths == (6, 4) and workload.completion_lengths == (2, 3, 1, 0)
    assert (workload.prompt_tokens, workload.completion_tokens) == (10, 6)
    assert workload.dense_tokens == 2 * 6 + 2 * 4 + 6
    assert workload.shared_tokens == 10 + 6


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="completion_lengths"):
        Workload((4, 5), (1, 2, 3))
    with pytest.raises(ValueError, match="prompt_lengths"):
        Workload((0,), (1,))
    shape = ModelShape.from_config(build_preset("tiny", layers=2).config)
    with pytest.raises(ValueError, match="attention_pairs"):
        forward_flops(shape, tokens=1, attention_pairs=[1], scored_tokens=1)
    olmoe = dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2)
    olmoe.update(hidden_size=8, intermediate_size=16, vocab_size=10)
    with pytest.raises(ValueError, match="model type 'olmoe' has routed experts"):
        ModelShape.from_config(types.SimpleNamespace(**olmoe))
    with pytest.raises(TypeError, match="config: needs integer"):
        ModelShape.from_config(object())


def test_moe_body_counts_the_routed_experts():
    """A token goes through the router and its top-k experts in a MoE layer: Qwen3-MoE's tiny test model, 4 experts
    of width 16, 2 per token; 2 layers, both routed."""
    config = build_model("qwen3_moe").config
    shape = ModelShape.from_config(config)
    assert shape.routed == ((2 * 16, 4), (2 * 16, 4))
    dense = ModelShape.from_config(build_model("qwen3", hidden=32).config)
    projections = dense.body_per_token - 2 * 2 * 32 * 3 * dense.intermediate
    assert shape.body_per_token == projections + 2 * 2 * 32 * (3 * 32 + 4)


def test_a_hybrids_gated_deltanet_layers_match_the_flop_counter():
    """A tiny Qwen3.5 (Gated DeltaNet, gated attention, Gated DeltaNet), rows of one recurrence chunk (64 tokens):
    the projections, the chunked kernel's matmuls and the convolution per token, pairs only in the attention layer.
    The counter also counts the convolution's K - 1 padded outputs per row (2 x channels x K each), which the model
    leaves out."""
    from support.hybrid_models import GDN_CHUNK_SIZE, build_hybrid

    model = build_hybrid("qwen3_5_text")
    model.set_attn_implementation("eager")
    rows, length, keep = 2, GDN_CHUNK_SIZE, 7
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    shape = ModelShape.from_config(model.config)
    assert [shape.is_linear(layer) for layer in range(shape.layers)] == [True, False, True]
    expected = forward_flops(
        shape, tokens=rows * length, attention_pairs=[rows * length * length] * shape.layers, scored_tokens=rows * keep
    )
    _, _, total = _counted(model, ids, keep, train=False)
    linear = shape.linear
    per_output = 2 * linear.conv_channels * linear.conv_kernel
    padded_outputs = len(linear.layers) * rows * (linear.conv_kernel - 1) * per_output
    assert total == expected.total + padded_outputs
    assert expected.attention == rows * length * length * shape.attention_per_pair  # the attention layer's only
