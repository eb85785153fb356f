"""The flex layout compiled: a bounded number of compilations over shapes, trie depths, sliding windows (None and
int), grad modes and every entry point, exact against dense, and a loud error at torch's recompile limit.

On CPU the library runs flex uncompiled; these tests select a compile backend for CPU (``aot_eager`` wrapped in a
counter of the graphs it receives) and lift torch's up-front refusal of flex's backward on CPU (its dense reference
backward runs there), so the compiled path of the CUDA default is traced here with the same guards.
"""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.graph_counter import CUDA_FLEX_MIN_HEAD_DIM
from support.tiny_models import build_model, make_batch
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import LogpsOutput, chunked_backward, compute_logps, compute_logps_tree
from shared_prefix_logps.backends import flex

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

#: (prompts, generations, prompt length, completion length): packed lengths from one to several blocks of 128 in
#: both node calls, G from 1 to 8, prompts and completions each the longer side.
SHAPES = [
    (2, 2, 9, 5),
    (3, 4, 13, 8),
    (1, 3, 40, 20),
    (4, 2, 7, 3),
    (2, 5, 150, 30),
    (3, 3, 60, 140),
    (5, 1, 11, 11),
    (2, 8, 31, 17),
]

#: Compilations allowed per model family: one graph per grad mode (scoring, training), and the probe the chunked
#: backward's calls run in every layer's backward to keep a non-finite gradient in its row (one head of width 16, its
#: own configuration); none per shape, depth or window.
FLEX_GRAPHS_PER_FAMILY = 3
#: Compilations of the block-mask builder: none, the masks are built from the batch's structure by plain tensor
#: operations (backends/flex_blocks.py); only the mask function, inside flex_attention's graph, is traced.
MASK_GRAPHS = 0


def _run(model, mode, prompts, comps, kwargs, generations):
    """(logps, parameter grads or None) of ``mode`` with the flex backend."""
    if mode == "score":
        with torch.no_grad():
            return compute_logps(model, prompts, comps, backend="flex", **kwargs).logps, None
    if mode == "train":
        out = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        return out.logps.detach(), parameter_grads(model, weighted_loss(out))
    model.zero_grad(set_to_none=True)
    out = chunked_backward(
        model,
        prompts,
        comps,
        lambda chunk, rows: weighted_loss(_in_full_batch(chunk, rows, comps.shape[0])),
        generations_per_chunk=max(1, generations // 2),
        backend="flex",
        **kwargs,
    )
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return out.logps, grads


def _in_full_batch(chunk, rows, num_rows):
    """The chunk's output scattered into zeros of the full batch, so that ``weighted_loss`` weighs each row as it
    does for the whole batch (the chunk losses then sum to the whole batch's loss)."""

    def scatter(values):
        return torch.zeros(num_rows, values.shape[1], dtype=values.dtype).index_copy(0, rows, values)

    entropy = None if chunk.entropy is None else scatter(chunk.entropy)
    return LogpsOutput(scatter(chunk.logps), entropy, scatter(chunk.mask))


def _tree_runs(model, seed):
    """A random trie of depth 3 (call and store lengths vary with the seed) scored and trained with ``flex``: (where,
    logps, grads or None, dense logps, dense grads) per mode."""
    ids, mask, score = pad_rows(random_tree_rows(seed, depth=3, branching=3, max_segment=30), seed)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    expected = parameter_grads(model, weighted_loss(dense))
    with torch.no_grad():
        scored = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=1, backend="flex")
    trained = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="flex")
    yield "score", scored.logps, None, dense.logps.detach(), expected
    yield (
        "train",
        trained.logps.detach(),
        parameter_grads(model, weighted_loss(trained)),
        dense.logps.detach(),
        expected,
    )


def _grouped_runs(model, index, shape):
    num_prompts, generations, prompt_len, completion_len = shape
    prompts, pmask, comps, cmask = make_batch(num_prompts, generations, prompt_len, completion_len, seed=index)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True, temperature=0.7)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, weighted_loss(dense))
    for mode in ("score", "train", "chunked"):
        logps, grads = _run(model, mode, prompts, comps, kwargs, generations)
        yield mode, logps, grads, dense.logps.detach(), expected


