"""The plan's prediction that bounds the GPU peak-memory test (``shared-prefix-logps plan``, tests/gpu/test_gpu.py)
checked where it can be on CPU, in ``make test``: for the expand backend on its CUDA code path, the live tensor bytes
of a call stay within a few percent of the plan's peak of the step, and the plan's expand terms follow the layout the
backend allocates (aligned masks, the repeat of grouped KV heads, nothing of the kind for flex).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from support.gpu_models import peak_memory_config

from shared_prefix_logps import chunked_backward, compute_logps
from shared_prefix_logps.backends import sdpa_kernels
from shared_prefix_logps.bench.memory import peak_memory
from shared_prefix_logps.plan import Engine, Workload, plan_memory, predicted_peak_bytes
from shared_prefix_logps.plan.dims import dims_from_config
from shared_prefix_logps.plan.memory import expand_terms

GENERATIONS, COMPLETION, PER_CHUNK = 8, 64, 2

#: (vocabulary, prompt width, left-padded): a head-bound step with one unpadded prompt (one mask row shared by the
#: completions' node call), and an attention-bound one with two prompts, one of them padded (a mask per row), whose
#: training peak is the last layer's attention backward with its recomputed, repeated keys/values.
CASES = {"head-bound": (512, 256, False), "attention-bound": (64, 512, True)}

#: Bounds of measured / planned (measured on the node-call engine: 0.998, 0.968, 0.996 head-bound and 0.943, 0.952,
#: 0.986 attention-bound for score, train, chunked). Above 1 by at most what the plan's estimate of the bookkeeping
#: tensors (the trie, the scored pairs, the calls' indices and RoPE tables: about 20 int64 per token) misses; below
#: 1 by what the plan counts as upper bounds: the parameters' gradients from the start of the step (this fresh model
#: has none before backward), a layer's largest transient beside the gathered and repeated keys/values in scoring.
PLAN_RATIO_BOUNDS = (0.88, 1.01)


def small_deep_qwen2(vocab: int):
    """The peak-memory model's structure (8 layers, 4 query heads per KV head, tied head) at CPU size, bf16."""
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)


def run_step(model, mode, prompts, prompt_mask, comps):
    if mode == "score":
        with torch.no_grad():
            compute_logps(model, prompts, comps, prompt_mask=prompt_mask, backend="expand")
    elif mode == "train":
        compute_logps(model, prompts, comps, prompt_mask=prompt_mask, backend="expand").logps.sum().backward()
    else:
        chunked_backward(
            model,
            prompts,
            comps,
            lambda o, r: o.logps.sum(),
            prompt_mask=prompt_mask,
            generations_per_chunk=PER_CHUNK,
            backend="expand",
        )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["score", "train", "chunked"])
@pytest.mark.usefixtures("fused_path_on_cpu")  # the code path CUDA takes
def test_expand_live_bytes_match_the_plan(mode, case, monkeypatch):
    # The kernel the plan assumes: a fused one that takes the mask but not grouped heads (torch 2.11's efficient
    # kernel on CUDA; on CPU the flash kernel stands in for it, with the same memory: no scores materialized).
    monkeypatch.setattr(
        sdpa_kernels,
        "accepts",
        lambda kernel, query, key, *rest: kernel == "FLASH_ATTENTION" and key.shape[1] == query.shape[1],
    )
    monkeypatch.setattr(sdpa_kernels, "_PRIORITY", {("cpu", None): ("FLASH_ATTENTION", "MATH")})
    vocab, prompt_len, padded = CASES[case]
    num_prompts = 2 if padded else 1
    model = small_deep_qwen2(vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (num_prompts, prompt_len), generator=gen)
    comps = torch.randint(0, vocab, (num_prompts * GENERATIONS, COMPLETION), generator=gen)
    prompt_mask = torch.ones(num_prompts, prompt_len, dtype=torch.bool)
    prompt_mask[1:, : prompt_len // 2] = False
    with peak_memory(torch.device("cpu")) as measured:
        run_step(model, mode, prompts, prompt_mask, comps)
    workload = Workload(
        num_prompts,
        prompt_len,
        COMPLETION,
        GENERATIONS,
        mode="score" if mode == "score" else "train",
        generations_per_chunk=PER_CHUNK,
        padded_prompts=padded,
        prompt_tokens=int(prompt_mask.sum()),  # the prompts' node call forwards their real tokens only
    )
    method = "chunked" if mode == "chunked" else "expand"
    config = model.config.to_dict()
    # The step as bench measures it on CUDA (the parameters exist before it), the head's statistics in torch (CPU).
    planned = predicted_peak_bytes(method, config, workload, step_only=True, head_implementation="torch")
    ratio = measured["peak_bytes"] / planned
    low, high = PLAN_RATIO_BOUNDS
    assert low <= ratio <= high, (ratio, measured["peak_bytes"], planned)
    if case == "attention-bound" and mode == "train":
        # The peak the plan predicts is the one it models for this step: the attention backward of a layer.
        terms = plan_memory(method, dims_from_config(config), workload, Engine(head_implementation="torch")).terms
        assert terms["repeated K/V grads (one layer)"] > 0, terms


PEAK_SHAPE = dict(prompts=1, prompt_len=16384, completion_len=1024, generations=64)


def test_plan_terms_follow_the_expand_layout():
    """The terms the expand backend's layout fixes, at the GPU test's shape: masks with a 16-aligned key dimension
    (one row's for unpadded prompts, none for the prompts' node call), the grouped-query repeat as a term of its own
    on the fused path only, and no expand terms for flex."""
    config = peak_memory_config()
    dims = dims_from_config(config.to_dict())
    assert dims.layers >= 8 and dims.heads // dims.kv_heads >= 4 and dims.head_dim >= 16
    padded = Workload(**PEAK_SHAPE)
    terms = expand_terms(dims, padded, Engine(), rows=64)
    assert terms["prompt mask"] == 0  # the prompts' node call is causal, padded or not
    assert terms["row masks"] == 64 * 1024 * 17408 * 2  # 17408 keys, a multiple of 16
    unpadded = expand_terms(dims, Workload(**PEAK_SHAPE, padded_prompts=False), Engine(), rows=64)
    assert unpadded["prompt mask"] == 0 and unpadded["row masks"] == 1024 * 17408 * 2
    kv_per_head_token = (32 + 32) * 2
    assert terms["gathered K/V (one layer)"] == 64 * 2 * 17408 * kv_per_head_token
    assert terms["repeated K/V (one layer)"] == 64 * 8 * 17408 * kv_per_head_token
    assert terms["prompt repeated K/V (one layer)"] == 8 * 16384 * kv_per_head_token
    on_cpu = expand_terms(dims, padded, Engine(device="cpu"), rows=64)
    assert on_cpu["repeated K/V (one layer)"] == on_cpu["prompt repeated K/V (one layer)"] == 0
    train = plan_memory("expand", dims, padded, Engine())
    assert any(moment.get("repeated K/V grads (one layer)") for moment in train.moments)
    flex = plan_memory("flex", dims, padded, Engine())
    expand_names = ("mask", "gathered", "repeated")
    assert not any(any(part in name for part in expand_names) for moment in flex.moments for name in moment)
    assert flex.peak_bytes < train.peak_bytes
