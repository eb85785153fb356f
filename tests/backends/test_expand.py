"""The expand layout of node calls: its masks (one per call shared by every layer, written in place, aligned rows,
exactly what the trie allows, one row shared by nodes with as many ancestors) and its fused-kernel path (the one it
takes on CUDA, selected on CPU: the SDPA kernel chosen by torch's own checks, the per-node gather recomputed in
backward instead of saved). Exact against dense in float32; the attention itself against plain attention in
float64."""

from __future__ import annotations

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads, weighted_loss
from support.sdpa_spy import SdpaCalls, aligned_rows
from support.tiny_models import build_model, make_batch
from support.trees import pad_rows, planned_node_calls, random_tree_rows, star_batch, token_visibility

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_tree
from shared_prefix_logps.backends import expand, sdpa_kernels
from shared_prefix_logps.backends.layouts import LayerCall
from shared_prefix_logps.bench.memory import LiveTensorBytes

HEAD_DIM = 8  # the tiny models' head size; the SDPA priority probe's own call has 64


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
    ids, mask, score = pad_rows(random_tree_rows(5, depth=3, branching=3), 5)
    tree = compute_logps_tree(model, ids, mask, score, return_entropy=True, merge_tiny_nodes=False)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err < 1e-4


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 3])
def test_node_attention_in_float64(fused, softcap, window, monkeypatch):
    """A call of a later chunk (several source calls, nodes of different lengths and ancestors) against plain
    attention over [the ancestor store ; the call's tokens] under the trie's visibility, outputs and gradients, in
    float64; on the fused path the gather is recomputed in backward."""
    if fused:
        monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    trie, calls = planned_node_calls(random_tree_rows(2, depth=4, branching=3, max_segment=5), rows_per_chunk=2)
    call = max(calls, key=lambda c: len(c.sources) * 100 + c.nodes.numel())
    assert len(call.sources) > 1 and call.nodes.numel() > 1
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, n = 6, 2, 8, call.num_tokens
    sizes = [int(call.store_node.numel()) // len(call.sources)] * len(call.sources)
    sizes[-1] += call.store_node.numel() - sum(sizes)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    query, key, value = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    ancestors = [(rand(kv_heads, size, dim), rand(kv_heads, size, dim)) for size in sizes]
    options = dict(scaling=0.3, softcap=softcap, dropout=0.0)
    layer = LayerCall(None, call, ancestors, {}, window, options, needs_grad=True)
    ours = expand.node_attention(query, key, value, layer)
    keys = torch.cat([*(k for k, _ in ancestors), key[0]], 1).repeat_interleave(heads // kv_heads, 0)
    values = torch.cat([*(v for _, v in ancestors), value[0]], 1).repeat_interleave(heads // kv_heads, 0)
    scores = query[0] @ keys.transpose(1, 2) * 0.3
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = token_visibility(trie, call, window)
    expected = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values).transpose(0, 1)[None]
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    inputs = (query, key, value, *(t for pair in ancestors for t in pair))
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
    # With activation checkpointing the recomputation of the ancestors' gather nests inside the layer's checkpoint.
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
def test_one_mask_per_call_shared_by_every_layer(fused, monkeypatch):
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
    # The two node calls are the last forward calls (preparing the model may run a plain forward first).
    prompts_call = spy.calls[forward_calls - 2 * layers : forward_calls - layers]
    completions_call = spy.calls[forward_calls - layers :]
    # The prompts: no ancestors, causal without a mask; the completions: one mask object for every layer.
    assert all(call["mask"] is None and call["is_causal"] for call in prompts_call)
    assert len({id(call["mask"]) for call in completions_call}) == 1
    assert completions_call[0]["mask"].dtype == torch.float32
    assert completions_call[0]["key_len"] > prompts_call[0]["key_len"]  # ancestors and own tokens
    ours = prompts_call + completions_call + backward_calls
    # On CPU no fused kernel accepts a call, so each runs on the math kernel alone, which takes grouped heads: none
    # are repeated. (CUDA's kernels are emulated in test_expand_cuda_rules.py.)
    assert all(call["gqa"] and not call["same_heads"] for call in ours)
    if fused:
        assert all(call["enabled"] == ("MATH",) for call in ours)
        # The completions' attention runs again in backward (its gather recomputed), over the same shared mask.
        assert [id(call["mask"]) for call in backward_calls] == [id(completions_call[0]["mask"])] * layers
    else:
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


def test_fused_path_keeps_no_ancestor_copy_per_node_for_backward(monkeypatch):
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
    # Keys and values of 16 more completion nodes per prompt over their ancestors (P tokens) and their own tokens,
    # float32, per layer: what the default path keeps for backward and the fused path does not.
    copies = layers * 2 * num_prompts * 16 * kv_heads * (prompt_len + completion_len) * head_dim * 4
    assert fused <= default - 0.85 * copies, (default, fused, copies)


@pytest.mark.parametrize("window", [None, 1, 2, 5, 9])
@pytest.mark.parametrize("seed", range(3))
def test_node_mask_is_what_the_trie_allows(window, seed):
    trie, calls = planned_node_calls(random_tree_rows(seed, depth=4, branching=3, max_segment=5), rows_per_chunk=2)
    assert len(calls) > trie.depth.max()  # later chunks' calls, over several earlier calls' stores
    for call in calls:
        mask = expand.node_mask(call, window, torch.float32)
        assert aligned_rows(mask)
        assert set(mask.unique().tolist()) <= {0.0, float("-inf")}
        shown = mask[:, 0] == 0  # (S, Lmax, A + Lmax)
        allowed = token_visibility(trie, call, window)  # (T, store + T)
        store = call.store_node.numel()
        valid, num_ancestors = call.pack_valid, call.ancestor_valid.shape[1]
        for s in range(valid.shape[0]):
            tokens = call.pack_index[s][valid[s]]
            expected = torch.zeros(tokens.numel(), shown.shape[-1], dtype=torch.bool)
            slots = call.ancestor_valid[s].nonzero().squeeze(1)
            expected[:, slots] = allowed[tokens][:, call.ancestor_index[s, slots]]
            expected[:, num_ancestors : num_ancestors + tokens.numel()] = allowed[tokens][:, store + tokens]
            assert torch.equal(shown[s, : tokens.numel()], expected), (s, window)
            # Padded query rows see something (no NaN), padded keys are seen by no real query.
            assert shown[s].any(-1).all()


@pytest.mark.parametrize("window", [None, 4])
def test_masks_are_written_in_place(window, monkeypatch):
    """A (S, 1, Lmax, A + Lmax) node mask is written in place, query rows in chunks: the peak while building one is its
    own storage plus small per-node index tensors, not boolean temporaries of its full size (nor int64 position
    differences, 4x a bfloat16 mask)."""
    monkeypatch.setattr(expand, "_FILL_CHUNK_ELEMENTS", 1024)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (47, 42)]
    # Completions that start with distinct tokens: each its own node under its prompt.
    rows = [
        prompt + [i] + torch.randint(0, 101, (15,), generator=gen).tolist() for i, prompt in enumerate(prompts * 16)
    ]
    _, calls = planned_node_calls(rows, rows_per_chunk=len(rows))
    call = calls[-1]  # the 32 completions under two prompts of different lengths
    assert call.pack_valid.shape == (32, 16) and call.ancestor_valid.shape == (32, 47)
    tracker = LiveTensorBytes()
    with tracker:
        mask = expand.node_mask(call, window, torch.float32)
    storage = mask.untyped_storage().nbytes()
    assert storage == 32 * 16 * 64 * 4  # A + Lmax = 63 keys, rows of 64 elements
    index_bytes = 8 * 32 * (47 + 2 * 16)  # key positions, window starts
    assert tracker.peak <= storage + index_bytes + 4096, (tracker.peak, storage)


@pytest.mark.parametrize("window", [None, 3, 30])
def test_a_shared_row_equals_every_node_row(window):
    """A call whose nodes all have as many ancestor tokens (sibling completions under prompts of one length) can share
    one mask row, instead of writing one per node: the memory the two-level trie's shared mask took, where one per node
    made the tree's no-grad peak exceed the two-level trie's on the agentic benchmark."""
    ids, _, _ = star_batch(8)
    _, calls = planned_node_calls(ids.tolist(), rows_per_chunk=8)
    uniform = [call for call in calls if call.pack_valid.all() and call.ancestor_valid.all() and call.nodes[0] > 0]
    assert len(uniform) == 2  # the prompts under the system prompt, then the leaves under the prompts
    for call in uniform:
        full = expand.node_mask(call, window, torch.float32)
        shared = expand.node_mask(call, window, torch.float32, shared=True)
        assert shared.shape == (1, *full.shape[1:]) and full.shape[0] == len(call.nodes) > 1
        assert torch.equal(full, shared.expand_as(full))


def test_calls_with_equal_ancestors_build_one_row_and_score_as_dense(monkeypatch):
    model = build_model("qwen2", dtype=torch.float64)
    ids, mask, score = star_batch(8)
    shapes = []
    original = expand.node_mask

    def spy(call, window, dtype, **kwargs):
        out = original(call, window, dtype, **kwargs)
        shapes.append((len(call.nodes), out.shape[0]))
        return out

    reference = compute_logps_tree(model, ids, mask, score, backend="dense")
    expected = parameter_grads(model, reference.logps.sum())
    monkeypatch.setattr(expand, "node_mask", spy)
    # The tiny-node rule would merge the short prompts into the leaves; the calls counted here are the unmerged trie's.
    out = compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=False)
    grads = parameter_grads(model, out.logps.sum())
    assert shapes == [(4, 1), (8, 1)], shapes  # the root call is causal without a mask
    torch.testing.assert_close(out.logps, reference.logps, rtol=0, atol=1e-6)
    assert max_relative_grad_error(grads, expected) < 1e-5