def test_compilations_are_bounded_and_results_exact(compiled_on_cpu, monkeypatch):
    """Grouped batches of every shape, every entry point, and tries of any shape share one graph per grad mode, under
    inductor's CUDA rule that refuses head dimensions below 16 (which the tiny models' 8 meet only zero-padded)."""
    counter = compiled_on_cpu
    counter.cuda_rules = True
    monkeypatch.setitem(flex.MIN_HEAD_DIM, "cpu", CUDA_FLEX_MIN_HEAD_DIM)
    graphs = {}
    for family in ("qwen2", "gemma2"):  # Gemma2: sliding (int) and global (None) windows, softcaps
        model = build_model(family)
        before = counter.counts["flex"]
        runs = [(("grouped", index), _grouped_runs(model, index, shape)) for index, shape in enumerate(SHAPES)]
        runs += [(("tree", seed), _tree_runs(model, seed)) for seed in range(3)]
        for case, results in runs:
            for mode, logps, grads, dense, expected in results:
                where = (family, *case, mode)
                assert (logps - dense).abs().max() <= 1e-5, where
                if grads is not None:
                    assert max_relative_grad_error(grads, expected) <= 1e-4, where
        graphs[family] = counter.counts["flex"] - before
    assert all(n >= 1 for n in graphs.values()), "the compiled path did not run"
    assert all(n <= FLEX_GRAPHS_PER_FAMILY for n in graphs.values()), graphs
    assert counter.counts["mask"] == MASK_GRAPHS, counter.counts


def _one_block_then_two(call):
    """Call ``call(query, key, value, block_mask)`` on one block of 128 keys, then two: dynamo specializes the
    one-block shape, so the second call compiles again (the library pads to two blocks to avoid exactly this)."""
    from torch.nn.attention.flex_attention import create_block_mask

    for length in (128, 256):
        qkv = [torch.randn(1, 2, length, 8) for _ in range(3)]
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, length, length, device="cpu")
        call(*qkv, mask)


def test_recompile_limit_raises_a_loud_error(compiled_on_cpu):
    def call(query, key, value, mask):
        with torch.no_grad():
            flex._flex_call(query, key, value, block_mask=mask, scale=0.25, score_mod=None)

    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(flex.FlexRecompileError, match="recompile_limit") as raised:
            _one_block_then_two(call)
    assert "backend='expand'" in str(raised.value)
    assert compiled_on_cpu.counts["flex"] == 1  # the first call compiled; the second was refused, not run eagerly


def test_below_the_limit_the_same_calls_compile_twice(compiled_on_cpu):
    """The counterpart of the test above: with torch's default limit the two calls run, compiled twice."""

    def call(query, key, value, mask):
        with torch.no_grad():
            out = flex._flex_call(query, key, value, block_mask=mask, scale=0.25, score_mod=None)
        ref = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.25)
        assert (out - ref).abs().max() <= 1e-5

    _one_block_then_two(call)
    assert compiled_on_cpu.counts["flex"] == 2


def test_lora_on_some_projections_compiles_no_extra_graph(compiled_on_cpu):
    """LoRA on q/v only: the first layer's keys come from frozen weights and need no gradient while its queries do.
    Which inputs require grad is a guard; the flex path makes it uniform, so training compiles one graph."""
    peft = pytest.importorskip("peft")
    from support.tiny_models import randomize_lora

    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    randomize_lora(model)
    for index, shape in enumerate(SHAPES[:3]):
        prompts, pmask, comps, cmask = make_batch(*shape, seed=index)
        kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
        out = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
        grads, expected = parameter_grads(model, weighted_loss(out)), parameter_grads(model, weighted_loss(dense))
        assert (out.logps - dense.logps).abs().max() <= 1e-5
        assert max_relative_grad_error(grads, expected) <= 1e-4
    assert compiled_on_cpu.counts["flex"] == 1, compiled_on_cpu.counts
